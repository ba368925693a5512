"""Host cost per call and eager wall time: the speed an engine gets without CUDA graphs.

Run from the repository root on a GPU machine:

    python -m benchmarks.bench_host                    # both tables, FlashInfer beside ours
    python -m benchmarks.bench_host --json PATH        # also every row as JSON

**Host cost** is the CPU time to enqueue one call: every call is timed on its own with
``time.perf_counter_ns`` while the GPU is kept busy (a ``torch.cuda._sleep`` enqueued
before each batch of calls, long enough that no launch waits on the device), median over
``--calls`` calls (1000 by default), after a warm-up that compiles and records; then as
many calls again with ``time.thread_time_ns`` (the calling thread's CPU time, which a
host that preempts the process does not inflate; the ``_cpu_us`` columns). A timer row
(an empty call, timed alike) gives what the clocks themselves add. Each row
is timed in ``--rounds`` rounds (3), each of which times every row of every shape once;
the table gives the median of the rounds' medians, the JSON every round. It is measured in
``torch.inference_mode()`` and outside it. Rows (bf16, Hq 32, Hkv 8, D 128,
page 16, two levels: one prefix group + each request's suffix):

* ours ``MultiLevelCascadeAttention.run``: the cascade (forced), the flat decode (forced),
  and three levels (the prefix cut in two);
* ours single launchers with ``validate=False``: ``batch_decode_paged`` on the flat table,
  ``batch_prefill_paged`` on the prefix level, ``merge_state``, ``merge_states`` (4
  states), ``append_paged_kv_cache`` (one token per request); on compute capability 9.0
  also ``batch_prefill_paged(backend="hopper")`` where the Hopper kernel takes the prefix
  level (its launches replay through Triton's launcher, which encodes its TMA descriptors);
* ours ``plan()`` of the two-level batch (host tables in, includes its device copies);
* FlashInfer: its fastest cascade ``run`` (two fa2 ``BatchPrefillWithPagedKVCacheWrapper``
  levels + ``merge_state_in_place``) and ``BatchDecodeWithPagedKVCacheWrapper.run``
  (tensor cores) on the flat table.

**Eager wall time** is ``triton.testing.do_bench`` (median, L2 flushed before every call,
no CUDA graph) of the public ``run`` (the planner's choice) against FlashInfer's eager
cascade, at bench_cascade's bar shapes and its short-prefix shapes, beside our
CUDA-graph time at the bar shapes: ``bench_cascade``'s rotated-pool timing, and the same
call captured in a graph and timed like the eager one (do_bench, L2 flushed).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections.abc import Callable

import torch
import triton

from benchmarks._common import environment, load_flashinfer, markdown_table
from benchmarks.fixtures import (
    BAR_SHAPES,
    DTYPE,
    MAX_ROTATIONS,
    MIN_POOL_BYTES,
    PAGE,
    SHORT_PREFIX_SHAPES,
    Shape,
    Workload,
    fi_cascade,
    make_timer,
    ours,
)
from cascadeinfer import (
    MultiLevelCascadeAttention,
    append_paged_kv_cache,
    batch_decode_paged,
    batch_prefill_paged,
    get_batch_indices_positions,
    get_seq_lens,
    merge_state,
    merge_states,
)
from cascadeinfer.kernels import hot_path
from cascadeinfer.kernels.backend import hopper_unavailable

HOST_SHAPES = ((64, 8192, 256), (4, 16384, 16384), (8, 128, 2048))  # (batch, prefix, suffix)
BATCH_OF_CALLS = 50
PLAN_REQUESTS = (256, 4096, 128)
TIMER_ROW = "timer: an empty call, timed alike"


def host_us(fn: Callable[[], object], calls: int, device: torch.device) -> tuple[float, float]:
    """Median microseconds to enqueue one ``fn()`` (see the module docstring): wall time
    (``perf_counter_ns``), then, in a second pass of as many calls, the calling thread's
    CPU time (``thread_time_ns``), which a host that preempts the process does not inflate."""
    for _ in range(3):  # compile, record, settle
        fn()
    cuda = device.type == "cuda"
    medians = []
    for clock in (time.perf_counter_ns, time.thread_time_ns):
        if cuda:
            torch.cuda.synchronize(device)
        times = []
        while len(times) < calls:
            if cuda:
                torch.cuda._sleep(40_000_000)  # ~20 ms of GPU time: the batch enqueues behind it
            for _ in range(min(BATCH_OF_CALLS, calls - len(times))):
                t0 = clock()
                fn()
                times.append(clock() - t0)
            if cuda:
                torch.cuda.synchronize(device)
        medians.append(statistics.median(times) / 1e3)
    return medians[0], medians[1]


def _three_levels(wl: Workload) -> MultiLevelCascadeAttention:
    """The prefix cut into two levels of one group each (the first half of its pages, then
    the rest), then each request's suffix."""
    s = wl.shape
    half = s.prefix_pages // 2
    i32 = dict(dtype=torch.int32, device=wl.device)
    prefix = wl.kv_indices[0]
    qo = [wl.qo_indptr[0], wl.qo_indptr[0], wl.qo_indptr[1]]
    kp = [torch.tensor([0, half], **i32), torch.tensor([0, s.prefix_pages - half], **i32), wl.kv_indptr[1]]
    ki = [prefix[:half].contiguous(), prefix[half:].contiguous(), wl.kv_indices[1]]
    kl = [torch.tensor([PAGE if half else 0], **i32), wl.kv_last[0], wl.kv_last[1]]
    attn = MultiLevelCascadeAttention(3, device=wl.device)
    attn.plan(qo, kp, ki, kl, s.hq, s.hkv, s.head_dim, PAGE, num_pages=wl.num_pages, use_cascade=True)
    return attn


