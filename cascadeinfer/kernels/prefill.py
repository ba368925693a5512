"""Tensor-core prefill attention: ragged queries against paged or ragged KV.

One kernel serves three public entry points:

* :func:`batch_prefill_paged` — group ``g``'s queries ``q[qo_indptr[g]:qo_indptr[g+1]]``
  attend to group ``g``'s pages of a paged cache (CSR page table). Every cascade level
  above the last runs through it; the shared-prefix level is ONE group holding every
  query of the batch against a long prefix.
* :func:`batch_prefill_ragged` — the same against contiguous ragged K/V (new prompts).
* :func:`shared_prefix_attention` — every query against one contiguous prefix.

How the kernel is laid out (the ideas of FlashAttention-2 and Triton's
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
  states (o in q's dtype, LSE float32), and :func:`cascadeinfer.kernels.merge.merge_states`
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
  page position are hoisted out of it (:class:`AddressPath`). Larger pools keep int64.
  Which of the two a tile takes is measured (:func:`default_address_path`).
* **Tiles from shapes.** 128x128 tiles, 8 warps, 3 stages for long groups; groups of
  few packed rows (cascade middle levels) get 16-64-row tiles (:func:`default_tile_config`).

Precision: dot operands stay in the storage dtype (fp16 / bf16 on tensor cores), the
softmax and accumulators are float32. For float32 inputs both dots use
``input_precision="ieee"`` (true fp32 FMA on the GPU, slow but exact to ~1e-6) rather
than tf32: fp32 callers are asking for accuracy, speed is what fp16/bf16 are for.

LSE is natural log at every boundary; inside the kernel scores are kept in log2 units
(``log2(e) * sm_scale`` folded into one multiplier) so the softmax runs on ``exp2``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from cascadeinfer._checks import (
    FLOAT_DTYPES,
    capturing,
    check_int32_vector,
    check_last_dim_contiguous,
    check_tensor,
    default_sm_scale,
    same_device,
    use_triton,
)
from cascadeinfer.kernels.constants import LOG2E
from cascadeinfer.kernels.launch import LaunchCache, given, launch, recorded, scratch
from cascadeinfer.kernels.merge import finish_state, merge_states
from cascadeinfer.kernels.policy import (
    AddressPath,
    TileConfig,
    default_address_path,
    default_num_splits,
    exact_address_path,
    groups_tile_config,
    num_m_tiles,
    padded_head_dim,
)
from cascadeinfer.kernels.reference import attention_state_ref, batch_prefill_paged_ref, batch_prefill_ragged_ref
from cascadeinfer.layouts.indptr import validate_indptr
from cascadeinfer.layouts.page_table import check_pages_in_pool, validate_page_table
from cascadeinfer.layouts.paged_cache import (
    PagedKV,
    PagedKVCache,
    cache_tensors,
    check_layout_fits,
    unpack_paged_kv_cache,
)



# --------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------


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
def _softmax_step(
    acc,  # [BLOCK_M, BLOCK_D] float32
    l_i,  # [BLOCK_M] float32
    m_i,  # [BLOCK_M] float32, log2 units
    s,  # [BLOCK_M, BLOCK_N] float32 raw scores q·k (masked entries -inf)
    v,  # [BLOCK_N, BLOCK_D] storage dtype
    qk_scale,
    MASKED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One key tile's online-softmax update of ``(acc, l, m)``."""
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)  # log2 units (qk_scale > 0 keeps the max)
    if MASKED:
        # A row that has seen no key yet keeps m = -inf; subtract 0 there so that
        # exp2(-inf - 0) = 0 instead of exp2(-inf - -inf) = NaN.
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        # Every row sees every key of an unmasked tile: m_new is finite — unless non-finite
        # input makes every score the row has seen so far -inf; that row then comes out NaN
        # where the float64 reference gives those keys weight 0. A loud answer to garbage, which the
        # hot loop does not pay a per-tile guard to avoid.
        m_sub = m_new
    p = tl.math.exp2(s * qk_scale - m_sub[:, None])  # one FMA per score
    alpha = tl.math.exp2(m_i - m_sub)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return acc, l_i, m_new


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
    acc, l_i, m_i,  # running state, as in _softmax_step
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
    return _softmax_step(acc, l_i, m_i, s, v, qk_scale, False, DOT_PRECISION)


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
        acc, l_i, m_i = _softmax_step(acc, l_i, m_i, s, v, qk_scale, True, DOT_PRECISION)
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
def _prefill_kernel(
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


# --------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------

MAX_HEAD_DIM = 256


@dataclass(frozen=True, slots=True)
class _KVSource:
    """The KV side as the kernel sees it: base tensors, (page, token, head) strides and,
    for a paged cache, the CSR page table (``None`` where the kernel reads none)."""

    k: torch.Tensor
    v: torch.Tensor
    paged: bool
    page_size: int  # 1 for ragged KV (not read)
    num_kv_heads: int
    k_strides: tuple[int, int, int]  # (page, token, head); page stride 0 for ragged
    v_strides: tuple[int, int, int]
    indptr: torch.Tensor | None  # pages (paged) or tokens (ragged) per group; None: one group
    indices: torch.Tensor | None = None  # page ids (paged)
    last_page_len: torch.Tensor | None = None  # (paged)

    @property
    def max_kv_len(self) -> int:
        """Upper bound on one group's KV length, from shapes."""
        return self.indices.shape[0] * self.page_size if self.paged else self.k.shape[0]


def _paged_source(kv: PagedKV, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                  kv_last_page_len: torch.Tensor) -> _KVSource:
    strides = (kv.stride_page, kv.stride_token, kv.stride_head)  # K and V views share strides
    return _KVSource(kv.k, kv.v, True, kv.page_size, kv.num_kv_heads, strides, strides,
                     kv_indptr, kv_indices, kv_last_page_len)


def _grid_tiles(q: torch.Tensor, qo_indptr: torch.Tensor | None, kv: _KVSource, config: TileConfig) -> tuple[int, int]:
    """``(num_groups, M tiles of the grid)``; ``qo_indptr is None`` is one group."""
    num_groups = 1 if qo_indptr is None else qo_indptr.shape[0] - 1
    return num_groups, num_m_tiles(q.shape[0], num_groups, q.shape[1] // kv.num_kv_heads, config.block_m)


def _launch(
    q: torch.Tensor,
    qo_indptr: torch.Tensor | None,
    kv: _KVSource,
    o_dest: torch.Tensor,
    lse_dest: torch.Tensor,
    *,
    causal: bool,
    sm_scale: float,
    config: TileConfig,
    address: AddressPath | None = None,
) -> None:
    """Run the kernel into ``o_dest [nnz_qo, S, Hq, D]`` and ``lse_dest [nnz_qo, S, Hq]``.

    ``S = o_dest.shape[1]`` is the number of KV splits; with ``S == 1`` the destinations
    may be views of the caller's ``out``/``lse``. ``qo_indptr is None`` means one group of
    all queries against all of ``kv`` (ragged, starting at token 0). ``address``: the
    address switches (default: :func:`default_address_path`); a forced one is checked
    against the same bounds, so the int32 path never runs where it could wrap.
    """
    nnz_qo, num_qo_heads, head_dim = q.shape
    num_groups, num_tiles = _grid_tiles(q, qo_indptr, kv, config)
    num_splits = o_dest.shape[1]
    if nnz_qo == 0 or num_groups == 0 or num_tiles == 0:
        return
    one_group = qo_indptr is None
    dummy = kv.k  # stands in for pointers the kernel does not read
    if kv.paged and kv.k_strides[:2] != kv.v_strides[:2]:
        raise AssertionError("paged K and V views must share page and token strides")  # _paged_source's promise
    safe = exact_address_path(kv, config)
    if address is None:
        address = default_address_path(kv, config)
    elif (address.offsets_32 and not safe.offsets_32) or (address.aligned_pages and not safe.aligned_pages):
        raise ValueError(f"address: {address} is not exact for these shapes (allowed at most {safe})")
    grid = (num_tiles, kv.num_kv_heads, num_splits)
    launch(
        _prefill_kernel, grid,
        q, kv.k, kv.v, o_dest, lse_dest,
        dummy if one_group else qo_indptr,
        dummy if one_group else kv.indptr,
        kv.indices if kv.paged else dummy,
        kv.last_page_len if kv.paged else dummy,
        (num_groups - 1).bit_length(), num_groups,
        nnz_qo, kv.k.shape[0] if one_group else 0,
        q.stride(0), q.stride(1),
        *kv.k_strides, *kv.v_strides[1:],  # V's page stride is K's (checked above)
        o_dest.stride(0), o_dest.stride(1), o_dest.stride(2),
        lse_dest.stride(0), lse_dest.stride(1), lse_dest.stride(2),
        sm_scale * LOG2E,
        GROUP_SIZE=num_qo_heads // kv.num_kv_heads,
        PAGE_SIZE=kv.page_size,
        HEAD_DIM=head_dim,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_D=padded_head_dim(head_dim),
        PAGED=kv.paged,
        CAUSAL=causal,
        ONE_GROUP=one_group,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        OFFSETS_32=address.offsets_32,
        ALIGNED_PAGES=address.aligned_pages,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


def _run(
    q: torch.Tensor,
    qo_indptr: torch.Tensor | None,
    kv: _KVSource,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    causal: bool,
    sm_scale: float,
    num_splits: int | None = None,
    config: TileConfig | None = None,
    address: AddressPath | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick tiles and splits from shapes, launch, merge the splits into ``out``/``lse``."""
    nnz_qo, num_qo_heads, head_dim = q.shape
    if config is None:
        num_groups = 1 if qo_indptr is None else qo_indptr.shape[0] - 1
        config = groups_tile_config(nnz_qo, num_groups, num_qo_heads // kv.num_kv_heads, head_dim, q.dtype)
    if num_splits is None:
        num_splits = default_num_splits(_grid_tiles(q, qo_indptr, kv, config)[1], kv.num_kv_heads, kv.max_kv_len,
                                        q.device)
    if num_splits == 1:
        _launch(q, qo_indptr, kv, out.unsqueeze(1), lse.unsqueeze(1), causal=causal, sm_scale=sm_scale,
                config=config, address=address)
        return out, lse
    # One partial state per split (o in q's dtype, as merge_states takes one dtype; LSE
    # float32). Every (row, split) is written, an empty split as the identity (0, -inf).
    part_o = scratch((nnz_qo, num_splits, num_qo_heads, head_dim), q.dtype, q.device)
    part_lse = scratch((nnz_qo, num_splits, num_qo_heads), torch.float32, q.device)
    _launch(q, qo_indptr, kv, part_o, part_lse, causal=causal, sm_scale=sm_scale, config=config, address=address)
    merge_states(part_o, part_lse, out=out, out_lse=lse)
    return out, lse


# ---- argument checks shared by the three entry points


def _check_q(q: object) -> torch.Tensor:
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    check_last_dim_contiguous("q", q)
    if q.shape[2] > MAX_HEAD_DIM:
        raise ValueError(f"q: head_dim {q.shape[2]} is not supported (at most {MAX_HEAD_DIM})")
    return q


def _check_kv_matches_q(q: torch.Tensor, kv_name: str, dtype: torch.dtype, num_kv_heads: int, head_dim: int) -> None:
    if dtype != q.dtype:
        raise TypeError(f"{kv_name}: expected dtype {q.dtype} (like q), got {dtype}")
    if head_dim != q.shape[2]:
        raise ValueError(f"{kv_name}: head_dim {head_dim} does not match q's head_dim {q.shape[2]}")
    if q.shape[1] % num_kv_heads != 0:
        raise ValueError(
            f"q: num_qo_heads {q.shape[1]} is not a multiple of num_kv_heads {num_kv_heads} of {kv_name}"
        )


def _outputs(q: torch.Tensor, out: torch.Tensor | None, lse: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The caller's ``out``/``lse`` after checks, or fresh ones: o like q, lse float32
    [nnz_qo, Hq] (a replayed call takes :meth:`Recording.outputs` instead)."""
    nnz_qo, num_qo_heads, _ = q.shape
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    else:
        check_tensor("out", out, ndim=3, dtypes=(q.dtype,), device=q.device, shape=tuple(q.shape))
        check_last_dim_contiguous("out", out)
    if lse is None:
        lse = torch.empty((nnz_qo, num_qo_heads), dtype=torch.float32, device=q.device)
    else:
        check_tensor("lse", lse, ndim=2, dtypes=(torch.float32,), device=q.device, shape=(nnz_qo, num_qo_heads))
    return out, lse


def _check_qo_indptr(qo_indptr: object, device: torch.device) -> None:
    check_int32_vector("qo_indptr", qo_indptr, device)
    if qo_indptr.shape[0] < 1:
        raise ValueError("qo_indptr: expected [num_groups + 1] entries, got none")


def _check_flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected a bool, got {type(value).__name__}")
    return value


def _store(out: torch.Tensor, lse: torch.Tensor, o64: torch.Tensor, lse64: torch.Tensor):
    """The plain-CPU path: the float64 reference, cast into the caller's buffers."""
    out.copy_(o64)
    lse.copy_(lse64)
    return out, lse


# ---- public entry points


def batch_prefill_paged(
    q: torch.Tensor,
    qo_indptr: torch.Tensor,
    paged_kv_cache: PagedKVCache,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_last_page_len: torch.Tensor,
    *,
    causal: bool = False,
    kv_layout: str = "NHD",
    sm_scale: float | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    validate: bool = True,
    num_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ragged query groups over their pages of a paged KV cache.

    Args:
        q: ``[nnz_qo, num_qo_heads, head_dim]`` fp16 / bf16 / fp32, last dim stride 1
            (other strides honoured).
        qo_indptr: int32 ``[num_groups + 1]``; group ``g`` owns queries
            ``q[qo_indptr[g]:qo_indptr[g + 1]]`` (starts at 0, ends at ``nnz_qo``).
        paged_kv_cache: NHD ``[num_pages, 2, page_size, Hkv, D]`` or HND
            ``[num_pages, 2, Hkv, page_size, D]``, or a ``(k, v)`` tuple of the per-tensor
            form; q's dtype; any positive page_size.
        kv_indptr: int32 ``[num_groups + 1]``; group ``g`` owns the pages
            ``kv_indices[kv_indptr[g]:kv_indptr[g + 1]]``.
        kv_indices: int32 ``[>= kv_indptr[-1]]`` page ids.
        kv_last_page_len: int32 ``[num_groups]``, in ``1..page_size`` for groups with pages;
            a group's KV length is ``(pages - 1) * page_size + last_page_len`` (0 without pages).
        causal: query ``j`` of a group of ``n`` queries and ``L`` keys sees keys
            ``<= L - n + j`` (the last query is aligned with the last key).
        kv_layout: ``"NHD"`` or ``"HND"``.
        sm_scale: softmax scale, default ``head_dim ** -0.5``.
        out: optional output buffer like ``q`` (shape, dtype; last dim stride 1).
        lse: optional float32 ``[nnz_qo, num_qo_heads]`` buffer.
        validate: read the index tensors on the host to check their contents (skipped
            while a CUDA graph is being captured). Pass False once they are known good.
        num_splits: KV splits per group (their states merged into ``out``); None: as
            many as fill one wave of programs (:func:`default_num_splits`, from shapes).
            Fewer leave SMs free for work on another stream (the cascade's suffix decode).

    Returns:
        ``(o, lse)``: ``o`` like ``q``; ``lse`` float32 ``[nnz_qo, num_qo_heads]``, NATURAL
        log. A query that sees no key (a group without pages, a causal row before the
        first key) gets ``o = 0, lse = -inf``.

    ``num_qo_heads`` must be a multiple of ``num_kv_heads``. No host reads on the launch
    path (with ``validate=False``), so the call can be captured in a CUDA graph.
    """
    cache = cache_tensors(paged_kv_cache)
    rec, key = _PAGED.find(
        (q, qo_indptr, *cache, kv_indptr, kv_indices, kv_last_page_len, *given(out, lse)),
        (len(cache), out is None, lse is None, causal, kv_layout, sm_scale, num_splits),
        lengthless=(len(cache) + 3,))
    if rec is not None:  # a call of this signature passed every shape check already
        out, lse = rec.outputs(out, lse, len(cache) + 5)
        if validate and not capturing():
            _check_paged_contents(q, qo_indptr, unpack_paged_kv_cache(paged_kv_cache, kv_layout), kv_indptr,
                                  kv_indices, kv_last_page_len)
        rec.replay((q, qo_indptr, *cache, kv_indptr, kv_indices, kv_last_page_len, out, lse))
        return out, lse
    _check_q(q)
    _check_flag("causal", causal)
    if num_splits is not None and (not isinstance(num_splits, int) or isinstance(num_splits, bool) or num_splits < 1):
        raise ValueError(f"num_splits: expected a positive int or None, got {num_splits!r}")
    kv = unpack_paged_kv_cache(paged_kv_cache, kv_layout)
    check_layout_fits(kv, num_qo_heads=q.shape[1],
                      kv_last_page_len=kv_last_page_len if validate and not capturing() else None)
    device = same_device(("q", q), ("paged_kv_cache", kv.k))
    _check_qo_indptr(qo_indptr, device)
    check_tensor("kv_indptr", kv_indptr, device=device, shape=(qo_indptr.shape[0],))
    _check_kv_matches_q(q, "paged_kv_cache", kv.dtype, kv.num_kv_heads, kv.head_dim)
    scale = default_sm_scale(q.shape[2], sm_scale)
    out, lse = _outputs(q, out, lse)
    if validate and not capturing():
        _check_paged_contents(q, qo_indptr, kv, kv_indptr, kv_indices, kv_last_page_len)
    else:
        validate_page_table(kv_indptr, kv_indices, kv_last_page_len, kv.page_size, kv.num_pages, contents=False)
    if not use_triton(device):
        check_pages_in_pool(kv_indptr.cpu(), kv_indices.cpu(), kv.num_pages)
        o64, lse64 = batch_prefill_paged_ref(
            q, qo_indptr, paged_kv_cache, kv_indptr, kv_indices, kv_last_page_len,
            causal=causal, kv_layout=kv_layout, sm_scale=scale,
        )
        return _store(out, lse, o64, lse64)
    source = _paged_source(kv, kv_indptr, kv_indices, kv_last_page_len)
    roots = (q, qo_indptr, *cache_tensors(paged_kv_cache), kv_indptr, kv_indices, kv_last_page_len, out, lse)
    with recorded(_PAGED, key, roots):
        _run(q, qo_indptr, source, out, lse, causal=causal, sm_scale=scale, num_splits=num_splits)
    return out, lse


def _check_paged_contents(q, qo_indptr, kv: PagedKV, kv_indptr, kv_indices, kv_last_page_len) -> None:
    """The content checks of :func:`batch_prefill_paged` (a host read): the page-table rule
    against this pool, and ``qo_indptr`` splitting exactly the ``nnz_qo`` queries."""
    validate_page_table(kv_indptr, kv_indices, kv_last_page_len, kv.page_size, kv.num_pages)
    validate_indptr("qo_indptr", qo_indptr, total=q.shape[0])


# Recordings of the public prefill launchers' calls, by signature (cascadeinfer.kernels.launch).
_PAGED, _RAGGED, _SHARED = LaunchCache(), LaunchCache(), LaunchCache()


def _ragged_source(q: torch.Tensor, k: object, v: object, kv_indptr: torch.Tensor | None) -> _KVSource:
    check_tensor("k", k, ndim=3, dtypes=FLOAT_DTYPES, device=q.device)
    check_tensor("v", v, ndim=3, dtypes=(k.dtype,), device=q.device, shape=tuple(k.shape))
    check_last_dim_contiguous("k", k)
    check_last_dim_contiguous("v", v)
    _check_kv_matches_q(q, "k", k.dtype, k.shape[1], k.shape[2])
    return _KVSource(k, v, False, 1, k.shape[1], (0, k.stride(0), k.stride(1)), (0, v.stride(0), v.stride(1)),
                     kv_indptr)


def batch_prefill_ragged(
    q: torch.Tensor,
    qo_indptr: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_indptr: torch.Tensor,
    *,
    causal: bool = False,
    sm_scale: float | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ragged query groups over ragged contiguous K/V (prefill of new prompts).

    Args:
        q: ``[nnz_qo, num_qo_heads, head_dim]`` fp16 / bf16 / fp32, last dim stride 1.
        qo_indptr: int32 ``[num_groups + 1]`` (starts at 0, ends at ``nnz_qo``).
        k, v: ``[nnz_kv, num_kv_heads, head_dim]``, q's dtype, last dim stride 1 (other
            strides honoured, and may differ between k and v).
        kv_indptr: int32 ``[num_groups + 1]``; group ``g`` owns keys
            ``k[kv_indptr[g]:kv_indptr[g + 1]]`` (starts at 0, ends at most at ``nnz_kv``).
        causal, sm_scale, out, lse, validate: as in :func:`batch_prefill_paged`.

    Returns:
        ``(o, lse)``: ``o`` like ``q``; ``lse`` float32 ``[nnz_qo, num_qo_heads]``, natural
        log; ``(0, -inf)`` for a query that sees no key.
    """
    rec, key = _RAGGED.find((q, qo_indptr, k, v, kv_indptr, *given(out, lse)),
                            (out is None, lse is None, causal, sm_scale))
    if rec is None:
        _check_q(q)
        _check_flag("causal", causal)
        source = _ragged_source(q, k, v, kv_indptr)
        _check_qo_indptr(qo_indptr, q.device)
        check_int32_vector("kv_indptr", kv_indptr, q.device, length=qo_indptr.shape[0])
        scale = default_sm_scale(q.shape[2], sm_scale)
    out, lse = _outputs(q, out, lse) if rec is None else rec.outputs(out, lse, 5)
    if validate and not capturing():
        validate_indptr("qo_indptr", qo_indptr, total=q.shape[0])
        validate_indptr("kv_indptr", kv_indptr)
        if kv_indptr[-1].item() > k.shape[0]:
            raise ValueError(f"kv_indptr: last entry {kv_indptr[-1].item()} exceeds nnz_kv = {k.shape[0]} keys in k")
    roots = (q, qo_indptr, k, v, kv_indptr, out, lse)
    if rec is not None:
        rec.replay(roots)
        return out, lse
    if not use_triton(q.device):
        o64, lse64 = batch_prefill_ragged_ref(q, qo_indptr, k, v, kv_indptr, causal=causal, sm_scale=scale)
        return _store(out, lse, o64, lse64)
    with recorded(_RAGGED, key, roots):
        _run(q, qo_indptr, source, out, lse, causal=causal, sm_scale=scale)
    return out, lse


def shared_prefix_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    sm_scale: float | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every query attends to all of one contiguous prefix (non-causal).

    Args:
        q: ``[n, num_qo_heads, head_dim]`` fp16 / bf16 / fp32, last dim stride 1.
        k, v: ``[L, num_kv_heads, head_dim]``, q's dtype, last dim stride 1 (other strides
            honoured). ``L = 0`` gives ``(0, -inf)`` everywhere.
        sm_scale, out, lse: as in :func:`batch_prefill_paged`.

    Returns:
        ``(o, lse)``: ``o`` like ``q``; ``lse`` float32 ``[n, num_qo_heads]``, natural log.

    Reads no index tensor at all: the KV split count and the grid come from the shapes.
    """
    rec, key = _SHARED.find((q, k, v, *given(out, lse)), (out is None, lse is None, sm_scale))
    if rec is not None:
        out, lse = rec.outputs(out, lse, 3)
        rec.replay((q, k, v, out, lse))
        return out, lse
    _check_q(q)
    source = _ragged_source(q, k, v, None)
    scale = default_sm_scale(q.shape[2], sm_scale)
    out, lse = _outputs(q, out, lse)
    if not use_triton(q.device):
        o64, lse64 = attention_state_ref(q, k, v, sm_scale=scale)
        return _store(out, lse, o64, lse64)
    with recorded(_SHARED, key, (q, k, v, out, lse)):
        _run(q, None, source, out, lse, causal=False, sm_scale=scale)
    return out, lse
