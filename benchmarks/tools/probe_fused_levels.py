"""Could the cascade's two levels share each SM instead of splitting the SMs between them?

    python -m benchmarks.tools.probe_fused_levels [--shapes B,P,S ...] [--configs N,PS,DW,DS ...]
        [--beside N [--beside-only]] [--json PATH]

Beside the prefix level the decode level reads its pages through the SMs the prefix
leaves, at the rate per SM it gets anywhere, so the cascade costs the SM time of both
levels (benchmarks/NOTES.md, "Cascade" v9 and v13). This probes the other arrangement:
one Gluon kernel, ``fused_levels``, one program per 64-row prefix tile and kv head, each
program running both levels at once in its SM:

* its default warpgroup computes the prefix tile (a single shared group, one split):
  ``S = Q Kᵀ`` and ``O += P V`` by ``wgmma``, the online softmax in registers, the next
  tile's scores issued before this tile's softmax; K and V by TMA into ``PS`` slots of
  ``N`` keys, issued by the warpgroup itself (the compact form of NOTES "Prefix" v6);
* ``DW`` single-warp partitions beside it each take every ``DW``-th of the program's share
  of the decode level's (request, kv head) items, their pages by TMA into their own ring
  of ``DS`` slots (one page's K and V a slot, one stream across items), ``mma.sync`` on 16
  rows of which the query group's are real.

The two levels' states are merged by ``merge_state`` afterwards. Per shape (default: the
engine's decode batch, 256 requests over a 4096-token shared prompt with 144, 256 and 384
tokens of their own) and config, CUDA-graph times over pools rotated past L2: the public
cascade; the fused kernel with both levels, with the prefix level only and with the decode
level only (one program per SM whichever runs: the register file), with the merge, and with
the decode level's page ids all among 64 pages (its work and L2 traffic kept, its HBM reads
gone), alone and beside the prefix level. With ``--beside N``, the decode part alone as a
persistent kernel of its own on ``N`` programs (its items spread over them), by itself and
on a side stream beside the public prefix level on one split (64 programs at these shapes). The result is checked against the public cascade's. If both levels
together take about the longer one alone, the SM can be shared and a fused cascade
kernel is worth building. A probe: bf16, head_dim 128, page size 16, whole prefix tiles,
the same number of pages per request. Compute capability 9.0 only.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as ttgl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy,
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from benchmarks._common import environment, markdown_table, measure_ceilings, write_json
from benchmarks.fixtures import PAGE, level_alone_calls, ours, shape_tool_start, shape_workloads
from cascadeinfer.kernels.constants import KERNEL_LN2
from cascadeinfer.kernels.prefill_kernel_hopper import _softmax_tile

ENGINE_SHAPES = ("256,4096,144", "256,4096,256", "256,4096,384")
# (prefix key tile N, prefix slots PS, decode warps DW, decode slots per warp DS): 208 KiB of
# shared memory each at head_dim 128 (Q 16 KiB, a prefix slot 2N x 256 B, a decode slot 8 KiB).
CONFIGS = ("64,3,4,3", "64,4,4,2", "64,2,4,4", "64,4,2,4")
DECODE_REGS = 192


@gluon.jit
def _prefix_kv(t, desc, page_ptr, k_bufs, v_bufs, ready, head_col, PAGE_SIZE: ttgl.constexpr):
    """Prefix key tile ``t``'s K and V into slot ``t % PS``, one ``[PAGE_SIZE, HEAD_DIM]`` box
    per page (the pool as rows: page ``p``'s K at row ``2 p PAGE_SIZE``, V ``PAGE_SIZE``
    rows later), both completing ``ready[slot]``."""
    STAGES: ttgl.constexpr = k_bufs.shape[0]
    BLOCK_N: ttgl.constexpr = k_bufs.shape[1]
    HEAD_DIM: ttgl.constexpr = k_bufs.shape[2]
    s = t % STAGES
    mbarrier.expect(ready.index(s), 2 * BLOCK_N * HEAD_DIM * 2)
    for j in ttgl.static_range(BLOCK_N // PAGE_SIZE):
        page = ttgl.load(page_ptr + t * (BLOCK_N // PAGE_SIZE) + j)
        tma.async_copy_global_to_shared(desc, [page * 2 * PAGE_SIZE, head_col], ready.index(s),
                                        k_bufs.index(s).slice(j * PAGE_SIZE, PAGE_SIZE))
        tma.async_copy_global_to_shared(desc, [page * 2 * PAGE_SIZE + PAGE_SIZE, head_col], ready.index(s),
                                        v_bufs.index(s).slice(j * PAGE_SIZE, PAGE_SIZE))


@gluon.jit
def _prefix_step(t, q_smem, k_bufs, v_bufs, ready, acc, qk, l_i, m_i, s_zero, keys, qk_scale,
                 p_layout: ttgl.constexpr, NEXT: ttgl.constexpr):
    """Tile ``t``: (NEXT) tile ``t + 1``'s scores issued, tile ``t``'s softmax while they
    run, then its P·V, both waited. Returns ``(acc, qk_next, l, m)``."""
    STAGES: ttgl.constexpr = k_bufs.shape[0]
    BLOCK_N: ttgl.constexpr = k_bufs.shape[1]
    if NEXT:
        kn = (t + 1) % STAGES
        mbarrier.wait(ready.index(kn), ((t + 1) // STAGES) & 1)
        qk_next = warpgroup_mma(q_smem, k_bufs.index(kn).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    p, alpha, l_i, m_i = _softmax_tile(qk, l_i, m_i, keys, 0, BLOCK_N, qk_scale, False)
    acc = acc * ttgl.expand_dims(ttgl.convert_layout(alpha, ttgl.SliceLayout(1, acc.type.layout)), 1)
    p16 = ttgl.convert_layout(p.to(k_bufs.dtype), p_layout)
    acc = warpgroup_mma(p16, v_bufs.index(t % STAGES), acc, is_async=True)  # V landed with K
    if NEXT:
        qk_next, acc = warpgroup_mma_wait(0, deps=(qk_next, acc))
    else:
        acc = warpgroup_mma_wait(0, deps=(acc,))
        qk_next = qk
    return acc, qk_next, l_i, m_i


@gluon.jit
def _prefix_part(q_ptr, desc, page_ptr, o_ptr, lse_ptr, q_smem, k_bufs, v_bufs, q_bar, ready,
                 pid, qo_len, n_tiles, num_kv_heads, stride_qt, stride_qh, stride_ot, stride_oh, stride_lt,
                 qk_scale, GROUP: ttgl.constexpr, PAGE_SIZE: ttgl.constexpr, ENABLED: ttgl.constexpr):
    """Prefix tile ``pid // num_kv_heads`` (64 packed rows) of kv head ``pid % num_kv_heads``
    over all ``n_tiles`` key tiles of the shared pages; one warpgroup."""
    if ENABLED:
        STAGES: ttgl.constexpr = k_bufs.shape[0]
        BLOCK_N: ttgl.constexpr = k_bufs.shape[1]
        HEAD_DIM: ttgl.constexpr = k_bufs.shape[2]
        row0 = (pid // num_kv_heads) * 64
        kv_head = pid % num_kv_heads
        head_col = kv_head * HEAD_DIM
        for i in ttgl.static_range(STAGES):
            if i < n_tiles:
                _prefix_kv(i, desc, page_ptr, k_bufs, v_bufs, ready, head_col, PAGE_SIZE)
        # Q's 64 packed rows (row r: token r // GROUP, head r % GROUP of the group) by cp.async.
        ld: ttgl.constexpr = ttgl.BlockedLayout([1, 8], [32 // (HEAD_DIM // 8), HEAD_DIM // 8], [4, 1], [1, 0])
        r = row0 + ttgl.arange(0, 64, layout=ttgl.SliceLayout(1, ld))
        cols = ttgl.expand_dims(ttgl.arange(0, HEAD_DIM, layout=ttgl.SliceLayout(0, ld)), 0)
        q_off = (r // GROUP).to(ttgl.int64) * stride_qt + (kv_head * GROUP + r % GROUP).to(ttgl.int64) * stride_qh
        q_off = ttgl.multiple_of(q_off, 8)  # 16-byte copies: the host checks the strides
        async_copy.async_copy_global_to_shared(q_smem, q_ptr + (ttgl.expand_dims(q_off, 1) + cols),
                                               mask=ttgl.expand_dims(r < qo_len * GROUP, 1))
        async_copy.commit_group()
        async_copy.wait_group(0)
        mbarrier.arrive(q_bar)  # after the warpgroup's barrier: every thread's copies landed
        mbarrier.wait(q_bar, 0)
        fence_async_shared()  # the copies' generic-proxy writes, before wgmma reads them

        s_l: ttgl.constexpr = ttgl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                          instr_shape=[16, BLOCK_N, 16])
        o_l: ttgl.constexpr = ttgl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                          instr_shape=[16, HEAD_DIM, 16])
        p_l: ttgl.constexpr = ttgl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2)
        m_i = ttgl.full([64], float("-inf"), ttgl.float32, layout=ttgl.SliceLayout(1, s_l))
        l_i = ttgl.full([64], 0.0, ttgl.float32, layout=ttgl.SliceLayout(1, s_l))
        acc = ttgl.zeros([64, HEAD_DIM], ttgl.float32, layout=o_l)
        s_zero = ttgl.zeros([64, BLOCK_N], ttgl.float32, layout=s_l)
        keys = ttgl.arange(0, BLOCK_N, layout=ttgl.SliceLayout(0, s_l))
        mbarrier.wait(ready.index(0), 0)
        qk = warpgroup_mma(q_smem, k_bufs.index(0).permute((1, 0)), s_zero, use_acc=False)
        # After step t, tile t's K (scores waited a step earlier) and V (waited in step t)
        # are read: its slot takes tile t + STAGES.
        for t in range(n_tiles - 1):
            acc, qk, l_i, m_i = _prefix_step(t, q_smem, k_bufs, v_bufs, ready, acc, qk, l_i, m_i, s_zero, keys,
                                             qk_scale, p_l, True)
            if t + STAGES < n_tiles:
                _prefix_kv(t + STAGES, desc, page_ptr, k_bufs, v_bufs, ready, head_col, PAGE_SIZE)
        acc, qk, l_i, m_i = _prefix_step(n_tiles - 1, q_smem, k_bufs, v_bufs, ready, acc, qk, l_i, m_i, s_zero,
                                         keys, qk_scale, p_l, False)

        row_o: ttgl.constexpr = ttgl.SliceLayout(1, o_l)
        l_o = ttgl.convert_layout(l_i, row_o)
        l_safe = ttgl.where(l_o == 0.0, 1.0, l_o)
        o = acc / ttgl.expand_dims(l_safe, 1)
        lse = (ttgl.convert_layout(m_i, row_o) + ttgl.log2(l_safe)) * KERNEL_LN2
        ro = row0 + ttgl.arange(0, 64, layout=row_o)
        ok = ro < qo_len * GROUP
        tok = (ro // GROUP).to(ttgl.int64)
        head = (kv_head * GROUP + ro % GROUP).to(ttgl.int64)
        d = ttgl.arange(0, HEAD_DIM, layout=ttgl.SliceLayout(0, o_l))
        o_off = tok * stride_ot + head * stride_oh
        ttgl.store(o_ptr + (ttgl.expand_dims(o_off, 1) + ttgl.expand_dims(d, 0)), o.to(o_ptr.dtype.element_ty),
                   mask=ttgl.expand_dims(ok, 1))
        ttgl.store(lse_ptr + tok * stride_lt + head, lse, mask=ok)


@gluon.jit
def _decode_issue(g, desc, page_ptr, dk_bufs, dv_bufs, dbars, base, first, stride, pages_per_request, num_kv_heads,
                  PAGE_SIZE: ttgl.constexpr, HEAD_DIM: ttgl.constexpr, SLOTS: ttgl.constexpr):
    """Box pair ``g`` of this warp's stream (item ``first + (g // pages) * stride``, its
    page ``g % pages``) into slot ``base + g % SLOTS``."""
    item = first + (g // pages_per_request) * stride
    page = ttgl.load(page_ptr + (item // num_kv_heads) * pages_per_request + g % pages_per_request)
    col = (item % num_kv_heads) * HEAD_DIM
    s = base + g % SLOTS
    mbarrier.expect(dbars.index(s), 2 * PAGE_SIZE * HEAD_DIM * 2)
    tma.async_copy_global_to_shared(desc, [page * 2 * PAGE_SIZE, col], dbars.index(s), dk_bufs.index(s))
    tma.async_copy_global_to_shared(desc, [page * 2 * PAGE_SIZE + PAGE_SIZE, col], dbars.index(s), dv_bufs.index(s))


@gluon.jit
def _decode_part(q_ptr, desc, page_ptr, last_ptr, o_ptr, lse_ptr, dk_bufs, dv_bufs, dbars,
                 pid, programs, n_items, pages_per_request, num_kv_heads,
                 stride_qt, stride_qh, stride_ot, stride_oh, stride_lt, qk_scale,
                 W: ttgl.constexpr, WARPS: ttgl.constexpr, GROUP: ttgl.constexpr, PAGE_SIZE: ttgl.constexpr,
                 ENABLED: ttgl.constexpr):
    """Decode items ``pid * WARPS + W``, then every ``programs * WARPS``-th after it: one
    request's ``GROUP`` query heads of one kv head over its pages, one warp."""
    if ENABLED:
        HEAD_DIM: ttgl.constexpr = dk_bufs.shape[2]
        SLOTS: ttgl.constexpr = dk_bufs.shape[0] // WARPS
        base = W * SLOTS
        first = pid * WARPS + W
        stride = programs * WARPS
        n_mine = ttgl.cdiv(ttgl.maximum(n_items - first, 0), stride)
        total = n_mine * pages_per_request
        for i in ttgl.static_range(SLOTS):
            if i < total:
                _decode_issue(i, desc, page_ptr, dk_bufs, dv_bufs, dbars, base, first, stride, pages_per_request,
                              num_kv_heads, PAGE_SIZE, HEAD_DIM, SLOTS)

        mma_l: ttgl.constexpr = ttgl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1],
                                                            instr_shape=[16, 8])
        a_l: ttgl.constexpr = ttgl.DotOperandLayout(operand_index=0, parent=mma_l, k_width=2)
        b_l: ttgl.constexpr = ttgl.DotOperandLayout(operand_index=1, parent=mma_l, k_width=2)
        ld: ttgl.constexpr = ttgl.BlockedLayout([1, 8], [2, 16], [1, 1], [1, 0])
        rows = ttgl.arange(0, 16, layout=ttgl.SliceLayout(1, ld))
        cols = ttgl.arange(0, HEAD_DIM, layout=ttgl.SliceLayout(0, ld))
        s_zero = ttgl.zeros([16, PAGE_SIZE], ttgl.float32, layout=mma_l)
        keys = ttgl.arange(0, PAGE_SIZE, layout=ttgl.SliceLayout(0, mma_l))
        r = ttgl.arange(0, 16, layout=ttgl.SliceLayout(1, mma_l))
        d = ttgl.arange(0, HEAD_DIM, layout=ttgl.SliceLayout(0, mma_l))
        for it in range(n_mine):
            item = first + it * stride
            request = item // num_kv_heads
            head = item % num_kv_heads
            q_off = request.to(ttgl.int64) * stride_qt + (head * GROUP + rows).to(ttgl.int64) * stride_qh
            q = ttgl.load(q_ptr + (ttgl.expand_dims(q_off, 1) + ttgl.expand_dims(cols, 0)),
                          mask=ttgl.expand_dims(rows < GROUP, 1), other=0.0)
            q = ttgl.convert_layout(q, a_l)
            last_len = ttgl.load(last_ptr + request)
            m_i = ttgl.full([16], float("-inf"), ttgl.float32, layout=ttgl.SliceLayout(1, mma_l))
            l_i = ttgl.full([16], 0.0, ttgl.float32, layout=ttgl.SliceLayout(1, mma_l))
            acc = ttgl.zeros([16, HEAD_DIM], ttgl.float32, layout=mma_l)
            for j in range(pages_per_request):
                g = it * pages_per_request + j
                s = base + g % SLOTS
                mbarrier.wait(dbars.index(s), (g // SLOTS) & 1)
                k = dk_bufs.index(s).permute((1, 0)).load(b_l)
                v = dv_bufs.index(s).load(b_l)
                valid = ttgl.where(j == pages_per_request - 1, last_len, PAGE_SIZE)
                qk = mma_v2(q, k, s_zero)
                p, alpha, l_i, m_i = _softmax_tile(qk, l_i, m_i, keys, 0, valid, qk_scale, True)
                acc = acc * ttgl.expand_dims(alpha, 1)
                acc = mma_v2(ttgl.convert_layout(p.to(ttgl.bfloat16), a_l), v, acc)
                if g + SLOTS < total:  # both products read the slot: refill it
                    _decode_issue(g + SLOTS, desc, page_ptr, dk_bufs, dv_bufs, dbars, base, first, stride,
                                  pages_per_request, num_kv_heads, PAGE_SIZE, HEAD_DIM, SLOTS)
            l_safe = ttgl.where(l_i == 0.0, 1.0, l_i)
            o = acc / ttgl.expand_dims(l_safe, 1)
            lse = (m_i + ttgl.log2(l_safe)) * KERNEL_LN2
            o_off = request.to(ttgl.int64) * stride_ot + (head * GROUP + r).to(ttgl.int64) * stride_oh
            ttgl.store(o_ptr + (ttgl.expand_dims(o_off, 1) + ttgl.expand_dims(d, 0)), o.to(ttgl.bfloat16),
                       mask=ttgl.expand_dims(r < GROUP, 1))
            ttgl.store(lse_ptr + request.to(ttgl.int64) * stride_lt + head * GROUP + r, lse, mask=r < GROUP)


@gluon.jit
def fused_levels(q_ptr, desc, prefix_pages_ptr, suffix_pages_ptr, suffix_last_ptr,
                 po_ptr, plse_ptr, do_ptr, dlse_ptr,
                 qo_len, n_prefix_tiles, n_items, pages_per_request, num_kv_heads,
                 stride_qt, stride_qh, stride_ot, stride_oh, stride_lt, qk_scale,
                 GROUP: ttgl.constexpr, PAGE_SIZE: ttgl.constexpr, HEAD_DIM: ttgl.constexpr,
                 BLOCK_N: ttgl.constexpr, P_STAGES: ttgl.constexpr, D_WARPS: ttgl.constexpr,
                 D_STAGES: ttgl.constexpr, DO_PREFIX: ttgl.constexpr, DO_DECODE: ttgl.constexpr,
                 D_REGS: ttgl.constexpr):
    """One program per (64-row prefix tile, kv head): the prefix tile on the default
    warpgroup, ``D_WARPS`` one-warp decode partitions beside it (see the module docstring)."""
    pid = ttgl.program_id(0)
    programs = ttgl.num_programs(0)
    dtype: ttgl.constexpr = q_ptr.dtype.element_ty
    q_smem = ttgl.allocate_shared_memory(dtype, [64, HEAD_DIM],
                                         ttgl.NVMMASharedLayout.get_default_for([64, HEAD_DIM], dtype))
    kv_sl: ttgl.constexpr = ttgl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
    k_bufs = ttgl.allocate_shared_memory(dtype, [P_STAGES, BLOCK_N, HEAD_DIM], kv_sl)
    v_bufs = ttgl.allocate_shared_memory(dtype, [P_STAGES, BLOCK_N, HEAD_DIM], kv_sl)
    q_bar = ttgl.allocate_shared_memory(ttgl.int64, [1], mbarrier.MBarrierLayout())
    ready = ttgl.allocate_shared_memory(ttgl.int64, [P_STAGES, 1], mbarrier.MBarrierLayout())
    page_sl: ttgl.constexpr = ttgl.NVMMASharedLayout.get_default_for([PAGE_SIZE, HEAD_DIM], dtype)
    dk_bufs = ttgl.allocate_shared_memory(dtype, [D_WARPS * D_STAGES, PAGE_SIZE, HEAD_DIM], page_sl)
    dv_bufs = ttgl.allocate_shared_memory(dtype, [D_WARPS * D_STAGES, PAGE_SIZE, HEAD_DIM], page_sl)
    dbars = ttgl.allocate_shared_memory(ttgl.int64, [D_WARPS * D_STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in ttgl.static_range(P_STAGES):
        mbarrier.init(ready.index(i), count=1)
    for i in ttgl.static_range(D_WARPS * D_STAGES):
        mbarrier.init(dbars.index(i), count=1)
    fence_async_shared()
    # (The partitions' arguments are written out in each call: a tuple held in a variable
    # would turn its constexprs into runtime values.)
    if D_WARPS == 2:
        ttgl.warp_specialize([
            (_prefix_part, (q_ptr, desc, prefix_pages_ptr, po_ptr, plse_ptr, q_smem, k_bufs, v_bufs, q_bar, ready,
                            pid, qo_len, n_prefix_tiles, num_kv_heads, stride_qt, stride_qh, stride_ot, stride_oh,
                            stride_lt, qk_scale, GROUP, PAGE_SIZE, DO_PREFIX)),
            (_decode_part, (q_ptr, desc, suffix_pages_ptr, suffix_last_ptr, do_ptr, dlse_ptr, dk_bufs, dv_bufs, dbars,
                            pid, programs, n_items, pages_per_request, num_kv_heads, stride_qt, stride_qh,
                            stride_ot, stride_oh, stride_lt, qk_scale, 0, 2, GROUP, PAGE_SIZE, DO_DECODE)),
            (_decode_part, (q_ptr, desc, suffix_pages_ptr, suffix_last_ptr, do_ptr, dlse_ptr, dk_bufs, dv_bufs, dbars,
                            pid, programs, n_items, pages_per_request, num_kv_heads, stride_qt, stride_qh,
                            stride_ot, stride_oh, stride_lt, qk_scale, 1, 2, GROUP, PAGE_SIZE, DO_DECODE)),
        ], [1, 1], [D_REGS, D_REGS])
    else:
        ttgl.warp_specialize([
            (_prefix_part, (q_ptr, desc, prefix_pages_ptr, po_ptr, plse_ptr, q_smem, k_bufs, v_bufs, q_bar, ready,
                            pid, qo_len, n_prefix_tiles, num_kv_heads, stride_qt, stride_qh, stride_ot, stride_oh,
                            stride_lt, qk_scale, GROUP, PAGE_SIZE, DO_PREFIX)),
            (_decode_part, (q_ptr, desc, suffix_pages_ptr, suffix_last_ptr, do_ptr, dlse_ptr, dk_bufs, dv_bufs, dbars,
                            pid, programs, n_items, pages_per_request, num_kv_heads, stride_qt, stride_qh,
                            stride_ot, stride_oh, stride_lt, qk_scale, 0, 4, GROUP, PAGE_SIZE, DO_DECODE)),
            (_decode_part, (q_ptr, desc, suffix_pages_ptr, suffix_last_ptr, do_ptr, dlse_ptr, dk_bufs, dv_bufs, dbars,
                            pid, programs, n_items, pages_per_request, num_kv_heads, stride_qt, stride_qh,
                            stride_ot, stride_oh, stride_lt, qk_scale, 1, 4, GROUP, PAGE_SIZE, DO_DECODE)),
            (_decode_part, (q_ptr, desc, suffix_pages_ptr, suffix_last_ptr, do_ptr, dlse_ptr, dk_bufs, dv_bufs, dbars,
                            pid, programs, n_items, pages_per_request, num_kv_heads, stride_qt, stride_qh,
                            stride_ot, stride_oh, stride_lt, qk_scale, 2, 4, GROUP, PAGE_SIZE, DO_DECODE)),
            (_decode_part, (q_ptr, desc, suffix_pages_ptr, suffix_last_ptr, do_ptr, dlse_ptr, dk_bufs, dv_bufs, dbars,
                            pid, programs, n_items, pages_per_request, num_kv_heads, stride_qt, stride_qh,
                            stride_ot, stride_oh, stride_lt, qk_scale, 3, 4, GROUP, PAGE_SIZE, DO_DECODE)),
        ], [1, 1, 1, 1], [D_REGS, D_REGS, D_REGS, D_REGS])


class Fused:
    """``fused_levels`` on one workload and config (one rotation's pool and queries each
    call), its two states merged by ``merge_state`` when ``merge``."""

    def __init__(self, wl, config: str, prefix: bool = True, decode: bool = True, merge: bool = True,
                 decode_from_l2: bool = False, programs: int | None = None):
        from benchmarks.tools.probe_tma_read import page_descriptors  # noqa: PLC0415

        s = wl.shape
        if s.head_dim != 128 or s.prefix % 64 or s.hq % s.hkv:
            raise SystemExit("probe_fused_levels: head_dim 128 and prefixes of whole 64-key tiles only")
        self.block_n, self.p_stages, self.d_warps, self.d_stages = (int(x) for x in config.split(","))
        self.wl, self.prefix, self.decode, self.merge = wl, prefix, decode, merge
        self.group = s.hq // s.hkv
        self.tiles = -(-s.batch * self.group // 64)
        # Without the prefix part the grid may be any size (the decode items spread over it).
        self.programs = programs if programs is not None and not prefix else self.tiles * s.hkv
        self.descs = page_descriptors(wl)
        # decode_from_l2: every decode page one of 64 (4 MiB), so the decode level keeps its
        # work and its L2 traffic but reads (almost) nothing from HBM.
        pages = wl.kv_indices[1]
        self.decode_pages = pages[:64][torch.arange(pages.numel(), device=pages.device) % 64] if decode_from_l2 \
            else pages
        self.p_out, self.p_lse = wl.out_buffers()
        self.d_out, self.d_lse = wl.out_buffers()
        self.out, self.lse = wl.out_buffers()
        self.qk_scale = s.head_dim ** -0.5 * 1.4426950408889634

    def call(self, i: int):
        from cascadeinfer.kernels.merge import merge_state

        wl, s = self.wl, self.wl.shape

        def run():
            q, po, pl, do, dl = wl.qs[i], self.p_out[i], self.p_lse[i], self.d_out[i], self.d_lse[i]
            fused_levels[(self.programs,)](
                q, self.descs[i], wl.kv_indices[0], self.decode_pages, wl.kv_last[1], po, pl, do, dl,
                s.batch, s.prefix // self.block_n, s.batch * s.hkv, s.suffix_pages, s.hkv,
                q.stride(0), q.stride(1), po.stride(0), po.stride(1), pl.stride(0), self.qk_scale,
                self.group, PAGE, s.head_dim, self.block_n, self.p_stages, self.d_warps, self.d_stages,
                self.prefix, self.decode, DECODE_REGS, num_warps=4)
            if self.merge:
                merge_state(po, pl, do, dl, out=self.out[i], out_lse=self.lse[i], validate=False)
        return run

    def check(self, expected) -> tuple[float, float]:
        """(max |o - o_cascade|, max |lse - lse_cascade|) on rotation 0, outputs poisoned first."""
        for t in (self.out[0], self.lse[0], self.p_out[0], self.p_lse[0], self.d_out[0], self.d_lse[0]):
            t.fill_(float("nan"))
        self.call(0)()
        torch.cuda.synchronize()
        o_ref, lse_ref = expected
        err = (self.out[0].float() - o_ref.float()).abs().nan_to_num(float("inf")).max().item()
        lse_err = (self.lse[0] - lse_ref).abs().nan_to_num(float("inf")).max().item()
        return err, lse_err


def options(ap) -> None:
    ap.add_argument("--configs", nargs="*", default=list(CONFIGS))
    ap.add_argument("--beside", type=int, default=0, metavar="N",
                    help="also the decode part alone on N programs beside the prefix level's one-split grid")
    ap.add_argument("--beside-only", action="store_true", help="only that (with --beside)")


def main() -> None:
    args, device, timer = shape_tool_start(__doc__, "probe_fused_levels", ENGINE_SHAPES, 100, options)
    if torch.cuda.get_device_capability(device) != (9, 0):
        raise SystemExit("probe_fused_levels: Gluon wgmma and TMA need compute capability 9.0")
    copy_bw, _ = measure_ceilings()
    rows = []
    for text, s, wl in shape_workloads(args.shapes, device):
        row = {"shape": text}
        row["decode alone us"] = timer(level_alone_calls(wl, 1)) * 1e6
        row["prefix alone us"] = timer(level_alone_calls(wl, 0)) * 1e6
        cascade = ours(wl, True)
        calls = [cascade.call(i) for i in range(wl.rot)]
        row["cascade us"] = timer(calls) * 1e6
        expected = tuple(t.clone() for t in cascade.result())
        if args.beside:
            from benchmarks.tools.probe_tma_read import beside, prefix_calls  # noqa: PLC0415

            prefix = prefix_calls(wl, 1)
            row["prefix, one split, alone us"] = timer(prefix) * 1e6
            for cfg in args.configs:
                f = Fused(wl, cfg, prefix=False, merge=False, programs=args.beside)
                calls = [f.call(i) for i in range(wl.rot)]
                row[f"{cfg} decode part on {args.beside} us"] = timer(calls) * 1e6
                row[f"prefix + {cfg} decode part on {args.beside} us"] = timer(beside(prefix, calls)) * 1e6
        for cfg in ([] if args.beside_only else args.configs):
            both = Fused(wl, cfg)
            row[f"{cfg} max err o / lse"] = "{:.3g} / {:.3g}".format(*both.check(expected))
            row[f"{cfg} fused + merge us"] = timer([both.call(i) for i in range(wl.rot)]) * 1e6
            for name, kw in (("fused", {}), ("prefix part", {"decode": False}), ("decode part", {"prefix": False}),
                             ("fused, decode from L2", {"decode_from_l2": True}),
                             ("decode part from L2", {"prefix": False, "decode_from_l2": True})):
                f = Fused(wl, cfg, merge=False, **kw)
                row[f"{cfg} {name} us"] = timer([f.call(i) for i in range(wl.rot)]) * 1e6
        rows.append(row)
        print(markdown_table([row], list(row)), flush=True)
    write_json(args.json, {"environment": environment(), "copy_bytes_per_s": copy_bw, "rows": rows})


if __name__ == "__main__":
    main()