def host_calls(shape: Shape, fi, device: torch.device) -> dict[str, Callable[[], object]]:
    """Every host-cost row's call at one shape (the workload lives as long as they do)."""
    wl = Workload(shape, device, seed=7, min_pool_bytes=MIN_POOL_BYTES, max_rot=1)
    s = wl.shape
    q, pool = wl.qs[0], wl.pools[0]
    out, lse = wl.out_buffers()[0][0], wl.out_buffers()[1][0]
    casc, flat = ours(wl, True), ours(wl, False)
    three = _three_levels(wl)
    states = torch.randn(s.batch, 4, s.hq, s.head_dim, device=device, dtype=DTYPE)
    state_lse = torch.randn(s.batch, 4, s.hq, device=device)
    merged, merged_lse = torch.empty_like(states[:, 0]), torch.empty_like(state_lse[:, 0])
    # The two states, sliced once here: the rows time the launcher, not the caller's slicing.
    v_a, s_a, v_b, s_b = states[:, 0], state_lse[:, 0], states[:, 1], state_lse[:, 1]
    seq_lens = get_seq_lens(wl.flat_indptr, wl.flat_last, PAGE)
    append_indptr = torch.arange(s.batch + 1, dtype=torch.int32, device=device)
    rows_b, pos = get_batch_indices_positions(append_indptr, seq_lens, s.batch)
    new_k = torch.randn(s.batch, s.hkv, s.head_dim, device=device, dtype=DTYPE)
    new_v = torch.randn_like(new_k)
    calls_by_name: dict[str, Callable[[], object]] = {
        "ours run, cascade": casc.call(0),
        "ours run, flat": flat.call(0),
        "ours run, 3 levels": lambda: three.run(q, pool, out=out),
        "ours batch_decode_paged": lambda: batch_decode_paged(
            q, pool, wl.flat_indptr, wl.flat_indices, wl.flat_last, validate=False),
        "ours batch_prefill_paged (prefix level)": lambda: batch_prefill_paged(
            q, wl.qo_indptr[0], pool, wl.kv_indptr[0], wl.kv_indices[0], wl.kv_last[0], validate=False),
        "ours merge_state": lambda: merge_state(v_a, s_a, v_b, s_b, validate=False),
        "ours merge_states (4 states)": lambda: merge_states(states, state_lse, validate=False),
        # As an engine calls them: into its own buffers (no allocation per call).
        "ours batch_decode_paged, out given": lambda: batch_decode_paged(
            q, pool, wl.flat_indptr, wl.flat_indices, wl.flat_last, out=out, lse=lse, validate=False),
        "ours batch_prefill_paged (prefix level), out given": lambda: batch_prefill_paged(
            q, wl.qo_indptr[0], pool, wl.kv_indptr[0], wl.kv_indices[0], wl.kv_last[0], out=out, lse=lse,
            validate=False),
        "ours merge_state, out given": lambda: merge_state(v_a, s_a, v_b, s_b, out=merged, out_lse=merged_lse,
                                                           validate=False),
        "ours append_paged_kv_cache": lambda: append_paged_kv_cache(
            new_k, new_v, rows_b, pos, pool, wl.flat_indices, wl.flat_indptr, wl.flat_last, validate=False),
    }
    if hopper_unavailable(device) is None:

        def hopper():
            return batch_prefill_paged(q, wl.qo_indptr[0], pool, wl.kv_indptr[0], wl.kv_indices[0], wl.kv_last[0],
                                       out=out, lse=lse, validate=False, backend="hopper")

        try:
            hopper()
        except ValueError as exc:  # the Hopper kernel declines this shape: no row
            print(f"# {shape.batch, shape.prefix, shape.suffix}: {exc}", file=sys.stderr)
        else:
            calls_by_name["ours batch_prefill_paged (prefix level), Hopper, out given"] = hopper
    if fi is not None:
        calls_by_name["FlashInfer cascade run (fa2 x2 + merge)"] = fi_cascade(fi, wl).call(0)
        w = fi.BatchDecodeWithPagedKVCacheWrapper(torch.zeros(256 * 2**20, dtype=torch.uint8, device=device),
                                                  "NHD", use_tensor_cores=True)
        w.plan(wl.flat_indptr, wl.flat_indices, wl.flat_last, s.hq, s.hkv, s.head_dim, PAGE,
               q_data_type=DTYPE, kv_data_type=DTYPE)
        calls_by_name["FlashInfer decode run (tensor cores)"] = lambda: w.run(q, pool, out=out)
    return calls_by_name


