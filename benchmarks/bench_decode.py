"""Paged decode (batch_decode_paged) against the copy-bandwidth roofline and its peers.

Run from the repository root on a GPU machine:

    python -m benchmarks.bench_decode            # full grid
    python -m benchmarks.bench_decode --quick    # a few shapes

bf16, Hq=32, Hkv=8, head_dim=128, page 16, every request's pages randomly permuted in the
pool. For each batch x context (1K..128K; combinations with more than 40 GB of KV are
skipped), then a few batches between waves and of variable lengths: the schedule the
default picks and our time with it (CUDA-graph replay, median; the call an engine makes
when it knows the lengths: ``pick_decode_schedule(..., seq_lens=)``), both schedules'
times, achieved GB/s (KV bytes + q/o/lse), the measured copy bandwidth and the fraction of
it; beside it
FlashInfer's BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=True) when installed, and
PyTorch SDPA on K/V already gathered into contiguous [batch, Hkv, L, D] tensors (the
gather is not timed) where memory allows. Pools are rotated so that repeated calls are
not served from L2 (one pool when it is larger than 3x L2 by itself). A second table
compares the internal stage-1 launch variants on a few shapes. JSON goes to
--json PATH.
"""

from __future__ import annotations

import argparse
import gc
import math
import sys

import torch
import torch.nn.functional as F

from benchmarks._common import (
    L2_BYTES,
    bench_rotating,
    environment,
    load_flashinfer,
    markdown_table,
    measure_ceilings,
    roofline_floor,
    rotation_count,
    write_json,
)
from benchmarks.fixtures import (
    DTYPE,
    HKV,
    HQ,
    PAGE,
    D,
    fi_wrapper,
    io_bytes,
    kv_bytes,
    new_pool,
    page_table,
)
from cascadeinfer.kernels import decode as decode_mod
from cascadeinfer.kernels.decode import batch_decode_paged
from cascadeinfer.kernels.policy import DECODE_VARIANTS, SCHEDULES, pick_decode_schedule
from cascadeinfer.kernels.reference import attention_state_ref
from cascadeinfer.layouts.paged_cache import gather_paged_kv, unpack_paged_kv_cache

BATCHES = (1, 16, 64, 256)
CONTEXTS = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
# Batches between waves of the per-request plan, and variable lengths: (label, lengths).
EXTRA_SHAPES = (
    ("9x16K", [16384] * 9), ("17x8K", [8192] * 17), ("40x4K", [4096] * 40), ("100x4K", [4096] * 100),
    ("1x64K+63x1K", [65536] + [1024] * 63), ("1x100K+99x1-2K", [100_000] + [1024 + (i * 337) % 1024 for i in range(99)]),
    ("64x512-8K", [512 + (i * 2731) % 7680 for i in range(64)]),
)
MAX_KV_BYTES = 40e9  # skip combinations with more KV than this
MAX_SDPA_KV_BYTES = 16e9  # SDPA needs a second, gathered copy of the KV
VARIANT_SHAPES = ((1, 32768), (16, 4096), (16, 32768), (64, 4096), (64, 16384), (256, 4096))
QUICK_SHAPES = ((1, 16384), (16, 4096), (16, 32768), (64, 4096), (256, 4096))
QUICK_EXTRA = ("17x8K", "1x64K+63x1K")
LN2 = math.log(2.0)
REP_MS = 200  # do_bench_cudagraph's rep per timing (--rep-ms)


# --------------------------------------------------------------------------- correctness


