"""Can the suffix decode run beside the shared-prefix level on SMs the prefix leaves free?

    python -m benchmarks.tools.tune_overlap                 # the four bar shapes
    python -m benchmarks.tools.tune_overlap --quick         # the two-stream variants only

The prefix level (128x128 tiles, one program per SM) is compute-bound, the suffix decode
bandwidth-bound. One after the other their times add. Here the prefix is launched with
fewer KV splits than fill the GPU (so some SMs stay free), and the decode on a second
stream fills the rest; with 128-row prefix tiles (one program per SM) or 64-row ones (two
per SM). Each level alone is timed too, and the balanced decode alone on one-wave grids
of 16 / 36 / 68 SMs (what a decode beside the prefix can draw). It also timed the
decode first with a limited grid and the prefix on the remaining SMs (lost everywhere),
a one-stream co-launch (commit a97b9ce; NOTES.md, cascade v5 attempts), and one with the
per-request decode and no wait in it (commit c9935ef; v8 attempts). Each split count is timed with the
public path's two merges (the prefix's splits, then the levels) and with one merge of
the prefix's split states and the decode's state together. Every two-stream variant is
checked against the serial cascade on rotation 0 and timed in one CUDA graph over
rotated pools. ``benchmarks/tools/timeline.py`` shows when each of their kernels runs.
"""

from __future__ import annotations

import argparse
import sys

import torch

from benchmarks._common import (
    bench_rotating,
    environment,
    markdown_table,
    measure_ceilings,
    roofline_floor,
    write_json,
)
from benchmarks.fixtures import BAR_SHAPES, DTYPE, MIN_POOL_BYTES, PAGE, Shape, Workload
from cascadeinfer.cascade.multi_level import MultiLevelCascadeAttention
from cascadeinfer.cascade.plan import check_levels, choose_cascade
from cascadeinfer.kernels import policy
from cascadeinfer.kernels import prefill as P
from cascadeinfer.kernels.decode import batch_decode_paged, decode_with_config
from cascadeinfer.kernels.merge import merge_state
from cascadeinfer.kernels.merge_many import merge_states
from cascadeinfer.kernels.policy import BALANCED_VARIANTS
from cascadeinfer.layouts.paged_cache import unpack_paged_kv_cache


def two_streams(wl: Workload, prefix_splits: int, parts: str = "both", *, prefix_idx=None, suffix_idx=None,
                config=None):
    """Closures over each rotation: prefix (main stream) and suffix decode (side stream), merged;
    ``parts`` = "prefix" / "suffix" times one level alone. ``prefix_idx`` / ``suffix_idx``
    replace a level's page list (benchmarks.tools.probe_interference); ``config``, a
    ``DECODE_VARIANTS`` entry, runs the per-request decode with it (None: the public default)."""
    qo, kp, ki, kl = wl.tables()
    prefix_idx = ki[0] if prefix_idx is None else prefix_idx
    suffix_idx = ki[1] if suffix_idx is None else suffix_idx
    schedule = None if config is None else "per_request"
    side = torch.cuda.Stream()
    bufs = [(torch.empty_like(q), torch.empty(q.shape[:2], device=q.device), torch.empty_like(q),
             torch.empty(q.shape[:2], device=q.device), torch.empty_like(q), torch.empty(q.shape[:2], device=q.device))
            for q in wl.qs]

    def call(i):
        q, pool = wl.qs[i], wl.pools[i]
        o_p, l_p, o_s, l_s, out, lse = bufs[i]
        source = P.paged_source(unpack_paged_kv_cache(pool, "NHD"), kp[0], prefix_idx, kl[0])

        def prefix():
            P.run_prefill(q, qo[0], source, o_p, l_p, causal=False, sm_scale=wl.shape.head_dim ** -0.5,
                   num_splits=prefix_splits, backend="portable")  # the cascade's prefix level

        def suffix():
            decode_with_config(q, pool, kp[1], suffix_idx, kl[1], kv_layout="NHD", sm_scale=None, num_splits=None,
                                schedule=schedule, out=o_s, lse=l_s, validate=False, config=config)

        def run():
            if parts == "prefix":
                prefix()
                return None
            if parts == "suffix":
                suffix()
                return None
            main = torch.cuda.current_stream()
            side.wait_stream(main)
            prefix()
            with torch.cuda.stream(side):
                suffix()
            main.wait_stream(side)
            merge_state(o_p, l_p, o_s, l_s, out=out, out_lse=lse)
            return out, lse
        return run

    return [call(i) for i in range(wl.rot)]


