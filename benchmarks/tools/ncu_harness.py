"""A few calls of each flat decode over shared prefix pages, for Nsight Compute to profile.

    ncu --set full -k regex:'decode_kernel|Prefill' --launch-skip 2 --launch-count 4 \\
        python -m benchmarks.tools.ncu_harness 64,8192,256
    ncu --section WarpStateStats -k regex:decode_kernel --launch-skip 2 --launch-count 1 \\
        python -m benchmarks.tools.ncu_harness --level 256,4096,256

With ``--level`` it calls the cascade's decode level instead (``batch_decode_paged`` over
each request's own pages, the public default), then the same with every page id among the
first 64 (4 MiB: the same work and L2 traffic, no HBM reads), ``--calls`` times each.

Per shape (bench_cascade's workload, rotation 0): ours with the default tiles, ours with the
``"shared_pages"`` schedule and FlashInfer's flat decode (tensor cores) where it is
installed, each called ``--calls`` times with a synchronize between calls, in that order,
so that ``--launch-skip``/``--launch-count`` pick the warm calls. It times nothing itself;
benchmarks/NOTES.md ("Decode") reads such a profile.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks._common import gpu_start, load_flashinfer
from benchmarks.fixtures import MAX_ROTATIONS, MIN_POOL_BYTES, Shape, Workload, fi_flat
from cascadeinfer import batch_decode_paged


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shapes", nargs="+", help="batch,prefix,suffix triples")
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--level", action="store_true", help="the cascade's decode level, from HBM then from L2")
    args = ap.parse_args()
    dev = gpu_start("ncu_harness")
    fi = load_flashinfer()
    for text in args.shapes:
        wl = Workload(Shape(*map(int, text.split(","))), dev, seed=0, min_pool_bytes=MIN_POOL_BYTES,
                      max_rot=MAX_ROTATIONS)
        outs, lses = wl.out_buffers()
        if args.level:
            own = wl.kv_indices[1]
            in_l2 = own[:64][torch.arange(own.numel(), device=dev) % 64].contiguous()
            for name, pages in (("decode level", own), ("decode level from L2", in_l2)):
                for _ in range(args.calls):
                    batch_decode_paged(wl.qs[0], wl.pools[0], wl.kv_indptr[1], pages, wl.kv_last[1], out=outs[0],
                                       lse=lses[0], validate=False)
                    torch.cuda.synchronize()
                print(f"# {text}: {name} x{args.calls}", flush=True)
            continue
        tables = (wl.flat_indptr, wl.flat_indices, wl.flat_last)
        calls = {sched: (lambda sched=sched: batch_decode_paged(wl.qs[0], wl.pools[0], *tables, schedule=sched,
                                                                out=outs[0], lse=lses[0], validate=False))
                 for sched in (None, "shared_pages")}
        if fi is not None:
            calls["flashinfer"] = fi_flat(fi, wl).call(0)
        for name, call in calls.items():
            for _ in range(args.calls):
                call()
                torch.cuda.synchronize()
            print(f"# {text}: {name} x{args.calls}", flush=True)


if __name__ == "__main__":
    main()
