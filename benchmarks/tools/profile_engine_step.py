"""Where a full-batch decode step of the engine spends its time, kernel by kernel.

    python -m benchmarks.tools.profile_engine_step --preset llama3-8b --requests 256 \\
        --prefix 4096 --suffix 128 --steps 8 --json PATH

Builds the engine as ``cascadeinfer bench`` does (a preset's shapes, random bf16 weights,
page 16), runs the workload once to compile and capture every graph, then again until
every request decodes, and profiles ``--steps`` full-batch decode steps with
``torch.profiler``. Printed per step (medians over the profiled steps): the host's wall
time, the GPU's time from one step's start to the next's, its busy time in it (the union of
kernel intervals, every stream) and its idle time; for each kind of kernel (weight GEMMs, attention, fused elementwise, other) the
summed kernel time and the busy time of that kind alone (kernels of one kind running side
by side, e.g. the cascade's two levels, counted once); then the kernels that take the
most time. The profiler's overhead is in the wall time, so the wall time is ``cascadeinfer
bench``'s job; this tool says where the GPU's part goes.

With ``--host`` it says where the host's part goes instead: ``--steps`` full-batch steps
timed bare (each step's wall time, and its wait for the previous step's tokens), then as
many under ``cProfile``, whose table lists the Python functions by their own time
(``cProfile`` slows the host, so compare its rows with each other, not with the wall).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from collections import defaultdict

import torch

from benchmarks._common import environment, gpu_start, markdown_table, write_json

MARKER = "spin_kernel"  # torch.cuda._sleep's kernel, enqueued before each profiled step

# Kernel kinds by name. cuBLAS names its Hopper kernels nvjet_* / sm90_xmma_*, older ones *gemm*.
KINDS = (
    ("gemm", re.compile(r"gemm|nvjet|xmma|cutlass|cublas", re.I)),
    ("attention", re.compile(r"prefill_kernel|decode_kernel|all_heads_kernel|_balanced|_merge_|merge_kernel")),
    ("fused elementwise", re.compile(r"_rms_norm|_silu_and_mul|_rope|_append_paged")),
)


def kind_of(name: str) -> str:
    for kind, pattern in KINDS:
        if pattern.search(name):
            return kind
    return "other"


def union_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``[start, end)`` intervals."""
    total, end = 0.0, -float("inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def gpu_events(prof) -> list[dict]:
    """The profile's kernels (and memcpy/memset) as chrome-trace dicts, by start time."""
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = [e for e in json.load(f)["traceEvents"]
                      if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    finally:
        os.remove(path)
    return sorted(events, key=lambda e: e["ts"])


def summarize(start: float, end: float, step: list[dict]) -> dict:
    by_kind: dict[str, list[tuple[float, float]]] = defaultdict(list)
    by_name: dict[str, float] = defaultdict(float)
    for e in step:
        kind = kind_of(e["name"]) if e.get("cat") == "kernel" else "memcpy/memset"
        by_kind[kind].append((e["ts"], e["ts"] + e["dur"]))
        by_name[e["name"][:60]] += e["dur"]
    busy = union_us([iv for ivs in by_kind.values() for iv in ivs])
    return {"span_us": end - start, "busy_us": busy, "idle_us": end - start - busy,
            "kinds": {k: {"sum_us": sum(e - s for s, e in ivs), "busy_us": union_us(ivs), "count": len(ivs)}
                      for k, ivs in by_kind.items()},
            "names": dict(by_name)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_args(ap, new_tokens=64)
    ap.add_argument("--steps", type=int, default=8, help="full-batch decode steps profiled")
    ap.add_argument("--top", type=int, default=15, help="kernels listed by time")
    ap.add_argument("--host", action="store_true", help="profile the host's part of the steps (cProfile)")
    ap.add_argument("--json", metavar="PATH", help="write the results and the environment here as JSON")
    args = ap.parse_args()
    steps = 2 * args.steps if args.host else args.steps  # --host: as many bare steps, then the profiled ones
    if args.new_tokens <= steps + 4:
        sys.exit(f"--new-tokens: must exceed {steps + 4} (the profiled steps come after the batch fills)")
    device = gpu_start("profile_engine_step")
    llm = engine_in_full_decode(args, device, warm_up=True)
    if args.host:
        return profile_host(llm, args)
    walls = []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            # A marker kernel on the engine's stream before each step: the engine enqueues a
            # step's work on the current stream, so everything after a marker is its step's.
            torch.cuda._sleep(1)
            t0 = time.perf_counter()
            llm.step()
            walls.append(time.perf_counter() - t0)
        torch.cuda._sleep(1)
        torch.cuda.synchronize()
    while llm.has_unfinished():
        llm.step()
    steps = split_at_markers(gpu_events(prof))
    if len(steps) != args.steps:
        sys.exit(f"found {len(steps)} steps between markers in the profile, expected {args.steps}")
    summaries = [summarize(*s) for s in steps]
    wall = statistics.median(walls) * 1e6
    med = lambda f: statistics.median(f(s) for s in summaries)  # noqa: E731
    kinds = sorted({k for s in summaries for k in s["kinds"]})
    rows = [{"kind": k, "sum us": round(med(lambda s, k=k: s["kinds"].get(k, {}).get("sum_us", 0.0)), 1),
             "busy us": round(med(lambda s, k=k: s["kinds"].get(k, {}).get("busy_us", 0.0)), 1),
             "kernels": int(med(lambda s, k=k: s["kinds"].get(k, {}).get("count", 0)))} for k in kinds]
    names = sorted({n for s in summaries for n in s["names"]},
                   key=lambda n: -med(lambda s, n=n: s["names"].get(n, 0.0)))[:args.top]
    top = [{"kernel": n, "us per step": round(med(lambda s, n=n: s["names"].get(n, 0.0)), 1), "kind": kind_of(n)}
           for n in names]
    head = {"host wall us (profiled)": round(wall, 1), "GPU span us": round(med(lambda s: s["span_us"]), 1),
            "GPU busy us": round(med(lambda s: s["busy_us"]), 1), "GPU idle us": round(med(lambda s: s["idle_us"]), 1)}
    print("# per full-batch decode step, median of", len(summaries), "steps")
    print(markdown_table([head], list(head)))
    print()
    print(markdown_table(rows, ["kind", "sum us", "busy us", "kernels"]))
    print()
    print(markdown_table(top, ["kernel", "us per step", "kind"]))
    write_json(args.json, {"environment": environment(), "workload": {k: v for k, v in vars(args).items() if k != "json"}, "step": head, "kinds": rows,
                           "top": top})


def profile_host(llm, args) -> None:
    """``--host``: the steps' wall and wait times bare, then their Python functions under
    cProfile, by own time."""
    import cProfile  # noqa: PLC0415
    import pstats  # noqa: PLC0415

    first = len(llm.step_stats)
    for _ in range(args.steps):
        llm.step()
    bare = llm.step_stats[first:]
    head = {"step wall us": round(statistics.median(s.seconds for s in bare) * 1e6, 1),
            "host us (wall less wait)": round(statistics.median(s.seconds - s.wait_seconds for s in bare) * 1e6, 1),
            "wait us": round(statistics.median(s.wait_seconds for s in bare) * 1e6, 1)}
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(args.steps):
        llm.step()
    profiler.disable()
    while llm.has_unfinished():
        llm.step()
    stats = pstats.Stats(profiler)
    rows = []
    for (file, line, name), (_, calls, own, cumulative, _) in stats.stats.items():
        rows.append({"function": f"{os.path.basename(file)}:{line}({name})", "calls per step": calls / args.steps,
                     "own us per step": own / args.steps * 1e6, "cumulative us per step": cumulative / args.steps * 1e6})
    rows.sort(key=lambda r: -r["own us per step"])
    rows = [{k: round(v, 1) if isinstance(v, float) else v for k, v in r.items()} for r in rows[:args.top]]
    print("# per full-batch decode step, median of", len(bare), "bare steps")
    print(markdown_table([head], list(head)))
    print()
    print(f"# under cProfile, {args.steps} steps: the {len(rows)} functions of most own time")
    print(markdown_table(rows, list(rows[0])))
    write_json(args.json, {"environment": environment(), "workload": {k: v for k, v in vars(args).items() if k != "json"},
                           "step": head, "functions": rows})


def add_workload_args(ap: argparse.ArgumentParser, *, new_tokens: int) -> None:
    """The workload options of :func:`engine_in_full_decode` (``cascadeinfer bench``'s)."""
    ap.add_argument("--preset", default="llama3-8b")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prefix", type=int, default=4096)
    ap.add_argument("--suffix", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=new_tokens, help="per request; enough to reach full-batch steps")


def engine_in_full_decode(args, device: torch.device, *, warm_up: bool):
    """An engine as ``cascadeinfer bench`` builds it (``args.preset``'s shapes, random bf16
    weights, page 16) with ``args.requests`` requests of ``args.prefix`` shared and
    ``args.suffix`` own tokens added, stepped until every request decodes, then twice more.
    ``warm_up``: first run the whole workload once on other prompts (every kernel compiled,
    every graph bucket captured), as the bench does."""
    from cascadeinfer.engine.bench import Workload  # noqa: PLC0415
    from cascadeinfer.engine.llm import LLM  # noqa: PLC0415
    from cascadeinfer.engine.model_loader import preset  # noqa: PLC0415
    from cascadeinfer.engine.sampling import SamplingParams  # noqa: PLC0415

    workload = Workload(args.requests, args.prefix, args.suffix, args.new_tokens)
    mc = preset(args.preset)
    llm = LLM.from_config(mc, device=device, dtype=torch.bfloat16, record_steps=True, page_size=16,
                          max_model_len=args.prefix + args.suffix + args.new_tokens)
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    if warm_up:
        llm.generate(workload.prompts(mc.vocab_size, 1), params)
        llm.reset_prefix_cache()
    for prompt in workload.prompts(mc.vocab_size, 0):
        llm.add_request(prompt, params)
    step_until_full_batch(llm, args.requests)
    for _ in range(2):  # to settle
        llm.step()
    torch.cuda.synchronize()
    return llm


def step_until_full_batch(llm, requests: int) -> None:
    """Step ``llm`` (``record_steps``) until a step decodes its whole batch: ``requests``
    rows, or ``max_num_seqs``."""
    while True:
        llm.step()
        last = llm.step_stats[-1]
        if last.num_prefill_tokens == 0 and last.num_decode == min(requests, llm.config.max_num_seqs):
            return
        if not llm.has_unfinished():
            sys.exit("--new-tokens: the first requests finished before the last began to decode; raise it")


def split_at_markers(events: list[dict]) -> list[tuple[float, float, list[dict]]]:
    """The GPU's work cut into steps at the marker kernels: ``(start, end, events)`` per
    step, from its marker's end to the next marker's start (the GPU's idle time between
    steps included); work after the last marker is dropped."""
    steps, current, start = [], None, 0.0
    for e in events:
        if MARKER in e["name"]:
            if current is not None:
                steps.append((start, e["ts"], current))
            current, start = [], e["ts"] + e["dur"]
        elif current is not None:
            current.append(e)
    return steps


if __name__ == "__main__":
    main()
