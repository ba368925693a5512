"""What one host read of a vLLM block table costs per step, two ways.

    python -m benchmarks.tools.probe_block_table_read

The vLLM backend (cascadeinfer/integrations/vllm) plans each step on the host and so
reads vLLM's block table, which lives on the GPU, once per step. This times that read for
int32 tables of a few shapes: ``.cpu()`` (a pageable copy) against a copy into pinned
memory followed by a stream wait (what the backend does, on just the step's columns).
Medians of 300 reads, the GPU idle before each.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

SHAPES = [(256, 512), (256, 2048), (1024, 512)]


def median_us(read) -> float:
    times = []
    for _ in range(300):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        read()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    print("| block table | KiB | .cpu() µs | pinned copy + wait µs |\n| --- | --- | --- | --- |")
    for rows, cols in SHAPES:
        table = torch.randint(0, 1000, (rows, cols), dtype=torch.int32, device="cuda")
        host = torch.empty((rows, cols), dtype=torch.int32, pin_memory=True)

        def pinned():
            host.copy_(table, non_blocking=True)
            torch.cuda.current_stream().synchronize()

        print(f"| [{rows}, {cols}] | {rows * cols * 4 // 1024} | {median_us(table.cpu):.1f} | {median_us(pinned):.1f} |")


if __name__ == "__main__":
    main()
