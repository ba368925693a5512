"""Where the splits of a split-KV launch should be merged: in the kernel, or by a merge kernel.

    python -m benchmarks.tools.tune_split_merge [--rep-ms MS] [--json PATH]

Each shape runs twice in one process, CUDA-graph timed with its K/V rotated past L2
(``bench_rotating``): once merged inside the splits' own launch, once with the merge sent
to ``merge_states``' kernel after it, whatever the policy would pick. Decode
(``batch_decode_paged`` at the batch sizes that split, 1-8 requests): the last split of
each row merges the float32 states (:mod:`cascadeinfer.kernels.split_merge`). The prefix
level (``batch_prefill_paged``, one group of n queries over a shared prefix): merge
programs after the splits' programs (``TAIL_MERGE`` in ``prefill_kernel.py``); these rows
are also timed eagerly (``eager_*``: 200 calls back to back on rotated caches, CUDA events
around them, so the host's launches count where they are slower than the GPU). bf16, Hq
32, Hkv 8, D 128, page 16. Both answers are checked against each other before timing.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks._common import (
    bench_rotating,
    environment,
    gpu_start,
    markdown_table,
    rotation_count,
    write_json,
)
from cascadeinfer import batch_decode_paged, batch_prefill_paged
from cascadeinfer.kernels import decode as decode_mod
from cascadeinfer.kernels import policy
from cascadeinfer.kernels import prefill as prefill_mod

HQ, HKV, D, PAGE = 32, 8, 128, 16
DECODE = [(1, 2048), (1, 8192), (1, 16384), (2, 8192), (4, 4096), (4, 16384), (8, 2048), (8, 8192)]
# (queries, prefix keys): the prefix levels of bench_cascade's bar and short-prefix shapes that split.
PREFIX = [(64, 8192), (4, 16384), (128, 32768), (16, 65536), (64, 256), (8, 128)]


def _caches(tokens: int, device: torch.device) -> list[torch.Tensor]:
    pages = -(-tokens // PAGE)
    rot = rotation_count(pages * PAGE * HKV * D * 2 * 2)
    return [torch.randn(pages, 2, PAGE, HKV, D, device=device, dtype=torch.bfloat16) for _ in range(rot)]


def _eager_us(fns, calls: int = 200) -> float:
    """µs per call of ``calls`` eager calls back to back (the host ahead where it can be)."""
    for f in fns:
        f()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(calls):
            fns[i % len(fns)]()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return sorted(times)[2]


def _time_both(fns_of, forced=None, eager: bool = False) -> dict:
    """``fns_of()`` -> the rotated calls; times them merged in the kernel and by a merge
    kernel (``forced(in_kernel)`` sets which) and checks the two answers equal."""
    out = {}
    for in_kernel in (True, False):
        with (forced or _forced)(in_kernel):
            fns = fns_of()
            o, lse = fns[0]()
            o, lse = o.float(), lse.clone()
            graph_us = bench_rotating(fns, rep_ms=ARGS.rep_ms) * 1e6
            out[in_kernel] = (graph_us, o, lse, _eager_us(fns) if eager else None)
    (t_in, o_in, l_in, e_in), (t_out, o_out, l_out, e_out) = out[True], out[False]
    torch.testing.assert_close(o_in, o_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(l_in, l_out, atol=1e-4, rtol=1e-4)
    row = dict(in_kernel_us=round(t_in, 2), merge_kernel_us=round(t_out, 2), ratio=round(t_out / t_in, 3))
    if eager:
        row.update(eager_in_kernel_us=round(e_in, 2), eager_merge_kernel_us=round(e_out, 2),
                   eager_ratio=round(e_out / e_in, 3))
    return row


class _forced:
    """Every split-KV merge in the kernel (the policy's limits lifted, in capture too) or in a merge kernel."""

    def __init__(self, in_kernel: bool) -> None:
        self.value = in_kernel

    def __enter__(self):
        self.saved = policy.merge_in_kernel
        value = self.value
        policy.merge_in_kernel = lambda *args, **kwargs: value
        decode_mod._LAUNCHES.clear()  # recordings keep the setting they were made with

    def __exit__(self, *exc):
        policy.merge_in_kernel = self.saved


class _forced_prefill:
    """Every prefill with KV splits merged in its own launch (in capture too), or by a merge kernel."""

    def __init__(self, in_kernel: bool) -> None:
        self.value = in_kernel

    def __enter__(self):
        self.saved = prefill_mod.prefill_merge_in_kernel
        value = self.value
        prefill_mod.prefill_merge_in_kernel = lambda num_splits, **kwargs: value and num_splits > 1
        prefill_mod._PAGED.clear()  # recordings keep the setting they were made with

    def __exit__(self, *exc):
        prefill_mod.prefill_merge_in_kernel = self.saved
        prefill_mod._PAGED.clear()


def prefix_row(queries: int, keys: int, device: torch.device) -> dict:
    pages = -(-keys // PAGE)
    caches = _caches(keys, device)
    qo_indptr = torch.tensor([0, queries], dtype=torch.int32, device=device)
    indptr = torch.tensor([0, pages], dtype=torch.int32, device=device)
    indices = torch.randperm(pages, device=device).to(torch.int32)
    last = torch.tensor([keys - (pages - 1) * PAGE], dtype=torch.int32, device=device)
    q = torch.randn(queries, HQ, D, device=device, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    lse = torch.empty(queries, HQ, device=device)

    def fns_of():
        return [lambda c=c: batch_prefill_paged(q, qo_indptr, c, indptr, indices, last, out=out, lse=lse,
                                                validate=False) for c in caches]

    cfg = policy.groups_tile_config(queries, 1, HQ // HKV, D, torch.bfloat16)
    splits = policy.default_num_splits(policy.num_m_tiles(queries, 1, HQ // HKV, cfg.block_m), HKV, pages * PAGE,
                                       device)
    return dict(op="prefix", batch=queries, kv=keys, splits=splits,
                eager_in_kernel_by_policy=policy.prefill_merge_in_kernel(splits),
                **_time_both(fns_of, _forced_prefill, eager=True))


def decode_row(batch: int, ctx: int, device: torch.device) -> dict:
    pages = -(-ctx // PAGE)
    caches = _caches(batch * ctx, device)
    indptr = torch.arange(0, batch * pages + 1, pages, dtype=torch.int32, device=device)
    indices = torch.randperm(batch * pages, device=device).to(torch.int32)
    last = torch.full((batch,), ctx - (pages - 1) * PAGE, dtype=torch.int32, device=device)
    q = torch.randn(batch, HQ, D, device=device, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    lse = torch.empty(batch, HQ, device=device)

    def fns_of():
        return [lambda c=c: batch_decode_paged(q, c, indptr, indices, last, out=out, lse=lse, validate=False)
                for c in caches]

    cfg = policy.pick_decode_config(D, torch.bfloat16, PAGE, work=batch * HKV, num_sms=policy.planning_sms(device),
                                    group_size=HQ // HKV)
    splits = policy.decode_num_splits(batch, HKV, device, programs_per_sm=cfg.programs_per_sm)
    return dict(op="decode", batch=batch, kv=ctx, splits=splits,
                eager_in_kernel_by_policy=policy.merge_in_kernel(splits, HQ // HKV, D), **_time_both(fns_of))


def main() -> None:
    global ARGS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rep-ms", type=int, default=100)
    ap.add_argument("--json", metavar="PATH")
    ARGS = ap.parse_args()
    device = gpu_start("tune_split_merge")
    env = environment()
    rows = [decode_row(b, c, device) for b, c in DECODE] + [prefix_row(n, k, device) for n, k in PREFIX]
    print(markdown_table(rows, ["op", "batch", "kv", "splits", "eager_in_kernel_by_policy", "in_kernel_us",
                                "merge_kernel_us", "ratio", "eager_in_kernel_us", "eager_merge_kernel_us",
                                "eager_ratio"]))
    write_json(ARGS.json, dict(env=env, rows=rows))


ARGS: argparse.Namespace


if __name__ == "__main__":
    main()
