"""Which kernel runs when: a per-kernel timeline of one cascade call on the GPU.

    python -m benchmarks.tools.timeline                          # the four bar shapes
    python -m benchmarks.tools.timeline --shapes 128,32768,512 --splits 3 4

Each call (the public ``MultiLevelCascadeAttention.run``, then tune_overlap's two-stream
variants at the given prefix split counts) is captured in a CUDA graph and replayed under
``torch.profiler`` with idle gaps between replays. For the replay of median span it prints
each kernel's stream, start, end and duration in µs from the replay's first kernel: how
long each level runs beside the other, when the decode level starts, and what the merges
after them cost. Timings here carry the profiler's overhead and reuse one input set, so
they explain ``bench_cascade``'s numbers rather than replace them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

from benchmarks._common import environment, markdown_table, write_json
from benchmarks.fixtures import BAR_SHAPES, DTYPE, MIN_POOL_BYTES, PAGE, Shape, Workload
from benchmarks.tools.tune_overlap import one_merge, two_streams
from cascadeinfer.cascade.multi_level import MultiLevelCascadeAttention

_REPLAY_GAP_US = 500.0  # replays are separated by a host sleep of milliseconds


def kernel_timeline(fn, replays: int = 9) -> list[dict]:
    """Kernels of the median-span replay of ``fn`` captured in a CUDA graph: dicts of
    ``kernel``, ``stream``, ``start``, ``end``, ``dur`` (µs from the replay's first kernel)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
            torch.cuda.synchronize()
            time.sleep(0.002)
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = [e for e in json.load(f)["traceEvents"] if e.get("cat") == "kernel"]
    finally:
        os.remove(path)
    events.sort(key=lambda e: e["ts"])
    groups, end = [], -float("inf")
    for e in events:
        if e["ts"] > end + _REPLAY_GAP_US:
            groups.append([])
        groups[-1].append(e)
        end = max(end, e["ts"] + e["dur"])
    if not groups:
        return []
    spans = [max(e["ts"] + e["dur"] for e in g) - g[0]["ts"] for g in groups]
    median = statistics.median_low(spans)
    group = groups[spans.index(median)]
    t0 = group[0]["ts"]
    return [dict(kernel=e["name"][:48], stream=e.get("args", {}).get("stream", "?"),
                 start=round(e["ts"] - t0, 1), end=round(e["ts"] + e["dur"] - t0, 1), dur=round(e["dur"], 1))
            for e in group]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*", help="batch,prefix,suffix[,hkv,head_dim] (default: the four bar shapes)")
    ap.add_argument("--splits", nargs="*", type=int, default=[],
                    help="prefix split counts of the two-stream variants (default: the plan's)")
    ap.add_argument("--json", metavar="PATH", help="write the results and the environment here as JSON")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("timeline needs a CUDA device")
    dev = torch.device("cuda")
    print("#", environment(), flush=True)
    shapes = [Shape(*map(int, t.split(","))) for t in args.shapes] if args.shapes else \
        [Shape(b, p, x) for b, p, x in BAR_SHAPES]
    out = []
    for s in shapes:
        wl = Workload(s, dev, seed=0, min_pool_bytes=MIN_POOL_BYTES, max_rot=1)
        attn = MultiLevelCascadeAttention(2, device=dev)
        attn.plan(*wl.tables(), s.hq, s.hkv, s.head_dim, PAGE, num_pages=wl.num_pages, dtype=DTYPE)
        planned = attn._levels[-2].num_splits if attn.use_cascade else None
        calls = {"public path": lambda: attn.run(wl.qs[0], wl.pools[0])}
        for splits in args.splits or ([planned] if planned else []):
            calls[f"s{splits}, two merges"] = two_streams(wl, splits)[0]
            calls[f"s{splits}, one merge"] = one_merge(wl, splits)[0]
        for name, fn in calls.items():
            rows = kernel_timeline(fn)
            span = max((r["end"] for r in rows), default=0.0)
            title = f"{s.batch},{s.prefix},{s.suffix} (Hkv {s.hkv}, D {s.head_dim}) {name}: span {span:.1f} us"
            print(f"\n### {title}\n")
            print(markdown_table(rows, ["kernel", "stream", "start", "end", "dur"]), flush=True)
            out.append(dict(shape=[s.batch, s.prefix, s.suffix, s.hkv, s.head_dim], variant=name, span_us=span,
                            kernels=rows))
        del wl, attn
        torch.cuda.empty_cache()
    write_json(args.json, dict(env=environment(), rows=out))


if __name__ == "__main__":
    main()
