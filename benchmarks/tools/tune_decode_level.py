"""The cascade's decode level with each per-request decode config: beside the prefix level and alone.

    python -m benchmarks.tools.tune_decode_level                          # engine and bar shapes
    python -m benchmarks.tools.tune_decode_level --shapes 256,4096,144 --json PATH
    python -m benchmarks.tools.tune_decode_level --variants n16_w1_s5 --configs n16_w1_s9 n32_w1_s5

The two-stream cascade of ``tools/tune_overlap`` (the prefix level on the main stream at
the plan's split count, the per-request decode level on a side stream, one merge), with
the decode level run by each ``DECODE_VARIANTS`` entry in turn (and each ``--configs``
launch config, named ``n<keys>_w<warps>_s<stages>[_x<sub-tiles>][_p<k>][_c]`` as
``benchmarks._common.parse_config`` reads them), and that decode level alone; CUDA-graph
replays over rotated pools. Every answer is checked against the
public default's (bf16, Hq 32, Hkv 8, D 128, page 16).
"""

from __future__ import annotations

import argparse

import torch

from benchmarks._common import (
    bench_rotating,
    environment,
    gpu_start,
    markdown_table,
    parse_config,
    write_json,
)
from benchmarks.fixtures import (
    DTYPE,
    MAX_ROTATIONS,
    MIN_POOL_BYTES,
    PAGE,
    Shape,
    Workload,
)
from benchmarks.tools.tune_overlap import two_streams
from cascadeinfer.cascade.multi_level import MultiLevelCascadeAttention
from cascadeinfer.kernels.policy import DECODE_VARIANTS

SHAPES = ("256,4096,144", "256,4096,256", "64,8192,256", "128,32768,512", "256,4096,128", "512,1024,64")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES), help="batch,prefix,suffix triples")
    ap.add_argument("--variants", nargs="*", default=list(DECODE_VARIANTS), choices=list(DECODE_VARIANTS))
    ap.add_argument("--configs", nargs="*", default=[],
                    help="more launch configs, n<keys>_w<warps>_s<stages>[_x<k>][_p<k>][_c]")
    ap.add_argument("--rep-ms", type=int, default=50)
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()
    # every launch by name, a misspelt config failing here, before the GPU work
    launches = {name: DECODE_VARIANTS[name] for name in args.variants} | {c: parse_config(c) for c in args.configs}
    dev = gpu_start("tune_decode_level")
    rows = []
    for text in args.shapes:
        s = Shape(*map(int, text.split(",")))
        wl = Workload(s, dev, seed=0, min_pool_bytes=MIN_POOL_BYTES, max_rot=MAX_ROTATIONS)
        attn = MultiLevelCascadeAttention(2, device=dev)
        attn.plan(*wl.tables(), s.hq, s.hkv, s.head_dim, PAGE, num_pages=wl.num_pages, dtype=DTYPE, use_cascade=True)
        splits = attn._levels[-2].num_splits
        base = two_streams(wl, splits)
        o_ref = base[0]()[0].float().clone()
        for name in [None, *launches]:
            cfg = None if name is None else launches[name]
            both = base if cfg is None else two_streams(wl, splits, config=cfg)
            o = both[0]()[0].float()
            torch.testing.assert_close(o, o_ref, atol=2e-2, rtol=2e-2)
            alone = two_streams(wl, splits, "suffix", config=cfg)
            row = dict(shape=f"({text})", decode=name or "default", prefix_splits=splits,
                       cascade_us=round(bench_rotating(both, rep_ms=args.rep_ms) * 1e6, 1),
                       decode_alone_us=round(bench_rotating(alone, rep_ms=args.rep_ms) * 1e6, 1))
            print("#", row, flush=True)
            rows.append(row)
        del wl, attn, base
        torch.cuda.empty_cache()
    print(markdown_table(rows, list(rows[0])))
    write_json(args.json, dict(env=environment(), rows=rows))


if __name__ == "__main__":
    main()
