"""Shared-prefix batch decode: many requests share one long prefix in a paged KV pool.

Runs two-level cascade attention (the shared prefix once on tensor cores, each request's
suffix by split-KV decode, states merged) and flat paged decode (every request reads its
whole page list) on the same pool, checks both against each other and against a float64
reference (PASS / FAIL), and prints which path ran, the timings and the planner's pick.

    python examples/shared_prefix_decode.py            # GPU: batch 128, prefix 32768, suffix 512
    python examples/shared_prefix_decode.py --small    # the default without a GPU: runs in seconds
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from cascadeinfer import MultiLevelCascadeAttention
from cascadeinfer.kernels.reference import attention_state_ref
from cascadeinfer.layouts.paged_cache import page_tokens, unpack_paged_kv_cache


def build_batch(batch, prefix_len, suffix_len, page_size, hq, hkv, d, dtype, device, seed=0):
    """A pool holding one shared prefix and ``batch`` suffixes, pages randomly permuted,
    and the two-level CSR tables that describe it."""
    g = torch.Generator().manual_seed(seed)
    prefix_pages = -(-prefix_len // page_size)
    suffix_pages = -(-suffix_len // page_size)
    num_pages = prefix_pages + batch * suffix_pages
    perm = torch.randperm(num_pages, generator=g).int()
    cache = torch.randn(num_pages, 2, page_size, hkv, d, generator=g, dtype=torch.float32).to(dtype).to(device)
    q = torch.randn(batch, hq, d, generator=g, dtype=torch.float32).to(dtype).to(device)
    i32 = dict(dtype=torch.int32)
    qo_indptr = [torch.tensor([0, batch], **i32), torch.arange(batch + 1, **i32)]
    kv_indptr = [torch.tensor([0, prefix_pages], **i32), torch.arange(batch + 1, **i32) * suffix_pages]
    kv_indices = [perm[:prefix_pages], perm[prefix_pages:]]
    last = lambda n: (n - 1) % page_size + 1  # noqa: E731
    kv_last = [torch.tensor([last(prefix_len)], **i32), torch.full((batch,), last(suffix_len), **i32)]
    tables = [[t.to(device) for t in x] for x in (qo_indptr, kv_indptr, kv_indices, kv_last)]
    return q, cache, tables, num_pages


def reference_rows(q, cache, tables, prefix_len, suffix_len, rows):
    """Float64 attention of the given requests over prefix + suffix (gathered on the host)."""
    kv = unpack_paged_kv_cache(cache.cpu())
    _, kv_indptr, kv_indices, _ = tables
    prefix = kv_indices[0].cpu().long()
    outs = []
    for r in rows:
        suffix = kv_indices[1][int(kv_indptr[1][r]):int(kv_indptr[1][r + 1])].cpu().long()
        k = torch.cat([page_tokens(kv, "k", prefix)[:prefix_len], page_tokens(kv, "k", suffix)[:suffix_len]])
        v = torch.cat([page_tokens(kv, "v", prefix)[:prefix_len], page_tokens(kv, "v", suffix)[:suffix_len]])
        outs.append(attention_state_ref(q[r:r + 1].cpu(), k, v))
    return torch.cat([o for o, _ in outs]), torch.cat([s for _, s in outs])


def time_call(fn, device) -> float:
    """Seconds per call: CUDA-graph replay median on a GPU, best wall time of 3 on a CPU."""
    if device.type == "cuda":
        import triton

        fn()
        return triton.testing.do_bench_cudagraph(fn, rep=200, return_mode="median") * 1e-3
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    has_gpu = torch.cuda.is_available()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small", action="store_true", default=not has_gpu, help="CPU-sized shapes")
    ap.add_argument("--batch", type=int)
    ap.add_argument("--prefix", type=int)
    ap.add_argument("--suffix", type=int)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--heads", type=int, nargs=2, default=(32, 8), metavar=("HQ", "HKV"))
    ap.add_argument("--head-dim", type=int, default=128)
    args = ap.parse_args()
    small = dict(batch=8, prefix=1024, suffix=64) if args.small else dict(batch=128, prefix=32768, suffix=512)
    batch = args.batch or small["batch"]
    prefix_len = args.prefix or small["prefix"]
    suffix_len = args.suffix or small["suffix"]
    hq, hkv = args.heads
    d = args.head_dim
    device = torch.device("cuda" if has_gpu else "cpu")
    dtype = torch.bfloat16 if has_gpu else torch.float32

    q, cache, tables, num_pages = build_batch(batch, prefix_len, suffix_len, args.page_size, hq, hkv, d, dtype, device)
    # The library's rule: Triton on CUDA tensors (and CPU ones under TRITON_INTERPRET=1), else PyTorch.
    kernels = device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    path = ("Triton kernels" + (" (through the interpreter)" if device.type == "cpu" else "") if kernels
            else "the PyTorch path (plain CPU tensors: vectorised float64 reference code, not the kernels)")
    print(f"batch {batch}, shared prefix {prefix_len}, suffix {suffix_len}, Hq={hq}, Hkv={hkv}, D={d}, "
          f"page {args.page_size}, {dtype}, {device}: {path}")

    results = {}
    for name, use_cascade in (("cascade", True), ("flat", False)):
        attn = MultiLevelCascadeAttention(2, device=device)
        attn.plan(*tables, hq, hkv, d, args.page_size, num_pages=num_pages, dtype=dtype, use_cascade=use_cascade)
        out = torch.empty_like(q)
        lse = torch.empty(batch, hq, device=device)
        attn.run(q, cache, out=out, lse=lse)
        results[name] = (out.clone(), lse.clone(), time_call(lambda: attn.run(q, cache, out=out, lse=lse), device))

    o_c, lse_c, t_c = results["cascade"]
    o_f, lse_f, t_f = results["flat"]
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    rows = sorted({0, batch // 2, batch - 1})
    o_ref, lse_ref = reference_rows(q, cache, tables, prefix_len, suffix_len, rows)
    err = {
        "cascade vs flat": (o_c.float() - o_f.float()).abs().max().item(),
        "cascade vs float64": (o_c[rows].cpu().double() - o_ref).abs().max().item(),
        "flat vs float64": (o_f[rows].cpu().double() - o_ref).abs().max().item(),
        "lse cascade vs float64": (lse_c[rows].cpu().double() - lse_ref).abs().max().item(),
    }
    for name, e in err.items():
        print(f"  max |error| {name:<24} {e:.2e}")
    ok = max(err.values()) <= tol
    print(f"{'PASS' if ok else 'FAIL'}: cascade and flat decode {'agree' if ok else 'disagree'} with each other "
          f"and with the float64 reference of rows {rows} (tolerance {tol:g})")
    timing = "CUDA-graph replay" if device.type == "cuda" else "best of 3 wall times"
    print(f"  time per call ({timing}): cascade {t_c * 1e6:.1f} us, flat {t_f * 1e6:.1f} us, "
          f"cascade / flat {t_f / t_c:.2f}x")
    auto = MultiLevelCascadeAttention(2, device=device)
    auto.plan(*tables, hq, hkv, d, args.page_size, dtype=dtype)
    pick = "cascade" if auto.use_cascade else "flat"
    where = "on this GPU" if device.type == "cuda" else "on a GPU (its cost model is fit to an H100's kernels)"
    print(f"  planner (use_cascade=None) picks {pick} {where}: predicted cascade "
          f"{auto.predicted_cascade_s * 1e6:.1f} us, flat {auto.predicted_flat_s * 1e6:.1f} us")
    if device.type != "cuda":
        print("  (CPU times are of the path above, not of the GPU kernels; run on a GPU for kernel timings)")
    if not ok:
        raise SystemExit(1)

if __name__ == "__main__":
    main()
