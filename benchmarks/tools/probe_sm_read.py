"""How fast can a few SMs read HBM, and does that hold beside the cascade's prefix level?

    python -m benchmarks.tools.probe_sm_read [--shapes B,P,S ...] [--sms 8 33 66 132] [--json PATH]

Beside the prefix level the decode level gets the SMs the prefix leaves and reads its pages
there at 36-40 GB/s per SM (benchmarks/NOTES.md, "Cascade" v9, v13), about what each SM
reads when the decode level has the whole GPU. Is that the hardware's rate per SM? This
times a streaming reader with nothing in its way: one persistent Triton program per SM,
``--sms`` of them, summing a 4 GiB bf16 buffer chunk by chunk (chunks of 4,096 or 16,384
elements, 8 warps, a ``tl.range`` pipeline of 4 stages: 24 or 96 KiB in flight per
program), as GB/s per SM. Then, per shape (default: the engine's decode batch, 256
requests over a 4096-token shared prompt with 144, 256 and 384 tokens of their own), in
CUDA-graph replays: the decode level alone, the prefix level alone on the share's grid
(one split, 64 programs at these shapes), the public cascade, and the reader streaming
the decode level's byte count (a buffer of that size) on 68 programs, alone and on a side
stream beside that prefix level: the time the cascade would take if its decode level read
like the reader. Last, ``page_major``, a first sketch of a decode level built that way
(one program per SM; each step one page of one request, all its kv heads: a 32 KiB K and
a 32 KiB V load, batched ``tl.dot`` over the heads; the programs take contiguous ranges of
the flat page list, across requests, and write one state per (program, request) piece,
merged here in float64 for the check only), alone on 132 and 68 programs and beside the
prefix level. And ``request_major``, a second sketch: one program per request (8 warps),
its query heads loaded once, then each of its pages with all kv heads a step, K loaded
straight into the batched product's ``[Hkv, D, page]`` order (no permute), the K/V ring
as deep as ``tl.range``'s stages give it; one program per request, and 68 persistent
programs walking the requests; alone and beside the prefix level, for each of
``REQUEST_MAJOR``'s (stages, warps). ``flat_major``: the same step over one loop through
the flat page list (whole requests per program), so the K/V ring runs on across request
boundaries. ``request_major_t``: the same step transposed (keys on the products' M side,
the query group on N: a quarter of the accumulator), 8 warps capped at 128 registers so
that two programs share an SM (``REQUEST_MAJOR_T``). ``--sketches`` picks which of them run.
GPU only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from benchmarks._common import environment, markdown_table, measure_ceilings, write_json
from benchmarks.fixtures import PAGE, level_alone_calls, ours, shape_tool_start, shape_workloads
from benchmarks.tools.probe_tma_read import beside, prefix_calls

ENGINE_SHAPES = ("256,4096,144", "256,4096,256", "256,4096,384")
SMS = (8, 33, 66, 132)
CHUNKS = (4096, 16384)
BESIDE = 68  # the SMs the prefix level's one-split grid (64 programs) leaves on 132
# (stages, warps) of request_major: Triton 3.6 gives its K/V ring 1 page at 3 stages, 2 at 5,
# 3 at 8 (64 KiB a page at Hkv 8, D 128; 96 / 160 / 224 KiB of shared memory; 164-170
# registers, one program an SM).
REQUEST_MAJOR = ((3, 8), (5, 8), (8, 8))
# (stages, warps, register cap) of request_major_t: at 8 warps 155 registers uncapped (one
# program an SM), 124 capped at 128 without spills (two an SM); at 4 warps, capped at 168,
# three an SM. 72 KiB of shared memory each (a K/V ring one page deep).
REQUEST_MAJOR_T = ((3, 8, None), (3, 8, 128), (3, 4, 168))
SKETCHES = ("page_major", "request_major", "flat_major", "request_major_t")


def sketch_configs(sketches):
    """(sketch, stages, warps, register cap, programs) of the request- and flat-major runs:
    one program per request or ``BESIDE`` persistent ones (two per SM too for the capped
    ``request_major_t``); ``flat_major`` on 132 and ``BESIDE``."""
    for stages, warps in REQUEST_MAJOR:
        if "request_major" in sketches:
            yield from (("request_major", stages, warps, None, p) for p in (None, BESIDE))
        if "flat_major" in sketches:
            yield from (("flat_major", stages, warps, None, p) for p in (132, BESIDE))
    for stages, warps, cap in REQUEST_MAJOR_T if "request_major_t" in sketches else ():
        programs = (None, BESIDE, 2 * BESIDE) if cap else (None, BESIDE)
        yield from (("request_major_t", stages, warps, cap, p) for p in programs)


@triton.jit
def stream_reader(x_ptr, out_ptr, n_chunks, programs, BLOCK: tl.constexpr, STAGES: tl.constexpr):
    """Program ``p`` sums chunks ``p, p + programs, ..`` of ``BLOCK`` elements into one
    float32 row of ``out`` (so the loads cannot be dropped)."""
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], tl.float32)
    offs = tl.arange(0, BLOCK)
    for c in tl.range(pid, n_chunks, programs, num_stages=STAGES):
        acc += tl.load(x_ptr + c.to(tl.int64) * BLOCK + offs).to(tl.float32)
    tl.store(out_ptr + pid * BLOCK + offs, acc)


@triton.jit
def _page_step(acc, l_i, m_i, q, kt, v, key_ok, qk_scale):
    """One page of every kv head into the sketches' online softmax (base 2): ``q`` [HKV, 16,
    D], ``kt`` [HKV, D, PAGE], ``v`` [HKV, PAGE, D], keys outside ``key_ok`` [PAGE] masked."""
    s = tl.dot(q, kt)  # [HKV, 16, PAGE]
    s = tl.where(key_ok[None, None, :], s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=2))
    p = tl.exp2(s - m_new[:, :, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=2)
    acc = acc * alpha[:, :, None] + tl.dot(p.to(q.dtype), v)
    return acc, l_i, m_new


@triton.jit
def page_major(q_ptr, pool_ptr, entry_req_ptr, kv_indices_ptr, kv_indptr_ptr, kv_last_ptr, po_ptr, plse_ptr,
               total, per_prog, stride_qb, stride_qh, stride_pp, stride_pkv, stride_pt, stride_ph,
               stride_ob, stride_oh, stride_lb, qk_scale,
               HKV: tl.constexpr, GROUP: tl.constexpr, PAGE_SIZE: tl.constexpr, D: tl.constexpr,
               STAGES: tl.constexpr):
    """Entries ``[pid * per_prog, ..)`` of the flat page list, one a step, all kv heads; the
    state of each (program, request) piece into slot ``pid + request`` (base-2 LSE)."""
    pid = tl.program_id(0)
    lo = pid * per_prog
    hi = tl.minimum(lo + per_prog, total)
    h = tl.arange(0, HKV)
    g = tl.arange(0, 16)
    n = tl.arange(0, PAGE_SIZE)
    d = tl.arange(0, D)
    qrow = h[:, None] * GROUP + g[None, :]  # [HKV, 16]: rows past GROUP are padding
    row_ok = (g < GROUP)[None, :] & (h >= 0)[:, None]
    kv_off = n[:, None, None] * stride_pt + h[None, :, None] * stride_ph + d[None, None, :]  # [PAGE, HKV, D]
    m_i = tl.full([HKV, 16], float("-inf"), tl.float32)
    l_i = tl.zeros([HKV, 16], tl.float32)
    acc = tl.zeros([HKV, 16, D], tl.float32)
    for j in tl.range(lo, hi, num_stages=STAGES):
        r = tl.load(entry_req_ptr + j)
        page = tl.load(kv_indices_ptr + j).to(tl.int64)
        first = tl.load(kv_indptr_ptr + r)
        last = tl.load(kv_indptr_ptr + r + 1) - 1
        valid = tl.where(j == last, tl.load(kv_last_ptr + r), PAGE_SIZE)
        q = tl.load(q_ptr + r.to(tl.int64) * stride_qb + qrow[:, :, None] * stride_qh + d[None, None, :],
                    mask=row_ok[:, :, None], other=0.0)
        k = tl.load(pool_ptr + page * stride_pp + kv_off)
        v = tl.load(pool_ptr + page * stride_pp + stride_pkv + kv_off)
        fresh = (j == first) | (j == lo)
        m_i = tl.where(fresh, float("-inf"), m_i)
        l_i = tl.where(fresh, 0.0, l_i)
        acc = tl.where(fresh, 0.0, acc)
        s = tl.dot(q, tl.permute(k, (1, 2, 0)))  # [HKV, 16, PAGE]
        s = tl.where((n < valid)[None, None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=2))
        p = tl.exp2(s - m_new[:, :, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=2)
        acc = acc * alpha[:, :, None] + tl.dot(p.to(q.dtype), tl.permute(v, (1, 0, 2)))
        m_i = m_new
        if (j == last) | (j == hi - 1):
            slot = (pid + r).to(tl.int64)
            tl.store(po_ptr + slot * stride_ob + qrow[:, :, None] * stride_oh + d[None, None, :],
                     acc / l_i[:, :, None], mask=row_ok[:, :, None])
            tl.store(plse_ptr + slot * stride_lb + qrow, m_i + tl.log2(l_i), mask=row_ok)


@triton.jit
def request_major(q_ptr, pool_ptr, kv_indices_ptr, kv_indptr_ptr, kv_last_ptr, o_ptr, lse_ptr, batch,
                  stride_qb, stride_qh, stride_pp, stride_pkv, stride_pt, stride_ph,
                  stride_ob, stride_oh, stride_lb, qk_scale,
                  HKV: tl.constexpr, GROUP: tl.constexpr, PAGE_SIZE: tl.constexpr, D: tl.constexpr,
                  STAGES: tl.constexpr):
    """Program ``p`` takes requests ``p, p + programs, ..`` (one each when the grid is the
    batch): per request its query heads once, then each of its pages with all kv heads a
    step (a 32 KiB K and a 32 KiB V load at Hkv 8, D 128), K loaded straight into the
    batched product's ``[Hkv, D, PAGE]`` order and V into ``[Hkv, PAGE, D]`` (no permute).
    Writes each request's ``(o, natural-log lse)``."""
    for r in range(tl.program_id(0), batch, tl.num_programs(0)):
        _request_major_row(q_ptr, pool_ptr, kv_indices_ptr, kv_indptr_ptr, kv_last_ptr, o_ptr, lse_ptr, r,
                           stride_qb, stride_qh, stride_pp, stride_pkv, stride_pt, stride_ph,
                           stride_ob, stride_oh, stride_lb, qk_scale, HKV, GROUP, PAGE_SIZE, D, STAGES)


