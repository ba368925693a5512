"""Why do the two cascade levels slow each other down? Memory, L2 or clocks.

    python -m benchmarks.tools.probe_interference                       # the four bar shapes
    python -m benchmarks.tools.probe_interference --shapes 128,32768,512

The cascade-v7 timelines (benchmarks/tools/timeline.py) showed the decode level beside the prefix level drawing 25-38 GB/s
per SM where it draws 61-76 alone, and the prefix level losing 8%. This probe runs the
two-stream cascade (prefix on the main stream at the plan's split count, the per-request
decode on a side stream) with one thing changed at a time:

- ``prefix from L2``: the prefix's page list points at 64 pages only (4 MiB, L2-resident),
  so the prefix level keeps its FLOPs and its L2-to-SM traffic but reads nothing from HBM;
- ``decode from L2``: the same for the decode level's pages;
- the decode with each per-request config (``DECODE_VARIANTS``) beside the prefix;
- each level alone, and the prefix one split finer (alone and beside the decode);
- FlashInfer's fa2 cascade (bench_cascade's), where it is installed.

For every variant: the CUDA-graph time, each kernel's duration from a profiled replay
(benchmarks.tools.timeline), and the SM clock and board power sampled by ``nvidia-smi`` while
the variant's graph replays for about a second (with a bf16 matmul and a copy as
references). They probe a cause and do not replace bench_cascade's tables. The L2-only
variants compute on other pages, so only their times are compared; every other variant's
output is checked against the two-stream cascade's.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

import torch

from benchmarks._common import (
    bench_rotating, environment, load_flashinfer, markdown_table, measure_ceilings, write_json)
from benchmarks.fixtures import BAR_SHAPES, DTYPE, MIN_POOL_BYTES, PAGE, Shape, Workload, fi_cascade
from benchmarks.tools.timeline import kernel_timeline
from benchmarks.tools.tune_overlap import two_streams
from cascadeinfer.cascade.multi_level import MultiLevelCascadeAttention
from cascadeinfer.kernels.policy import DECODE_VARIANTS

_SMI_FIELDS = "clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active"


def sampled_clocks(fn, seconds: float = 1.2) -> dict:
    """Mean SM clock (MHz), power (W), temperature and the union of clock-event reasons while
    ``fn`` (captured 8 times in one CUDA graph) replays back to back for ``seconds``."""
    graph = torch.cuda.CUDAGraph()
    fn()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        for _ in range(8):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={_SMI_FIELDS}", "--format=csv,noheader,nounits",
                            "-lms", "50"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        for _ in range(4):
            graph.replay()
        torch.cuda.synchronize()
    smi.terminate()
    lines = smi.communicate()[0].strip().splitlines()
    rows = [ln.split(", ") for ln in lines[len(lines) // 4:] if ln.count(",") >= 3]  # skip the ramp
    if not rows:
        return dict(mhz=None, watts=None, temp=None, reasons=None)
    num = lambda i: statistics.mean(float(r[i]) for r in rows)  # noqa: E731
    reasons = 0
    for r in rows:
        try:
            reasons |= int(r[3], 16)
        except ValueError:
            pass
    return dict(mhz=round(num(0)), watts=round(num(1)), temp=round(num(2)), reasons=hex(reasons))


def cascade_call(wl: Workload, splits: int, parts: str = "both", **kw):
    """Rotation 0's two-stream cascade (tune_overlap's), with the given page lists / decode config."""
    return two_streams(wl, splits, parts, **kw)[0]


def kernel_durations(fn) -> dict:
    """Span of the median replay and each kernel's duration (µs), keyed by a short name."""
    rows = kernel_timeline(fn)
    out = dict(span=max((r["end"] for r in rows), default=0.0))
    for r in rows:
        name = r["kernel"].lower()
        key = ("prefill" if "prefill" in name else "decode" if "decode" in name else
               "merge" if "merge" in name else name[:16])
        while key in out:
            key += "'"
        out[key] = r["dur"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*", default=[",".join(map(str, b)) for b in BAR_SHAPES])
    ap.add_argument("--rep-ms", type=int, default=100)
    ap.add_argument("--json", metavar="PATH", help="write the results and the environment here as JSON")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("probe_interference needs a CUDA device")
    dev = torch.device("cuda")
    print("#", environment(), flush=True)
    fi = load_flashinfer()
    copy_bw, mm_rate = measure_ceilings()
    n = 8192
    a, b = (torch.randn(n, n, device=dev, dtype=DTYPE) for _ in range(2))
    src = torch.randn(2**29, device=dev)
    dst = torch.empty_like(src)
    refs = {"matmul 8192 bf16": sampled_clocks(lambda: torch.matmul(a, b)),
            "copy 2 GiB": sampled_clocks(lambda: torch.add(src, 0, out=dst))}
    for name, c in refs.items():
        print(f"# {name}: {c}", flush=True)
    del a, b, src, dst
    rows = []
    for text in args.shapes:
        s = Shape(*map(int, text.split(",")))
        wl = Workload(s, dev, seed=0, min_pool_bytes=MIN_POOL_BYTES, max_rot=1)
        attn = MultiLevelCascadeAttention(2, device=dev)
        attn.plan(*wl.tables(), s.hq, s.hkv, s.head_dim, PAGE, num_pages=wl.num_pages, dtype=DTYPE,
                  use_cascade=True)
        splits = attn._levels[-2].num_splits
        _, _, ki, _ = wl.tables()
        few_prefix = ki[0][:64].repeat(-(-ki[0].numel() // 64))[: ki[0].numel()].contiguous()
        few_suffix = ki[1][:64].repeat(-(-ki[1].numel() // 64))[: ki[1].numel()].contiguous()
        variants = {
            "public path": lambda: attn.run(wl.qs[0], wl.pools[0], return_lse=True),
            f"two streams s{splits}": cascade_call(wl, splits),
            "prefix from L2": cascade_call(wl, splits, prefix_idx=few_prefix),
            "decode from L2": cascade_call(wl, splits, suffix_idx=few_suffix),
            "both from L2": cascade_call(wl, splits, prefix_idx=few_prefix, suffix_idx=few_suffix),
            f"prefix alone s{splits}": cascade_call(wl, splits, "prefix"),
            "prefix alone from L2": cascade_call(wl, splits, "prefix", prefix_idx=few_prefix),
            "decode alone": cascade_call(wl, splits, "suffix"),
            f"two streams s{splits + 1}": cascade_call(wl, splits + 1),
            f"prefix alone s{splits + 1}": cascade_call(wl, splits + 1, "prefix"),
        }
        if fi is not None:
            variants["FlashInfer fa2 cascade"] = fi_cascade(fi, wl).call(0)
        for name, cfg in DECODE_VARIANTS.items():
            variants[f"decode {name} beside"] = cascade_call(wl, splits, config=cfg)
            variants[f"decode {name} alone"] = cascade_call(wl, splits, "suffix", config=cfg)
        ref = variants[f"two streams s{splits}"]()
        o_ref = ref[0].clone()
        for name, fn in variants.items():
            row = dict(shape=text, variant=name)
            try:
                res = fn()
                torch.cuda.synchronize()
                if isinstance(res, tuple) and "L2" not in name:
                    row["max err"] = round((res[0].float() - o_ref.float()).abs().max().item(), 4)
                row["us"] = round(bench_rotating([fn], rep_ms=args.rep_ms) * 1e6, 1)
                row.update(kernel_durations(fn))
                row.update(sampled_clocks(fn))
            except Exception as exc:  # noqa: BLE001 — a failing variant is a table row
                row["error"] = f"{type(exc).__name__}: {str(exc)[:100]}"
            print("#", row, flush=True)
            rows.append(row)
        del wl, attn, variants
        torch.cuda.empty_cache()
    cols = ["shape", "variant", "us", "span", "prefill", "decode", "merge", "mhz", "watts", "temp", "reasons",
            "max err", "error"]
    print(markdown_table(rows, cols))
    write_json(args.json, dict(env=environment(), copy_bw=copy_bw, mm_rate=mm_rate,
                                               references=refs, rows=rows))


if __name__ == "__main__":
    main()
