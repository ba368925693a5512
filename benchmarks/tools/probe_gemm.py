"""The weight GEMMs of one decode step: which BLAS path reads the weights fastest?

    python -m benchmarks.tools.probe_gemm                       # Llama-3-8B shapes, 256 tokens
    python -m benchmarks.tools.probe_gemm --tokens 64 128 256 --json PATH
    python -m benchmarks.tools.probe_gemm --triton --json PATH  # Triton tiles and K splits beside cuBLAS
    python -m benchmarks.tools.probe_gemm --head --json PATH    # the LM head written five ways

A full-batch decode step of the engine spends most of its time in ``F.linear`` with a
few hundred rows against each weight matrix: the weights are read once, so each GEMM's
floor is its bytes over the copy bandwidth. For every projection of a Llama-3-8B layer
(and the LM head) this times ``F.linear`` through each BLAS library PyTorch offers
(``torch.backends.cuda.preferred_blas_library``), CUDA-graph replays over weight copies
rotated past L2, beside the floor; then the whole step's GEMM time (32 layers plus the
head) per library. With ``--triton`` it sweeps a Triton GEMM instead (pointer loads or TMA
descriptors, ``TRITON_CONFIGS`` tiles, K split 1/2/4 ways and summed by a second kernel)
and prints the best config per GEMM beside cuBLAS; every timing goes to the JSON. With
``--head`` it times the LM head (the one GEMM whose output, [tokens, vocab], is larger than
its input) in the forms an engine may write it: into a given buffer as the engine does,
allocating, with the operands swapped (logits transposed), in vocabulary chunks, and
through cuBLASLt.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from benchmarks._common import (
    bench_rotating,
    environment,
    markdown_table,
    measure_ceilings,
    roofline_floor,
    rotation_count,
    write_json,
)

# (name, in features, out features, times per step) of Llama-3-8B's decode step.
LLAMA3_8B = [("qkv", 4096, 6144, 32), ("o", 4096, 4096, 32), ("gate_up", 4096, 28672, 32),
             ("down", 14336, 4096, 32), ("lm_head", 4096, 128256, 1)]
LIBRARIES = ["cublas", "cublaslt"]
# Triton tile configs swept with --triton: (BM, BN, BK, stages, warps).
TRITON_CONFIGS = [(64, 128, 64, 4, 4), (64, 128, 64, 6, 4), (64, 256, 64, 3, 4), (64, 256, 64, 4, 4),
                  (64, 256, 64, 4, 8), (128, 128, 64, 3, 4), (128, 128, 64, 4, 8), (128, 128, 64, 5, 8),
                  (128, 256, 64, 3, 8), (128, 256, 64, 4, 8)]
SPLITS = (1, 2, 4)


def operands(tokens: int, k: int, n: int):
    """``(weights, x, outs, ref)`` for ``x [tokens, k] @ w [n, k].T`` in bf16: weight copies
    rotated past L2 with an output buffer each, one input, and the float32 answer for
    the first copy."""
    copies = rotation_count(n * k * 2)
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
    outs = [torch.empty(tokens, n, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
    return ws, x, outs, F.linear(x.float(), ws[0].float())


def check(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """Raise unless ``got`` is within 5% of ``ref``'s largest magnitude everywhere."""
    err = (got.float() - ref).abs().max().item()
    if err > 0.05 * ref.abs().max().item():
        raise AssertionError(f"{what}: max error {err}")