@triton.jit
def _request_major_row(q_ptr, pool_ptr, kv_indices_ptr, kv_indptr_ptr, kv_last_ptr, o_ptr, lse_ptr, r,
                       stride_qb, stride_qh, stride_pp, stride_pkv, stride_pt, stride_ph,
                       stride_ob, stride_oh, stride_lb, qk_scale,
                       HKV: tl.constexpr, GROUP: tl.constexpr, PAGE_SIZE: tl.constexpr, D: tl.constexpr,
                       STAGES: tl.constexpr):
    """Request ``r`` of :func:`request_major`."""
    r64 = tl.full([], 0, tl.int64) + r  # a tensor in every mode (the interpreter's loop gives an int)
    h = tl.arange(0, HKV)
    g = tl.arange(0, 16)
    n = tl.arange(0, PAGE_SIZE)
    d = tl.arange(0, D)
    qrow = h[:, None] * GROUP + g[None, :]  # [HKV, 16]: rows past GROUP are padding
    row_ok = (g < GROUP)[None, :] & (h >= 0)[:, None]
    q = tl.load(q_ptr + r64 * stride_qb + qrow[:, :, None] * stride_qh + d[None, None, :],
                mask=row_ok[:, :, None], other=0.0)  # [HKV, 16, D]
    kt_off = h[:, None, None] * stride_ph + d[None, :, None] + n[None, None, :] * stride_pt  # [HKV, D, PAGE]
    v_off = h[:, None, None] * stride_ph + n[None, :, None] * stride_pt + d[None, None, :]  # [HKV, PAGE, D]
    first = tl.load(kv_indptr_ptr + r)
    n_pages = tl.load(kv_indptr_ptr + r + 1) - first
    last_len = tl.load(kv_last_ptr + r)
    m_i = tl.full([HKV, 16], float("-inf"), tl.float32)
    l_i = tl.zeros([HKV, 16], tl.float32)
    acc = tl.zeros([HKV, 16, D], tl.float32)
    for j in tl.range(0, n_pages, num_stages=STAGES):
        page = tl.load(kv_indices_ptr + first + j).to(tl.int64)
        kt = tl.load(pool_ptr + page * stride_pp + kt_off)
        v = tl.load(pool_ptr + page * stride_pp + stride_pkv + v_off)
        valid = tl.where(j == n_pages - 1, last_len, PAGE_SIZE)
        acc, l_i, m_i = _page_step(acc, l_i, m_i, q, kt, v, n < valid, qk_scale)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    tl.store(o_ptr + r64 * stride_ob + qrow[:, :, None] * stride_oh + d[None, None, :],
             (acc / l_safe[:, :, None]).to(o_ptr.dtype.element_ty), mask=row_ok[:, :, None])
    tl.store(lse_ptr + r64 * stride_lb + qrow,
             tl.where(l_i == 0.0, float("-inf"), (m_i + tl.log2(l_safe)) * 0.6931471805599453), mask=row_ok)


