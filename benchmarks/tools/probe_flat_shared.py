"""Flat decode where requests share their prefix pages: which launch reads them fastest?

    python -m benchmarks.tools.probe_flat_shared [--rep-ms MS] [--json PATH]
    python -m benchmarks.tools.probe_flat_shared --head-dim 256 --configs n32_w4_s3 n16_w2_s5 --splits 1 4

The cascade planner falls back to flat decode (``batch_decode_paged`` over each request's
whole page list). Where requests share a prefix their page lists repeat the same pages,
and a launch whose programs read a shared page at about the same time finds it in L2.
Per shape of bench_cascade's bar and short-prefix sets (bf16, Hq 32, Hkv 8, D 128, page
16; the flat tables of :class:`benchmarks.fixtures.Workload`, prefix pages first in every
list): FlashInfer's flat decode (tensor cores), ours as the launcher picks it, then every
decode variant x split count, the "shared_pages" schedule (what the cascade planner's flat
fallback runs) and the balanced schedule. CUDA-graph replays over rotated
pools; every answer is checked against the default's first. (A program order with
requests before splits was measured too and not kept: benchmarks/NOTES.md, "Flat decode
over shared prefixes".) ``--head-dim`` changes D; ``--configs`` adds launch configs
that are not variants, named ``n<keys>_w<warps>_s<stages>[_x<sub-tiles>][_p<k>][_c]``,
each timed under the per-request schedule at every split count and under the balanced
one. FlashInfer's
row needs its prebuilt kernels (head_dim 128) unless ``--fi-jit`` lets it compile others.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks._common import (
    bench_rotating,
    environment,
    gpu_start,
    load_flashinfer,
    markdown_table,
    measure_ceilings,
    parse_config,
    write_json,
)
from benchmarks.fixtures import (
    BAR_SHAPES,
    MAX_ROTATIONS,
    MIN_POOL_BYTES,
    SHORT_PREFIX_SHAPES,
    Shape,
    Workload,
    fi_flat,
)
from cascadeinfer import batch_decode_paged
from cascadeinfer.kernels import decode as decode_mod
from cascadeinfer.kernels.policy import DECODE_VARIANTS, DecodeConfig

SHAPES = (*BAR_SHAPES, (4, 16384, 16384), *SHORT_PREFIX_SHAPES)
SPLITS = (1, 2, 4, 8, 16)
MAX_PROGRAMS = 4096


def shape_rows(s: Shape, fi, copy_bw: float, device: torch.device, rep_ms: int,
               variants=tuple(DECODE_VARIANTS), splits_list=SPLITS, configs: dict[str, DecodeConfig] | None = None,
               fi_jit=False) -> list[dict]:
    wl = Workload(s, device, seed=0, min_pool_bytes=MIN_POOL_BYTES, max_rot=MAX_ROTATIONS)
    outs, lses = wl.out_buffers()
    tables = (wl.flat_indptr, wl.flat_indices, wl.flat_last)

    def default(i):
        return batch_decode_paged(wl.qs[i], wl.pools[i], *tables, out=outs[i], lse=lses[i], validate=False)

    def variant(cfg, splits, schedule):
        def call(i):
            return decode_mod.decode_with_config(
                wl.qs[i], wl.pools[i], *tables, kv_layout="NHD", sm_scale=None, num_splits=splits,
                schedule=schedule, out=outs[i], lse=lses[i], validate=False, config=cfg)
        return call

    def timed(call) -> tuple[float, torch.Tensor]:
        outs[0].fill_(float("nan"))
        call(0)
        answer = outs[0].float().clone()
        return bench_rotating([lambda i=i: call(i) for i in range(wl.rot)], rep_ms=rep_ms) * 1e6, answer

    base_us, base = timed(default)
    label = f"({s.batch}, {s.prefix}, {s.suffix})"
    unique_us = s.kv_bytes / copy_bw * 1e6
    rows = [dict(shape=label, launch="ours, as picked", us=base_us)]
    if fi is not None and (s.head_dim == 128 or fi_jit):
        try:
            fi_method = fi_flat(fi, wl)
            fi_us = bench_rotating([fi_method.call(i) for i in range(wl.rot)], rep_ms=rep_ms) * 1e6
            rows.append(dict(shape=label, launch="FlashInfer flat (tensor cores)", us=fi_us))
        except Exception as exc:  # noqa: BLE001 - a peer that cannot build must not lose our rows
            print(f"# FlashInfer flat at {label}: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}", flush=True)
    launches = {v: DECODE_VARIANTS[v] for v in variants} | (configs or {})
    for name, cfg in launches.items():
        for splits in splits_list:
            if s.batch * s.hkv * splits > MAX_PROGRAMS:
                continue
            us, answer = timed(variant(cfg, splits, "per_request"))
            torch.testing.assert_close(answer, base, atol=2e-2, rtol=2e-2)
            rows.append(dict(shape=label, launch=f"{name} x{splits}", us=us))
    us, answer = timed(variant(None, None, "shared_pages"))
    torch.testing.assert_close(answer, base, atol=2e-2, rtol=2e-2)
    rows.append(dict(shape=label, launch="shared_pages schedule", us=us))
    us, answer = timed(variant(None, None, "balanced"))
    torch.testing.assert_close(answer, base, atol=2e-2, rtol=2e-2)
    rows.append(dict(shape=label, launch="balanced schedule", us=us))
    for name, cfg in (configs or {}).items():  # the balanced schedule on each extra config, its own plan
        us, answer = timed(variant(cfg, None, "balanced"))
        torch.testing.assert_close(answer, base, atol=2e-2, rtol=2e-2)
        rows.append(dict(shape=label, launch=f"{name} balanced", us=us))
    best = min(r["us"] for r in rows if not r["launch"].startswith("FlashInfer"))
    for r in rows:
        r.update(us=round(r["us"], 1), over_best_ours=round(r["us"] / best, 3),
                 unique_bytes_us=round(unique_us, 1))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rep-ms", type=int, default=50)
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--shapes", nargs="*", help="only these shapes, as batch,prefix,suffix")
    ap.add_argument("--variants", nargs="*", default=list(DECODE_VARIANTS), choices=list(DECODE_VARIANTS))
    ap.add_argument("--splits", nargs="*", type=int, default=list(SPLITS))
    ap.add_argument("--configs", nargs="*", default=[],
                    help="more launch configs, n<keys>_w<warps>_s<stages>[_x<k>][_p<k>][_c]")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--fi-jit", action="store_true", help="let FlashInfer JIT-compile head dims it does not ship")
    args = ap.parse_args()
    shapes = [tuple(int(v) for v in x.split(",")) for x in args.shapes] if args.shapes else SHAPES
    configs = {c: parse_config(c) for c in args.configs}  # a misspelt one fails here, before the GPU work
    device = gpu_start("probe_flat_shared")
    env = environment()
    fi = load_flashinfer()
    copy_bw, _ = measure_ceilings()
    rows = []
    for b, p, sfx in shapes:
        rows += shape_rows(Shape(b, p, sfx, head_dim=args.head_dim), fi, copy_bw, device, args.rep_ms,
                           args.variants, args.splits, configs, args.fi_jit)
        print(markdown_table([r for r in rows if r["shape"] == rows[-1]["shape"]],
                             ["shape", "launch", "us", "over_best_ours", "unique_bytes_us"]), flush=True)
    write_json(args.json, dict(env=env, copy_Bps=copy_bw, rows=rows))


if __name__ == "__main__":
    main()