@triton.jit
def _tile_and_split(M, k_per_split, BM: tl.constexpr):
    """(row tile, column tile, first k) of this program. The m tiles of one weight tile
    are neighbours in launch order: the weight tile is read from memory once and from L2
    by the other row tiles."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BM)
    return pid % num_m, pid // num_m, tl.program_id(1) * k_per_split


@triton.jit
def _store_tile(c_ptr, acc, pid_m, pid_n, M, N, stride_cs, stride_cm,
                BM: tl.constexpr, BN: tl.constexpr, PARTIAL: tl.constexpr):
    """acc into out (cast to its dtype) or, with PARTIAL, into this split's float32 slice."""
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    c_offs = tl.program_id(1).to(tl.int64) * stride_cs + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    if PARTIAL:
        tl.store(c_ptr + c_offs, acc, mask=mask)
    else:
        tl.store(c_ptr + c_offs, acc.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _linear_kernel(
    a_ptr,  # [M, K] activations, K contiguous
    b_ptr,  # [N, K] weight (F.linear layout), K contiguous
    c_ptr,  # [M, N] out (SPLIT == 1) or [splits, M, N] float32 partial sums
    M, N, k_per_split,
    stride_am, stride_bn, stride_cs, stride_cm,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr,
    PARTIAL: tl.constexpr,
):
    pid_m, pid_n, k0 = _tile_and_split(M, k_per_split, BM)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    a_ptrs = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am + (k0 + offs_k)[None, :]
    b_ptrs = b_ptr + offs_n.to(tl.int64)[:, None] * stride_bn + (k0 + offs_k)[None, :]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for _ in tl.range(0, k_per_split, BK, num_stages=STAGES):
        a = tl.load(a_ptrs, mask=(offs_m < M)[:, None], other=0.0)
        b = tl.load(b_ptrs, mask=(offs_n < N)[:, None], other=0.0)
        acc = tl.dot(a, tl.trans(b), acc)
        a_ptrs += BK
        b_ptrs += BK
    _store_tile(c_ptr, acc, pid_m, pid_n, M, N, stride_cs, stride_cm, BM, BN, PARTIAL)


@triton.jit
def _linear_tma_kernel(
    a_desc, b_desc,  # TensorDescriptor of a [M, K] (block [BM, BK]) and b [N, K] (block [BN, BK])
    c_ptr, M, N, k_per_split, stride_cs, stride_cm,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr,
    PARTIAL: tl.constexpr,
):
    pid_m, pid_n, k0 = _tile_and_split(M, k_per_split, BM)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in tl.range(0, k_per_split, BK, num_stages=STAGES):
        a = a_desc.load([pid_m * BM, k0 + k])
        b = b_desc.load([pid_n * BN, k0 + k])
        acc = tl.dot(a, b.T, acc)
    _store_tile(c_ptr, acc, pid_m, pid_n, M, N, stride_cs, stride_cm, BM, BN, PARTIAL)


@triton.jit
def _sum_splits_kernel(p_ptr, out_ptr, n, splits, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(splits):
        acc += tl.load(p_ptr + s * n + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def triton_linear_fn(x, w, out, cfg, splits, tma):
    """A callable computing ``out = x @ w.T`` with one tile config, split over K ``splits`` ways."""
    bm, bn, bk, stages, warps = cfg
    m, k = x.shape
    n = w.shape[0]
    if k % (bk * splits):
        return None
    per = k // splits
    part = torch.empty(splits, m, n, device=x.device, dtype=torch.float32) if splits > 1 else None
    c = part if splits > 1 else out
    stride_cs = part.stride(0) if splits > 1 else 0
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn), splits)
    total = m * n
    if tma:
        a_desc = TensorDescriptor.from_tensor(x, [bm, bk])
        b_desc = TensorDescriptor.from_tensor(w, [bn, bk])

        def gemm():
            _linear_tma_kernel[grid](a_desc, b_desc, c, m, n, per, stride_cs, n, BM=bm, BN=bn, BK=bk,
                                     STAGES=stages, PARTIAL=splits > 1, num_warps=warps)
    else:
        def gemm():
            _linear_kernel[grid](x, w, c, m, n, per, x.stride(0), w.stride(0), stride_cs, n, BM=bm, BN=bn,
                                 BK=bk, STAGES=stages, PARTIAL=splits > 1, num_warps=warps)
    if splits == 1:
        return gemm

    def gemm_and_sum():
        gemm()
        _sum_splits_kernel[(triton.cdiv(total, 1024),)](part, out, total, splits, BLOCK=1024, num_warps=4)
    return gemm_and_sum


def time_triton(tokens: int, k: int, n: int, cfg, splits: int, tma: bool) -> float | None:
    """Seconds per Triton GEMM with ``cfg``/``splits`` (None: the config does not apply or fails)."""
    ws, x, outs, ref = operands(tokens, k, n)
    try:
        fns = [triton_linear_fn(x, w, o, cfg, splits, tma) for w, o in zip(ws, outs)]
        if fns[0] is None:
            return None
        fns[0]()
        torch.cuda.synchronize()
    except Exception as e:  # out of resources for this config
        print("skip", cfg, splits, tma, type(e).__name__, str(e)[:120], flush=True)
        return None
    check(outs[0], ref, f"triton {cfg} x{splits} ({tokens}, {k}, {n})")
    return bench_rotating(fns, rep_ms=100)


def sweep_triton(tokens, copy_bw, mm_rate):
    """Best Triton config per GEMM beside cuBLAS; every timing kept."""
    rows, every = [], []
    for name, k, n, _ in LLAMA3_8B:
        floor = roofline_floor(2 * (n * k + tokens * k + tokens * n), 2 * tokens * n * k, copy_bw, mm_rate)
        t_blas = time_linear(tokens, k, n, "cublas")
        best = None
        for tma in (False, True):
            for cfg in TRITON_CONFIGS:
                for splits in SPLITS:
                    if name == "lm_head" and splits > 1:
                        continue
                    t = time_triton(tokens, k, n, cfg, splits, tma)
                    if t is None:
                        continue
                    every.append({"gemm": name, "cfg": list(cfg), "splits": splits, "tma": tma, "us": round(t * 1e6, 2)})
                    if best is None or t < best[0]:
                        best = (t, cfg, splits, tma)
        row = {"tokens": tokens, "gemm": f"{name} {k}x{n}", "floor us": round(floor * 1e6, 1),
               "cublas us": round(t_blas * 1e6, 1), "triton us": round(best[0] * 1e6, 1),
               "triton / cublas": round(best[0] / t_blas, 3),
               "best": f"{best[1]} x{best[2]}{' tma' if best[3] else ''}"}
        print(row, flush=True)
        rows.append(row)
    return rows, every



def time_linear(tokens: int, k: int, n: int, library: str) -> float:
    """Seconds per ``F.linear(x [tokens, k], w [n, k])`` in bf16 through ``library``."""
    torch.backends.cuda.preferred_blas_library(library)
    ws, x, outs, ref = operands(tokens, k, n)
    fns = [lambda w=w, o=o: torch.matmul(x, w.t(), out=o) for w, o in zip(ws, outs)]
    fns[0]()
    check(outs[0], ref, f"{library} ({tokens}, {k}, {n})")
    return bench_rotating(fns)


def head_forms(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, chunks: int = 4) -> dict:
    """Callables computing ``x @ w.T`` (or its transpose) in each form, keyed by name."""
    n = w.shape[0]
    out_t = torch.empty(n, x.shape[0], device=x.device, dtype=x.dtype)
    bounds = [n * i // chunks for i in range(chunks + 1)]

    def chunked():
        for a, b in zip(bounds, bounds[1:]):
            torch.mm(x, w[a:b].t(), out=out[:, a:b])

    return {"mm into out": lambda: torch.mm(x, w.t(), out=out),
            "F.linear": lambda: F.linear(x, w),
            "mm swapped (w @ x.T) into out_t": lambda: torch.mm(w, x.t(), out=out_t),
            f"mm in {chunks} vocab chunks into out": chunked}


def time_head(tokens: int, copy_bw: float, mm_rate: float) -> list[dict]:
    """The LM head of Llama-3-8B in each of :func:`head_forms`, cuBLAS and cuBLASLt."""
    _, k, n, _ = LLAMA3_8B[-1]
    floor = roofline_floor(2 * (n * k + tokens * k + tokens * n), 2 * tokens * n * k, copy_bw, mm_rate)
    ws, x, outs, ref = operands(tokens, k, n)
    rows = []
    for lib in LIBRARIES:
        torch.backends.cuda.preferred_blas_library(lib)
        forms = [head_forms(x, w, o) for w, o in zip(ws, outs)]
        for name in forms[0]:
            outs[0].zero_()
            got = forms[0][name]()
            got = outs[0] if got is None else got
            got = got.t() if got.shape[0] == n else got
            check(got, ref, f"head {name} ({lib})")
            t = bench_rotating([f[name] for f in forms])
            rows.append({"tokens": tokens, "library": lib, "form": name, "floor us": round(floor * 1e6, 1),
                         "us": round(t * 1e6, 1), "of floor": round(floor / t, 2)})
            print(rows[-1], flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", nargs="*", type=int, default=[256])
    ap.add_argument("--triton", action="store_true", help="sweep Triton tile configs and K splits beside cuBLAS")
    ap.add_argument("--json", metavar="PATH", help="write the results and the environment here as JSON")
    ap.add_argument("--head", action="store_true", help="time the LM head in several forms")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    default = torch.backends.cuda.preferred_blas_library()
    copy_bw, mm_rate = measure_ceilings()
    if args.head:
        rows = [r for tokens in args.tokens for r in time_head(tokens, copy_bw, mm_rate)]
        torch.backends.cuda.preferred_blas_library(default)
        print(markdown_table(rows, list(rows[0])))
        write_json(args.json, {"environment": environment(), "copy_bw": copy_bw, "mm_rate": mm_rate, "rows": rows})
        return
    if args.triton:
        rows, every = [], []
        for tokens in args.tokens:
            r, e = sweep_triton(tokens, copy_bw, mm_rate)
            rows += r
            every += e
        print(markdown_table(rows, list(rows[0])))
        write_json(args.json, {"environment": environment(), "copy_bw": copy_bw, "mm_rate": mm_rate,
                               "rows": rows, "every": every})
        return
    rows, totals = [], []
    for tokens in args.tokens:
        step = {lib: 0.0 for lib in LIBRARIES}
        step_floor = 0.0
        for name, k, n, times in LLAMA3_8B:
            floor = roofline_floor(2 * (n * k + tokens * k + tokens * n), 2 * tokens * n * k, copy_bw, mm_rate)
            row = {"tokens": tokens, "gemm": f"{name} {k}x{n}", "floor us": round(floor * 1e6, 1)}
            for lib in LIBRARIES:
                t = time_linear(tokens, k, n, lib)
                row[f"{lib} us"] = round(t * 1e6, 1)
                row[f"{lib} of floor"] = round(floor / t, 2)
                step[lib] += times * t
            step_floor += times * floor
            rows.append(row)
            print(row, flush=True)
        totals.append({"tokens": tokens, "step floor ms": round(step_floor * 1e3, 2),
                       **{f"{lib} ms": round(step[lib] * 1e3, 2) for lib in LIBRARIES}})
    torch.backends.cuda.preferred_blas_library(default)
    columns = ["tokens", "gemm", "floor us"] + [f"{lib} {c}" for lib in LIBRARIES for c in ("us", "of floor")]
    print(markdown_table(rows, columns))
    print(markdown_table(totals, list(totals[0])))
    write_json(args.json, {"environment": environment(), "copy_bw": copy_bw, "mm_rate": mm_rate,
                           "rows": rows, "step": totals})


if __name__ == "__main__":
    main()
