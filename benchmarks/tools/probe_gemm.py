"""The weight GEMMs of one decode step: which BLAS path reads the weights fastest?

    python -m benchmarks.tools.probe_gemm                       # Llama-3-8B shapes, 256 tokens
    python -m benchmarks.tools.probe_gemm --tokens 64 128 256 --json PATH

A full-batch decode step of the engine spends most of its time in ``F.linear`` with a
few hundred rows against each weight matrix: the weights are read once, so each GEMM's
floor is its bytes over the copy bandwidth. For every projection of a Llama-3-8B layer
(and the LM head) this times ``F.linear`` through each BLAS library PyTorch offers
(``torch.backends.cuda.preferred_blas_library``), CUDA-graph replays over weight copies
rotated past L2, beside the floor; then the whole step's GEMM time (32 layers plus the
head) per library.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

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


def time_linear(tokens: int, k: int, n: int, library: str) -> float:
    """Seconds per ``F.linear(x [tokens, k], w [n, k])`` in bf16 through ``library``."""
    torch.backends.cuda.preferred_blas_library(library)
    copies = rotation_count(n * k * 2)
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
    outs = [torch.empty(tokens, n, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
    fns = [lambda w=w, o=o: torch.matmul(x, w.t(), out=o) for w, o in zip(ws, outs)]
    ref = F.linear(x.float(), ws[0].float())
    fns[0]()
    err = (outs[0].float() - ref).abs().max().item()
    if err > 0.05 * ref.abs().max().item():
        raise AssertionError(f"{library} ({tokens}, {k}, {n}): max error {err}")
    return bench_rotating(fns)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", nargs="*", type=int, default=[256])
    ap.add_argument("--json", metavar="PATH", help="write the results and the environment here as JSON")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    default = torch.backends.cuda.preferred_blas_library()
    copy_bw, mm_rate = measure_ceilings()
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