@triton.jit
def flat_major(q_ptr, pool_ptr, kv_indices_ptr, info_ptr, range_ptr, o_ptr, lse_ptr,
               stride_qb, stride_qh, stride_pp, stride_pkv, stride_pt, stride_ph,
               stride_ob, stride_oh, stride_lb, qk_scale,
               HKV: tl.constexpr, GROUP: tl.constexpr, PAGE_SIZE: tl.constexpr, D: tl.constexpr,
               STAGES: tl.constexpr):
    """``request_major``'s step over one flat loop: program ``p`` takes the whole requests
    whose pages are entries ``[range[p], range[p + 1])`` of the flat page list, one page
    (all kv heads) a step, so the K/V ring runs on across request boundaries. Each entry's
    ``info`` packs ``request << 7 | valid tokens << 2 | last << 1 | first``: the state
    restarts on a first page (the query heads reloaded then), and is written on a last."""
    pid = tl.program_id(0)
    lo = tl.load(range_ptr + pid)
    hi = tl.load(range_ptr + pid + 1)
    h = tl.arange(0, HKV)
    g = tl.arange(0, 16)
    n = tl.arange(0, PAGE_SIZE)
    d = tl.arange(0, D)
    qrow = h[:, None] * GROUP + g[None, :]  # [HKV, 16]: rows past GROUP are padding
    row_ok = (g < GROUP)[None, :] & (h >= 0)[:, None]
    kt_off = h[:, None, None] * stride_ph + d[None, :, None] + n[None, None, :] * stride_pt  # [HKV, D, PAGE]
    v_off = h[:, None, None] * stride_ph + n[None, :, None] * stride_pt + d[None, None, :]  # [HKV, PAGE, D]
    q = tl.zeros([HKV, 16, D], q_ptr.dtype.element_ty)
    m_i = tl.full([HKV, 16], float("-inf"), tl.float32)
    l_i = tl.zeros([HKV, 16], tl.float32)
    acc = tl.zeros([HKV, 16, D], tl.float32)
    for t in tl.range(lo, hi, num_stages=STAGES):
        info = tl.load(info_ptr + t)
        page = tl.load(kv_indices_ptr + t).to(tl.int64)
        r = (info >> 7).to(tl.int64)
        valid = (info >> 2) & 31
        last = (info & 2) != 0
        first = (info & 1) != 0
        if first:  # a branch, not a masked load: the pipeliner would give q a ring of its own
            q = tl.load(q_ptr + r * stride_qb + qrow[:, :, None] * stride_qh + d[None, None, :],
                        mask=row_ok[:, :, None], other=0.0)
        kt = tl.load(pool_ptr + page * stride_pp + kt_off)
        v = tl.load(pool_ptr + page * stride_pp + stride_pkv + v_off)
        m_i = tl.where(first, float("-inf"), m_i)
        l_i = tl.where(first, 0.0, l_i)
        acc = tl.where(first, 0.0, acc)
        acc, l_i, m_i = _page_step(acc, l_i, m_i, q, kt, v, n < valid, qk_scale)
        if last:  # a branch: the division and the stores' addresses only once a request
            tl.store(o_ptr + r * stride_ob + qrow[:, :, None] * stride_oh + d[None, None, :],
                     (acc / l_i[:, :, None]).to(o_ptr.dtype.element_ty), mask=row_ok[:, :, None])
            tl.store(lse_ptr + r * stride_lb + qrow, (m_i + tl.log2(l_i)) * 0.6931471805599453, mask=row_ok)


