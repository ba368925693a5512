"""Timing work that runs collectives: the same number of runs on every rank."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def median_seconds(fn: Callable[[], object], device: torch.device, reps: int, *, graph: bool = False) -> float:
    """Median seconds of ``fn`` over exactly ``reps`` timed runs, after three untimed ones
    (compilation, communicator set-up). The count is fixed, not adapted to the time taken
    as ``triton.testing.do_bench`` does, so ranks whose ``fn`` runs collectives stay in step.

    On a GPU CUDA events time eager calls or, with ``graph``, replays of one CUDA graph of
    ``fn`` (its collectives captured too); on a CPU the wall clock times calls.
    """
    for _ in range(3):
        fn()
    if graph and device.type == "cuda":
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            fn()
        fn = captured.replay
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e-3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)
