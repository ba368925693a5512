"""Where a replayed launcher call's host time goes, part by part.

    python -m benchmarks.tools.probe_host_parts [--calls N] [--json PATH]

Each part of a replayed ``batch_decode_paged(validate=False)`` (bf16, Hq 32, Hkv 8, D 128,
page 16, the flat table of bench_host's shapes) is timed on its own as bench_host times a
whole call: CPU time to enqueue, median over ``--calls`` calls with the GPU kept busy, in
inference mode and outside it. Parts: the signature lookup (torch's tensor guards and the
alignment pass), reading the roots' addresses, the current stream, the output
allocations (``torch.empty`` with keywords, ``empty_like`` of q, ``empty_like`` of a
stride-0 template and of the dense memoryless template replays use), the scratch block's
raw allocation, the stream's counter block lookup, the replay alone, and the whole call
with its outputs given and left to the launcher.
"""

from __future__ import annotations

import argparse
import contextlib
import json

import torch

from benchmarks._common import environment, gpu_start, markdown_table
from benchmarks.bench_host import HOST_SHAPES, host_us
from benchmarks.fixtures import MIN_POOL_BYTES, Shape, Workload
from cascadeinfer import batch_decode_paged
from cascadeinfer.kernels import decode as decode_mod
from cascadeinfer.kernels import launch as launch_mod


def parts(shape: Shape, calls: int, device: torch.device) -> list[dict]:
    wl = Workload(shape, device, seed=7, min_pool_bytes=MIN_POOL_BYTES, max_rot=1)
    q, pool = wl.qs[0], wl.pools[0]
    out, lse = wl.out_buffers()[0][0], wl.out_buffers()[1][0]
    args = (q, pool, wl.flat_indptr, wl.flat_indices, wl.flat_last)
    batch_decode_paged(*args, validate=False)
    batch_decode_paged(*args, out=out, lse=lse, validate=False)
    tensors = (q, pool, wl.flat_indptr, wl.flat_indices, wl.flat_last)
    options = (1, True, True, "NHD", None, None, None)
    rec, _, _ = decode_mod._LAUNCHES.find(tensors, options, lengthless=(3,))
    rec, _, _ = decode_mod._LAUNCHES.find(tensors, options, lengthless=(3,))
    assert rec is not None, "the decode call was not recorded"
    roots = (*tensors, out, lse)
    idx = device.index
    template_o, template_lse = launch_mod._template(out), launch_mod._template(lse)
    expanded_o = torch.empty(1, dtype=out.dtype, device=device).expand(out.shape)
    expanded_lse = torch.empty(1, dtype=lse.dtype, device=device).expand(lse.shape)
    scratch = max(rec.scratch_bytes, 256)
    fns = {
        "find (guards + alignment)": lambda: decode_mod._LAUNCHES.find(tensors, options, lengthless=(3,)),
        "roots' addresses (7 data_ptr)": lambda: [t.data_ptr() for t in roots],
        "current raw stream": lambda: torch._C._cuda_getCurrentRawStream(idx),
        "o, lse by torch.empty(shape, dtype=, device=)": lambda: (
            torch.empty(q.shape, dtype=q.dtype, device=q.device),
            torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)),
        "o by empty_like(q), lse by torch.empty": lambda: (
            torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)),
        "o, lse by empty_like(stride-0 template)": lambda: (
            torch.empty_like(expanded_o), torch.empty_like(expanded_lse)),
        "o, lse by empty_like(dense template) (what replays do)": lambda: (
            torch.empty_like(template_o), torch.empty_like(template_lse)),
        "scratch raw alloc + free": lambda: launch_mod._raw_free(
            launch_mod._raw_alloc(scratch, torch._C._cuda_getCurrentRawStream(idx))),
        "stream's counter block (lookup by stream)": lambda: launch_mod._stream_counters(
            device, idx, *(torch._C._cuda_getCurrentRawStream(idx),) * 2, max(rec.counter_bytes, 4)).data_ptr(),
        "replay alone": lambda: rec.replay(roots),
        "call, outputs given": lambda: batch_decode_paged(*args, out=out, lse=lse, validate=False),
        "call, outputs allocated": lambda: batch_decode_paged(*args, validate=False),
    }
    rows = []
    for name, fn in fns.items():
        row = dict(part=name, batch=shape.batch, prefix=shape.prefix, suffix=shape.suffix,
                   kernels=len(rec.launches), scratch_bytes=rec.scratch_bytes, counter_bytes=rec.counter_bytes)
        for mode in ("inference", "grad"):
            with torch.inference_mode() if mode == "inference" else contextlib.nullcontext():
                wall_us, cpu_us = host_us(fn, calls, device)
                row[f"{mode}_us"], row[f"{mode}_cpu_us"] = round(wall_us, 2), round(cpu_us, 2)
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()
    device = gpu_start("probe_host_parts")
    env = environment()
    rows = []
    for shape in HOST_SHAPES:
        rows += parts(Shape(*shape), args.calls, device)
    print(markdown_table(rows, ["part", "batch", "prefix", "suffix", "kernels", "scratch_bytes",
                                "counter_bytes", "inference_us", "grad_us", "inference_cpu_us", "grad_cpu_us"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(env=env, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
