"""The Hopper (sm_90) prefill kernel: warp-specialised, beside the portable one.

The same work and the same contract as :func:`cascadeinfer.kernels.prefill_kernel.prefill_kernel`
for the case that dominates a cascade: non-causal, paged K/V, fp16/bf16. One program
computes one 128-row M tile of packed query rows of one group (row ``r`` = query token
``r // G``, head ``r % G`` of the KV head's query group), against one KV head's pages in
one KV split, and writes that tile's state ``(o, lse)``; the grid and the sync-free tile
map are the portable kernel's, so the launchers and the split merge are shared.

What differs is how a program spends its SM (the ideas of FlashAttention-3):

* **Warp specialisation.** A producer warpgroup fills rings of ``K_STAGES`` and
  ``V_STAGES`` shared-memory slots: a whole key tile by TMA, one ``[PAGE_SIZE, HEAD_DIM]``
  box per page (one thread issues them; the page ids are the box coordinates, so there
  are no per-row addresses), signalled by the bytes it expects on the slot's mbarrier;
  the split's partial last tile by a ``cp.async`` gather that zero-fills the rows past
  its end (a box would bring in whatever the pool holds there). It holds few registers
  (``setmaxnreg``), so the consumers get the rest.
* **Two consumer warpgroups, 64 rows each**, that never wait for each other: each runs
  ``S = Q Kᵀ`` (``wgmma``, Q and K in shared memory), the online softmax in registers and
  ``O += P V`` (``wgmma``, P from registers) on its own rows, and releases the slots it
  read with its own mbarrier arrivals. Each step issues tile t's scores together with
  tile t - 1's P·V and runs tile t's softmax while both are on the tensor cores
  (FlashAttention-3's order). Where each wait sits is chosen against ptxas, which hoists
  a wait for every product (and the slot releases and the rescale that follow one) as
  far up its block as it can: the releases come at the top of the next step, and a
  barrier wait ends the block between the softmax and the wait for P·V.

Status (benchmarks/NOTES.md "Prefix / prefill kernel", v5-v8): it passes its GPU tests
(``tests/test_prefill_hopper.py``: the float64 reference, edges, splits, NaN/inf, graph
capture, the cascade) and runs 1.09-1.23x the portable kernel's speed at >= 128 queries
over >= 8K keys on the H100 (0.59-0.85 of the matmul rate; v8 on the H200: 0.75-0.90 at
>= 256 queries over >= 8K keys), but slower on prefixes of 1K keys, and
beside a decode level on a side stream (the cascade's schedule) it holds its SMs whole
(all their registers and shared memory). The launchers run it when asked
(``backend="hopper"``) and, with ``backend=None``, for one large group (at head_dim 128:
>= 256 packed rows and 2^23 packed rows x keys, or 512 and 2^22;
:mod:`cascadeinfer.kernels.backend`); the
cascade per level by the same rule. Its TMA
descriptors hold the cache's address: recordings re-point them in every replay, which the
direct launcher encodes at each launch as Triton's launcher would (checked byte for byte
when prepared; :mod:`cascadeinfer.kernels.direct_launch`).

Numerics are the portable kernel's: scores in base 2 (``qk_scale = sm_scale * log2(e)``),
float32 state, ``finish_state``'s rules for empty rows ``(0, -inf)`` and poisoned rows
``(NaN, NaN)``, the natural-log LSE at the boundary. Keys past the split's end in its last
tile are masked; rows past the group's end are neither read nor stored.

Gluon has no interpreter: this kernel runs on a GPU of compute capability 9.0 only, and
the launchers reach it through :mod:`cascadeinfer.kernels.backend`, which falls back to the
portable kernel everywhere else.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as ttgl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy,
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from cascadeinfer.kernels.constants import KERNEL_LN2


@gluon.jit
def _gather_tile(dst, src_ptr, page_ptr, key0, split_hi, head_off, stride_kp, stride_kt,
                 PAGE_SIZE: ttgl.constexpr, HEAD_DIM: ttgl.constexpr):
    """cp.async keys ``key0 ..`` of a paged K or V into ``dst``, 32 rows at a time (few
    registers), rows past ``split_hi`` zero-filled (a TMA box would bring in whatever the
    pool holds there, and a non-finite value times a zero weight is NaN)."""
    COLS: ttgl.constexpr = HEAD_DIM // 8
    ld: ttgl.constexpr = ttgl.BlockedLayout([1, 8], [32 // COLS, COLS], [4, 1], [1, 0])
    cols = ttgl.expand_dims(ttgl.arange(0, HEAD_DIM, layout=ttgl.SliceLayout(0, ld)), 0)
    for c in ttgl.static_range(dst.shape[0] // 32):
        key = key0 + c * 32 + ttgl.arange(0, 32, layout=ttgl.SliceLayout(1, ld))
        ok = key < split_hi
        page = ttgl.load(page_ptr + key // PAGE_SIZE, mask=ok, other=0)
        off = page.to(ttgl.int64) * stride_kp + (key % PAGE_SIZE).to(ttgl.int64) * stride_kt + head_off
        off = ttgl.expand_dims(ttgl.multiple_of(off, 8), 1) + cols
        async_copy.async_copy_global_to_shared(dst.slice(c * 32, 32), src_ptr + off, mask=ttgl.expand_dims(ok, 1))


@gluon.jit
def _producer(
    q_ptr, k_ptr, v_ptr, k_desc, v_desc, page_ptr,
    q_smem, k_bufs, v_bufs, bars,
    qo_start, qo_len, row0, kv_head, split_lo, split_hi, n_tiles,
    stride_qt, stride_qh, stride_kp, stride_kt, stride_kh,
    GROUP_SIZE: ttgl.constexpr, PAGE_SIZE: ttgl.constexpr, HEAD_DIM: ttgl.constexpr,
):
    """Q once, then the K and V tiles of ``[split_lo, split_hi)`` into their rings: whole
    tiles by TMA, one box per page, issued by one thread (no per-row addresses); the
    split's partial last tile by a cp.async gather that zero-fills the rows past its end."""
    q_bar, k_ready, v_ready, k_empty, v_empty = bars
    K_STAGES: ttgl.constexpr = k_bufs.shape[0]
    V_STAGES: ttgl.constexpr = v_bufs.shape[0]
    BLOCK_N: ttgl.constexpr = k_bufs.shape[1]
    PAGES: ttgl.constexpr = BLOCK_N // PAGE_SIZE
    TILE_BYTES: ttgl.constexpr = BLOCK_N * HEAD_DIM * 2
    # Tiles spread over the warpgroup 8 elements (16 bytes: one cp.async) per thread along a row.
    COLS: ttgl.constexpr = HEAD_DIM // 8  # threads along a row
    ld: ttgl.constexpr = ttgl.BlockedLayout([1, 8], [32 // COLS, COLS], [4, 1], [1, 0])
    rows_l: ttgl.constexpr = ttgl.SliceLayout(1, ld)
    cols = ttgl.expand_dims(ttgl.arange(0, HEAD_DIM, layout=ttgl.SliceLayout(0, ld)), 0)

    # ---- the packed query rows (zeros past the group's end)
    r = row0 + ttgl.arange(0, 128, layout=rows_l)
    tok = r // GROUP_SIZE
    q_off = (qo_start + tok).to(ttgl.int64) * stride_qt + (kv_head * GROUP_SIZE + r % GROUP_SIZE).to(ttgl.int64) * stride_qh
    q_off = ttgl.multiple_of(q_off, 8)  # the launcher checked: strides are multiples of 8 elements
    async_copy.async_copy_global_to_shared(q_smem, q_ptr + (ttgl.expand_dims(q_off, 1) + cols),
                                           mask=ttgl.expand_dims(r < qo_len * GROUP_SIZE, 1))
    # wait_group waits only for committed groups: without the commit the copies could
    # still be in flight when the barrier says they landed. The wait itself comes after
    # tile 0's loads are issued, so Q and the first K and V tiles are in flight together
    # (the consumers need all three for their first product).
    async_copy.commit_group()

    # ---- K and V tiles: row j of tile t is key split_lo + t * BLOCK_N + j of the group.
    # The pool as the descriptors see it: rows of stride_kt elements; page p's slot s of
    # this head is row p * (stride_kp // stride_kt) + head_row + s, column head_col.
    head_off = kv_head.to(ttgl.int64) * stride_kh  # K and V share every stride (one PagedKV)
    head_row = (head_off // stride_kt).to(ttgl.int32)
    head_col = (head_off % stride_kt).to(ttgl.int32)
    rows_per_page = (stride_kp // stride_kt).to(ttgl.int32)  # TMA coordinates are int32
    n_full = (split_hi - split_lo) // BLOCK_N
    for t in range(n_tiles):
        ks = t % K_STAGES
        vs = t % V_STAGES
        first_page = (split_lo + t * BLOCK_N) // PAGE_SIZE
        if t < n_full:
            mbarrier.wait(k_empty.index(ks), ((t // K_STAGES) & 1) ^ 1)  # a fresh slot counts as free
            mbarrier.expect(k_ready.index(ks), TILE_BYTES)
            for j in ttgl.static_range(PAGES):
                page = ttgl.load(page_ptr + first_page + j)
                tma.async_copy_global_to_shared(k_desc, [page * rows_per_page + head_row, head_col],
                                                k_ready.index(ks), k_bufs.index(ks).slice(j * PAGE_SIZE, PAGE_SIZE))
            mbarrier.wait(v_empty.index(vs), ((t // V_STAGES) & 1) ^ 1)
            mbarrier.expect(v_ready.index(vs), TILE_BYTES)
            for j in ttgl.static_range(PAGES):
                page = ttgl.load(page_ptr + first_page + j)
                tma.async_copy_global_to_shared(v_desc, [page * rows_per_page + head_row, head_col],
                                                v_ready.index(vs), v_bufs.index(vs).slice(j * PAGE_SIZE, PAGE_SIZE))
        else:
            key = split_lo + t * BLOCK_N
            mbarrier.wait(k_empty.index(ks), ((t // K_STAGES) & 1) ^ 1)
            _gather_tile(k_bufs.index(ks), k_ptr, page_ptr, key, split_hi, head_off, stride_kp, stride_kt,
                         PAGE_SIZE, HEAD_DIM)
            mbarrier.wait(v_empty.index(vs), ((t // V_STAGES) & 1) ^ 1)
            _gather_tile(v_bufs.index(vs), v_ptr, page_ptr, key, split_hi, head_off, stride_kp, stride_kt,
                         PAGE_SIZE, HEAD_DIM)
            async_copy.commit_group()
            async_copy.wait_group(0)
            mbarrier.arrive(k_ready.index(ks))
            mbarrier.arrive(v_ready.index(vs))
        if t == 0:
            async_copy.wait_group(0)
            mbarrier.arrive(q_bar)  # after the partition's barrier: every thread's copies landed
    if n_tiles == 0:
        async_copy.wait_group(0)
        mbarrier.arrive(q_bar)


@gluon.jit
def _softmax_tile(qk, l_i, m_i, keys, tile_lo, split_hi, qk_scale, MASK: ttgl.constexpr):
    """One key tile's online-softmax update (``softmax.online_softmax_step`` without the
    product): returns the tile's weights ``p``, the factor ``alpha`` that rescales the
    running output, and the new ``(l, m)``. MASK: keys past the split's end are masked."""
    if MASK:
        qk = ttgl.where(ttgl.expand_dims(tile_lo + keys < split_hi, 0), qk, float("-inf"))
    m_new = ttgl.maximum(m_i, ttgl.max(qk, axis=1) * qk_scale)  # qk_scale > 0 keeps the max
    # A row whose scores were all -inf (non-finite input) keeps m = -inf: subtract 0
    # there, so exp2(-inf - 0) = 0 instead of NaN (the portable kernel's masked rule).
    m_sub = ttgl.where(m_new == float("-inf"), 0.0, m_new)
    p = ttgl.exp2(qk * qk_scale - ttgl.expand_dims(m_sub, 1))
    alpha = ttgl.exp2(m_i - m_sub)
    l_i = l_i * alpha + ttgl.sum(p, axis=1)
    return p, alpha, l_i, m_new


@gluon.jit
def _tile_step(t, q_rows, k_bufs, v_bufs, bars, acc, p16, l_i, m_i, s_zero, keys, split_lo, split_hi, qk_scale,
               MASK: ttgl.constexpr):
    """Tile ``t >= 1``: its scores and tile ``t - 1``'s P·V issued together, tile ``t``'s
    softmax while both run, then the output rescaled and tile ``t``'s P kept in registers
    for the next step. Returns ``(acc, p16, l, m)``; ``acc`` then holds tiles ``< t``
    scaled to tile ``t``'s running maximum."""
    _, k_ready, v_ready, k_empty, v_empty = bars
    K_STAGES: ttgl.constexpr = k_bufs.shape[0]
    V_STAGES: ttgl.constexpr = v_bufs.shape[0]
    BLOCK_N: ttgl.constexpr = k_bufs.shape[1]
    if t >= 2:
        # Tile t - 1's K and tile t - 2's V, done at the last step's final wait, released
        # here where no product is in flight: an arrival releases every shared-memory read
        # before it, and ptxas hoists it (with a wait for all products) to the top of its block.
        mbarrier.arrive(k_empty.index((t - 1) % K_STAGES))
        mbarrier.arrive(v_empty.index((t - 2) % V_STAGES))
    ks = t % K_STAGES
    mbarrier.wait(k_ready.index(ks), (t // K_STAGES) & 1)
    fence_async_shared()
    qk = warpgroup_mma(q_rows, k_bufs.index(ks).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    acc = warpgroup_mma(p16, v_bufs.index((t - 1) % V_STAGES), acc, is_async=True)
    qk = warpgroup_mma_wait(1, deps=(qk,))  # the scores; P·V stays in flight
    p, alpha, l_i, m_i = _softmax_tile(qk, l_i, m_i, keys, split_lo + t * BLOCK_N, split_hi, qk_scale, MASK)
    # Tile t's V (the next product's) is waited here, between the softmax and the wait for
    # P·V: the wait loop ends a block, and ptxas does not hoist the wait for P·V, nor the
    # rescale after it, out of its block into the softmax it is to run under.
    mbarrier.wait(v_ready.index(t % V_STAGES), (t // V_STAGES) & 1)
    acc = warpgroup_mma_wait(0, deps=(acc,))
    acc = acc * ttgl.expand_dims(ttgl.convert_layout(alpha, ttgl.SliceLayout(1, acc.type.layout)), 1)
    p16 = ttgl.convert_layout(p.to(k_bufs.dtype), p16.type.layout)
    return acc, p16, l_i, m_i


@gluon.jit
def _consumer(
    q_smem, k_bufs, v_bufs, bars,
    o_ptr, lse_ptr,
    qo_start, qo_len, row0, kv_head, split, split_lo, split_hi, n_tiles,
    stride_ot, stride_os, stride_oh, stride_lt, stride_ls, stride_lh,
    qk_scale,
    HALF: ttgl.constexpr, GROUP_SIZE: ttgl.constexpr, HEAD_DIM: ttgl.constexpr,
):
    """Rows ``HALF * 64 .. + 64`` of the tile: the key loop, then the finished state."""
    q_bar, k_ready, v_ready, k_empty, v_empty = bars
    K_STAGES: ttgl.constexpr = k_bufs.shape[0]
    V_STAGES: ttgl.constexpr = v_bufs.shape[0]
    BLOCK_N: ttgl.constexpr = k_bufs.shape[1]
    s_l: ttgl.constexpr = ttgl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, BLOCK_N, 16])
    o_l: ttgl.constexpr = ttgl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, HEAD_DIM, 16])
    p_l: ttgl.constexpr = ttgl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2)
    row_s: ttgl.constexpr = ttgl.SliceLayout(1, s_l)
    row_o: ttgl.constexpr = ttgl.SliceLayout(1, o_l)
    q_rows = q_smem.slice(HALF * 64, 64, dim=0)

    m_i = ttgl.full([64], float("-inf"), ttgl.float32, layout=row_s)
    l_i = ttgl.full([64], 0.0, ttgl.float32, layout=row_s)
    acc = ttgl.zeros([64, HEAD_DIM], ttgl.float32, layout=o_l)
    s_zero = ttgl.zeros([64, BLOCK_N], ttgl.float32, layout=s_l)
    keys = ttgl.arange(0, BLOCK_N, layout=ttgl.SliceLayout(0, s_l))

    mbarrier.wait(q_bar, 0)
    if n_tiles > 0:
        # Tile 0: its scores and softmax alone. Then each step issues tile t's scores with
        # tile t - 1's P·V and runs tile t's softmax while both are on the tensor cores
        # (FlashAttention-3's order); the last P·V follows the loop. Only the split's last
        # tile can be partial, so only the first and the last softmax mask.
        mbarrier.wait(k_ready.index(0), 0)
        fence_async_shared()
        qk = warpgroup_mma(q_rows, k_bufs.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        qk = warpgroup_mma_wait(0, deps=(qk,))
        p, _, l_i, m_i = _softmax_tile(qk, l_i, m_i, keys, split_lo, split_hi, qk_scale, True)
        mbarrier.arrive(k_empty.index(0))
        mbarrier.wait(v_ready.index(0), 0)
        p16 = ttgl.convert_layout(p.to(k_bufs.dtype), p_l)
        for t in range(1, n_tiles - 1):
            acc, p16, l_i, m_i = _tile_step(t, q_rows, k_bufs, v_bufs, bars, acc, p16, l_i, m_i, s_zero, keys,
                                            split_lo, split_hi, qk_scale, False)
        if n_tiles > 1:
            acc, p16, l_i, m_i = _tile_step(n_tiles - 1, q_rows, k_bufs, v_bufs, bars, acc, p16, l_i, m_i, s_zero,
                                            keys, split_lo, split_hi, qk_scale, True)
            mbarrier.arrive(k_empty.index((n_tiles - 1) % K_STAGES))
            mbarrier.arrive(v_empty.index((n_tiles - 2) % V_STAGES))
        vs = (n_tiles - 1) % V_STAGES
        fence_async_shared()
        acc = warpgroup_mma(p16, v_bufs.index(vs), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(v_empty.index(vs))

    # ---- finish (softmax.finish_state's rules) and store
    l_o = ttgl.convert_layout(l_i, row_o)
    l_safe = ttgl.where(l_o == 0.0, 1.0, l_o)  # 0: every score was -inf; NaN stays NaN
    o = acc / ttgl.expand_dims(l_safe, 1)
    lse = (ttgl.convert_layout(m_i, row_o) + ttgl.log2(l_safe)) * KERNEL_LN2
    finite = (ttgl.min((ttgl.abs(o) < float("inf")).to(ttgl.int32), axis=1) > 0) & (lse == lse)  # noqa: PLR0124 (NaN fails)
    lse = ttgl.where(finite, lse, float("nan"))
    lse = ttgl.where(split_hi > split_lo, lse, float("-inf"))  # no key in this split: the identity
    o = ttgl.where(ttgl.expand_dims(finite, 1), o, float("nan"))
    o = ttgl.where(ttgl.expand_dims(lse == float("-inf"), 1), 0.0, o)

    r = row0 + HALF * 64 + ttgl.arange(0, 64, layout=row_o)
    row_ok = r < qo_len * GROUP_SIZE
    tok = (qo_start + r // GROUP_SIZE).to(ttgl.int64)
    head = (kv_head * GROUP_SIZE + r % GROUP_SIZE).to(ttgl.int64)
    split64 = split.to(ttgl.int64)
    d = ttgl.arange(0, HEAD_DIM, layout=ttgl.SliceLayout(0, o_l))
    o_off = tok * stride_ot + split64 * stride_os + head * stride_oh
    ttgl.store(o_ptr + (ttgl.expand_dims(o_off, 1) + ttgl.expand_dims(d, 0)), o.to(o_ptr.dtype.element_ty),
               mask=ttgl.expand_dims(row_ok, 1))
    ttgl.store(lse_ptr + (tok * stride_lt + split64 * stride_ls + head * stride_lh), lse, mask=row_ok)


@gluon.jit
def prefill_kernel_hopper(
    q_ptr,  # [nnz_qo, num_qo_heads, head_dim] fp16 / bf16
    k_ptr,  # paged K: [num_pages, page_size, num_kv_heads, head_dim] in any layout (strides)
    v_ptr,  # paged V, sharing K's page and token strides
    k_desc,  # TMA descriptor of K as rows of stride_kt elements, boxes of [PAGE_SIZE, HEAD_DIM]
    v_desc,  # of V, likewise
    o_ptr,  # [nnz_qo, num_splits, num_qo_heads, head_dim] q's dtype
    lse_ptr,  # [nnz_qo, num_splits, num_qo_heads] float32, natural log
    qo_indptr_ptr,  # [num_groups + 1] int32
    kv_indptr_ptr,  # [num_groups + 1] int32 pages
    kv_indices_ptr,  # int32 page ids
    kv_last_page_len_ptr,  # [num_groups] int32
    search_steps,  # ceil(log2(num_groups))
    num_groups,
    stride_qt,
    stride_qh,
    stride_kp,  # K and V share their strides (one PagedKV)
    stride_kt,
    stride_kh,
    stride_ot,
    stride_os,
    stride_oh,
    stride_lt,
    stride_ls,
    stride_lh,
    qk_scale,  # sm_scale * log2(e)
    GROUP_SIZE: ttgl.constexpr,
    PAGE_SIZE: ttgl.constexpr,
    HEAD_DIM: ttgl.constexpr,  # 64 or 128
    BLOCK_N: ttgl.constexpr,
    K_STAGES: ttgl.constexpr,  # shared-memory slots of K tiles
    V_STAGES: ttgl.constexpr,  # of V tiles
    PRODUCER_REGS: ttgl.constexpr,
    CONSUMER_REGS: ttgl.constexpr,
):
    tile = ttgl.program_id(0)
    kv_head = ttgl.program_id(1)
    split = ttgl.program_id(2)
    num_splits = ttgl.num_programs(2)

    # ---- the group owning this tile: prefill_kernel's binary search over qo_indptr
    lo_g = num_groups * 0
    hi_g = num_groups
    for _ in range(search_steps):
        mid = (lo_g + hi_g) // 2
        mid_start = (ttgl.load(qo_indptr_ptr + mid) * GROUP_SIZE + mid * 127) // 128
        go_right = mid_start <= tile
        lo_g = ttgl.where(go_right, mid, lo_g)
        hi_g = ttgl.where(go_right, hi_g, mid)
    qo_start = ttgl.load(qo_indptr_ptr + lo_g)
    qo_len = ttgl.load(qo_indptr_ptr + lo_g + 1) - qo_start
    local_tile = tile - (qo_start * GROUP_SIZE + lo_g * 127) // 128
    kv_start = ttgl.load(kv_indptr_ptr + lo_g)
    kv_end = ttgl.load(kv_indptr_ptr + lo_g + 1)
    last_len = ttgl.load(kv_last_page_len_ptr + lo_g)
    kv_len = ttgl.where(kv_end > kv_start, (kv_end - kv_start - 1) * PAGE_SIZE + last_len, 0)
    row0 = local_tile * 128
    if row0 >= qo_len * GROUP_SIZE:
        return  # a slot of the upper-bound grid that holds no tile
    chunk = ttgl.cdiv(ttgl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N
    split_lo = split * chunk
    split_hi = ttgl.minimum(split_lo + chunk, kv_len)
    n_tiles = ttgl.cdiv(ttgl.maximum(split_hi - split_lo, 0), BLOCK_N)
    page_ptr = kv_indices_ptr + kv_start

    dtype: ttgl.constexpr = q_ptr.dtype.element_ty
    q_sl: ttgl.constexpr = ttgl.NVMMASharedLayout.get_default_for([128, HEAD_DIM], dtype)
    kv_sl: ttgl.constexpr = ttgl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
    q_smem = ttgl.allocate_shared_memory(dtype, [128, HEAD_DIM], q_sl)
    k_bufs = ttgl.allocate_shared_memory(dtype, [K_STAGES, BLOCK_N, HEAD_DIM], kv_sl)
    v_bufs = ttgl.allocate_shared_memory(dtype, [V_STAGES, BLOCK_N, HEAD_DIM], kv_sl)
    q_bar = ttgl.allocate_shared_memory(ttgl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = ttgl.allocate_shared_memory(ttgl.int64, [K_STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = ttgl.allocate_shared_memory(ttgl.int64, [V_STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = ttgl.allocate_shared_memory(ttgl.int64, [K_STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = ttgl.allocate_shared_memory(ttgl.int64, [V_STAGES, 1], mbarrier.MBarrierLayout())
    # The producer arrives once per filled slot (with the TMA bytes expected, or after its
    # cp.async copies landed); each consumer warpgroup arrives once per slot it is done
    # with. K and V slots are freed apart: a K tile is done with its scores, a V tile a
    # softmax later.
    mbarrier.init(q_bar, count=1)
    for i in ttgl.static_range(K_STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)
    for i in ttgl.static_range(V_STAGES):
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(v_empty.index(i), count=2)
    fence_async_shared()  # the initialised barriers, before TMA completes on them
    bars = (q_bar, k_ready, v_ready, k_empty, v_empty)
    ttgl.warp_specialize([
        (_consumer, (q_smem, k_bufs, v_bufs, bars, o_ptr, lse_ptr,
                     qo_start, qo_len, row0, kv_head, split, split_lo, split_hi, n_tiles,
                     stride_ot, stride_os, stride_oh, stride_lt, stride_ls, stride_lh, qk_scale,
                     0, GROUP_SIZE, HEAD_DIM)),
        (_consumer, (q_smem, k_bufs, v_bufs, bars, o_ptr, lse_ptr,
                     qo_start, qo_len, row0, kv_head, split, split_lo, split_hi, n_tiles,
                     stride_ot, stride_os, stride_oh, stride_lt, stride_ls, stride_lh, qk_scale,
                     1, GROUP_SIZE, HEAD_DIM)),
        (_producer, (q_ptr, k_ptr, v_ptr, k_desc, v_desc, page_ptr, q_smem, k_bufs, v_bufs, bars,
                     qo_start, qo_len, row0, kv_head, split_lo, split_hi, n_tiles,
                     stride_qt, stride_qh, stride_kp, stride_kt, stride_kh, GROUP_SIZE, PAGE_SIZE, HEAD_DIM)),
    ], [4, 4], [CONSUMER_REGS, PRODUCER_REGS])