def check_correctness(fi, device: str = "cuda", lens: tuple[int, ...] = (0, 1, 16, 517, 4096, 3000, 70, 12345)) -> None:
    """Ours (every variant, both layouts, ragged lengths with empty rows) against the
    float64 reference on the GPU; FlashInfer against ours. Raises on a mismatch."""
    dev = torch.device(device)
    num_pages = sum((n + PAGE - 1) // PAGE for n in lens) + 64
    for layout in ("NHD", "HND"):
        pool = new_pool(num_pages, dev, layout)
        indptr, indices, last = page_table(len(lens), lens, num_pages, dev, seed=1)
        q = torch.randn(len(lens), HQ, D, device=dev, dtype=DTYPE)
        kv = unpack_paged_kv_cache(pool, layout)
        refs = [attention_state_ref(q[b:b + 1], *gather_paged_kv(kv, indptr, indices, last, b)) for b in range(len(lens))]
        runs = {sched: lambda splits, sched=sched: batch_decode_paged(
            q, pool, indptr, indices, last, kv_layout=layout, num_splits=splits, schedule=sched)
            for sched in SCHEDULES}
        for name, cfg in DECODE_VARIANTS.items():
            runs[name] = lambda splits, cfg=cfg: decode_mod.decode_with_config(
                q, pool, indptr, indices, last, kv_layout=layout, sm_scale=None, num_splits=splits,
                schedule="per_request", out=None, lse=None, validate=True, config=cfg)
        for name, run in runs.items():
            for splits in (None, 1, 5):
                o, s = run(splits)
                for b, (o_ref, s_ref) in enumerate(refs):
                    if lens[b] == 0:
                        assert torch.all(o[b] == 0) and torch.all(s[b] == -math.inf), (name, layout, b)
                        continue
                    torch.testing.assert_close(o[b].double(), o_ref[0], atol=1.5e-2, rtol=1.5e-2,
                                               msg=lambda m: f"{name} {layout} splits={splits} row {b}: {m}")
                    torch.testing.assert_close(s[b].double(), s_ref[0], atol=1e-3, rtol=1e-4,
                                               msg=lambda m: f"{name} {layout} splits={splits} row {b} lse: {m}")
        if fi is not None and layout == "NHD":
            nonempty = [b for b in range(len(lens)) if lens[b] > 0]
            sel = torch.tensor(nonempty, device=dev)
            sub_lens = [lens[b] for b in nonempty]
            ip, _, la = page_table(len(sub_lens), sub_lens, num_pages, dev)
            idx = torch.cat([indices[indptr[b]:indptr[b + 1]] for b in nonempty])
            w = fi_wrapper(fi, ip, idx, la)
            o_fi, s_fi = w.run(q[sel].contiguous(), pool, return_lse=True)
            o, s = batch_decode_paged(q[sel].contiguous(), pool, ip, idx, la)
            torch.testing.assert_close(o_fi.float(), o.float(), atol=2e-2, rtol=2e-2)
            # FlashInfer's LSE is base 2; ours is natural log.
            torch.testing.assert_close(s_fi.float() * LN2, s, atol=1e-3, rtol=1e-3)
            print("# FlashInfer agrees with ours (lse base 2 converted)")
    print("# correctness: ok (both schedules, all per-request variants, NHD and HND, splits None/1/5)")


# --------------------------------------------------------------------------- peers


# --------------------------------------------------------------------------- timing


def time_shape(label: str, lens: list[int], copy_bw: float, mm_rate: float, fi, variants: bool) -> dict:
    dev = torch.device("cuda")
    batch, total = len(lens), sum(lens)
    uniform = len(set(lens)) == 1
    ctx = total // batch  # the mean; the byte counts below use the total
    kvb = kv_bytes(1, total)
    n_rot = 1 if kvb > 3 * L2_BYTES else rotation_count(kvb)
    num_pages = sum((n + PAGE - 1) // PAGE for n in lens)
    indptr, indices, last = page_table(batch, lens, num_pages, dev, seed=batch * 7 + total)
    pools = [new_pool(num_pages, dev) for _ in range(n_rot)]
    qs = [torch.randn(batch, HQ, D, device=dev, dtype=DTYPE) for _ in range(n_rot)]
    outs = [torch.empty_like(q) for q in qs]
    lses = [torch.empty(batch, HQ, device=dev) for _ in range(n_rot)]
    nbytes = kvb + io_bytes(batch, 0)
    flops = 4 * HQ * total * D
    floor = roofline_floor(nbytes, flops, copy_bw, mm_rate)
    # what an engine that knows the lengths gets (the shape-only default where they are equal)
    schedule = pick_decode_schedule(batch, HKV, dev, seq_lens=lens)
    row = dict(shape=label, batch=batch, ctx=ctx, kv_GB=kvb / 1e9, rot=n_rot, schedule=schedule,
               floor_us=floor * 1e6, copy_GBps=copy_bw / 1e9)

    def ours(i, cfg=None, sched=None):
        return lambda: decode_mod.decode_with_config(
            qs[i], pools[i], indptr, indices, last, kv_layout="NHD", sm_scale=None, num_splits=None,
            schedule=sched, out=outs[i], lse=lses[i], validate=False, config=cfg)

    def record(prefix: str, seconds: float | None) -> None:
        row[f"{prefix}_us"] = None if seconds is None else seconds * 1e6
        row[f"{prefix}_GBps"] = None if seconds is None else nbytes / seconds / 1e9
        row[f"{prefix}_frac"] = None if seconds is None else floor / seconds

    for sched in SCHEDULES:
        record(sched, bench_rotating([ours(i, sched=sched) for i in range(n_rot)], rep_ms=REP_MS))
    record("ours", row[f"{schedule}_us"] * 1e-6)
    ours(0, sched=schedule)()  # outs[0] from the picked schedule, for the peers' checks

    if variants:
        for name, cfg in DECODE_VARIANTS.items():
            try:
                record(f"var_{name}", bench_rotating([ours(i, cfg, "per_request") for i in range(n_rot)],
                                                     rep_ms=REP_MS))
            except Exception as exc:  # a variant that does not compile here is reported, not fatal
                print(f"# variant {name} failed at batch {batch} ctx {ctx}: {type(exc).__name__}: {exc}",
                      file=sys.stderr)
                record(f"var_{name}", None)

    if fi is not None:
        try:
            w = fi_wrapper(fi, indptr, indices, last)
            fi_outs = [torch.empty_like(q) for q in qs]
            t_fi = bench_rotating([lambda i=i: w.run(qs[i], pools[i], out=fi_outs[i]) for i in range(n_rot)],
                                  rep_ms=REP_MS)
            torch.testing.assert_close(fi_outs[0].float(), outs[0].float(), atol=2e-2, rtol=2e-2)
            record("fi", t_fi)
        except Exception as exc:
            print(f"# flashinfer failed at batch {batch} ctx {ctx}: {type(exc).__name__}: {exc}", file=sys.stderr)
            record("fi", None)
    else:
        record("fi", None)

    if kvb <= MAX_SDPA_KV_BYTES and uniform:
        del pools[1:]  # keep one pool as the gather source; SDPA gets its own rotated copies
        try:
            n_sdpa = 1 if kvb > 3 * L2_BYTES else n_rot
            src = pools[0]
            kv_sets = []
            for _ in range(n_sdpa):
                pages = src[indices.long()].view(batch, ctx // PAGE, 2, PAGE, HKV, D)
                k = pages[:, :, 0].reshape(batch, ctx, HKV, D).transpose(1, 2).contiguous()
                v = pages[:, :, 1].reshape(batch, ctx, HKV, D).transpose(1, 2).contiguous()
                del pages
                kv_sets.append((k, v))
            sdpa_q = [qs[i % n_rot].unsqueeze(2) for i in range(n_sdpa)]

            def sdpa(i):
                return lambda: F.scaled_dot_product_attention(sdpa_q[i], kv_sets[i][0], kv_sets[i][1], enable_gqa=True)

            o_sdpa = sdpa(0)()
            torch.testing.assert_close(o_sdpa.squeeze(2).float(), outs[0].float(), atol=2e-2, rtol=2e-2)
            record("sdpa", bench_rotating([sdpa(i) for i in range(n_sdpa)], rep_ms=REP_MS))
        except Exception as exc:
            print(f"# sdpa failed at batch {batch} ctx {ctx}: {type(exc).__name__}: {exc}", file=sys.stderr)
            record("sdpa", None)
    else:
        record("sdpa", None)
    if row.get("fi_us"):
        row["fi_over_ours"] = row["fi_us"] / row["ours_us"]
    return row


def main() -> None:
    global REP_MS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a few shapes only")
    ap.add_argument("--no-variants", action="store_true", help="skip the launch-variant comparison")
    ap.add_argument("--all-variants", action="store_true", help="compare the variants at every shape")
    ap.add_argument("--rep-ms", type=int, default=REP_MS, help="do_bench_cudagraph rep per timing")
    ap.add_argument("--json", metavar="PATH", help="write the results and the environment here as JSON")
    args = ap.parse_args()
    REP_MS = args.rep_ms
    if not torch.cuda.is_available():
        sys.exit("bench_decode needs a CUDA device")

    env = environment()
    print(f"# {env}")
    fi = load_flashinfer()
    check_correctness(fi)
    copy_bw, mm_rate = measure_ceilings()

    grid = list(QUICK_SHAPES) if args.quick else [
        (b, c) for b in BATCHES for c in CONTEXTS if kv_bytes(b, c) <= MAX_KV_BYTES]
    shapes = [(f"{b}x{c // 1024}K", [c] * b, (b, c) in VARIANT_SHAPES) for b, c in grid]
    shapes += [(label, lens, False) for label, lens in EXTRA_SHAPES if not args.quick or label in QUICK_EXTRA]
    rows = []
    for label, lens, variant_shape in shapes:
        variants = not args.no_variants and (args.all_variants or variant_shape)
        row = time_shape(label, lens, copy_bw, mm_rate, fi, variants)
        gc.collect()  # free this shape's pools before the next one is allocated
        torch.cuda.empty_cache()
        rows.append(row)
        write_json(args.json, dict(env=env, copy_Bps=copy_bw, rows=rows, partial=True))  # if cut short
        print(f"# {label:>16}: ours ({row['schedule']}) {row['ours_us']:9.1f} us {row['ours_frac']:.3f} of copy"
              + (f", flashinfer {row['fi_us']:9.1f} us {row['fi_frac']:.3f}" if row.get("fi_us") else ""),
              flush=True)

    write_json(args.json, dict(env=env, copy_Bps=copy_bw, matmul_flops=mm_rate,
                                         shape=dict(hq=HQ, hkv=HKV, head_dim=D, page_size=PAGE, dtype=str(DTYPE)),
                                         variants={k: str(v) for k, v in DECODE_VARIANTS.items()}, rows=rows))
    var_rows = [r for r in rows if any(k.startswith("var_") for k in r)]
    if var_rows:
        cols = ["shape", "per_request_frac"] + [f"var_{n}_frac" for n in DECODE_VARIANTS]
        print("\n## per-request stage-1 launch variants (fraction of copy bandwidth)\n")
        print(markdown_table(var_rows, cols))
    print("\n## batch_decode_paged, bf16, Hq=32, Hkv=8, D=128, page 16 "
          f"(copy bandwidth {copy_bw / 1e9:.0f} GB/s)\n")
    print("(ours: the schedule pick_decode_schedule takes with the lengths known; both schedules' fractions beside it)\n")
    print(markdown_table(rows, ["shape", "kv_GB", "schedule", "floor_us", "ours_us", "ours_GBps", "ours_frac",
                                "per_request_frac", "balanced_frac", "fi_us", "fi_frac", "fi_over_ours",
                                "sdpa_us", "sdpa_frac"]))


if __name__ == "__main__":
    main()
