"""Which prefix tiles let the prefix level share SMs with the decode level beside it?

    python -m benchmarks.tools.tune_prefix_tiles [--shapes B,P,S ...] [--json PATH]

The cascade runs the suffix decode on a side stream beside the shared-prefix level. With
128-row tiles (8 warps, 255 registers a thread, 224 KiB of shared memory) a prefix
program holds a whole SM, so the two levels split the SMs between them rather than share
them. Smaller tiles leave room on an SM for decode programs beside a prefix program. For
each shape (default: the engine's decode batch, 256 requests over a 4096-token prompt
with 144 and 256 tokens of their own, and three bar shapes) this times the public
two-level ``run`` (CUDA-graph replays over pools rotated past L2) with the prefix level's
tiles forced to each candidate (the side stream kept), at the planner's SM share and at
the whole GPU, beside the prefix level alone with those tiles and the decode level alone.
Each run's answer is checked against the default's.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import torch

from benchmarks._common import (
    environment,
    markdown_table,
    measure_ceilings,
    roofline_floor,
    write_json,
)
from benchmarks.fixtures import (
    level_alone_calls,
    ours,
    shape_tool_start,
    shape_workloads,
)
from cascadeinfer.cascade import cost as cost_mod
from cascadeinfer.cascade import plan as plan_mod
from cascadeinfer.kernels import policy
from cascadeinfer.kernels import prefill as prefill_mod
from cascadeinfer.kernels.policy import TileConfig

SHAPES = ("256,4096,144", "256,4096,256", "64,8192,256", "256,4096,128", "16,65536,1024")
CANDIDATES = {
    "64x64 w4 s2": TileConfig(64, 64, 4, 2),
    "64x64 w4 s3": TileConfig(64, 64, 4, 3),
    "64x32 w4 s2": TileConfig(64, 32, 4, 2),
    "32x64 w4 s3": TileConfig(32, 64, 4, 3),
    "128x64 w8 s2": TileConfig(128, 64, 8, 2),
}


@contextlib.contextmanager
def prefix_tiles(config: TileConfig | None):
    """Every prefill launch and split count inside takes ``config`` (None: the policy's),
    and the cascade keeps its side stream whatever the tiles."""
    if config is None:
        yield
        return
    forced = lambda *args, **kwargs: config  # noqa: E731
    with mock.patch.object(prefill_mod, "groups_tile_config", forced), \
            mock.patch.object(policy, "groups_tile_config", forced), \
            mock.patch.object(cost_mod, "groups_tile_config", forced), \
            mock.patch.object(plan_mod, "groups_tile_config", forced):
        prefill_mod._PAGED.clear()
        try:
            yield
        finally:
            prefill_mod._PAGED.clear()


def main() -> None:
    args, device, timer = shape_tool_start(__doc__, "tune_prefix_tiles", SHAPES, 60)
    copy_bw, mm_rate = measure_ceilings()
    rows = []
    for text, s, wl in shape_workloads(args.shapes, device):
        floor = roofline_floor(s.io_bytes, s.flops, copy_bw, mm_rate) * 1e6
        decode_us = timer(level_alone_calls(wl, 1)) * 1e6
        base = None
        for name, config in {"default": None, **CANDIDATES}.items():
            with prefix_tiles(config):
                prefix_us = timer(level_alone_calls(wl, 0)) * 1e6
                row = dict(shape=text, tiles=name, floor_us=round(floor, 1), decode_alone_us=round(decode_us, 1),
                           prefix_alone_us=round(prefix_us, 1))
                for share in (None, 1.0):
                    patch = (contextlib.nullcontext() if share is None else
                             mock.patch.object(plan_mod, "prefix_sm_fraction", lambda *a, share=share: share))
                    with patch:
                        m = ours(wl, True)
                    o, _ = m.result()
                    o = o.float().clone()
                    if base is None:
                        base = o
                    torch.testing.assert_close(o, base, atol=2e-2, rtol=2e-2)
                    key = "cascade_planner_share_us" if share is None else "cascade_share_1_us"
                    row[key] = round(timer([m.call(i) for i in range(wl.rot)]) * 1e6, 1)
            rows.append(row)
            print(markdown_table([row], list(row)), flush=True)
    write_json(args.json, {"environment": environment(), "copy_bytes_per_s": copy_bw, "matmul_flop_per_s": mm_rate,
                           "rows": rows})


if __name__ == "__main__":
    main()