@triton.jit
def request_major_t(q_ptr, pool_ptr, kv_indices_ptr, kv_indptr_ptr, kv_last_ptr, o_ptr, lse_ptr, batch,
                    stride_qb, stride_qh, stride_pp, stride_pkv, stride_pt, stride_ph,
                    stride_ob, stride_oh, stride_lb, qk_scale,
                    HKV: tl.constexpr, GROUP: tl.constexpr, PAGE_SIZE: tl.constexpr, D: tl.constexpr,
                    STAGES: tl.constexpr):
    """``request_major`` transposed: the page's keys on the products' M side and the query
    group on N (``S^T = K Q^T``, ``O^T += V^T P^T``), so no query row is padded to 16 and
    the accumulator is ``[HKV, D, GROUP]``, a quarter of ``request_major``'s at group 4."""
    for r in range(tl.program_id(0), batch, tl.num_programs(0)):
        r64 = tl.full([], 0, tl.int64) + r  # a tensor in every mode (the interpreter's loop gives an int)
        h = tl.arange(0, HKV)
        g = tl.arange(0, GROUP)
        n = tl.arange(0, PAGE_SIZE)
        d = tl.arange(0, D)
        qt = tl.load(q_ptr + r64 * stride_qb + (h[:, None, None] * GROUP + g[None, None, :]) * stride_qh
                     + d[None, :, None])  # [HKV, D, GROUP]
        k_off = h[:, None, None] * stride_ph + n[None, :, None] * stride_pt + d[None, None, :]  # [HKV, PAGE, D]
        vt_off = h[:, None, None] * stride_ph + d[None, :, None] + n[None, None, :] * stride_pt  # [HKV, D, PAGE]
        first = tl.load(kv_indptr_ptr + r)
        n_pages = tl.load(kv_indptr_ptr + r + 1) - first
        last_len = tl.load(kv_last_ptr + r)
        m_i = tl.full([HKV, GROUP], float("-inf"), tl.float32)
        l_i = tl.zeros([HKV, GROUP], tl.float32)
        acc = tl.zeros([HKV, D, GROUP], tl.float32)
        for j in tl.range(0, n_pages, num_stages=STAGES):
            page = tl.load(kv_indices_ptr + first + j).to(tl.int64)
            k = tl.load(pool_ptr + page * stride_pp + k_off)
            vt = tl.load(pool_ptr + page * stride_pp + stride_pkv + vt_off)
            valid = tl.where(j == n_pages - 1, last_len, PAGE_SIZE)
            s = tl.dot(k, qt)  # [HKV, PAGE, GROUP]
            s = tl.where((n < valid)[None, :, None], s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            p = tl.exp2(s - m_new[:, None, :])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None, :] + tl.dot(vt, p.to(qt.dtype))
            m_i = m_new
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        qrow = h[:, None] * GROUP + g[None, :]  # [HKV, GROUP]
        tl.store(o_ptr + r64 * stride_ob + qrow[:, None, :] * stride_oh + d[None, :, None],
                 (acc / l_safe[:, None, :]).to(o_ptr.dtype.element_ty))
        tl.store(lse_ptr + r64 * stride_lb + qrow,
                 tl.where(l_i == 0.0, float("-inf"), (m_i + tl.log2(l_safe)) * 0.6931471805599453))


