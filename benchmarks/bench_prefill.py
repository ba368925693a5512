"""Causal prefill of new prompts (batch_prefill_ragged, and batch_prefill_paged over the
same prompts in a paged cache) against the roofline and its peers.

Run from the repository root:

    python -m benchmarks.bench_prefill [--quick] [--json PATH]      # on a GPU machine
    TRITON_INTERPRET=1 python -m benchmarks.bench_prefill --smoke    # tiny shapes on a CPU: checks only

bf16, Hq 32, Hkv 8: prompts of 1 x 8192, 4 x 2048, 16 x 512 and 64 x 128 tokens at
head_dim 128, and 4 x 2048 at head_dim 64 and 256. Every query sees the keys up to its
own position. FLOPs count the unmasked half only: 2 (QK^T, PV) x 2 x sum n_i(n_i + 1)/2 x
Hq x D. Bytes: q, k, v and o (bf16) and the float32 lse, each once. The floor is
``max(bytes / copy bandwidth, FLOPs / bf16 matmul rate)`` with both ceilings measured in
the same run; every method's time is given with its TFLOP/s and the fraction of the
floor it reaches. Timing: ``do_bench_cudagraph`` median, ``rot`` input sets rotated so
that no call finds its inputs in L2.

Methods: ours ragged; ours paged (``batch_prefill_paged(causal=True)``, every prompt's
K/V written by ``append_paged_kv_cache`` into its own randomly placed pages of an NHD
pool, page 16); FlashInfer's ``BatchPrefillWithRaggedKVCacheWrapper`` with backend "fa2"
and "fa3" and ``BatchPrefillWithPagedKVCacheWrapper`` ("fa2") on the same pages (head_dim
128 only unless --fi-jit: the package ships no other bf16 kernels; a backend that fails
is reported missing); PyTorch SDPA (``is_causal=True``, ``enable_gqa=True``) on the
prompts packed as [prompts, heads, n, D] (the repacking is not timed).

Correctness first: ours (ragged and paged) against the float64 reference
``batch_prefill_ragged_ref`` on prompts of 1, 37, 300 and 129 tokens at every head_dim;
then at every timed shape each peer's output (and LSE where it gives one; FlashInfer's is
base 2, converted) against ours.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from benchmarks._common import (
    bench_rotating,
    environment,
    gpu_start,
    load_flashinfer,
    markdown_table,
    measure_ceilings,
    roofline_floor,
    rotation_count,
    write_json,
)
from benchmarks.fixtures import DTYPE, HKV, HQ, PAGE, fi_workspace, page_table
from cascadeinfer import (
    append_paged_kv_cache,
    batch_prefill_paged,
    batch_prefill_ragged,
    get_batch_indices_positions,
)
from cascadeinfer.kernels.reference import batch_prefill_ragged_ref

LN2 = math.log(2.0)  # FlashInfer's base-2 LSE times ln 2 is ours
SHAPES = ((1, 8192, 128), (4, 2048, 128), (16, 512, 128), (64, 128, 128), (4, 2048, 64), (4, 2048, 256))
QUICK_SHAPES = ((1, 8192, 128), (16, 512, 128), (4, 2048, 64))  # (prompts, tokens each, head_dim)
CHECK_LENS = (1, 37, 300, 129)
FI_PREBUILT_HEAD_DIMS = (128,)
# Smoke runs: fewer heads, and float16, since the interpreter multiplies bf16 bit patterns in tl.dot.
SMOKE_SHAPES, SMOKE_LENS, SMOKE_HEADS, SMOKE_DTYPE = ((2, 24, 32), (3, 16, 64)), (1, 17, 40), (8, 2), torch.float16
TOL = {torch.bfloat16: (2e-2, 2e-3), torch.float16: (5e-3, 1e-3)}  # (o, lse) atol = rtol


@dataclass(frozen=True, slots=True)
class Prompts:
    batch: int
    n: int
    head_dim: int
    hq: int = HQ
    hkv: int = HKV
    dtype: torch.dtype = DTYPE

    @property
    def tokens(self) -> int:
        return self.batch * self.n

    @property
    def flops(self) -> int:
        return 4 * self.batch * self.n * (self.n + 1) // 2 * self.hq * self.head_dim

    @property
    def nbytes(self) -> int:
        return self.tokens * ((2 * self.hq + 2 * self.hkv) * self.head_dim * self.dtype.itemsize + self.hq * 4)


class Workload:
    """``rot`` sets of packed q/k/v, their outputs, and each set's K/V in its own paged pool."""

    def __init__(self, p: Prompts, device, rot: int, seed: int):
        torch.manual_seed(seed)
        self.p, self.rot = p, rot
        i32 = dict(dtype=torch.int32, device=device)
        self.indptr = torch.arange(p.batch + 1, **i32) * p.n  # queries and keys alike
        rand = lambda h: [torch.randn(p.tokens, h, p.head_dim, dtype=p.dtype, device=device)  # noqa: E731
                          for _ in range(rot)]
        self.qs, self.ks, self.vs = rand(p.hq), rand(p.hkv), rand(p.hkv)
        self.outs = {m: [torch.empty_like(q) for q in self.qs] for m in ("ours", "paged")}
        self.lses = {m: [torch.empty(p.tokens, p.hq, device=device) for _ in range(rot)] for m in self.outs}
        pages = -(-p.n // PAGE) * p.batch
        self.kv_indptr, self.kv_indices, self.kv_last = page_table(p.batch, [p.n] * p.batch, pages, device, seed)
        bi, pos = get_batch_indices_positions(self.indptr, torch.full((p.batch,), p.n, **i32), p.tokens)
        self.pools = [torch.zeros(pages, 2, PAGE, p.hkv, p.head_dim, dtype=p.dtype, device=device) for _ in range(rot)]
        for pool, k, v in zip(self.pools, self.ks, self.vs):
            append_paged_kv_cache(k, v, bi, pos, pool, self.kv_indices, self.kv_indptr, self.kv_last)

    def ragged(self, i: int, validate: bool = False):
        return lambda: batch_prefill_ragged(self.qs[i], self.indptr, self.ks[i], self.vs[i], self.indptr, causal=True,
                                            out=self.outs["ours"][i], lse=self.lses["ours"][i], validate=validate)

    def paged(self, i: int, validate: bool = False):
        return lambda: batch_prefill_paged(self.qs[i], self.indptr, self.pools[i], self.kv_indptr, self.kv_indices,
                                           self.kv_last, causal=True, out=self.outs["paged"][i],
                                           lse=self.lses["paged"][i], validate=validate)


def check_reference(head_dims, lens, heads, dtype, device) -> None:
    """Ours, ragged and paged, against the float64 reference on ragged causal prompts."""
    hq, hkv = heads
    o_tol, lse_tol = TOL[dtype]
    for d in head_dims:
        p = Prompts(len(lens), max(lens), d, hq, hkv, dtype)
        w = Workload(p, device, 1, seed=d)
        # Ragged lengths: the first l_i tokens of each packed prompt, and a page table as long.
        keep = torch.cat([torch.arange(b * p.n, b * p.n + n) for b, n in enumerate(lens)]).to(device)
        q, k, v = w.qs[0][keep], w.ks[0][keep], w.vs[0][keep]
        indptr = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
        o_ref, lse_ref = batch_prefill_ragged_ref(q, indptr, k, v, indptr, causal=True)
        pages = [-(-n // PAGE) for n in lens]
        kv_indptr = torch.tensor([0, *torch.tensor(pages).cumsum(0).tolist()], dtype=torch.int32, device=device)
        full = -(-p.n // PAGE)
        kv_indices = torch.cat([w.kv_indices[b * full:b * full + c] for b, c in enumerate(pages)])
        kv_last = torch.tensor([n - (c - 1) * PAGE for n, c in zip(lens, pages)], dtype=torch.int32, device=device)
        results = {"ragged": batch_prefill_ragged(q, indptr, k, v, indptr, causal=True),
                   "paged": batch_prefill_paged(q, indptr, w.pools[0], kv_indptr, kv_indices, kv_last, causal=True)}
        for name, (o, lse) in results.items():
            torch.testing.assert_close(o.double(), o_ref, atol=o_tol, rtol=o_tol, msg=lambda m: f"{name} D {d}: {m}")
            torch.testing.assert_close(lse.double(), lse_ref, atol=lse_tol, rtol=lse_tol,
                                       msg=lambda m: f"{name} D {d} lse: {m}")
    print(f"# correctness: ok (ragged and paged against the float64 reference, prompts {lens}, D {head_dims})")


# --------------------------------------------------------------------------- peers


def fi_ragged(fi, w: Workload, backend: str):
    p = w.p
    wrapper = fi.BatchPrefillWithRaggedKVCacheWrapper(fi_workspace(w.indptr.device), "NHD", backend=backend)
    wrapper.plan(w.indptr, w.indptr, p.hq, p.hkv, p.head_dim, causal=True, q_data_type=p.dtype, kv_data_type=p.dtype)
    outs = [torch.empty_like(q) for q in w.qs]
    check = lambda: wrapper.run(w.qs[0], w.ks[0], w.vs[0], return_lse=True)  # noqa: E731
    return (lambda i: lambda: wrapper.run(w.qs[i], w.ks[i], w.vs[i], out=outs[i])), check


def fi_paged(fi, w: Workload):
    p = w.p
    wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(fi_workspace(w.indptr.device), "NHD", backend="fa2")
    wrapper.plan(w.indptr, w.kv_indptr, w.kv_indices, w.kv_last, p.hq, p.hkv, p.head_dim, PAGE, causal=True,
                 q_data_type=p.dtype, kv_data_type=p.dtype)
    outs = [torch.empty_like(q) for q in w.qs]
    check = lambda: wrapper.run(w.qs[0], w.pools[0], return_lse=True)  # noqa: E731
    return (lambda i: lambda: wrapper.run(w.qs[i], w.pools[i], out=outs[i])), check


def sdpa(w: Workload):
    """SDPA on [prompts, heads, n, D] copies of the packed prompts (copied here, not timed)."""
    p = w.p
    pack = lambda t: t.view(p.batch, p.n, -1, p.head_dim).transpose(1, 2).contiguous()  # noqa: E731
    sets = [(pack(q), pack(k), pack(v)) for q, k, v in zip(w.qs, w.ks, w.vs)]
    run = lambda i: lambda: F.scaled_dot_product_attention(*sets[i], is_causal=True, enable_gqa=True)  # noqa: E731
    check = lambda: (run(0)().transpose(1, 2).reshape(p.tokens, p.hq, p.head_dim), None)  # noqa: E731
    return run, check


# --------------------------------------------------------------------------- one shape


def run_shape(p: Prompts, *, device, fi, fi_jit: bool, ceilings, rep_ms: int, seed: int) -> dict:
    """Check ours and every peer against ours, then (on a GPU) time them. Ours failing raises."""
    gpu = device.type == "cuda"
    rot = rotation_count(p.nbytes) if gpu else 1
    w = Workload(p, device, rot, seed)
    floor = roofline_floor(p.nbytes, p.flops, *ceilings) if ceilings else None
    row = dict(prompts=p.batch, n=p.n, D=p.head_dim, rot=rot, GB=p.nbytes / 1e9, TFLOP=p.flops / 1e12,
               floor_us=None if floor is None else floor * 1e6)
    o_tol, lse_tol = TOL[p.dtype]

    def record(name: str, seconds: float | None) -> None:
        row[f"{name}_us"] = None if seconds is None else seconds * 1e6
        row[f"{name}_TFLOPs"] = None if seconds is None else p.flops / seconds / 1e12
        row[f"{name}_frac"] = None if seconds is None or floor is None else floor / seconds

    for name in ("ours", "paged"):  # NaN first, so an unwritten row cannot pass
        w.outs[name][0].fill_(float("nan"))
        (w.ragged if name == "ours" else w.paged)(0, validate=True)()
    ref_o, ref_lse = w.outs["ours"][0].clone(), w.lses["ours"][0].clone()  # timing rewrites the buffers
    if not (torch.isfinite(ref_o).all() and torch.isfinite(ref_lse).all()):
        raise AssertionError(f"ours at {p}: non-finite output")
    methods = {"ours": (w.ragged, None), "paged": (w.paged, lambda: (w.outs["paged"][0], w.lses["paged"][0]))}
    if fi is not None and (p.head_dim in FI_PREBUILT_HEAD_DIMS or fi_jit):
        for name, build in (("fi_fa2", lambda: fi_ragged(fi, w, "fa2")), ("fi_fa3", lambda: fi_ragged(fi, w, "fa3")),
                            ("fi_paged", lambda: fi_paged(fi, w))):
            try:
                run, check = build()
                o, lse = check()
                methods[name] = (run, lambda o=o, lse=lse: (o, lse * LN2))  # base 2 -> natural log
            except Exception as exc:
                print(f"# {name} unavailable at {p}: {type(exc).__name__}: {exc}", file=sys.stderr)
    methods["sdpa"] = sdpa(w)
    checked = []
    for name, (run, check) in methods.items():
        try:
            if check is not None:
                o, lse = check()
                torch.testing.assert_close(o.float(), ref_o.float(), atol=o_tol, rtol=o_tol)
                if lse is not None:
                    torch.testing.assert_close(lse.float(), ref_lse, atol=lse_tol, rtol=lse_tol)
            checked.append(name)
            record(name, bench_rotating([run(i) for i in range(rot)], rep_ms=rep_ms) if gpu else None)
        except Exception as exc:
            if name in ("ours", "paged"):
                raise AssertionError(f"{name} at {p}: {exc}") from exc
            print(f"# {name} failed at {p}: {type(exc).__name__}: {exc}", file=sys.stderr)
            record(name, None)
    row["check"] = "+".join(checked)
    fi_best = [row[k] for k in ("fi_fa2_us", "fi_fa3_us") if row.get(k)]
    if fi_best and row.get("ours_us"):
        row["fi_over_ours"] = min(fi_best) / row["ours_us"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a few shapes only")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on a CPU (TRITON_INTERPRET=1): checks, no timing")
    ap.add_argument("--fi-jit", action="store_true", help="let FlashInfer JIT-compile head dims it does not ship")
    ap.add_argument("--rep-ms", type=int, default=200, help="do_bench_cudagraph rep per timing")
    ap.add_argument("--json", metavar="PATH", help="write the rows and the environment here as JSON")
    args = ap.parse_args()

    if args.smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            print("# TRITON_INTERPRET is not 1: the CPU runs the float64 reference, not the kernel", file=sys.stderr)
        device, fi, ceilings = torch.device("cpu"), None, None  # FlashInfer and the ceilings need CUDA
        print("#", environment(), flush=True)
        hq, hkv = SMOKE_HEADS
        shapes = [Prompts(b, n, d, hq, hkv, SMOKE_DTYPE) for b, n, d in SMOKE_SHAPES]
        check_reference(sorted({d for *_, d in SMOKE_SHAPES}), SMOKE_LENS, SMOKE_HEADS, SMOKE_DTYPE, device)
    else:
        device = gpu_start("bench_prefill")
        fi = load_flashinfer()
        shapes = [Prompts(b, n, d) for b, n, d in (QUICK_SHAPES if args.quick else SHAPES)]
        check_reference(sorted({p.head_dim for p in shapes}), CHECK_LENS, (HQ, HKV), DTYPE, device)
        ceilings = measure_ceilings()

    rows = []
    for n, p in enumerate(shapes):
        row = run_shape(p, device=device, fi=fi, fi_jit=args.fi_jit, ceilings=ceilings, rep_ms=args.rep_ms,
                        seed=200 + n)
        rows.append(row)
        gc.collect()  # free this shape's sets before the next one is allocated
        if device.type == "cuda":
            torch.cuda.empty_cache()
        print(f"# {p.batch} x {p.n} D {p.head_dim}: checked {row['check']}"
              + (f"; ours {row['ours_us']:.1f} us {row['ours_TFLOPs']:.0f} TFLOP/s, {row['ours_frac']:.2f} of floor"
                 if row.get("ours_us") else ""), flush=True)

    write_json(args.json, dict(env=environment(), rows=rows, copy_Bps=ceilings[0] if ceilings else None,
                               matmul_flops=ceilings[1] if ceilings else None,
                               shape=dict(hq=shapes[0].hq, hkv=shapes[0].hkv, page_size=PAGE,
                                          dtype=str(shapes[0].dtype), smoke=args.smoke)))
    print(f"\n## causal prefill, {shapes[0].dtype}, Hq {shapes[0].hq}, Hkv {shapes[0].hkv}"
          + (f" (copy {ceilings[0] / 1e9:.0f} GB/s, matmul {ceilings[1] / 1e12:.0f} TFLOP/s)" if ceilings
             else " (smoke: no timing)") + "\n")
    print(markdown_table(rows, ["prompts", "n", "D", "rot", "floor_us", "ours_us", "ours_TFLOPs", "ours_frac",
                                "paged_us", "paged_frac", "fi_fa2_us", "fi_fa3_us", "fi_paged_us", "fi_over_ours",
                                "sdpa_us", "sdpa_TFLOPs", "sdpa_frac", "check"]))


if __name__ == "__main__":
    main()
