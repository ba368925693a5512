"""Workloads the benchmarks share: shapes, paged pools and page tables, our calls and the
peers' on them, and the timer.

* The shared-prefix batch (``Shape``, ``Workload``): bf16, Hq 32, page 16, one query token
  per request, two levels (one group over a shared prefix, then each request's own
  suffix), every used page randomly placed in a pool of at least ``MIN_POOL_BYTES``, and
  several pools (with their own queries) to rotate through so the prefix is not served
  from L2 between calls. ``ours``, ``fi_cascade``, ``fi_shipped``, ``fi_flat`` and ``sdpa``
  build each method's calls over it (``Method``).
* The decode batch: ``new_pool`` and ``page_table`` (Hq 32, Hkv 8, D 128, page 16) with
  ``kv_bytes``/``io_bytes`` for its floor, and FlashInfer's decode wrapper on it.
* ``shape_tool_start``, ``shape_workloads`` and ``level_alone_calls``: a cascade probe's
  command line, its ``--shapes`` as workloads, and each cascade level alone on one.
* ``make_timer``: CUDA-graph replays over the rotated calls on a GPU, wall clock on a CPU
  (smoke runs, no claims about speed).
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from benchmarks._common import L2_BYTES, bench_rotating, gpu_start, rotation_count
from cascadeinfer.cascade.multi_level import MultiLevelCascadeAttention
from cascadeinfer.kernels.reference import attention_state_ref
from cascadeinfer.layouts.paged_cache import gather_paged_kv, unpack_paged_kv_cache

HQ, HKV, D, PAGE = 32, 8, 128, 16
DTYPE = torch.bfloat16
LN2 = math.log(2.0)  # FlashInfer's base-2 LSE times ln 2 is ours

BAR_SHAPES = ((64, 8192, 256), (128, 32768, 512), (256, 4096, 128), (16, 65536, 1024))  # (batch, prefix, suffix)
# Short shared prefixes, where the cascade's win is small and launch and host costs weigh most.
SHORT_PREFIX_SHAPES = ((8, 128, 2048), (64, 256, 256), (256, 1024, 64), (512, 1024, 64))
MIN_POOL_BYTES = 256 * 2**20  # every pool spans at least this (pages randomly spread over it)
MAX_ROTATIONS = 16
MAX_SDPA_BYTES = 24e9  # SDPA needs a gathered copy of batch x (prefix + suffix) tokens


@dataclass(frozen=True)
class Shape:
    batch: int
    prefix: int
    suffix: int
    hkv: int = 8
    head_dim: int = 128
    hq: int = HQ

    def __post_init__(self) -> None:
        if self.prefix < PAGE or self.prefix % PAGE or self.suffix < 1 or self.batch < 1:
            raise ValueError(f"shape {self}: the prefix must be whole pages and the suffix non-empty")

    @property
    def prefix_pages(self) -> int:
        return self.prefix // PAGE

    @property
    def suffix_pages(self) -> int:
        return -(-self.suffix // PAGE)

    @property
    def used_pages(self) -> int:
        return self.prefix_pages + self.batch * self.suffix_pages

    @property
    def token_bytes(self) -> int:
        """K and V of one token, all kv heads."""
        return 2 * self.hkv * self.head_dim * DTYPE.itemsize

    @property
    def kv_bytes(self) -> int:
        """The unique K/V: the prefix once and every request's suffix."""
        return (self.prefix + self.batch * self.suffix) * self.token_bytes

    @property
    def decode_level_bytes(self) -> int:
        """K/V the decode level reads: every request's own pages, whole pages."""
        return self.batch * self.suffix_pages * PAGE * self.token_bytes

    @property
    def io_bytes(self) -> int:
        return self.kv_bytes + 2 * self.batch * self.hq * self.head_dim * DTYPE.itemsize  # + q + o

    @property
    def flops(self) -> int:
        return 4 * self.batch * (self.prefix + self.suffix) * self.hq * self.head_dim

    @property
    def gathered_bytes(self) -> int:
        """K/V of every request's whole sequence as contiguous tensors (SDPA's input)."""
        return self.batch * (self.prefix + self.suffix) * self.token_bytes

    def label(self) -> str:
        return (f"batch {self.batch} prefix {self.prefix} suffix {self.suffix} "
                f"Hq {self.hq} Hkv {self.hkv} D {self.head_dim}")