def host_rows(shapes, fi, calls: int, device: torch.device, rounds: int = 3) -> list[dict]:
    """Every host-cost row of every shape, in and out of inference mode: the median of
    ``rounds`` medians, each round timing every row of every shape once (so that a slower
    spell of the host weighs on one round of many rows, not on every round of a few)."""
    by_shape = {shape: host_calls(Shape(*shape), fi, device) for shape in shapes}
    by_shape[shapes[0]][TIMER_ROW] = lambda: None  # what the clocks themselves cost
    samples: dict[tuple, list[float]] = {}
    cpu_samples: dict[tuple, list[float]] = {}
    for r in range(rounds):
        for shape, calls_by_name in by_shape.items():
            for name, fn in calls_by_name.items():
                for mode in ("inference", "grad"):
                    with torch.inference_mode() if mode == "inference" else contextlib.nullcontext():
                        wall_us, cpu_us = host_us(fn, calls, device)
                    samples.setdefault((shape, name, mode), []).append(wall_us)
                    cpu_samples.setdefault((shape, name, mode), []).append(cpu_us)
        print(f"# host cost round {r + 1} of {rounds} done", flush=True)
    rows = []
    for shape, calls_by_name in by_shape.items():
        for name in calls_by_name:
            row = dict(call=name, batch=shape[0], prefix=shape[1], suffix=shape[2])
            for mode in ("inference", "grad"):
                row[f"{mode}_us"] = statistics.median(samples[shape, name, mode])
                row[f"{mode}_rounds_us"] = [round(x, 2) for x in samples[shape, name, mode]]
                row[f"{mode}_cpu_us"] = statistics.median(cpu_samples[shape, name, mode])
                row[f"{mode}_cpu_rounds_us"] = [round(x, 2) for x in cpu_samples[shape, name, mode]]
            rows.append(row)
    return rows


