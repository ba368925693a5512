"""The tensor-core prefill kernel behind :mod:`cascadeinfer.kernels.prefill`.

One program computes one M tile of packed query rows of one query group, against one KV
head's keys in one KV split, and writes that tile's attention state ``(o, lse)``; the
launchers in ``prefill.py`` pick tiles and splits and merge the splits.

How it is laid out (the ideas of FlashAttention-2 and Triton's
``06-fused-attention`` tutorial, with the query heads of one KV head packed together):

* **GQA packing.** Row ``r`` of an M tile is ``(query token r // G, head-in-group r % G)``
  with ``G = num_qo_heads // num_kv_heads``. A program owns one M tile of one group, one
  KV head and one KV split, so each K/V tile it loads feeds ``BLOCK_M`` rows — all the
  query heads that share that KV head — through two ``tl.dot`` on tensor cores.
* **Sync-free tile map.** Group ``g`` owns the M tiles ``start(g) .. start(g) +
  cdiv(rows(g), BLOCK_M)`` with ``start(g) = (qo_indptr[g] * G + g * (BLOCK_M - 1)) //
  BLOCK_M``, which never overlap and never exceed ``(nnz_qo * G + num_groups *
  (BLOCK_M - 1)) // BLOCK_M`` (exactly ``cdiv(nnz_qo * G, BLOCK_M)`` for one group). The
  grid is that bound; each program finds its group by a binary search over
  ``qo_indptr`` and exits when its tile is past the group's end. The host never reads
  an indptr, so launches can be captured in a CUDA graph.
* **Split-KV.** When tiles × KV heads cannot fill the SMs (128 decode queries × 4 heads
  per KV head = 4 tiles × 8 KV heads = 32 programs on 132 SMs), each group's KV range is
  cut into ``num_splits`` chunks (a function of shapes only), the programs write partial
  states (o in q's dtype, LSE float32), and :func:`cascadeinfer.kernels.merge_many.merge_states`
  merges them.
* **Masked work apart.** Key tiles every row of the tile sees in full run without masks;
  only the last partial tile and the causal diagonal band run the masked loop.
* **Pipelined page gather.** In the unmasked loop the page ids of the next key tile are
  loaded one iteration ahead and carried in registers, so the K/V loads (16-byte
  ``cp.async`` per row, at ``page * stride_page + slot * stride_token``; K and V of a
  paged cache share those strides, hence one offset) depend on no load of their own
  iteration and Triton keeps ``num_stages - 1`` tiles in flight. A page-id load inside the
  iteration makes them indirect loads, which Triton 3.6 issues one tile ahead and waits
  for at once: the former kernel's 0.31-0.35 of the bf16 matmul rate on an H200, against
  0.49-0.65 now (benchmarks/NOTES.md). ``PAGE_SIZE`` is a compile-time constant (a mask
  for powers of two, a multiply-shift otherwise).
* **Cheap row addresses.** Where every element offset of the K/V pool is below 2**31
  (checked on the host from shapes and strides), the unmasked loop forms row offsets in
  int32; and when ``BLOCK_N`` is a multiple of ``PAGE_SIZE`` each row's slot offset and
  page position are hoisted out of it (:class:`cascadeinfer.kernels.policy.AddressPath`). Larger pools keep int64.
  Which of the two a tile takes is measured (:func:`cascadeinfer.kernels.policy.default_address_path`).
* **Tiles from shapes.** 128x128 tiles, 8 warps, 3 stages for long groups; groups of
  few packed rows (cascade middle levels) get 16-64-row tiles (:data:`cascadeinfer.kernels.policy.PREFILL_TILES`).

Precision: dot operands stay in the storage dtype (fp16 / bf16 on tensor cores), the
softmax and accumulators are float32. For float32 inputs both dots use
``input_precision="ieee"`` (true fp32 FMA on the GPU, slow but exact to ~1e-6) rather
than tf32: fp32 callers are asking for accuracy, speed is what fp16/bf16 are for.

LSE is natural log at every boundary; inside the kernel scores are kept in log2 units
(``log2(e) * sm_scale`` folded into one multiplier) so the softmax runs on ``exp2``.
"""

import triton
import triton.language as tl

from cascadeinfer.kernels.softmax import finish_state, online_softmax_step