class Workload:
    """Rotated pools and queries for one shape, the two-level tables and the flat table.

    Every pool holds the same page layout: the used pages (prefix, then each request's
    suffix) are a random subset of the pool, in random order.
    """

    def __init__(self, shape: Shape, device: torch.device, *, seed: int, min_pool_bytes: int, max_rot: int):
        s = self.shape = shape
        self.device = device
        page_bytes = PAGE * s.token_bytes
        touched = s.used_pages * page_bytes
        self.rot = 1 if touched > 3 * L2_BYTES else rotation_count(touched, maximum=max_rot)
        self.l2_resident = self.rot * touched <= 3 * L2_BYTES  # rotations do not clear L2
        self.num_pages = max(s.used_pages, -(-min_pool_bytes // page_bytes))
        g = torch.Generator().manual_seed(seed)
        perm = torch.randperm(self.num_pages, generator=g)[: s.used_pages].to(torch.int32)
        pp, sp = s.prefix_pages, s.suffix_pages
        prefix_idx, suffix_idx = perm[:pp], perm[pp:].view(s.batch, sp)
        last_suffix = s.suffix - (sp - 1) * PAGE
        i32 = dict(dtype=torch.int32)
        dev = lambda ts: [t.to(device) for t in ts]  # noqa: E731
        self.qo_indptr = dev([torch.tensor([0, s.batch], **i32), torch.arange(s.batch + 1, **i32)])
        self.kv_indptr = dev([torch.tensor([0, pp], **i32), torch.arange(s.batch + 1, **i32) * sp])
        self.kv_indices = dev([prefix_idx, suffix_idx.reshape(-1).contiguous()])
        self.kv_last = dev([torch.tensor([PAGE], **i32), torch.full((s.batch,), last_suffix, **i32)])
        # Flat: each request's prefix pages then its suffix pages (the prefix ends on a full page).
        flat_idx = torch.cat([prefix_idx.expand(s.batch, pp), suffix_idx], dim=1).reshape(-1)
        self.flat_indptr, self.flat_indices, self.flat_last = dev(
            [torch.arange(s.batch + 1, **i32) * (pp + sp), flat_idx, torch.full((s.batch,), last_suffix, **i32)])
        pool_shape = (self.num_pages, 2, PAGE, s.hkv, s.head_dim)
        self.pools = [torch.empty(pool_shape, dtype=DTYPE, device=device).normal_() for _ in range(self.rot)]
        self.qs = [torch.randn(s.batch, s.hq, s.head_dim, device=device, dtype=DTYPE) for _ in range(self.rot)]

    def tables(self):
        return self.qo_indptr, self.kv_indptr, self.kv_indices, self.kv_last

    def out_buffers(self):
        s = self.shape
        outs = [torch.empty(s.batch, s.hq, s.head_dim, device=self.device, dtype=DTYPE) for _ in range(self.rot)]
        lses = [torch.empty(s.batch, s.hq, device=self.device, dtype=torch.float32) for _ in range(self.rot)]
        return outs, lses

    def reference(self, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Float64 (o, natural-log lse) of the given requests on rotation 0 (on the device)."""
        kv = unpack_paged_kv_cache(self.pools[0], "NHD")
        os_, ls_ = [], []
        for r in rows:
            k, v = gather_paged_kv(kv, self.flat_indptr, self.flat_indices, self.flat_last, r)
            o, lse = attention_state_ref(self.qs[0][r:r + 1], k, v)
            os_.append(o)
            ls_.append(lse)
        return torch.cat(os_), torch.cat(ls_)


# --------------------------------------------------------------------------- methods


@dataclass
class Method:
    """One implementation on one workload: ``call(i)`` is a closure over rotation ``i``
    (for timing); ``result()`` runs rotation 0 and returns (o, natural-log lse or None)."""

    call: Callable[[int], Callable[[], object]]
    result: Callable[[], tuple[torch.Tensor, torch.Tensor | None]]
    pick: str | None = None
    predicted: tuple[float, float] | None = None
    n_calls: int | None = None  # input sets to rotate (None: the workload's rotation count)


def poisoned(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> None:
    for t in (*outs, *lses):
        t.fill_(float("nan"))


def ours(wl: Workload, use_cascade: bool | None, backend: str | None = None) -> Method:
    s = wl.shape
    attn = MultiLevelCascadeAttention(2, kv_layout="NHD", device=wl.device, backend=backend)
    attn.plan(*wl.tables(), s.hq, s.hkv, s.head_dim, PAGE, num_pages=wl.num_pages, dtype=DTYPE,
              use_cascade=use_cascade)
    outs, lses = wl.out_buffers()

    def call(i):
        return lambda: attn.run(wl.qs[i], wl.pools[i], out=outs[i], lse=lses[i])

    def result():
        poisoned(outs[:1], lses[:1])
        call(0)()
        return outs[0], lses[0]

    return Method(call, result, pick="cascade" if attn.use_cascade else "flat",
                  predicted=(attn.predicted_cascade_s, attn.predicted_flat_s))


def fi_workspace(device) -> torch.Tensor:
    return torch.zeros(256 * 2**20, dtype=torch.uint8, device=device)


def fi_cascade(fi, wl: Workload) -> Method:
    """FlashInfer's fastest cascade: fa2 prefill per level, states merged in place."""
    s = wl.shape
    ws = fi_workspace(wl.device)
    wrappers = []
    for lv in range(2):
        w = fi.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend="fa2")
        w.plan(wl.qo_indptr[lv], wl.kv_indptr[lv], wl.kv_indices[lv], wl.kv_last[lv], s.hq, s.hkv, s.head_dim, PAGE,
               causal=False, q_data_type=DTYPE, kv_data_type=DTYPE)
        wrappers.append(w)
    bufs = [wl.out_buffers() for _ in range(2)]  # [level] -> (outs, lses)

    def call(i):
        def run():
            for w, (outs, lses) in zip(wrappers, bufs):
                w.run(wl.qs[i], wl.pools[i], out=outs[i], lse=lses[i], return_lse=True)
            fi.merge_state_in_place(bufs[0][0][i], bufs[0][1][i], bufs[1][0][i], bufs[1][1][i])
        return run

    def result():
        for outs, lses in bufs:
            poisoned(outs[:1], lses[:1])
        call(0)()
        return bufs[0][0][0], bufs[0][1][0] * LN2  # FlashInfer's LSE is base 2

    return Method(call, result)


def fi_shipped(fi, wl: Workload) -> Method:
    """FlashInfer's MultiLevelCascadeAttentionWrapper as shipped (backend auto: fa3 on Hopper)."""
    s = wl.shape
    w = fi.MultiLevelCascadeAttentionWrapper(2, fi_workspace(wl.device), "NHD")
    w.plan(list(wl.qo_indptr), list(wl.kv_indptr), list(wl.kv_indices), list(wl.kv_last), s.hq, s.hkv,
           s.head_dim, PAGE, q_data_type=DTYPE, kv_data_type=DTYPE)

    def call(i):
        return lambda: w.run(wl.qs[i], wl.pools[i])

    def result():
        return call(0)(), None  # it returns no LSE

    return Method(call, result)


def fi_flat(fi, wl: Workload) -> Method:
    """FlashInfer's best flat decode over each request's concatenated page list."""
    s = wl.shape
    w = fi.BatchDecodeWithPagedKVCacheWrapper(fi_workspace(wl.device), "NHD", use_tensor_cores=True)
    w.plan(wl.flat_indptr, wl.flat_indices, wl.flat_last, s.hq, s.hkv, s.head_dim, PAGE,
           q_data_type=DTYPE, kv_data_type=DTYPE)
    outs, lses = wl.out_buffers()

    def call(i):
        return lambda: w.run(wl.qs[i], wl.pools[i], out=outs[i])

    def result():
        poisoned(outs[:1], lses[:1])
        w.run(wl.qs[0], wl.pools[0], out=outs[0], lse=lses[0], return_lse=True)
        return outs[0], lses[0] * LN2  # base 2 -> natural log

    return Method(call, result)


def sdpa(wl: Workload) -> Method:
    """SDPA on contiguous gathered K/V (copies built here, not timed)."""
    s = wl.shape
    if s.gathered_bytes > MAX_SDPA_BYTES:
        raise MemoryError(f"gathered K/V would take {s.gathered_bytes / 1e9:.1f} GB (limit {MAX_SDPA_BYTES / 1e9:.0f})")
    n_sets = 1 if s.gathered_bytes > 3 * L2_BYTES else min(wl.rot, rotation_count(s.gathered_bytes))
    length = s.prefix + s.suffix
    prefix_idx = wl.kv_indices[0].long()
    suffix_idx = wl.kv_indices[1].long().view(s.batch, s.suffix_pages)
    sets = []
    for j in range(n_sets):
        pool = wl.pools[j % wl.rot]
        k = torch.empty(s.batch, s.hkv, length, s.head_dim, device=wl.device, dtype=DTYPE)
        v = torch.empty_like(k)
        for which, dst in ((0, k), (1, v)):
            pre = pool[prefix_idx, which].reshape(s.prefix, s.hkv, s.head_dim)  # [P, Hkv, D]
            dst[:, :, : s.prefix] = pre.transpose(0, 1).unsqueeze(0)
            del pre
            suf = pool[suffix_idx, which].reshape(s.batch, s.suffix_pages * PAGE, s.hkv, s.head_dim)[:, : s.suffix]
            dst[:, :, s.prefix:] = suf.transpose(1, 2)
            del suf
        sets.append((wl.qs[j % wl.rot].unsqueeze(2), k, v))  # q [B, Hq, 1, D]

    def call(i):
        q, k, v = sets[i % n_sets]
        return lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    def result():
        return call(0)().squeeze(2), None

    return Method(call, result, n_calls=n_sets)


def shape_tool_start(doc: str, tool: str, shapes: tuple[str, ...], rep_ms: int, extra=None):
    """A cascade probe's command line, then its GPU: ``--shapes`` ("batch,prefix,suffix"
    triples, default ``shapes``), ``--rep-ms``, ``--json`` and whatever ``extra(parser)``
    adds. Returns ``(args, device, timer)``."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="*", default=list(shapes), help="batch,prefix,suffix triples")
    ap.add_argument("--rep-ms", type=int, default=rep_ms)
    ap.add_argument("--json", metavar="PATH")
    if extra is not None:
        extra(ap)
    args = ap.parse_args()
    device = gpu_start(tool)
    return args, device, make_timer(device, args.rep_ms)


def shape_workloads(shapes: list[str], device: torch.device):
    """``(text, Shape, Workload)`` for each "batch,prefix,suffix" triple of a tool's
    ``--shapes`` (pools of at least ``MIN_POOL_BYTES``, up to 16 rotations), one at a time."""
    for text in shapes:
        s = Shape(*map(int, text.split(",")))
        yield text, s, Workload(s, device, seed=5, min_pool_bytes=MIN_POOL_BYTES, max_rot=16)


def level_alone_calls(wl: Workload, level: int, backend: str | None = None) -> list[Callable[[], object]]:
    """Each rotation's call of one cascade level alone, through its public launcher:
    level 0 the shared prefix (``batch_prefill_paged``, one group, on ``backend``), 1 the
    suffix decode."""
    from cascadeinfer import batch_decode_paged, batch_prefill_paged  # noqa: PLC0415

    outs, lses = wl.out_buffers()
    if level == 0:
        return [lambda i=i: batch_prefill_paged(
            wl.qs[i], wl.qo_indptr[0], wl.pools[i], wl.kv_indptr[0], wl.kv_indices[0], wl.kv_last[0],
            out=outs[i], lse=lses[i], validate=False, backend=backend) for i in range(wl.rot)]
    return [lambda i=i: batch_decode_paged(wl.qs[i], wl.pools[i], wl.kv_indptr[1], wl.kv_indices[1], wl.kv_last[1],
                                           out=outs[i], lse=lses[i], validate=False) for i in range(wl.rot)]


def make_timer(device: torch.device, rep_ms: int) -> Callable[[list], float]:
    if device.type == "cuda":
        return lambda fns: bench_rotating(fns, rep_ms=rep_ms)

    def wall(fns):  # CPU smoke runs: best of 3 wall-clock passes (no claims about speed)
        for f in fns:
            f()
        best = math.inf
        for _ in range(3):
            t0 = time.perf_counter()
            for f in fns:
                f()
            best = min(best, time.perf_counter() - t0)
        return best / len(fns)

    return wall


# ---- the decode batch


def kv_bytes(batch: int, ctx: int) -> int:
    """K and V bytes of ``batch`` requests of ``ctx`` tokens (``ctx``: their total / batch)."""
    return batch * ctx * HKV * D * 2 * DTYPE.itemsize


def io_bytes(batch: int, ctx: int) -> int:
    """Bytes one call must move: K and V of every token, q in, o and lse out."""
    return kv_bytes(batch, ctx) + 2 * batch * HQ * D * DTYPE.itemsize + batch * HQ * 4


def page_table(batch: int, lens: list[int], num_pages: int, device, seed: int = 0):
    """CSR page table with each request's pages randomly permuted over the pool."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    npages = [(n + PAGE - 1) // PAGE for n in lens]
    indices = torch.randperm(num_pages, generator=g)[: sum(npages)].to(device, torch.int32)
    indptr = torch.tensor([0, *torch.tensor(npages).cumsum(0).tolist()], dtype=torch.int32, device=device)
    last = torch.tensor([n - (p - 1) * PAGE if p else 0 for n, p in zip(lens, npages)],
                        dtype=torch.int32, device=device)
    return indptr, indices, last


def new_pool(num_pages: int, device, layout: str = "NHD", num_kv_heads: int = HKV, head_dim: int = D) -> torch.Tensor:
    shape = ((num_pages, 2, PAGE, num_kv_heads, head_dim) if layout == "NHD"
             else (num_pages, 2, num_kv_heads, PAGE, head_dim))
    return torch.empty(shape, dtype=DTYPE, device=device).normal_()


def fi_wrapper(fi, indptr, indices, last, workspace=None):
    if workspace is None:
        workspace = torch.zeros(256 * 2**20, dtype=torch.uint8, device=indptr.device)
    w = fi.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=True)
    w.plan(indptr, indices, last, HQ, HKV, D, PAGE, q_data_type=DTYPE, kv_data_type=DTYPE)
    return w