class RequestMajor:
    """``request_major`` over one workload's decode level (one program per request)."""

    def __init__(self, wl, stages: int = 3, warps: int = 8, programs: int | None = None):
        s = wl.shape
        if s.hkv & (s.hkv - 1) or s.hq // s.hkv > 16:
            raise SystemExit("probe_sm_read: request_major needs a power-of-two Hkv and groups of <= 16")
        self.wl, self.stages, self.warps = wl, stages, warps
        self.kernel, self.maxnreg = request_major, None
        self.programs = programs or s.batch  # fewer: persistent programs over the requests
        self.outs, self.lses = wl.out_buffers()
        self.qk_scale = s.head_dim ** -0.5 * 1.4426950408889634

    def tables(self) -> tuple:
        """The kernel's arguments between the pool and the outputs, and after the outputs."""
        wl = self.wl
        return (wl.kv_indices[1], wl.kv_indptr[1], wl.kv_last[1]), (wl.shape.batch,)

    def call(self, i: int):
        wl, s = self.wl, self.wl.shape
        pool, q, o, lse = wl.pools[i], wl.qs[i], self.outs[i], self.lses[i]
        before, after = self.tables()

        def run():
            self.kernel[(self.programs,)](
                q, pool, *before, o, lse, *after, q.stride(0), q.stride(1),
                pool.stride(0), pool.stride(1), pool.stride(2), pool.stride(3), o.stride(0), o.stride(1),
                lse.stride(0), self.qk_scale, s.hkv, s.hq // s.hkv, PAGE, s.head_dim, self.stages,
                num_warps=self.warps, **({"maxnreg": self.maxnreg} if self.maxnreg else {}))
        return run

    def max_error(self, o_ref: torch.Tensor) -> float:
        """Max |o - o_ref| on rotation 0, the output poisoned first."""
        self.outs[0].fill_(float("nan"))
        self.call(0)()
        return (self.outs[0].float() - o_ref.float()).abs().nan_to_num(float("inf")).max().item()