def plan_row(fi, calls: int, device: torch.device) -> dict:
    """``plan()`` of PLAN_REQUESTS requests (host tables, as an engine's scheduler has them)."""
    batch, prefix, suffix = PLAN_REQUESTS
    wl = Workload(Shape(batch, prefix, suffix), device, seed=3, min_pool_bytes=0, max_rot=1)
    s = wl.shape
    tables = [[t.cpu() for t in ts] for ts in wl.tables()]
    attn = MultiLevelCascadeAttention(2, device=device)

    def plan():
        attn.plan(*tables, s.hq, s.hkv, s.head_dim, PAGE, num_pages=wl.num_pages)

    times = []
    for i in range(max(20, calls // 20) + 3):
        t0 = time.perf_counter_ns()
        plan()
        if i >= 3:
            times.append(time.perf_counter_ns() - t0)
    return dict(call=f"ours plan(), {batch} requests", batch=batch, prefix=prefix, suffix=suffix,
                grad_us=statistics.median(times) / 1e3)


def wall_rows(shapes, fi, device: torch.device, graph: bool, rep_ms: int) -> list[dict]:
    """Eager do_bench medians of ours (planner's choice) and FlashInfer's cascade; with
    ``graph`` also our CUDA-graph time with rotated pools."""
    rows = []
    for b, p, x in shapes:
        wl = Workload(Shape(b, p, x), device, seed=11, min_pool_bytes=MIN_POOL_BYTES,
                      max_rot=MAX_ROTATIONS if graph else 1)
        m = ours(wl, None)
        row = dict(batch=b, prefix=p, suffix=x, pick=m.pick)
        eager = lambda f: triton.testing.do_bench(f, warmup=50, rep=rep_ms, return_mode="median") * 1e3  # noqa: E731
        row["ours_eager_us"] = eager(m.call(0))
        if fi is not None:
            row["fi_eager_us"] = eager(fi_cascade(fi, wl).call(0))
        if graph:
            row["ours_graph_us"] = make_timer(device, rep_ms)([m.call(i) for i in range(wl.rot)]) * 1e6
            row["eager_over_graph"] = row["ours_eager_us"] / row["ours_graph_us"]
            # The same call replayed from a CUDA graph, timed like the eager call (do_bench,
            # L2 flushed): what eager execution itself costs, apart from the timing method.
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                m.call(0)()
            row["ours_graph_flushed_us"] = eager(g.replay)
            row["eager_over_graph_flushed"] = row["ours_eager_us"] / row["ours_graph_flushed_us"]
        rows.append(row)
        del wl
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=1000, help="timed calls per host-cost row")
    ap.add_argument("--rep-ms", type=int, default=200, help="do_bench repetition time")
    ap.add_argument("--json", metavar="PATH", help="write every row and the environment here")
    ap.add_argument("--rounds", type=int, default=3, help="host-cost rounds (each row's median of their medians)")
    ap.add_argument("--no-wall", action="store_true", help="host cost only")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_host needs a CUDA device")
    device = torch.device("cuda", torch.cuda.current_device())
    if hot_path.module() is None:  # built now, not in the background while rows are timed
        print("# the C++ hot path is unavailable: every row of ours takes the Python path", flush=True)
    fi = load_flashinfer()
    env = environment()
    print(f"# {env}", flush=True)
    host = host_rows(HOST_SHAPES, fi, args.calls, device, args.rounds)
    host.append(plan_row(fi, args.calls, device))
    print(f"\n## Host cost per call (µs, median of {args.rounds} rounds' medians: wall time, and the "
          f"thread's CPU time)\n")
    print(markdown_table(host, ["call", "batch", "prefix", "suffix", "inference_us", "grad_us", "inference_cpu_us",
                                "grad_cpu_us"]))
    wall = []
    if not args.no_wall:
        wall = wall_rows(BAR_SHAPES, fi, device, True, args.rep_ms) + wall_rows(
            SHORT_PREFIX_SHAPES, fi, device, False, args.rep_ms)
        print("\n## Eager wall time (µs, do_bench median, L2 flushed)\n")
        print(markdown_table(wall, ["batch", "prefix", "suffix", "pick", "ours_eager_us", "fi_eager_us",
                                    "ours_graph_us", "eager_over_graph", "ours_graph_flushed_us",
                                    "eager_over_graph_flushed"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(env=env, host=host, wall=wall), f, indent=1)


if __name__ == "__main__":
    main()
