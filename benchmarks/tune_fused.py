"""Tune the fused last-two-levels kernel (cascadeinfer/kernels/fused_cascade.py) on a GPU.

    python -m benchmarks.tune_fused                 # the four issue shapes
    python -m benchmarks.tune_fused --shapes 64,8192,256 --hkv 8

For each shape: correctness of every variant against the level-by-level cascade on
rotation 0, then CUDA-graph timing over rotated pools (bench_rotating) of: the cascade one
launch per level, its levels alone (prefix prefill, suffix decode), the fused default, and
fused variants over suffix item size x prefix KV splits x prefix tile rows. Prints a table
of µs and fraction of the roofline floor; JSON to $OUT/tune_fused.json.
"""

from __future__ import annotations

import argparse
import itertools
import sys

import torch

from benchmarks._common import bench_rotating, environment, markdown_table, measure_ceilings, roofline_floor, write_json
from benchmarks.bench_cascade import BAR_SHAPES, DTYPE, MIN_POOL_BYTES, PAGE, Shape, Workload
from cascadeinfer.cascade.multi_level import MultiLevelCascadeAttention
from cascadeinfer.kernels import fused_cascade as F
from cascadeinfer.kernels.decode import batch_decode_paged
from cascadeinfer.kernels.prefill import batch_prefill_paged


def planned(wl: Workload, fuse: bool, config: F.FusedConfig | None = None, num_splits: int | None = None):
    s = wl.shape
    attn = MultiLevelCascadeAttention(2, device=wl.device)
    attn.plan(*wl.tables(), s.hq, s.hkv, s.head_dim, PAGE, num_pages=wl.num_pages, dtype=DTYPE, use_cascade=True,
              fuse=fuse)
    if fuse and (config is not None or num_splits is not None):
        real = F.fused_config
        if config is not None:
            F.fused_config = lambda *a, **k: config  # noqa: E731 — a forced tile for this plan only
        try:
            qo, kp, ki, _ = wl.tables()
            lens = torch.full((s.batch,), s.suffix)
            attn._fused = F.plan_fused(qo[0].cpu(), kp[0].cpu(), ki[0].numel(), kp[1].cpu(), lens, ki[1].numel(),
                                       num_qo_heads=s.hq, num_kv_heads=s.hkv, page_size=PAGE, device=wl.device,
                                       num_splits=num_splits)
        finally:
            F.fused_config = real
    outs, lses = wl.out_buffers()
    return attn, [lambda i=i: attn.run(wl.qs[i], wl.pools[i], out=outs[i], lse=lses[i]) for i in range(wl.rot)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*", help="batch,prefix,suffix triples (default: the issue's four)")
    ap.add_argument("--hkv", type=int, default=8)
    ap.add_argument("--rep-ms", type=int, default=60)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("tune_fused needs a CUDA device")
    dev = torch.device("cuda")
    print("#", environment(), flush=True)
    copy_bw, mm_rate = measure_ceilings()
    shapes = [Shape(*map(int, t.split(",")), hkv=args.hkv) for t in args.shapes] if args.shapes else \
        [Shape(b, p, x, hkv=args.hkv) for b, p, x in BAR_SHAPES]
    rows = []
    for s in shapes:
        wl = Workload(s, dev, seed=0, min_pool_bytes=MIN_POOL_BYTES, max_rot=16)
        floor = roofline_floor(s.io_bytes, s.flops, copy_bw, mm_rate)
        base_attn, base_calls = planned(wl, False)
        base_calls[0]()
        o_base, lse_base = base_attn.run(wl.qs[0], wl.pools[0], return_lse=True)
        row = dict(shape=f"{s.batch},{s.prefix},{s.suffix}", floor_us=floor * 1e6)
        row["unfused"] = bench_rotating(base_calls, rep_ms=args.rep_ms) * 1e6
        qo, kp, ki, kl = wl.tables()
        pre_out = [torch.empty_like(q) for q in wl.qs]
        pre_lse = [torch.empty(q.shape[:2], device=dev) for q in wl.qs]
        row["prefix only"] = bench_rotating([lambda i=i: batch_prefill_paged(
            wl.qs[i], qo[0], wl.pools[i], kp[0], ki[0], kl[0], out=pre_out[i], lse=pre_lse[i], validate=False)
            for i in range(wl.rot)], rep_ms=args.rep_ms) * 1e6
        row["suffix only"] = bench_rotating([lambda i=i: batch_decode_paged(
            wl.qs[i], wl.pools[i], kp[1], ki[1], kl[1], out=pre_out[i], lse=pre_lse[i], validate=False)
            for i in range(wl.rot)], rep_ms=args.rep_ms) * 1e6
        default_attn, calls = planned(wl, True)
        d = default_attn._fused
        row["default"] = f"{d.config.block_m}x{d.config.block_n} suf{d.config.suf_n} s{d.num_splits}"
        variants = {"fused default": (None, None)}
        for suf, mult, bm in itertools.product((16, 32, 64), (0.5, 1, 2), (64, 128)):
            splits = max(1, round(d.num_splits * mult))
            cfg = F.FusedConfig(bm, 64, suf, 4 if bm == 64 else 8, 3)
            variants[f"{bm}x64 suf{suf} s{splits}"] = (cfg, splits)
        best = None
        for name, (cfg, splits) in variants.items():
            try:
                attn, calls = planned(wl, True, cfg, splits)
                o, lse = attn.run(wl.qs[0], wl.pools[0], return_lse=True)
                err = (o.float() - o_base.float()).abs().max().item()
                lerr = (lse - lse_base).abs().max().item()
                if not (err < 3e-2 and lerr < 2e-3):
                    row[name] = f"WRONG {err:.2g}/{lerr:.2g}"
                    continue
                t = bench_rotating(calls, rep_ms=args.rep_ms) * 1e6
                row[name] = t
                if best is None or t < best[1]:
                    best = (name, t)
            except Exception as exc:  # noqa: BLE001 — a variant that does not build is a table cell
                row[name] = f"{type(exc).__name__}: {str(exc)[:60]}"
            del attn
            torch.cuda.empty_cache()
        row["best"] = f"{best[0]} {best[1]:.1f} ({floor * 1e6 / best[1]:.2f})" if best else None
        print("#", {k: (round(v, 1) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
        rows.append(row)
        del wl
        torch.cuda.empty_cache()
    cols = ["shape", "floor_us", "unfused", "prefix only", "suffix only", "default", "fused default", "best"]
    print(markdown_table(rows, cols))
    keys = [k for k in rows[0] if k not in cols]
    print(markdown_table(rows, ["shape", *keys]))
    write_json("tune_fused.json", dict(env=environment(), copy_bw=copy_bw, mm_rate=mm_rate, rows=rows))


if __name__ == "__main__":
    main()