class RequestMajorT(RequestMajor):
    """``request_major_t`` over one workload's decode level (power-of-two query groups)."""

    def __init__(self, wl, stages: int = 3, warps: int = 8, programs: int | None = None):
        super().__init__(wl, stages, warps, programs)
        group = wl.shape.hq // wl.shape.hkv
        if group & (group - 1):
            raise SystemExit("probe_sm_read: request_major_t needs a power-of-two query group")
        self.kernel = request_major_t


class FlatMajor(RequestMajor):
    """``flat_major`` over one workload's decode level on ``programs`` programs, each given
    whole requests of about equal page counts."""

    def __init__(self, wl, stages: int, warps: int, programs: int):
        super().__init__(wl, stages, warps, programs)
        indptr, last_len = wl.kv_indptr[1].long().cpu(), wl.kv_last[1].long().cpu()
        total = int(indptr[-1])
        entries = torch.arange(total)
        req = torch.searchsorted(indptr, entries, right=True) - 1
        is_last = entries == indptr[req + 1] - 1
        valid = torch.where(is_last, last_len[req], PAGE)
        info = req << 7 | valid << 2 | is_last.long() << 1 | (entries == indptr[req]).long()
        # request boundaries nearest to equal shares of the pages
        cuts = torch.searchsorted(indptr, torch.arange(programs + 1) * total / programs).clamp(max=len(indptr) - 1)
        cuts[-1] = len(indptr) - 1
        self.kernel = flat_major
        self.info = info.to(torch.int32).to(wl.device)
        self.ranges = indptr[cuts].to(torch.int32).to(wl.device)

    def tables(self) -> tuple:
        return (self.wl.kv_indices[1], self.info, self.ranges), ()


