"""Where the splits of a split-KV decode should be merged: in the kernel, or by a merge kernel.

    python -m benchmarks.tools.tune_split_merge [--rep-ms MS] [--json PATH]

Each shape runs twice in one process, CUDA-graph timed with its K/V rotated past L2
(``bench_rotating``): once with the last split of each row merging the float32 states
inside the kernel (:mod:`cascadeinfer.kernels.split_merge`), once with the merge sent to
``merge_states``' kernel after it, whatever :func:`policy.merge_in_kernel` would pick.
``batch_decode_paged`` at the batch sizes that split (1-8 requests; bf16, Hq 32, Hkv 8,
D 128, page 16). Both answers are checked against each other before timing.
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
from cascadeinfer import batch_decode_paged
from cascadeinfer.kernels import decode as decode_mod
from cascadeinfer.kernels import policy

HQ, HKV, D, PAGE = 32, 8, 128, 16
DECODE = [(1, 2048), (1, 8192), (1, 16384), (2, 8192), (4, 4096), (4, 16384), (8, 2048), (8, 8192)]


def _caches(tokens: int, device: torch.device) -> list[torch.Tensor]:
    pages = -(-tokens // PAGE)
    rot = rotation_count(pages * PAGE * HKV * D * 2 * 2)
    return [torch.randn(pages, 2, PAGE, HKV, D, device=device, dtype=torch.bfloat16) for _ in range(rot)]


def _time_both(fns_of) -> dict:
    """``fns_of(in_kernel)`` -> the rotated calls; times both settings and checks them equal."""
    out = {}
    for in_kernel in (True, False):
        with _forced(in_kernel):
            fns = fns_of()
            o, lse = fns[0]()
            out[in_kernel] = (bench_rotating(fns, rep_ms=ARGS.rep_ms) * 1e6, o.float(), lse)
    (t_in, o_in, l_in), (t_out, o_out, l_out) = out[True], out[False]
    torch.testing.assert_close(o_in, o_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(l_in, l_out, atol=1e-4, rtol=1e-4)
    return dict(in_kernel_us=round(t_in, 2), merge_kernel_us=round(t_out, 2), ratio=round(t_out / t_in, 3))


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
    rows = [decode_row(b, c, device) for b, c in DECODE]
    print(markdown_table(rows, ["op", "batch", "kv", "splits", "eager_in_kernel_by_policy", "in_kernel_us",
                                "merge_kernel_us", "ratio"]))
    write_json(ARGS.json, dict(env=env, rows=rows))


ARGS: argparse.Namespace


if __name__ == "__main__":
    main()
