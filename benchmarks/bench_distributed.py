"""Context-parallel decode across GPUs: one cascade whose shared prefix is cut across ranks.

    python -m benchmarks.bench_distributed --world 1 2 4 --batch 1 4 16 --context 1048576 --json PATH
    python -m benchmarks.bench_distributed --smoke          # 2 CPU processes (gloo), tiny shapes

Each request has ``--context`` tokens: a prefix shared by the whole batch and
``--suffix`` tokens of its own (bf16 on GPUs, Hq 32, Hkv 8, D 128, page 16). For every
world size the ranks (one GPU each, NCCL; ``torch.multiprocessing``) plan the same
two-level cascade with ``context_parallel_level=0``: each rank reads its share of the
prefix's pages, every rank the whole suffixes, and the prefix states are merged across
the ranks (:func:`cascadeinfer.distributed.merge_states_across`). Reported per (world,
batch): the time of one decode step (the slowest rank's median of CUDA-event-timed
replays of a CUDA graph of it, the all-gather inside; eager calls beside it), its
speedup over one GPU, the floor of one rank's share (max of bytes over the
copy bandwidth and FLOPs over the matmul rate, both measured on each rank), the fraction
reached, and the cross-rank merge's own time (graph replays of ``merge_states_across``).
Every rank checks its output against a one-process cascade of the same tables first.

Tensor parallelism of the engine is measured by ``cascadeinfer bench --tensor-parallel-size N``.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HQ, HKV, D, PAGE = 32, 8, 128, 16


def tables(batch: int, prefix: int, suffix: int, device: torch.device):
    """The two levels' CSR tables (the same on every rank), pages in a random order."""
    pp, sp = -(-prefix // PAGE), -(-suffix // PAGE)
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(pp + batch * sp, generator=g).int()
    i32 = dict(dtype=torch.int32)
    last = lambda n: (n - 1) % PAGE + 1  # noqa: E731
    t = ([torch.tensor([0, batch], **i32), torch.arange(batch + 1, **i32)],
         [torch.tensor([0, pp], **i32), torch.arange(batch + 1, **i32) * sp],
         [perm[:pp], perm[pp:]],
         [torch.tensor([last(prefix)], **i32), torch.full((batch,), last(suffix), **i32)])
    return [[x.to(device) for x in level] for level in t], pp + batch * sp


def _rank(rank: int, world: int, init: str, cases: list, smoke: bool, results) -> None:
    from benchmarks._common import measure_copy_bandwidth, measure_matmul_rate, roofline_floor  # noqa: PLC0415
    from cascadeinfer import MultiLevelCascadeAttention  # noqa: PLC0415
    from cascadeinfer.distributed import merge_states_across  # noqa: PLC0415
    from cascadeinfer.distributed.timing import median_seconds  # noqa: PLC0415

    cuda = not smoke
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=init, rank=rank, world_size=world)
    dtype = torch.bfloat16 if cuda else torch.float32
    hq, hkv, d = (HQ, HKV, D) if cuda else (4, 2, 32)
    copy_bw, mm_rate = (measure_copy_bandwidth(), measure_matmul_rate()) if cuda else (1.0, 1.0)
    try:
        for batch, context, suffix in cases:
            prefix = context - suffix
            t, num_pages = tables(batch, prefix, suffix, device)
            torch.manual_seed(batch)  # the same cache and queries on every rank: one cache, cut in shares
            pool = torch.randn(num_pages, 2, PAGE, hkv, d, dtype=dtype, device=device)
            q = torch.randn(batch, hq, d, dtype=dtype, device=device)
            attn = MultiLevelCascadeAttention(2, device=device, context_parallel_level=0)
            attn.plan(*t, hq, hkv, d, PAGE, num_pages=num_pages, dtype=dtype)
            whole = MultiLevelCascadeAttention(2, device=device)
            whole.plan(*t, hq, hkv, d, PAGE, num_pages=num_pages, dtype=dtype, use_cascade=True)
            o, o_whole = attn.run(q, pool), whole.run(q, pool)
            err = (o.float() - o_whole.float()).abs().max().item()
            if err > (2e-2 if dtype == torch.bfloat16 else 1e-4):
                raise AssertionError(f"rank {rank}: context-parallel output off by {err} at {(batch, context)}")
            reps = 5 if smoke else 50
            out = torch.empty_like(q)
            step = median_seconds(lambda: attn.run(q, pool, out=out), device, reps, graph=True)
            eager = median_seconds(lambda: attn.run(q, pool, out=out), device, reps)
            state, lse = torch.randn(batch, hq, d, dtype=dtype, device=device), torch.randn(batch, hq, device=device)
            merged, merged_lse = torch.empty_like(state), torch.empty_like(lse)
            merge = median_seconds(lambda: merge_states_across(state, lse, out=merged, out_lse=merged_lse), device,
                                   reps, graph=True)
            slowest = torch.tensor([step, eager, merge], dtype=torch.float64, device=device)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            token_bytes = 2 * hkv * d * torch.empty((), dtype=dtype).element_size()
            share = prefix / world
            floor = roofline_floor((share + batch * suffix) * token_bytes + 2 * batch * hq * d * 4,
                                   4 * batch * hq * d * (share + suffix), copy_bw, mm_rate)
            if rank == 0:
                results.append(dict(world=world, batch=batch, context=context, suffix=suffix,
                                    step_us=slowest[0].item() * 1e6, eager_step_us=slowest[1].item() * 1e6,
                                    merge_us=slowest[2].item() * 1e6,
                                    floor_us=floor * 1e6 if cuda else None, max_err=err))
            del pool
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, nargs="+", default=[1, 2, 4], help="GPU counts to run")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--context", type=int, default=1 << 20, help="tokens per request (prefix + own suffix)")
    ap.add_argument("--suffix", type=int, default=4096, help="each request's own tokens")
    ap.add_argument("--smoke", action="store_true", help="2 CPU processes (gloo), tiny shapes")
    ap.add_argument("--json", metavar="PATH", help="write the rows and the environment here as JSON")
    args = ap.parse_args()
    if args.smoke:
        worlds, cases = [1, 2], [(b, 257, 40) for b in (1, 3)]
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no GPU: use --smoke for the CPU run")
        worlds = [w for w in args.world if w <= torch.cuda.device_count()]
        skipped = sorted(set(args.world) - set(worlds))
        if skipped:
            print(f"# world sizes {skipped} skipped: {torch.cuda.device_count()} GPU(s) visible", flush=True)
        cases = [(b, args.context, args.suffix) for b in args.batch]
    rows = []
    for world in worlds:
        with mp.Manager() as manager, tempfile.TemporaryDirectory() as tmp:
            results = manager.list()
            mp.spawn(_rank, args=(world, f"file://{os.path.join(tmp, 'init')}", cases, args.smoke, results),
                     nprocs=world, join=True)
            rows += list(results)
    base = {(r["batch"], r["context"]): r["step_us"] for r in rows if r["world"] == 1}
    print("| world | batch | context | step us | speedup vs 1 | floor us (one rank's share) | of floor | "
          "merge across ranks us | eager step us |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        one = base.get((r["batch"], r["context"]))
        step, floor = r["step_us"], r["floor_us"]
        speedup = f"{one / step:.2f}" if one else "—"
        floor_cells = ("—", "—") if floor is None else (f"{floor:.1f}", f"{floor / step:.2f}")
        print(f"| {r['world']} | {r['batch']} | {r['context']} | {step:.1f} | {speedup} | {floor_cells[0]} | "
              f"{floor_cells[1]} | {r['merge_us']:.1f} | {r['eager_step_us']:.1f} |")
    from benchmarks._common import environment, write_json  # noqa: PLC0415

    write_json(args.json, dict(env=environment(), rows=rows))


if __name__ == "__main__":
    main()