class PageMajor:
    """``page_major`` over one workload's decode level on ``programs`` programs."""

    def __init__(self, wl, programs: int):
        s = wl.shape
        if s.hkv & (s.hkv - 1) or s.hq // s.hkv > 16:
            raise SystemExit("probe_sm_read: page_major needs a power-of-two Hkv and groups of <= 16")
        self.wl, self.programs = wl, programs
        indptr = wl.kv_indptr[1]
        self.total = int(indptr[-1])
        self.per = -(-self.total // programs)
        entries = torch.arange(self.total, device=indptr.device, dtype=torch.int32)
        self.entry_req = (torch.searchsorted(indptr, entries, right=True) - 1).to(torch.int32)
        self.po = torch.empty(programs + s.batch, s.hq, s.head_dim, device=wl.device)
        self.plse = torch.empty(programs + s.batch, s.hq, device=wl.device)
        self.qk_scale = s.head_dim ** -0.5 * 1.4426950408889634

    def call(self, i: int):
        wl, s = self.wl, self.wl.shape
        pool, q = wl.pools[i], wl.qs[i]

        def run():
            page_major[(self.programs,)](
                q, pool, self.entry_req, wl.kv_indices[1], wl.kv_indptr[1], wl.kv_last[1], self.po, self.plse,
                self.total, self.per, q.stride(0), q.stride(1), pool.stride(0), pool.stride(1), pool.stride(2),
                pool.stride(3), self.po.stride(0), self.po.stride(1), self.plse.stride(0), self.qk_scale,
                s.hkv, s.hq // s.hkv, PAGE, s.head_dim, 3, num_warps=8)
        return run

    def max_error(self, o_ref: torch.Tensor) -> float:
        """Max |o - o_ref| over rotation 0, the pieces merged in float64."""
        self.po.fill_(float("nan"))
        self.call(0)()
        indptr = self.wl.kv_indptr[1].tolist()
        worst = 0.0
        for r in range(self.wl.shape.batch):
            slots = [p + r for p in range(indptr[r] // self.per, (indptr[r + 1] - 1) // self.per + 1)]
            lse = self.plse[slots].double() * 0.6931471805599453
            w = torch.softmax(lse, dim=0)
            o = (w[:, :, None] * self.po[slots].double()).sum(0)
            worst = max(worst, (o - o_ref[r].double()).abs().max().item())
        return worst


def reader_calls(nbytes: int, programs: int, rotations: int, device, block: int = 16384):
    """``stream_reader`` over a fresh buffer of ``nbytes`` per rotation on ``programs`` programs."""
    n_chunks = nbytes // (2 * block)
    bufs = [torch.randn(n_chunks * block, device=device, dtype=torch.bfloat16) for _ in range(rotations)]
    out = torch.empty(programs * block, device=device)
    return [lambda b=b: stream_reader[(programs,)](b, out, n_chunks, programs, block, 4, num_warps=8) for b in bufs]


def options(ap) -> None:
    ap.add_argument("--sms", nargs="*", type=int, default=list(SMS))
    ap.add_argument("--sketches", nargs="*", default=list(SKETCHES), choices=SKETCHES,
                    help="the decode-level sketches to time (default: all)")


def main() -> None:
    from cascadeinfer import batch_decode_paged

    args, device, timer = shape_tool_start(__doc__, "probe_sm_read", ENGINE_SHAPES, 100, options)
    copy_bw, _ = measure_ceilings()
    big = 4 * 1024 ** 3  # past L2 many times: one buffer, no rotation needed
    x = torch.randn(big // 2, device=device, dtype=torch.bfloat16)
    per_sm = []
    for block in CHUNKS:
        out = torch.empty(max(args.sms) * block, device=device)
        for n in args.sms:
            t = timer([lambda n=n, block=block, out=out, x=x: stream_reader[(n,)](
                x, out, x.numel() // block, n, block, 4, num_warps=8)])
            per_sm.append({"chunk elements": block, "programs": n, "GB/s": big / t / 1e9,
                           "GB/s per SM": big / t / n / 1e9})
    del x
    print(markdown_table(per_sm, list(per_sm[0])), flush=True)

    rows = []
    for text, s, wl in shape_workloads(args.shapes, device):
        nbytes = s.decode_level_bytes
        prefix = prefix_calls(wl, 1)
        cascade = ours(wl, True)
        row = {"shape": text, "decode MB": nbytes / 1e6, "bytes floor us": nbytes / copy_bw * 1e6,
               "decode alone us": timer(level_alone_calls(wl, 1)) * 1e6, "prefix alone us": timer(prefix) * 1e6,
               "cascade us": timer([cascade.call(i) for i in range(wl.rot)]) * 1e6}
        reader = reader_calls(nbytes, BESIDE, wl.rot, device)
        row[f"reader on {BESIDE} us"] = timer(reader) * 1e6
        row[f"prefix + reader on {BESIDE} us"] = timer(beside(prefix, reader)) * 1e6
        del reader
        o_ref, _ = batch_decode_paged(wl.qs[0], wl.pools[0], wl.kv_indptr[1], wl.kv_indices[1], wl.kv_last[1])
        for n in (132, BESIDE) if "page_major" in args.sketches else ():
            pm = PageMajor(wl, n)
            row[f"page_major on {n} max err"] = pm.max_error(o_ref)
            calls = [pm.call(i) for i in range(wl.rot)]
            row[f"page_major on {n} us"] = timer(calls) * 1e6
            if n == BESIDE:
                row[f"prefix + page_major on {n} us"] = timer(beside(prefix, calls)) * 1e6
        for sketch, stages, warps, cap, programs in sketch_configs(args.sketches):
            name = f"{sketch} s{stages} w{warps}" + (f" r{cap}" if cap else "") + (f" on {programs}" if programs else "")
            kind = {"request_major": RequestMajor, "flat_major": FlatMajor, "request_major_t": RequestMajorT}[sketch]
            rm = kind(wl, stages, warps, programs)
            rm.maxnreg = cap
            row[f"{name} max err"] = rm.max_error(o_ref)
            calls = [rm.call(i) for i in range(wl.rot)]
            row[f"{name} us"] = timer(calls) * 1e6
            row[f"prefix + {name} us"] = timer(beside(prefix, calls)) * 1e6
        rows.append(row)
        print(markdown_table([row], list(row)), flush=True)
    write_json(args.json, {"environment": environment(), "copy_bytes_per_s": copy_bw, "per_sm": per_sm,
                           "rows": rows})


if __name__ == "__main__":
    main()