def one_merge(wl: Workload, prefix_splits: int):
    """Like :func:`two_streams`, but the prefix level's split states and the decode level's
    state go into one ``[batch, S + 1, Hq, D]`` buffer (the decode writes slot S) and one
    ``merge_states`` makes the output: one merge launch after the levels instead of two
    (the prefix's split merge, then the level merge)."""
    s = wl.shape
    qo, kp, ki, kl = wl.tables()
    side = torch.cuda.Stream()
    cfg = policy.groups_tile_config(s.batch, 1, s.hq // s.hkv, s.head_dim, DTYPE)
    bufs = [(torch.empty(s.batch, prefix_splits + 1, s.hq, s.head_dim, device=q.device, dtype=DTYPE),
             torch.empty(s.batch, prefix_splits + 1, s.hq, device=q.device), torch.empty_like(q),
             torch.empty(q.shape[:2], device=q.device)) for q in wl.qs]

    def call(i):
        q, pool = wl.qs[i], wl.pools[i]
        part_o, part_lse, out, lse = bufs[i]
        source = P.paged_source(unpack_paged_kv_cache(pool, "NHD"), kp[0], ki[0], kl[0])

        def run():
            main = torch.cuda.current_stream()
            side.wait_stream(main)
            P.launch_prefill(q, qo[0], source, part_o[:, :prefix_splits], part_lse[:, :prefix_splits], causal=False,
                      sm_scale=s.head_dim ** -0.5, config=cfg)
            with torch.cuda.stream(side):
                batch_decode_paged(q, pool, kp[1], ki[1], kl[1], out=part_o[:, prefix_splits],
                                   lse=part_lse[:, prefix_splits], validate=False)
            main.wait_stream(side)
            merge_states(part_o, part_lse, out=out, out_lse=lse)
            return out, lse
        return run

    return [call(i) for i in range(wl.rot)]


def decode_on_few_sms(wl: Workload, programs: int, dcfg):
    """The balanced suffix decode alone on a one-wave grid of ``programs`` per kv head: its
    bandwidth on the SMs a prefix grid would leave free."""
    _, kp, ki, kl = wl.tables()
    outs = [(torch.empty_like(q), torch.empty(q.shape[:2], device=q.device)) for q in wl.qs]
    return [lambda i=i: decode_with_config(
        wl.qs[i], wl.pools[i], kp[1], ki[1], kl[1], kv_layout="NHD", sm_scale=None, num_splits=programs,
        schedule="balanced", out=outs[i][0], lse=outs[i][1], validate=False, config=dcfg) for i in range(wl.rot)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*", help="batch,prefix,suffix triples (default: the four bar shapes)")
    ap.add_argument("--rep-ms", type=int, default=60)
    ap.add_argument("--quick", action="store_true",
                    help="only the public path and the two-stream variants (no levels alone, no few-SM decode)")
    ap.add_argument("--json", metavar="PATH", help="write the results and the environment here as JSON")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("tune_overlap needs a CUDA device")
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    print("#", environment(), flush=True)
    copy_bw, mm_rate = measure_ceilings()
    shapes = [Shape(*map(int, t.split(","))) for t in args.shapes] if args.shapes else \
        [Shape(b, p, x) for b, p, x in BAR_SHAPES]
    rows = []
    for s in shapes:
        wl = Workload(s, dev, seed=0, min_pool_bytes=MIN_POOL_BYTES, max_rot=16)
        floor = roofline_floor(s.io_bytes, s.flops, copy_bw, mm_rate)
        attn = MultiLevelCascadeAttention(2, device=dev)
        attn.plan(*wl.tables(), s.hq, s.hkv, s.head_dim, PAGE, num_pages=wl.num_pages, dtype=DTYPE, use_cascade=True)
        o_ref, lse_ref = attn.run(wl.qs[0], wl.pools[0], return_lse=True)
        o_ref, lse_ref = o_ref.clone(), lse_ref.clone()
        serial = bench_rotating([lambda i=i: attn.run(wl.qs[i], wl.pools[i]) for i in range(wl.rot)],
                                rep_ms=args.rep_ms)
        row = dict(shape=f"{s.batch},{s.prefix},{s.suffix}", floor_us=floor * 1e6, serial=serial * 1e6)
        cfg = policy.default_tile_config(s.head_dim, DTYPE, s.batch * s.hq // s.hkv)
        pairs = policy.num_m_tiles(s.batch, 1, s.hq // s.hkv, cfg.block_m) * s.hkv
        full = max(1, sms // pairs)
        variants = {}
        levels = {f"alone: prefix s{full}": (full, "prefix"), "alone: suffix decode": (full, "suffix")}
        for name, spec in ({} if args.quick else levels).items():
            calls = two_streams(wl, *spec)
            row[name] = bench_rotating(calls, rep_ms=args.rep_ms) * 1e6
        s5, s3 = BALANCED_VARIANTS["n128_w4_s5"], BALANCED_VARIANTS["n128_w4_s3x2"]
        for sms_used in () if args.quick else (16, 36, 68):
            for dname, dcfg, per_sm in (("s5", s5, 1), ("s3", s3, 2), ("s3x3", s3, 3)):
                k = max(1, sms_used * per_sm // s.hkv)
                calls = decode_on_few_sms(wl, k, dcfg)
                row[f"alone: balanced {dname} {k * s.hkv} progs ({sms_used} SMs)"] = bench_rotating(
                    calls, rep_ms=args.rep_ms) * 1e6
        # the split count of the cost model's SM share alone (what the public path ran
        # before a whole-SM decode level took the prefix's whole grid: cascade.plan)
        tables = [[t.cpu() for t in x] for x in wl.tables()]
        share = choose_cascade(check_levels(*tables, 2, PAGE, wl.num_pages), page_size=PAGE, num_qo_heads=s.hq,
                               num_kv_heads=s.hkv, head_dim=s.head_dim, elem_bytes=DTYPE.itemsize, device=dev)[3]
        share_splits = {policy.paged_num_splits(s.batch, 1, s.hq, s.hkv, s.head_dim, DTYPE, s.prefix, dev,
                                                sm_share=share)} if share is not None else set()
        row["public path: prefix splits"] = attn._levels[-2].num_splits
        row["model share: prefix splits"] = min(share_splits, default=None)
        for splits in sorted({max(1, full - k) for k in range(0, 4)} | {max(1, full * 3 // 4)} | share_splits):
            variants[f"prefix s{splits} ({pairs * splits} progs) then decode"] = (two_streams, splits, "both")
            variants[f"prefix s{splits} ({pairs * splits} progs) then decode, one merge"] = (one_merge, splits)
        best = ("serial", serial)
        for name, (make, *spec) in variants.items():
            try:
                calls = make(wl, *spec)
                o, lse = calls[0]()
                torch.cuda.synchronize()
                err = (o.float() - o_ref.float()).abs().max().item()
                lerr = (lse - lse_ref).abs().max().item()
                if not (err < 3e-2 and lerr < 2e-3):
                    row[name] = f"WRONG {err:.2g}/{lerr:.2g}"
                    continue
                t = bench_rotating(calls, rep_ms=args.rep_ms)
                row[name] = t * 1e6
                if t < best[1]:
                    best = (name, t)
            except Exception as exc:  # noqa: BLE001 — a variant that fails is a table cell
                row[name] = f"{type(exc).__name__}: {str(exc)[:80]}"
        row["best"] = f"{best[0]}: {best[1] * 1e6:.1f} us ({floor / best[1]:.2f} of floor)"
        print("#", {k: (round(v, 1) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
        rows.append(row)
        del wl, attn
        torch.cuda.empty_cache()
    for r in rows:
        print(markdown_table([dict(variant=k, us=v) for k, v in r.items()], ["variant", "us"]))
    write_json(args.json, dict(env=environment(), copy_bw=copy_bw, mm_rate=mm_rate, rows=rows))


if __name__ == "__main__":
    main()
