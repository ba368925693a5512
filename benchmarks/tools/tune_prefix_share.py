"""Which share of the SMs should the prefix level take while the decode level runs beside it?

    python -m benchmarks.tools.tune_prefix_share [--shapes B,P,S ...] [--shares 0.2 0.4 ...] [--backend B] [--json PATH]

The cascade runs the suffix decode on a side stream while the shared-prefix level, its
grid sized to a share of the SMs (``cascade.cost.prefix_sm_fraction``), runs on the
caller's. For each shape (default: the engine's decode batch, 256 requests over a
4096-token shared prompt with 144, 256 and 384 tokens of their own) this times the
public two-level ``run`` (CUDA-graph replays over pools rotated past L2) with the share
forced to each value, with the planner's own share, and on one stream; each level alone
beside them (the public launchers on that level's table), and the floor. ``--backend``
runs the prefix level on that ``batch_prefill_paged`` backend everywhere (``hopper``: the
warp-specialised kernel, whose programs each hold a whole SM).
"""

from __future__ import annotations

from unittest import mock

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
from cascadeinfer.cascade import plan as plan_mod

ENGINE_SHAPES = ("256,4096,144", "256,4096,256", "256,4096,384")
SHARES = (0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.85, 1.0)


def options(ap) -> None:
    ap.add_argument("--shares", nargs="*", type=float, default=list(SHARES))
    ap.add_argument("--backend", choices=("portable", "hopper"), default=None,
                    help="the prefix level's kernel (default: picked per level)")


def main() -> None:
    args, device, timer = shape_tool_start(__doc__, "tune_prefix_share", ENGINE_SHAPES, 100, options)
    backend = args.backend
    copy_bw, mm_rate = measure_ceilings()
    rows = []
    for text, s, wl in shape_workloads(args.shapes, device):
        row = {"shape": text, "floor us": roofline_floor(s.io_bytes, s.flops, copy_bw, mm_rate) * 1e6}
        row["prefix alone us"] = timer(level_alone_calls(wl, 0, backend)) * 1e6
        row["decode alone us"] = timer(level_alone_calls(wl, 1)) * 1e6
        seen, real = [], plan_mod.prefix_sm_fraction
        with mock.patch.object(plan_mod, "prefix_sm_fraction", lambda a, b: seen.append(real(a, b)) or seen[-1]):
            planner = ours(wl, True, backend)
        row["planner share"] = round(seen[-1], 3) if seen else None
        row["planner us"] = timer([planner.call(i) for i in range(wl.rot)]) * 1e6
        with mock.patch.object(plan_mod, "overlaps", lambda *a, **k: False):
            one = ours(wl, True, backend)
        row["one stream us"] = timer([one.call(i) for i in range(wl.rot)]) * 1e6
        for share in args.shares:
            with mock.patch.object(plan_mod, "prefix_sm_fraction", lambda *a, share=share: share):
                m = ours(wl, True, backend)
            row[f"share {share}"] = timer([m.call(i) for i in range(wl.rot)]) * 1e6
        rows.append(row)
        print(markdown_table([row], list(row)), flush=True)
    write_json(args.json, {"environment": environment(), "copy_bytes_per_s": copy_bw, "matmul_flop_per_s": mm_rate,
                           "rows": rows})


if __name__ == "__main__":
    main()