@triton.jit
def _load_tile(
    ptrs,  # [BLOCK_N, BLOCK_D] pointers (rows may be anywhere, the last dim is contiguous)
    row_ok,  # [BLOCK_N] bool, used only when MASK_ROWS
    offs_d,  # [BLOCK_D]
    MASK_ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Load a K or V tile, masking only what needs a mask (rows past the end, padded dims)."""
    if MASK_ROWS:
        x = tl.load(ptrs, mask=row_ok[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)
    elif HEAD_DIM != BLOCK_D:
        x = tl.load(ptrs, mask=(offs_d < HEAD_DIM)[None, :], other=0.0)
    else:
        x = tl.load(ptrs)
    return x


@triton.jit
def _paged_rows(
    page,  # [BLOCK_N] int32 page id of each key of the tile
    start,  # the tile's first key (position in its sequence)
    stride_kp,
    stride_kt,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    OFFSETS_32: tl.constexpr,
):
    """[BLOCK_N] offsets of the tile's key rows in the pool (K and V share them): int32
    when OFFSETS_32 (the launcher proved every element offset of the pool < 2**31), else int64."""
    slot = (start + tl.arange(0, BLOCK_N)) % PAGE_SIZE  # PAGE_SIZE constexpr: a mask or a multiply-shift
    if OFFSETS_32:
        off = page * stride_kp + slot * stride_kt
    else:
        off = page.to(tl.int64) * stride_kp + slot.to(tl.int64) * stride_kt
    return off


@triton.jit
def _full_tile(
    acc, l_i, m_i,  # running state, as in online_softmax_step
    q,  # [BLOCK_M, BLOCK_D] storage dtype
    k_rows,  # [BLOCK_N, 1] pointers to the tile's K rows
    v_rows,  # [BLOCK_N, 1] pointers to the tile's V rows
    qk_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One key tile that every row sees in full: load K and V, fold them into the state."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    k = _load_tile(k_rows + offs_d[None, :], offs_n, offs_d, False, HEAD_DIM, BLOCK_D)
    v = _load_tile(v_rows + offs_d[None, :], offs_n, offs_d, False, HEAD_DIM, BLOCK_D)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N], unscaled
    return online_softmax_step(acc, l_i, m_i, s, v, qk_scale, False, DOT_PRECISION)


@triton.jit
def _full_tiles(
    acc,  # [BLOCK_M, BLOCK_D] float32, un-normalised output
    l_i,  # [BLOCK_M] float32, running sum of exp2(score - m_i)
    m_i,  # [BLOCK_M] float32, running max score in log2 units (-inf: nothing seen yet)
    q,  # [BLOCK_M, BLOCK_D] storage dtype, the packed (token, head) rows
    k_ptr,  # K of this KV head (head offset applied; ragged: group start applied too)
    v_ptr,  # V of this KV head, like k_ptr
    page_ptr,  # [pages of this group] int32 page ids (PAGED only)
    lo,  # first key (a multiple of BLOCK_N from the split start)
    hi,  # end: [lo, hi) is whole BLOCK_N tiles that every row sees in full
    stride_kp,  # paged: page stride of K and V (they share it)
    stride_kt,  # token stride of K (paged: of V too)
    stride_vt,  # ragged only: token stride of V
    qk_scale,  # sm_scale * log2(e): scores come out in log2 units
    PAGED: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    OFFSETS_32: tl.constexpr,  # row offsets in int32 (the launcher proved they fit)
    ALIGNED_PAGES: tl.constexpr,  # paged: BLOCK_N % PAGE_SIZE == 0, per-row page math hoisted
):
    """Fold the full key tiles ``[lo, hi)`` into ``(acc, l, m)``: no key mask at all.

    Paged: the page ids of tile ``i + 1`` are loaded during tile ``i`` and carried in
    registers, so the K/V loads of a tile depend on no load of the same iteration and
    Triton's pipeliner keeps ``num_stages - 1`` tiles of them in flight (a page-id load
    inside the iteration makes them an indirect load: one tile ahead, waited at once).

    ALIGNED_PAGES: every tile starts at a multiple of BLOCK_N (``lo`` does, the step is
    BLOCK_N), hence of PAGE_SIZE, so key ``start + j`` sits in slot ``j % PAGE_SIZE`` of
    the tile's page ``start // PAGE_SIZE + j // PAGE_SIZE``: the slot offsets and the
    rows' page positions are loop invariants, computed once; per tile only a scalar moves.
    """
    offs_n = tl.arange(0, BLOCK_N)
    if PAGED:
        last = hi - BLOCK_N
        page = tl.load(page_ptr + (lo + offs_n) // PAGE_SIZE, mask=lo <= last, other=0)
        if ALIGNED_PAGES:
            row_page = offs_n // PAGE_SIZE  # [BLOCK_N] page of each row, from the tile's first page
            if OFFSETS_32:
                slot_off = (offs_n % PAGE_SIZE) * stride_kt
            else:
                slot_off = (offs_n % PAGE_SIZE).to(tl.int64) * stride_kt
    for start in tl.range(lo, hi, BLOCK_N):
        if PAGED:
            if ALIGNED_PAGES:
                if OFFSETS_32:
                    k_off = page * stride_kp + slot_off
                else:
                    k_off = page.to(tl.int64) * stride_kp + slot_off
                # The next tile's page ids (the last tile re-reads its own: no mask needed).
                page = tl.load(page_ptr + tl.minimum(start + BLOCK_N, last) // PAGE_SIZE + row_page)
            else:
                k_off = _paged_rows(page, start, stride_kp, stride_kt, PAGE_SIZE, BLOCK_N, OFFSETS_32)
                page = tl.load(page_ptr + (tl.minimum(start + BLOCK_N, last) + offs_n) // PAGE_SIZE)
            v_off = k_off  # paged K and V views share their strides (one PagedKV)
        elif OFFSETS_32:
            t = start + offs_n
            k_off = t * stride_kt
            v_off = t * stride_vt
        else:
            t = (start + offs_n).to(tl.int64)
            k_off = t * stride_kt
            v_off = t * stride_vt
        acc, l_i, m_i = _full_tile(acc, l_i, m_i, q, k_ptr + k_off[:, None], v_ptr + v_off[:, None], qk_scale,
                                   HEAD_DIM, BLOCK_N, BLOCK_D, DOT_PRECISION)
    return acc, l_i, m_i


@triton.jit
def _masked_tiles(
    acc,  # [BLOCK_M, BLOCK_D] float32
    l_i,  # [BLOCK_M] float32
    m_i,  # [BLOCK_M] float32, log2 units
    q,  # [BLOCK_M, BLOCK_D] storage dtype
    k_ptr,  # like _full_tiles
    v_ptr,
    page_ptr,
    lo,  # first key (a multiple of BLOCK_N from the split start)
    hi,  # keys >= hi are never read
    row_hi,  # [BLOCK_M] int32, keys < row_hi are visible to a row
    stride_kp,
    stride_kt,
    stride_vt,
    qk_scale,
    PAGED: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    CAUSAL: tl.constexpr,  # row_hi differs per row: a tile may hold keys some of its rows do not see
):
    """The key tiles ``[lo, hi)`` with per-row key limits (the last partial tile, the
    causal diagonal band): a few tiles per program, plain per-token addressing.

    CAUSAL: a row's weight for a key it does not see is 0, and ``p @ v`` would still
    turn that key's NaN or inf value into ``0 * inf = NaN`` in the row. So such values
    are zeroed before the product and the key's score made NaN instead, which the mask
    then hides from the rows that do not see it (the float64 reference's rule: a key's
    non-finite value poisons exactly the rows that see it). Without CAUSAL every key
    below ``hi`` is seen by every row and none of this is needed."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    for start in tl.range(lo, hi, BLOCK_N):
        t = start + offs_n  # [BLOCK_N] key positions in the group's sequence
        t_ok = t < hi
        if PAGED:
            page = tl.load(page_ptr + t // PAGE_SIZE, mask=t_ok, other=0).to(tl.int64)
            k_off = page * stride_kp + (t % PAGE_SIZE).to(tl.int64) * stride_kt
            v_off = k_off  # paged K and V views share their strides
        else:
            k_off = t.to(tl.int64) * stride_kt
            v_off = t.to(tl.int64) * stride_vt
        k = _load_tile(k_ptr + k_off[:, None] + offs_d[None, :], t_ok, offs_d, True, HEAD_DIM, BLOCK_D)
        v = _load_tile(v_ptr + v_off[:, None] + offs_d[None, :], t_ok, offs_d, True, HEAD_DIM, BLOCK_D)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if CAUSAL:
            v_ok = tl.abs(v.to(tl.float32)) < float("inf")  # NaN fails the compare too
            v = tl.where(v_ok, v, tl.zeros_like(v))
            s = tl.where(tl.min(v_ok.to(tl.int32), 1)[None, :] == 0, float("nan"), s)
        s = tl.where(t[None, :] < row_hi[:, None], s, float("-inf"))
        acc, l_i, m_i = online_softmax_step(acc, l_i, m_i, s, v, qk_scale, True, DOT_PRECISION)
    return acc, l_i, m_i


@triton.jit
def _group_of_tile(
    tile,  # this program's M tile in the sync-free tile map
    qo_indptr_ptr,  # [num_groups + 1] int32
    kv_indptr_ptr,  # [num_groups + 1] int32, pages (PAGED) or tokens
    kv_last_page_len_ptr,  # [num_groups] int32 (PAGED only)
    search_steps,  # ceil(log2(num_groups))
    num_groups,
    GROUP_SIZE: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    PAGED: tl.constexpr,
):
    """``(qo_start, qo_len, local_tile, kv_start, kv_len)`` of the group owning ``tile``.

    The group is the largest ``g`` with ``start(g) <= tile``, ``start(g) = (qo_indptr[g] *
    G + g * (BLOCK_M - 1)) // BLOCK_M``: a binary search over ``qo_indptr`` on the device.
    """
    lo_g = num_groups * 0
    hi_g = num_groups
    for _ in range(search_steps):
        mid = (lo_g + hi_g) // 2
        mid_start = (tl.load(qo_indptr_ptr + mid) * GROUP_SIZE + mid * (BLOCK_M - 1)) // BLOCK_M
        go_right = mid_start <= tile
        lo_g = tl.where(go_right, mid, lo_g)
        hi_g = tl.where(go_right, hi_g, mid)
    group = lo_g
    qo_start = tl.load(qo_indptr_ptr + group)
    qo_len = tl.load(qo_indptr_ptr + group + 1) - qo_start
    local_tile = tile - (qo_start * GROUP_SIZE + group * (BLOCK_M - 1)) // BLOCK_M
    kv_start = tl.load(kv_indptr_ptr + group)
    kv_end = tl.load(kv_indptr_ptr + group + 1)
    if PAGED:
        last_len = tl.load(kv_last_page_len_ptr + group)
        kv_len = tl.where(kv_end > kv_start, (kv_end - kv_start - 1) * PAGE_SIZE + last_len, 0)
    else:
        kv_len = kv_end - kv_start
    return qo_start, qo_len, local_tile, kv_start, kv_len


@triton.jit
def prefill_kernel(
    q_ptr,  # [nnz_qo, num_qo_heads, head_dim]
    k_ptr,  # paged: [num_pages, page_size, num_kv_heads, head_dim] in any layout (strides); ragged: [nnz_kv, num_kv_heads, head_dim]
    v_ptr,  # like k_ptr
    o_ptr,  # [nnz_qo, num_splits, num_qo_heads, head_dim] q's dtype; num_splits == 1: the output itself
    lse_ptr,  # [nnz_qo, num_splits, num_qo_heads] float32, natural log
    qo_indptr_ptr,  # [num_groups + 1] int32 (not read when ONE_GROUP)
    kv_indptr_ptr,  # [num_groups + 1] int32, pages (PAGED) or tokens (not read when ONE_GROUP)
    kv_indices_ptr,  # [kv_indptr[-1]] int32 page ids (PAGED only)
    kv_last_page_len_ptr,  # [num_groups] int32 (PAGED only)
    search_steps,  # ceil(log2(num_groups)): binary-search iterations
    num_groups,
    one_group_qo_len,  # ONE_GROUP only: the number of queries
    one_group_kv_len,  # ONE_GROUP only: the number of keys
    stride_qt,
    stride_qh,
    stride_kp,  # paged: K and V share their page and token strides (one PagedKV)
    stride_kt,
    stride_kh,
    stride_vt,  # ragged only (paged V uses stride_kt)
    stride_vh,
    stride_ot,
    stride_os,
    stride_oh,
    stride_lt,
    stride_ls,
    stride_lh,
    qk_scale,  # sm_scale * log2(e)
    GROUP_SIZE: tl.constexpr,  # query heads per KV head
    PAGE_SIZE: tl.constexpr,  # tokens per page (PAGED; 1 otherwise)
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,  # next power of two >= HEAD_DIM (and >= 16)
    PAGED: tl.constexpr,
    CAUSAL: tl.constexpr,
    ONE_GROUP: tl.constexpr,  # one group, no indptr (shared_prefix_attention)
    DOT_PRECISION: tl.constexpr,
    OFFSETS_32: tl.constexpr,  # unmasked loop: K/V row offsets in int32 (every pool offset < 2**31)
    ALIGNED_PAGES: tl.constexpr,  # unmasked loop, paged, BLOCK_N % PAGE_SIZE == 0: page math hoisted
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)

    # ---- which group, which tile of it, and the group's KV range (no host reads)
    if ONE_GROUP:
        qo_start = 0
        qo_len = one_group_qo_len
        local_tile = tile
        kv_start = 0
        kv_len = one_group_kv_len
    else:
        qo_start, qo_len, local_tile, kv_start, kv_len = _group_of_tile(
            tile, qo_indptr_ptr, kv_indptr_ptr, kv_last_page_len_ptr, search_steps, num_groups,
            GROUP_SIZE, PAGE_SIZE, BLOCK_M, PAGED)
    row0 = local_tile * BLOCK_M
    if row0 >= qo_len * GROUP_SIZE:
        return  # a slot of the upper-bound grid that holds no tile

    # ---- the packed query rows: row r = (token r // G, head-in-group r % G)
    offs_m = row0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    tok = offs_m // GROUP_SIZE
    head = kv_head * GROUP_SIZE + offs_m % GROUP_SIZE
    row_ok = offs_m < qo_len * GROUP_SIZE
    d_ok = offs_d < HEAD_DIM
    q_off = (qo_start + tok).to(tl.int64) * stride_qt + head.to(tl.int64) * stride_qh
    q = tl.load(q_ptr + q_off[:, None] + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    # ---- key limits: row j of the group sees keys < kv_len - qo_len + j + 1 when causal
    if CAUSAL:
        shift = kv_len - qo_len + 1
        row_lim = tl.minimum(shift + tok, kv_len)  # [BLOCK_M], may be <= 0: sees nothing
        tok_last = tl.minimum((row0 + BLOCK_M - 1) // GROUP_SIZE, qo_len - 1)
        lim_all = tl.minimum(shift + row0 // GROUP_SIZE, kv_len)  # every row of the tile sees these
        lim_any = tl.minimum(shift + tok_last, kv_len)  # some row of the tile sees these
    else:
        row_lim = tl.full([BLOCK_M], 0, tl.int32) + kv_len
        lim_all = kv_len
        lim_any = kv_len

    # ---- this program's split of the KV range, in whole BLOCK_N tiles
    chunk = tl.cdiv(tl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N
    split_lo = split * chunk
    split_hi = tl.minimum(split_lo + chunk, kv_len)
    full_end = split_lo + tl.maximum(tl.minimum(split_hi, lim_all) - split_lo, 0) // BLOCK_N * BLOCK_N
    masked_end = tl.minimum(split_hi, lim_any)

    k_head = k_ptr + kv_head.to(tl.int64) * stride_kh
    v_head = v_ptr + kv_head.to(tl.int64) * stride_vh
    if PAGED:
        page_ptr = kv_indices_ptr + kv_start
    else:
        page_ptr = kv_indices_ptr  # not read
        if not ONE_GROUP:
            k_head += kv_start.to(tl.int64) * stride_kt
            v_head += kv_start.to(tl.int64) * stride_vt

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    acc, l_i, m_i = _full_tiles(
        acc, l_i, m_i, q, k_head, v_head, page_ptr, split_lo, full_end,
        stride_kp, stride_kt, stride_vt, qk_scale,
        PAGED, PAGE_SIZE, HEAD_DIM, BLOCK_N, BLOCK_D, DOT_PRECISION, OFFSETS_32, ALIGNED_PAGES,
    )
    # Chunks are whole BLOCK_N tiles, so no masked tile straddles a split boundary other
    # than kv_len itself: row_lim (<= kv_len) is the only per-row limit needed.
    acc, l_i, m_i = _masked_tiles(
        acc, l_i, m_i, q, k_head, v_head, page_ptr, full_end, masked_end, row_lim,
        stride_kp, stride_kt, stride_vt, qk_scale,
        PAGED, PAGE_SIZE, HEAD_DIM, BLOCK_N, BLOCK_D, DOT_PRECISION, CAUSAL,
    )

    # ---- normalise and store; a row that saw no key stores (0, -inf). Whether it saw one
    # comes from its key range in this split, never from l: a NaN key leaves l = NaN,
    # which must reach the output, not pass for "no keys". finish_state changes the base:
    # m_i + log2(l_i) is the LSE in log2 units, times ln(2) the natural log.
    o, lse = finish_state(acc, l_i, m_i, tl.minimum(split_hi, row_lim) > split_lo)
    tok64 = (qo_start + tok).to(tl.int64)
    o_off = tok64 * stride_ot + split.to(tl.int64) * stride_os + head.to(tl.int64) * stride_oh
    tl.store(o_ptr + o_off[:, None] + offs_d[None, :], o.to(o_ptr.dtype.element_ty),
             mask=row_ok[:, None] & d_ok[None, :])
    lse_off = tok64 * stride_lt + split.to(tl.int64) * stride_ls + head.to(tl.int64) * stride_lh
    tl.store(lse_ptr + lse_off, lse, mask=row_ok)


