"""Shared benchmark plumbing: measured ceilings, CUDA-graph timing with rotated inputs,
peers, and the table every benchmark prints.

Timing rules (see README "How we measure"): ``triton.testing.do_bench_cudagraph`` median;
fresh random inputs; several input sets rotated inside one captured graph so that
repeated calls are not served from L2; every result beside its roofline floor
``max(bytes / copy bandwidth, flops / matmul rate)`` with both ceilings measured in the
same run.
"""

from __future__ import annotations

import json
import math
import platform
import re
import sys
from collections.abc import Callable, Sequence
from datetime import date

import torch
import triton
import triton.language as tl

from cascadeinfer.kernels.policy import DecodeConfig

L2_BYTES = 50 * 2**20  # H100; the rotation sizes below keep several times this in flight


@triton.jit
def _copy_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)


def bench_seconds(fn: Callable[[], object], *, rep_ms: int = 200) -> float:
    """Median seconds of one replay of ``fn`` captured in a CUDA graph (warmed up)."""
    fn()  # compile outside the graph
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median") * 1e-3


def bench_rotating(fns: Sequence[Callable[[], object]], *, rep_ms: int = 200) -> float:
    """Seconds per call when the calls in ``fns`` (each on its own input set) run back to back.

    Capturing all of them in one graph means no call finds its inputs in L2 from the
    previous one, as long as the input sets together exceed L2.
    """
    def run_all():
        for f in fns:
            f()

    return bench_seconds(run_all, rep_ms=rep_ms) / len(fns)


def rotation_count(bytes_per_call: int, minimum: int = 2, maximum: int = 16) -> int:
    """How many input sets to rotate so that together they are at least 3× L2."""
    return max(minimum, min(maximum, math.ceil(3 * L2_BYTES / max(1, bytes_per_call))))


def measure_copy_bandwidth(nbytes: int = 2**31) -> float:
    """Bytes/s (read + write) of a kernel copy of ``nbytes`` (a copy engine reads ~20% low)."""
    n = nbytes // 4
    src = torch.randn(n, device="cuda")
    dst = torch.empty_like(src)
    block = 4096
    grid = (triton.cdiv(n, block),)
    t_triton = bench_seconds(lambda: _copy_kernel[grid](src, dst, n, BLOCK=block, num_warps=8))
    t_torch = bench_seconds(lambda: torch.add(src, 0, out=dst))
    assert torch.equal(src, dst)
    return 2 * nbytes / min(t_triton, t_torch)


def measure_matmul_rate(n: int = 8192, dtype: torch.dtype = torch.bfloat16) -> float:
    """FLOP/s of a large dense matmul through torch (cuBLAS) on random data."""
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    c = torch.empty(n, n, device="cuda", dtype=dtype)
    t = bench_seconds(lambda: torch.matmul(a, b, out=c))
    return 2 * n**3 / t


def measure_ceilings() -> tuple[float, float]:
    """(copy bytes/s, bf16 matmul FLOP/s), measured now and printed as a comment line."""
    copy_bw, mm_rate = measure_copy_bandwidth(), measure_matmul_rate()
    print(f"# copy bandwidth {copy_bw / 1e9:.0f} GB/s (read + write), bf16 matmul {mm_rate / 1e12:.0f} TFLOP/s",
          flush=True)
    return copy_bw, mm_rate


def roofline_floor(nbytes: float, flops: float, copy_bw: float, mm_rate: float) -> float:
    """Seconds no implementation can beat: the larger of the memory and compute times."""
    return max(nbytes / copy_bw, flops / mm_rate)


def load_flashinfer():
    """FlashInfer if it is importable (installed from ../shared/peers on the GPU machine), else None."""
    try:
        import flashinfer  # noqa: PLC0415

        return flashinfer
    except Exception as exc:  # a broken install is reported, not fatal
        print(f"# flashinfer unavailable: {type(exc).__name__}: {exc}", file=sys.stderr)
        return None


def environment() -> dict:
    """Device and versions, for the header of RESULTS.md."""
    fi = load_flashinfer()
    return {
        "date": date.today().isoformat(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "sms": torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else 0,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "flashinfer": getattr(fi, "__version__", None) if fi else None,
    }


def markdown_table(rows: Sequence[dict], columns: Sequence[str]) -> str:
    def fmt(x):
        if isinstance(x, float):
            return f"{x:.3g}" if abs(x) < 100 else f"{x:.0f}"
        return "—" if x is None else str(x)

    lines = ["| " + " | ".join(columns) + " |", "| " + " | ".join("---" for _ in columns) + " |"]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def write_json(path: str | None, payload: dict) -> None:
    """Write ``payload`` as JSON to ``path`` (a benchmark's ``--json PATH``); None: nowhere."""
    if path:
        with open(path, "w") as f:
            json.dump(payload, f, indent=1)


def gpu_start(tool: str) -> torch.device:
    """A GPU tool's start: exit with a message where no CUDA device is present, else print
    the environment as a ``#`` line and return the current CUDA device."""
    if not torch.cuda.is_available():
        sys.exit(f"{tool} needs a CUDA device")
    print("#", environment(), flush=True)
    return torch.device("cuda", torch.cuda.current_device())


def parse_config(name: str) -> DecodeConfig:
    """``n<keys>_w<warps>_s<stages>[_x<sub-tiles>][_p<programs per SM>][_c]`` as a
    :class:`DecodeConfig` (``_p``: the split plan's residency, default 2; ``_c``: the
    partial last tile inside the key loop, its rows clamped)."""
    m = re.fullmatch(r"n(\d+)_w(\d+)_s(\d+)(?:_x(\d+))?(?:_p(\d+))?(_c)?", name)
    if m is None:
        raise ValueError(f"config {name!r}: expected n<keys>_w<warps>_s<stages>[_x<sub-tiles>][_p<k>][_c]")
    n, w, st, x, p, c = m.groups()
    return DecodeConfig(block_n=int(n), num_warps=int(w), num_stages=int(st), subtiles=int(x or 1),
                        programs_per_sm=int(p or 2), clamp_tail=c is not None)
