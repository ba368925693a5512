"""Could a decode level fed by TMA bulk copies read HBM at full speed on fewer SMs?

    python -m benchmarks.tools.probe_tma_read [--shapes B,P,S ...] [--stages 2 4 8] [--sms 32 64 ...]
        [--beside-sms 68 ...] [--plan-splits] [--transposed] [--json PATH]

Beside the prefix level the decode level draws 36-40 GB/s per SM from HBM on the SMs the
prefix leaves it (benchmarks/NOTES.md, "Cascade" v9), so the two levels together take
the SM time of both. A decode kernel that reached the copy bandwidth on fewer SMs would
let the prefix level's programs run beside it at little cost. Before building one, this
times the bound such a kernel could reach: a Gluon kernel that reads exactly the decode
level's K and V (every request's own pages, each kv head's ``[page_size, head_dim]`` box of
each page, by TMA into a ring of ``STAGES`` shared-memory slots per program, one warp per
(request, kv head)) and computes nothing. Per shape (default: the engine's decode batch,
256 requests over a 4096-token shared prompt with 144, 256 and 384 tokens of their own),
CUDA-graph times over pools rotated past L2:

* the reader alone on the whole GPU, for each ``--stages``, and on fewer SMs (the reader
  in one persistent program per SM, ``--sms`` of them, its ring sized to take the SM; for
  each of ``--beside-sms`` also beside the prefix level);
* the Triton decode level alone (``batch_decode_paged``), the prefix level alone on the
  share's grid (one split: its (tile, kv head) pairs; with ``--plan-splits`` the split
  count of the cascade's plan), the two-level cascade (``run``);
* the prefix level with the reader on a side stream beside it, the reader standing in
  for the decode level;
* ``tma_decode``, a prototype decode kernel fed the same way (one warp per (request, kv
  head), mma.sync on 16 rows, no KV splits), checked against ``batch_decode_paged``, alone
  and beside the prefix level; with ``--transposed`` also ``tma_decode_t``, the same with
  the keys on the M side of the products and the query group on an 8-wide N side.

If the prefix level plus the reader takes about the decode level's time alone, a decode
kernel fed this way is worth building; if it takes the cascade's, it is not. Compute
capability 9.0 (Gluon TMA) only.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as ttgl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from benchmarks._common import environment, markdown_table, measure_ceilings, write_json
from benchmarks.fixtures import PAGE, level_alone_calls, ours, shape_tool_start, shape_workloads
from cascadeinfer.kernels.constants import KERNEL_LN2
from cascadeinfer.kernels.prefill_kernel_hopper import _softmax_tile

ENGINE_SHAPES = ("256,4096,144", "256,4096,256", "256,4096,384")
STAGES = (2, 4, 8)
SMS = (32, 48, 64, 68, 96, 132)
PERSISTENT_STAGES = 48  # slots of 4 KiB per persistent program: 192 KiB, one program per SM


@gluon.jit
def _page_of(page_ptr, k, pid, programs, boxes, pages_per_request, num_kv_heads):
    """The pool page of box ``k`` of this program (see ``_issue``)."""
    item = pid + (k // boxes) * programs
    return ttgl.load(page_ptr + (item // num_kv_heads) * pages_per_request + (k % boxes) // 2)


@gluon.jit
def _issue(desc, bufs, bars, slot, k, page, pid, programs, boxes, num_kv_heads,
           PAGE_SIZE: ttgl.constexpr, HEAD_DIM: ttgl.constexpr):
    """Box ``k`` of this program into ``slot``: its item ``pid + (k // boxes) * programs``
    (request ``item // num_kv_heads``, kv head ``item % num_kv_heads``), then the K (even)
    or V (odd) rows of that request's page ``page`` (its ``(k % boxes) // 2``-th)."""
    item = pid + (k // boxes) * programs
    b = k % boxes
    # The pool [pages, 2, page_size, kv heads, head_dim] as rows of kv heads x head_dim:
    # page p's K rows start at row 2 * p * page_size, its V rows page_size later.
    mbarrier.expect(bars.index(slot), PAGE_SIZE * HEAD_DIM * 2)
    tma.async_copy_global_to_shared(desc, [(page * 2 + b % 2) * PAGE_SIZE, (item % num_kv_heads) * HEAD_DIM],
                                    bars.index(slot), bufs.index(slot))


@gluon.jit
def tma_reader(desc, page_ptr, pages_per_request, num_kv_heads, work_items, programs,
               PAGE_SIZE: ttgl.constexpr, HEAD_DIM: ttgl.constexpr, STAGES: ttgl.constexpr):
    """Work item ``w`` = (request ``w // num_kv_heads``, kv head ``w % num_kv_heads``): the
    K and V boxes of its pages. Program ``p`` takes items ``p, p + programs, ..`` as one
    stream of boxes, ``STAGES`` in flight (a box is re-issued into its slot as soon as it
    landed: nothing reads it). bf16 pools."""
    layout: ttgl.constexpr = ttgl.NVMMASharedLayout.get_default_for([PAGE_SIZE, HEAD_DIM], ttgl.bfloat16)
    bufs = ttgl.allocate_shared_memory(ttgl.bfloat16, [STAGES, PAGE_SIZE, HEAD_DIM], layout)
    bars = ttgl.allocate_shared_memory(ttgl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in ttgl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    fence_async_shared()
    pid = ttgl.program_id(0)
    boxes = 2 * pages_per_request
    total = ttgl.cdiv(work_items - pid, programs) * boxes
    for i in ttgl.static_range(STAGES):
        if i < total:
            page = _page_of(page_ptr, i, pid, programs, boxes, pages_per_request, num_kv_heads)
            _issue(desc, bufs, bars, i, i, page, pid, programs, boxes, num_kv_heads, PAGE_SIZE, HEAD_DIM)
    # The page of the next box to issue is loaded one iteration ahead, so its latency
    # passes during the barrier wait instead of before each issue.
    nxt = _page_of(page_ptr, ttgl.minimum(STAGES, total - 1), pid, programs, boxes, pages_per_request, num_kv_heads)
    for k in range(total):
        slot = k % STAGES
        mbarrier.wait(bars.index(slot), (k // STAGES) & 1)
        if k + STAGES < total:
            _issue(desc, bufs, bars, slot, k + STAGES, nxt, pid, programs, boxes, num_kv_heads, PAGE_SIZE, HEAD_DIM)
            nxt = _page_of(page_ptr, ttgl.minimum(k + STAGES + 1, total - 1), pid, programs, boxes,
                           pages_per_request, num_kv_heads)


@gluon.jit
def _issue_page(desc, k_bufs, v_bufs, bars, slot, page, head_col, PAGE_SIZE: ttgl.constexpr,
                HEAD_DIM: ttgl.constexpr):
    """Pool page ``page``'s K and V boxes of one kv head into ``slot`` (one barrier)."""
    mbarrier.expect(bars.index(slot), 2 * PAGE_SIZE * HEAD_DIM * 2)
    tma.async_copy_global_to_shared(desc, [page * 2 * PAGE_SIZE, head_col], bars.index(slot), k_bufs.index(slot))
    tma.async_copy_global_to_shared(desc, [(page * 2 + 1) * PAGE_SIZE, head_col], bars.index(slot),
                                    v_bufs.index(slot))


@gluon.jit
def _request_ring(desc, kv_indices_ptr, kv_indptr_ptr, kv_last_ptr, request, head_col,
                  PAGE_SIZE: ttgl.constexpr, HEAD_DIM: ttgl.constexpr, STAGES: ttgl.constexpr):
    """One (request, kv head) program's ring of ``STAGES`` page slots (K and V, one barrier
    each), with the request's first pages issued into it. Returns ``(k_bufs, v_bufs, bars,
    page_ptr, n_pages, last_len)``."""
    sl: ttgl.constexpr = ttgl.NVMMASharedLayout.get_default_for([PAGE_SIZE, HEAD_DIM], ttgl.bfloat16)
    k_bufs = ttgl.allocate_shared_memory(ttgl.bfloat16, [STAGES, PAGE_SIZE, HEAD_DIM], sl)
    v_bufs = ttgl.allocate_shared_memory(ttgl.bfloat16, [STAGES, PAGE_SIZE, HEAD_DIM], sl)
    bars = ttgl.allocate_shared_memory(ttgl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in ttgl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    fence_async_shared()
    kv_start = ttgl.load(kv_indptr_ptr + request)
    n_pages = ttgl.load(kv_indptr_ptr + request + 1) - kv_start
    last_len = ttgl.load(kv_last_ptr + request)
    page_ptr = kv_indices_ptr + kv_start
    for i in ttgl.static_range(STAGES):
        if i < n_pages:
            _issue_page(desc, k_bufs, v_bufs, bars, i, ttgl.load(page_ptr + i), head_col, PAGE_SIZE, HEAD_DIM)
    return k_bufs, v_bufs, bars, page_ptr, n_pages, last_len


@gluon.jit
def tma_decode(q_ptr, desc, kv_indices_ptr, kv_indptr_ptr, kv_last_ptr, o_ptr, lse_ptr,
               stride_qt, stride_qh, stride_ot, stride_oh, stride_lt, qk_scale,
               GROUP: ttgl.constexpr, PAGE_SIZE: ttgl.constexpr, HEAD_DIM: ttgl.constexpr,
               STAGES: ttgl.constexpr):
    """Decode of one request's ``GROUP`` query heads of one kv head (program (request, kv
    head)) over its pages, one warp: each page's K and V boxes by TMA into a ring of
    ``STAGES`` slots, ``S = Q Kᵀ`` and ``O += P V`` by mma.sync on 16 rows (``GROUP``
    real), the online softmax between. The last page's keys past ``kv_last_page_len`` are
    masked and its V rows zeroed. A prototype for this probe: bf16, no KV splits."""
    request = ttgl.program_id(0)
    head = ttgl.program_id(1)
    mma_l: ttgl.constexpr = ttgl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    a_l: ttgl.constexpr = ttgl.DotOperandLayout(operand_index=0, parent=mma_l, k_width=2)
    b_l: ttgl.constexpr = ttgl.DotOperandLayout(operand_index=1, parent=mma_l, k_width=2)
    ld: ttgl.constexpr = ttgl.BlockedLayout([1, 8], [2, 16], [1, 1], [1, 0])
    head_col = head * HEAD_DIM
    k_bufs, v_bufs, bars, page_ptr, n_pages, last_len = _request_ring(
        desc, kv_indices_ptr, kv_indptr_ptr, kv_last_ptr, request, head_col, PAGE_SIZE, HEAD_DIM, STAGES)

    rows = ttgl.arange(0, 16, layout=ttgl.SliceLayout(1, ld))
    cols = ttgl.arange(0, HEAD_DIM, layout=ttgl.SliceLayout(0, ld))
    q_off = request.to(ttgl.int64) * stride_qt + (head * GROUP + rows).to(ttgl.int64) * stride_qh
    q = ttgl.load(q_ptr + (ttgl.expand_dims(q_off, 1) + ttgl.expand_dims(cols, 0)),
                  mask=ttgl.expand_dims(rows < GROUP, 1), other=0.0)
    q = ttgl.convert_layout(q, a_l)
    m_i = ttgl.full([16], float("-inf"), ttgl.float32, layout=ttgl.SliceLayout(1, mma_l))
    l_i = ttgl.full([16], 0.0, ttgl.float32, layout=ttgl.SliceLayout(1, mma_l))
    acc = ttgl.zeros([16, HEAD_DIM], ttgl.float32, layout=mma_l)
    s_zero = ttgl.zeros([16, PAGE_SIZE], ttgl.float32, layout=mma_l)
    keys = ttgl.arange(0, PAGE_SIZE, layout=ttgl.SliceLayout(0, mma_l))
    for j in range(n_pages - 1):  # every page but the last: whole
        slot = j % STAGES
        # The refill's page id is loaded before the wait, so its latency passes there.
        refill = ttgl.load(page_ptr + ttgl.minimum(j + STAGES, n_pages - 1))
        mbarrier.wait(bars.index(slot), (j // STAGES) & 1)
        k = k_bufs.index(slot).permute((1, 0)).load(b_l)
        v = v_bufs.index(slot).load(b_l)
        qk = mma_v2(q, k, s_zero)
        p, alpha, l_i, m_i = _softmax_tile(qk, l_i, m_i, keys, 0, PAGE_SIZE, qk_scale, False)
        acc = acc * ttgl.expand_dims(alpha, 1)
        acc = mma_v2(ttgl.convert_layout(p.to(ttgl.bfloat16), a_l), v, acc)
        if j + STAGES < n_pages:  # both products have read the slot's K and V: refill it
            _issue_page(desc, k_bufs, v_bufs, bars, slot, refill, head_col, PAGE_SIZE, HEAD_DIM)
    if n_pages > 0:  # the last page: keys past last_len masked, their V rows zeroed
        j = n_pages - 1
        slot = j % STAGES
        mbarrier.wait(bars.index(slot), (j // STAGES) & 1)
        k = k_bufs.index(slot).permute((1, 0)).load(b_l)
        v_rows = v_bufs.index(slot).load(ld)
        v_rows = ttgl.where(ttgl.expand_dims(ttgl.arange(0, PAGE_SIZE, layout=ttgl.SliceLayout(1, ld)) < last_len, 1),
                            v_rows, 0.0)
        qk = mma_v2(q, k, s_zero)
        p, alpha, l_i, m_i = _softmax_tile(qk, l_i, m_i, keys, 0, last_len, qk_scale, True)
        acc = acc * ttgl.expand_dims(alpha, 1)
        acc = mma_v2(ttgl.convert_layout(p.to(ttgl.bfloat16), a_l), ttgl.convert_layout(v_rows, b_l), acc)

    l_safe = ttgl.where(l_i == 0.0, 1.0, l_i)
    o = acc / ttgl.expand_dims(l_safe, 1)
    lse = ttgl.where(l_i == 0.0, float("-inf"), (m_i + ttgl.log2(l_safe)) * KERNEL_LN2)
    o = ttgl.where(ttgl.expand_dims(lse == float("-inf"), 1), 0.0, o)
    r = ttgl.arange(0, 16, layout=ttgl.SliceLayout(1, mma_l))
    d = ttgl.arange(0, HEAD_DIM, layout=ttgl.SliceLayout(0, mma_l))
    o_off = request.to(ttgl.int64) * stride_ot + (head * GROUP + r).to(ttgl.int64) * stride_oh
    ttgl.store(o_ptr + (ttgl.expand_dims(o_off, 1) + ttgl.expand_dims(d, 0)), o.to(ttgl.bfloat16),
               mask=ttgl.expand_dims(r < GROUP, 1))
    ttgl.store(lse_ptr + request.to(ttgl.int64) * stride_lt + head * GROUP + r, lse, mask=r < GROUP)


@gluon.jit
def tma_decode_t(q_ptr, desc, kv_indices_ptr, kv_indptr_ptr, kv_last_ptr, o_ptr, lse_ptr,
                 stride_qt, stride_qh, stride_ot, stride_oh, stride_lt, qk_scale,
                 GROUP: ttgl.constexpr, PAGE_SIZE: ttgl.constexpr, HEAD_DIM: ttgl.constexpr,
                 STAGES: ttgl.constexpr):
    """``tma_decode`` transposed: keys on the M side of ``mma.sync`` and the query group on
    an 8-wide N side (half the padding of 16 rows for groups of 4, a ``[HEAD_DIM, 8]``
    float32 output: a quarter of the registers). ``Sᵀ = K Qᵀ`` (``[PAGE_SIZE, 8]``), the
    softmax down the keys, ``Oᵀ += Vᵀ Pᵀ``. Groups of at most 8."""
    request = ttgl.program_id(0)
    head = ttgl.program_id(1)
    mma_l: ttgl.constexpr = ttgl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    a_l: ttgl.constexpr = ttgl.DotOperandLayout(operand_index=0, parent=mma_l, k_width=2)
    b_l: ttgl.constexpr = ttgl.DotOperandLayout(operand_index=1, parent=mma_l, k_width=2)
    ld: ttgl.constexpr = ttgl.BlockedLayout([8, 1], [16, 2], [1, 1], [0, 1])
    head_col = head * HEAD_DIM
    k_bufs, v_bufs, bars, page_ptr, n_pages, last_len = _request_ring(
        desc, kv_indices_ptr, kv_indptr_ptr, kv_last_ptr, request, head_col, PAGE_SIZE, HEAD_DIM, STAGES)

    # Qᵀ: [HEAD_DIM, 8], column n the query head head * GROUP + n (zeros past GROUP).
    dq = ttgl.arange(0, HEAD_DIM, layout=ttgl.SliceLayout(1, ld))
    nq = ttgl.arange(0, 8, layout=ttgl.SliceLayout(0, ld))
    q_off = request.to(ttgl.int64) * stride_qt + (head * GROUP + nq).to(ttgl.int64) * stride_qh
    qt = ttgl.load(q_ptr + (ttgl.expand_dims(dq, 1) + ttgl.expand_dims(q_off, 0)),
                   mask=ttgl.expand_dims(nq < GROUP, 0), other=0.0)
    qt = ttgl.convert_layout(qt, b_l)
    m_i = ttgl.full([8], float("-inf"), ttgl.float32, layout=ttgl.SliceLayout(0, mma_l))
    l_i = ttgl.full([8], 0.0, ttgl.float32, layout=ttgl.SliceLayout(0, mma_l))
    acc = ttgl.zeros([HEAD_DIM, 8], ttgl.float32, layout=mma_l)
    s_zero = ttgl.zeros([PAGE_SIZE, 8], ttgl.float32, layout=mma_l)
    keys = ttgl.arange(0, PAGE_SIZE, layout=ttgl.SliceLayout(1, mma_l))
    for j in range(n_pages):
        slot = j % STAGES
        refill = ttgl.load(page_ptr + ttgl.minimum(j + STAGES, n_pages - 1))
        mbarrier.wait(bars.index(slot), (j // STAGES) & 1)
        k = k_bufs.index(slot).load(a_l)
        vt = v_bufs.index(slot).permute((1, 0)).load(a_l)
        st = mma_v2(k, qt, s_zero)
        valid = ttgl.where(j == n_pages - 1, last_len, PAGE_SIZE)
        st = ttgl.where(ttgl.expand_dims(keys < valid, 1), st * qk_scale, float("-inf"))
        m_new = ttgl.maximum(m_i, ttgl.max(st, axis=0))
        p = ttgl.exp2(st - ttgl.expand_dims(m_new, 0))
        alpha = ttgl.exp2(m_i - m_new)
        l_i = l_i * alpha + ttgl.sum(p, axis=0)
        m_i = m_new
        acc = acc * ttgl.expand_dims(alpha, 0)
        acc = mma_v2(vt, ttgl.convert_layout(p.to(ttgl.bfloat16), b_l), acc)
        if j + STAGES < n_pages:  # both products have read the slot's K and V: refill it
            _issue_page(desc, k_bufs, v_bufs, bars, slot, refill, head_col, PAGE_SIZE, HEAD_DIM)

    l_safe = ttgl.where(l_i == 0.0, 1.0, l_i)
    o = acc / ttgl.expand_dims(l_safe, 0)
    lse = ttgl.where(l_i == 0.0, float("-inf"), (m_i + ttgl.log2(l_safe)) * KERNEL_LN2)
    d = ttgl.arange(0, HEAD_DIM, layout=ttgl.SliceLayout(1, mma_l))
    n = ttgl.arange(0, 8, layout=ttgl.SliceLayout(0, mma_l))
    o_off = request.to(ttgl.int64) * stride_ot + (head * GROUP + n).to(ttgl.int64) * stride_oh
    ttgl.store(o_ptr + (ttgl.expand_dims(d, 1) + ttgl.expand_dims(o_off, 0)), o.to(ttgl.bfloat16),
               mask=ttgl.expand_dims(n < GROUP, 0))
    ttgl.store(lse_ptr + request.to(ttgl.int64) * stride_lt + head * GROUP + n, lse, mask=n < GROUP)


def page_descriptors(wl, pools=None, hnd: bool = False) -> list:
    """A TMA descriptor of ``[PAGE, head_dim]`` bf16 boxes per rotation's pool: NHD pools
    (the workload's, ``[pages, 2, PAGE, Hkv, D]``) as rows of ``Hkv * D`` elements, HND
    ones (``[pages, 2, Hkv, PAGE, D]``, with ``hnd``) as rows of ``D``."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: PLC0415

    s = wl.shape
    layout = ttgl.NVMMASharedLayout.get_default_for([PAGE, s.head_dim], ttgl.bfloat16)
    descs = []
    for pool in pools if pools is not None else wl.pools:
        rows = pool.view(-1, s.head_dim if hnd else s.hkv * s.head_dim)
        descs.append(TensorDescriptor(rows, list(rows.shape), [rows.shape[1], 1], [PAGE, s.head_dim], layout))
    return descs


class Reader:
    """The decode level's pages of one workload, read by ``tma_reader`` (one rotation's
    pool each call)."""

    def __init__(self, wl, stages: int, programs: int | None):
        s = wl.shape
        self.stages = stages
        self.items = s.batch * s.hkv
        self.programs = programs or self.items
        self.pages_per_request = s.suffix_pages
        self.hkv = s.hkv
        self.pages = wl.kv_indices[1]
        self.descs = page_descriptors(wl)
        self.head_dim = s.head_dim

    def call(self, i: int):
        def run():
            tma_reader[(self.programs,)](self.descs[i], self.pages, self.pages_per_request, self.hkv, self.items,
                                         self.programs, PAGE, self.head_dim, self.stages, num_warps=1)
        return run


class Decoder:
    """The decode level of one workload by ``tma_decode`` (one rotation's pool each call)."""

    def __init__(self, wl, stages: int, reader: Reader, transposed: bool = False):
        s = wl.shape
        self.wl, self.stages, self.descs = wl, stages, reader.descs
        self.kernel = tma_decode_t if transposed else tma_decode
        self.group = s.hq // s.hkv
        self.outs, self.lses = wl.out_buffers()
        self.qk_scale = s.head_dim ** -0.5 * 1.4426950408889634

    def call(self, i: int):
        wl, s = self.wl, self.wl.shape

        def run():
            q, o, lse = wl.qs[i], self.outs[i], self.lses[i]
            self.kernel[(s.batch, s.hkv)](q, self.descs[i], wl.kv_indices[1], wl.kv_indptr[1], wl.kv_last[1], o, lse,
                                          q.stride(0), q.stride(1), o.stride(0), o.stride(1), lse.stride(0),
                                          self.qk_scale, self.group, PAGE, s.head_dim, self.stages, num_warps=1)
        return run

    def check(self) -> float:
        """Max |o - o_ref| against ``batch_decode_paged`` on rotation 0 (raises past 2e-2,
        or if any LSE is off by more than 1e-3)."""
        from cascadeinfer import batch_decode_paged  # noqa: PLC0415

        wl = self.wl
        o_ref, lse_ref = batch_decode_paged(wl.qs[0], wl.pools[0], wl.kv_indptr[1], wl.kv_indices[1], wl.kv_last[1],
                                            validate=True)
        self.call(0)()
        torch.cuda.synchronize()
        err = (self.outs[0].float() - o_ref.float()).abs().max().item()
        lse_err = (self.lses[0] - lse_ref).abs().max().item()
        if not err <= 2e-2 or not lse_err <= 1e-3:
            raise AssertionError(f"tma_decode: max |o error| {err}, max |lse error| {lse_err}")
        return err


def prefix_calls(wl, splits: int):
    """The prefix level alone in ``splits`` KV splits (1: the share's grid at the engine's
    shapes, one program per (tile, kv head))."""
    from cascadeinfer import batch_prefill_paged  # noqa: PLC0415

    outs, lses = wl.out_buffers()
    return [lambda i=i: batch_prefill_paged(
        wl.qs[i], wl.qo_indptr[0], wl.pools[i], wl.kv_indptr[0], wl.kv_indices[0], wl.kv_last[0],
        out=outs[i], lse=lses[i], validate=False, num_splits=splits) for i in range(wl.rot)]


def plan_splits(wl) -> int:
    """The prefix level's split count in the public cascade's plan of this workload."""
    from cascadeinfer.cascade.multi_level import MultiLevelCascadeAttention  # noqa: PLC0415

    s = wl.shape
    attn = MultiLevelCascadeAttention(2, device=wl.device)
    attn.plan(*wl.tables(), s.hq, s.hkv, s.head_dim, PAGE, num_pages=wl.num_pages, dtype=torch.bfloat16,
              use_cascade=True)
    return attn._levels[-2].num_splits


def beside(main_calls, side_calls):
    """Each rotation's main call with the side call on a second stream, joined."""
    side = torch.cuda.Stream()

    def both(i):
        def run():
            side.wait_stream(torch.cuda.current_stream())
            main_calls[i]()
            with torch.cuda.stream(side):
                side_calls[i]()
            torch.cuda.current_stream().wait_stream(side)
        return run
    return [both(i) for i in range(len(main_calls))]


def options(ap) -> None:
    ap.add_argument("--stages", nargs="*", type=int, default=list(STAGES))
    ap.add_argument("--sms", nargs="*", type=int, default=list(SMS))
    ap.add_argument("--beside-sms", nargs="*", type=int, default=[68])
    ap.add_argument("--transposed", action="store_true", help="also tma_decode_t (keys on the M side)")
    ap.add_argument("--plan-splits", action="store_true",
                    help="the prefix level in the cascade plan's split count (default: one split)")


def main() -> None:
    args, device, timer = shape_tool_start(__doc__, "probe_tma_read", ENGINE_SHAPES, 100, options)
    if torch.cuda.get_device_capability(device) != (9, 0):
        raise SystemExit("probe_tma_read: Gluon TMA needs compute capability 9.0")
    copy_bw, _ = measure_ceilings()
    rows = []
    for text, s, wl in shape_workloads(args.shapes, device):
        decode_bytes = s.decode_level_bytes
        row = {"shape": text, "decode bytes MB": decode_bytes / 1e6, "bytes floor us": decode_bytes / copy_bw * 1e6}
        row["decode alone us"] = timer(level_alone_calls(wl, 1)) * 1e6
        splits = plan_splits(wl) if args.plan_splits else 1
        row["prefix splits"] = splits
        prefix = prefix_calls(wl, splits)
        row["prefix alone us"] = timer(prefix) * 1e6
        cascade = ours(wl, True)
        row["cascade us"] = timer([cascade.call(i) for i in range(wl.rot)]) * 1e6
        for st in args.stages:
            rd = Reader(wl, st, None)
            calls = [rd.call(i) for i in range(wl.rot)]
            row[f"reader s{st} us"] = timer(calls) * 1e6
            row[f"prefix + reader s{st} us"] = timer(beside(prefix, calls)) * 1e6
            dec = Decoder(wl, st, rd)
            row[f"tma decode s{st} max err"] = dec.check()
            calls = [dec.call(i) for i in range(wl.rot)]
            row[f"tma decode s{st} us"] = timer(calls) * 1e6
            row[f"prefix + tma decode s{st} us"] = timer(beside(prefix, calls)) * 1e6
            if args.transposed:
                dec = Decoder(wl, st, rd, transposed=True)
                row[f"tma decode T s{st} max err"] = dec.check()
                calls = [dec.call(i) for i in range(wl.rot)]
                row[f"tma decode T s{st} us"] = timer(calls) * 1e6
                row[f"prefix + tma decode T s{st} us"] = timer(beside(prefix, calls)) * 1e6
        for n in args.sms:
            rd = Reader(wl, PERSISTENT_STAGES, n)
            calls = [rd.call(i) for i in range(wl.rot)]
            t = timer(calls)
            row[f"reader on {n} SMs GB/s per SM"] = decode_bytes / t / n / 1e9
            if n in args.beside_sms:
                row[f"prefix + reader on {n} SMs us"] = timer(beside(prefix, calls)) * 1e6
        rows.append(row)
        print(markdown_table([row], list(row)), flush=True)
    write_json(args.json, dict(environment=environment(), copy_bytes_per_s=copy_bw, rows=rows))


if __name__ == "__main__":
    main()
