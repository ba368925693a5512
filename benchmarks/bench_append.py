"""Appending new tokens' K/V to a paged cache (append_paged_kv_cache) against the
copy-bandwidth roofline, FlashInfer and a plain PyTorch index_put.

Run from the repository root:

    python -m benchmarks.bench_append [--quick] [--json PATH]      # on a GPU machine
    TRITON_INTERPRET=1 python -m benchmarks.bench_append --smoke    # tiny shapes on a CPU: checks only

bf16, Hkv 8, head_dim 128, page 16, NHD and HND pools. Two workloads:

* decode step: one new token for each of ``batch`` requests (1..512), each request holding
  a random 0..511 cached tokens before it, so the token lands on any slot of its page;
* prefill chunk: 8 requests x ``chunk`` new tokens (512..4096) after a random 0..1023
  cached tokens each.

Bytes = the new K/V read and written (2 x 2 x nnz x Hkv x D x 2 B) plus the index tensors
read (batch_indices and positions, 4 B each per token; the kv_indptr entries of the rows
and the kv_indices entries of the pages written). The floor is bytes / the kernel-copy
bandwidth measured in the same run (no FLOPs). Timing: ``do_bench_cudagraph`` median of
``rot`` calls captured back to back, each with its own new K/V and its own page table over
its own pages of one pool, so no call finds its inputs or its destination lines in L2
(``bench_rotating``, ``rotation_count``). batch_indices/positions are built before timing
(an engine builds them once per step for all layers): ours with our
``get_batch_indices_positions``, FlashInfer's with its own (checked equal).

Peers on the same pool and tables: ``flashinfer.append_paged_kv_cache`` (where FlashInfer
is installed) and a PyTorch ``index_put_`` computing page and slot from the same inputs.
Before timing, at every shape and layout, each method's append is checked: the pool is
filled with a poison value (inf), the append runs, the appended slots must hold exactly
the new K/V (targets worked out on the host from the page table, not from
batch_indices/positions) and every other slot of the pool must still hold the poison.

Then RoPE with the append, at the engine's decode step (batch 256, Hq 32, Hkv 8, D 128,
page 16, bf16; both layouts): ``append_paged_kv_cache_rope`` (one launch: q and k rotated
in place, the rotated K and V appended) against ``apply_rope`` then
``append_paged_kv_cache`` (what a fused decoder layer ran before), on the same inputs: q,
k and v views of one qkv projection output per set, each token rotated by its own
position in an 8192-entry cos/sin table. Bytes = the append's above, plus q read and
written, k written back, each token's cos/sin row and its int64 rotation position; one
floor for both methods (the two launches move more: k is read twice). Checked first: the
two launches' q and k after rotation equal the fused launch's bit for bit, and each
leaves the rotated K and V in their slots and the poison everywhere else.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import os
import sys

import torch

from benchmarks._common import (
    bench_rotating,
    environment,
    gpu_start,
    load_flashinfer,
    markdown_table,
    measure_ceilings,
    roofline_floor,
    rotation_count,
    write_json,
)
from benchmarks.fixtures import DTYPE, HKV, HQ, PAGE, D
from cascadeinfer import (
    append_paged_kv_cache,
    append_paged_kv_cache_rope,
    get_batch_indices_positions,
    get_seq_lens,
)
from cascadeinfer.kernels.fused import apply_rope
from cascadeinfer.layouts.paged_cache import unpack_paged_kv_cache

DECODE_BATCHES = (1, 8, 64, 256, 512)
CHUNK_REQUESTS = 8
CHUNKS = (512, 1024, 2048, 4096)
QUICK_DECODE, QUICK_CHUNKS = (1, 64, 512), (512, 4096)
SMOKE_SHAPES = (("decode", 3, 1), ("chunk", 2, 37))  # (workload, requests, new tokens each)
HISTORY = {"decode": 512, "chunk": 1024}  # cached tokens before the append: random in [0, this)
LAYOUTS = ("NHD", "HND")
POISON = float("inf")  # no appended value is inf: a slot still holding it was not written
TOKEN_BYTES = 2 * HKV * D * DTYPE.itemsize  # K and V of one token, all kv heads
SPARE_PAGES = 7  # pages no table names: the check sees that they stay untouched too
ROPE_BATCHES = (256,)  # the engine's decode step at Llama-3-8B shapes
SMOKE_ROPE_BATCH = 3
ROPE_MAX_POS = 8192  # rows of the cos/sin table (Llama-3's context)
QKV_WIDTH = (HQ + 2 * HKV) * D


class Append:
    """``rot`` input sets for one append: each has its own new K/V, batch_indices and
    positions, and its own page table over its own pages (randomly placed) of one pool."""

    def __init__(self, prior: list[int], new: list[int], layout: str, device, *, rot: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.layout, self.rot, self.batch, self.nnz = layout, rot, len(new), sum(new)
        lens = [p + n for p, n in zip(prior, new)]  # the tables count the appended tokens
        npages = [-(-n // PAGE) for n in lens]
        per_set = sum(npages)
        num_pages = rot * per_set + SPARE_PAGES
        perm = torch.randperm(num_pages, generator=g)[: rot * per_set].view(rot, per_set).to(torch.int32)
        i32 = dict(dtype=torch.int32, device=device)
        self.indptr = torch.tensor([0, *itertools.accumulate(npages)], **i32)
        self.last = torch.tensor([n - (p - 1) * PAGE for n, p in zip(lens, npages)], **i32)
        self.indices = [perm[i].to(device) for i in range(rot)]
        self.append_indptr = torch.tensor([0, *itertools.accumulate(new)], **i32)
        self.seq_lens = get_seq_lens(self.indptr, self.last, PAGE)
        # One copy per set, so the timed calls read their index tensors from DRAM too.
        self.batch_indices, self.positions = zip(*[
            get_batch_indices_positions(self.append_indptr, self.seq_lens, self.nnz) for _ in range(rot)])
        self.keys = [torch.randn(self.nnz, HKV, D, dtype=DTYPE, device=device) for _ in range(rot)]
        self.values = [torch.randn(self.nnz, HKV, D, dtype=DTYPE, device=device) for _ in range(rot)]
        shape = (num_pages, 2, PAGE, HKV, D) if layout == "NHD" else (num_pages, 2, HKV, PAGE, D)
        self.pool = torch.full(shape, POISON, dtype=DTYPE, device=device)
        # Each token's row and position straight from the definition (row b appends new[b]
        # tokens after its prior[b] cached ones), independent of get_batch_indices_positions.
        self.rows = torch.repeat_interleave(torch.arange(self.batch), torch.tensor(new))
        start = torch.tensor([0, *itertools.accumulate(new)])[:-1]
        self.pos = torch.tensor(prior)[self.rows] + torch.arange(self.nnz) - start[self.rows]
        pages_written = torch.unique(self.rows * 2**20 + self.pos // PAGE).numel()
        self.nbytes = 2 * self.nnz * TOKEN_BYTES + 8 * self.nnz + 4 * (self.batch + 1) + 4 * pages_written

    def nhd_views(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the pool as [num_pages, page_size, Hkv, D] views, whatever the layout."""
        kv = unpack_paged_kv_cache(self.pool, self.layout)
        return (kv.k, kv.v) if self.layout == "NHD" else (kv.k.transpose(1, 2), kv.v.transpose(1, 2))

    def check(self, i: int) -> None:
        """Set ``i``'s slots hold exactly its new K/V and the rest of the pool the poison.
        Re-poisons those slots on the way (the pool ends all poison)."""
        pages = self.indices[i].cpu().long()[self.indptr.cpu().long()[self.rows] + self.pos // PAGE]
        pages, slots = pages.to(self.pool.device), (self.pos % PAGE).to(self.pool.device)
        for view, src, name in zip(self.nhd_views(), (self.keys[i], self.values[i]), "KV"):
            if not torch.equal(view[pages, slots], src):
                raise AssertionError(f"{name}: the appended slots do not hold the new tokens")
            view[pages, slots] = POISON
        for a in range(0, self.pool.shape[0], 4096):  # in chunks: the pool may be gigabytes
            if not bool((self.pool[a:a + 4096] == POISON).all()):
                raise AssertionError("a slot outside the append was written")


class RopeAppend(Append):
    """Append's sets, their K and V cut from a qkv projection output per set with the q
    beside them (the views the engine passes), rotated by each token's own position."""

    def __init__(self, prior: list[int], new: list[int], layout: str, device, *, rot: int, seed: int):
        super().__init__(prior, new, layout, device, rot=rot, seed=seed)
        self.qkv = [torch.randn(self.nnz, QKV_WIDTH, dtype=DTYPE, device=device) for _ in range(rot)]
        views = [(x[:, :HQ * D].view(-1, HQ, D), x[:, HQ * D:(HQ + HKV) * D].view(-1, HKV, D),
                  x[:, (HQ + HKV) * D:].view(-1, HKV, D)) for x in self.qkv]
        self.q, self.keys, self.values = (list(t) for t in zip(*views))  # Append.check reads keys/values
        # Each table starts at its row's first page, so the slot position is the sequence position.
        self.rope_positions = [p.long() for p in self.positions]
        inv_freq = 1.0 / (500000.0 ** (torch.arange(0, D, 2, device=device).float() / D))
        freqs = torch.arange(ROPE_MAX_POS, device=device).float()[:, None] * inv_freq[None, :]
        self.cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(DTYPE)
        elem = DTYPE.itemsize
        self.nbytes += self.nnz * (2 * HQ * D * elem + HKV * D * elem + D * elem + 8)


# --------------------------------------------------------------------------- methods


def ours(w: Append, i: int, validate: bool = False):
    return lambda: append_paged_kv_cache(w.keys[i], w.values[i], w.batch_indices[i], w.positions[i], w.pool,
                                         w.indices[i], w.indptr, w.last, kv_layout=w.layout, validate=validate)


def torch_index_put(w: Append, i: int):
    """Plain PyTorch: page and slot from the same inputs, then one index_put_ per cache."""
    k_view, v_view = w.nhd_views()

    def run():
        bi, pos = w.batch_indices[i], w.positions[i]
        pages = w.indices[i][w.indptr[bi] + pos // PAGE]
        slots = pos % PAGE
        k_view.index_put_((pages, slots), w.keys[i])
        v_view.index_put_((pages, slots), w.values[i])

    return run


def flashinfer_append(fi, w: Append):
    """FlashInfer's append with its own batch_indices/positions (checked equal to ours)."""
    sets = []
    for i in range(w.rot):
        bi, pos = fi.get_batch_indices_positions(w.append_indptr, fi.get_seq_lens(w.indptr, w.last, PAGE), w.nnz)
        if not (torch.equal(bi, w.batch_indices[i]) and torch.equal(pos, w.positions[i])):
            raise AssertionError("flashinfer.get_batch_indices_positions differs from ours")
        sets.append((bi, pos))
    return lambda i: lambda: fi.append_paged_kv_cache(w.keys[i], w.values[i], *sets[i], w.pool, w.indices[i],
                                                      w.indptr, w.last, kv_layout=w.layout)


def rope_fused(w: RopeAppend, i: int, validate: bool = False):
    return lambda: append_paged_kv_cache_rope(
        w.q[i], w.keys[i], w.values[i], w.batch_indices[i], w.positions[i], w.pool, w.indices[i], w.indptr, w.last,
        w.rope_positions[i], w.cos_sin, kv_layout=w.layout, validate=validate)


def rope_then_append(w: RopeAppend, i: int, validate: bool = False):
    """The two launches the fused one replaces."""
    def run():
        apply_rope(w.q[i], w.keys[i], w.rope_positions[i], w.cos_sin, validate=validate)
        append_paged_kv_cache(w.keys[i], w.values[i], w.batch_indices[i], w.positions[i], w.pool, w.indices[i],
                              w.indptr, w.last, kv_layout=w.layout, validate=validate)

    return run


# --------------------------------------------------------------------------- one shape


def run_shape(workload: str, batch: int, new: int, layout: str, *, device, fi, copy_bw: float | None,
              rep_ms: int, seed: int) -> dict:
    """Check every method at this shape, then (on a GPU) time it. Ours failing raises."""
    g = torch.Generator().manual_seed(seed)
    prior = torch.randint(0, HISTORY[workload], (batch,), generator=g).tolist()
    nnz = batch * new
    rot = rotation_count(2 * nnz * TOKEN_BYTES) if device.type == "cuda" else 1
    w = Append(prior, [new] * batch, layout, device, rot=rot, seed=seed)
    floor = None if copy_bw is None else roofline_floor(w.nbytes, 0, copy_bw, 1.0)
    row = dict(workload=workload, layout=layout, batch=batch, new=new, nnz=nnz, rot=rot, MB=w.nbytes / 1e6,
               floor_us=None if floor is None else floor * 1e6)

    def record(name: str, seconds: float | None) -> None:
        row[f"{name}_us"] = None if seconds is None else seconds * 1e6
        row[f"{name}_GBps"] = None if seconds is None else w.nbytes / seconds / 1e9
        row[f"{name}_frac"] = None if seconds is None or floor is None else floor / seconds

    methods = {"ours": (lambda i: ours(w, i), lambda: ours(w, 0, validate=True)),  # (timed call, checked call)
               "torch": (lambda i: torch_index_put(w, i), lambda: torch_index_put(w, 0))}
    if fi is not None:
        try:
            call = flashinfer_append(fi, w)
            methods["fi"] = (call, lambda: call(0))
        except Exception as exc:
            print(f"# flashinfer failed at {workload} {batch}x{new} {layout}: {type(exc).__name__}: {exc}",
                  file=sys.stderr)
    row["check"] = []
    for name, (timed, checked) in methods.items():
        try:
            w.pool.fill_(POISON)  # the previous method's timed calls wrote every set's slots
            checked()()
            w.check(0)
            row["check"].append(name)
        except Exception as exc:
            if name == "ours":
                raise AssertionError(f"ours at {workload} batch {batch} new {new} {layout}: {exc}") from exc
            print(f"# {name} failed its check at {workload} {batch}x{new} {layout}: {type(exc).__name__}: {exc}",
                  file=sys.stderr)
            record(name, None)
            continue
        record(name, bench_rotating([timed(i) for i in range(rot)], rep_ms=rep_ms) if device.type == "cuda" else None)
    for name in ("fi", "torch"):
        if row.get(f"{name}_us") and row.get("ours_us"):
            row[f"{name}_over_ours"] = row[f"{name}_us"] / row["ours_us"]
    row["check"] = "+".join(row["check"])
    return row


def run_rope_shape(batch: int, layout: str, *, device, copy_bw: float | None, rep_ms: int, seed: int) -> dict:
    """Check the fused launch against the two it replaces at this decode batch, then (on
    a GPU) time both. A failed check raises."""
    g = torch.Generator().manual_seed(seed)
    prior = torch.randint(0, HISTORY["decode"], (batch,), generator=g).tolist()
    per_call = 2 * batch * TOKEN_BYTES + batch * 2 * QKV_WIDTH * DTYPE.itemsize
    rot = rotation_count(per_call) if device.type == "cuda" else 1
    w = RopeAppend(prior, [1] * batch, layout, device, rot=rot, seed=seed)
    floor = None if copy_bw is None else roofline_floor(w.nbytes, 0, copy_bw, 1.0)
    row = dict(workload="decode+rope", layout=layout, batch=batch, nnz=w.nnz, rot=rot, MB=w.nbytes / 1e6,
               floor_us=None if floor is None else floor * 1e6)
    bits = torch.int16  # bf16: compared as raw bits

    # The two launches first, on set 0: what the fused launch must reproduce.
    unrotated = w.qkv[0].clone()
    w.pool.fill_(POISON)
    rope_then_append(w, 0, validate=True)()
    w.check(0)
    rotated = w.qkv[0].clone()
    w.qkv[0].copy_(unrotated)
    w.pool.fill_(POISON)
    rope_fused(w, 0, validate=True)()
    if not torch.equal(w.qkv[0].view(bits), rotated.view(bits)):
        raise AssertionError(f"decode+rope batch {batch} {layout}: q or k differ from apply_rope's")
    w.check(0)
    w.qkv[0].copy_(unrotated)
    row["check"] = "fused=separate+slots"
    for name, make in (("fused", rope_fused), ("separate", rope_then_append)):
        seconds = bench_rotating([make(w, i) for i in range(rot)], rep_ms=rep_ms) if device.type == "cuda" else None
        row[f"{name}_us"] = None if seconds is None else seconds * 1e6
        row[f"{name}_GBps"] = None if seconds is None else w.nbytes / seconds / 1e9
        row[f"{name}_frac"] = None if seconds is None or floor is None else floor / seconds
    if row.get("fused_us") and row.get("separate_us"):
        row["separate_over_fused"] = row["separate_us"] / row["fused_us"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a few shapes only")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on a CPU (TRITON_INTERPRET=1): checks, no timing")
    ap.add_argument("--rep-ms", type=int, default=200, help="do_bench_cudagraph rep per timing")
    ap.add_argument("--json", metavar="PATH", help="write the rows and the environment here as JSON")
    args = ap.parse_args()

    if args.smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            print("# TRITON_INTERPRET is not 1: the CPU runs the PyTorch path, not the kernel", file=sys.stderr)
        device, fi, copy_bw = torch.device("cpu"), None, None  # FlashInfer and the ceilings need CUDA
        print("#", environment(), flush=True)
        shapes = list(SMOKE_SHAPES)
    else:
        device = gpu_start("bench_append")
        fi = load_flashinfer()
        copy_bw, _ = measure_ceilings()
        decode = QUICK_DECODE if args.quick else DECODE_BATCHES
        chunks = QUICK_CHUNKS if args.quick else CHUNKS
        shapes = [("decode", b, 1) for b in decode] + [("chunk", CHUNK_REQUESTS, c) for c in chunks]

    rows = []
    for n, ((workload, batch, new), layout) in enumerate(itertools.product(shapes, LAYOUTS)):
        row = run_shape(workload, batch, new, layout, device=device, fi=fi, copy_bw=copy_bw, rep_ms=args.rep_ms,
                        seed=100 + n)
        rows.append(row)
        gc.collect()  # free this shape's pool before the next one is allocated
        if device.type == "cuda":
            torch.cuda.empty_cache()
        print(f"# {workload} batch {batch} new {new} {layout}: checked {row['check']}"
              + (f"; ours {row['ours_us']:.1f} us, {row['ours_frac']:.2f} of floor" if row.get("ours_us") else ""),
              flush=True)

    rope_rows = []
    for n, (batch, layout) in enumerate(itertools.product((SMOKE_ROPE_BATCH,) if args.smoke else ROPE_BATCHES,
                                                          LAYOUTS)):
        row = run_rope_shape(batch, layout, device=device, copy_bw=copy_bw, rep_ms=args.rep_ms, seed=200 + n)
        rope_rows.append(row)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        print(f"# decode+rope batch {batch} {layout}: checked {row['check']}"
              + (f"; fused {row['fused_us']:.1f} us, separate {row['separate_us']:.1f} us" if row.get("fused_us")
                 else ""), flush=True)

    write_json(args.json, dict(env=environment(), copy_Bps=copy_bw, rows=rows, rope_rows=rope_rows,
                               shape=dict(hq=HQ, hkv=HKV, head_dim=D, page_size=PAGE, dtype=str(DTYPE),
                                          smoke=args.smoke)))
    print(f"\n## append_paged_kv_cache, bf16, Hkv {HKV}, D {D}, page {PAGE}"
          + (f" (copy bandwidth {copy_bw / 1e9:.0f} GB/s)" if copy_bw else " (smoke: no timing)") + "\n")
    print(markdown_table(rows, ["workload", "layout", "batch", "new", "nnz", "rot", "MB", "floor_us", "ours_us",
                                "ours_GBps", "ours_frac", "fi_us", "fi_frac", "fi_over_ours", "torch_us",
                                "torch_frac", "check"]))
    print(f"\n## append_paged_kv_cache_rope against apply_rope + append_paged_kv_cache, bf16, Hq {HQ}, Hkv {HKV}, "
          f"D {D}, page {PAGE}\n")
    print(markdown_table(rope_rows, ["workload", "layout", "batch", "rot", "MB", "floor_us", "fused_us", "fused_GBps",
                                     "fused_frac", "separate_us", "separate_GBps", "separate_frac",
                                     "separate_over_fused", "check"]))


if __name__ == "__main__":
    main()
