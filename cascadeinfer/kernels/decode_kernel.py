"""The per-request paged decode kernel behind :mod:`cascadeinfer.kernels.decode`.

One program per (request, kv head, split). The query heads that share a kv head are
packed into the M dimension of a ``tl.dot`` (padded to 16 rows and masked), so each K/V
tile is read from memory once for the whole group and the products run on tensor cores.
A split owns a contiguous range of its request's pages, ``cdiv(num_pages, num_splits)``
of them, computed inside the kernel from the page table; the grid comes from shapes only
(``batch * num_kv_heads * num_splits`` programs), so the launch never reads the page
table on the host and can be captured in a CUDA graph.

With one split the kernel writes the output and the natural-log LSE directly. With more,
each split writes its attention state (normalised fp32 output, natural-log LSE; an empty
range gives ``(0, -inf)``) to scratch; with ``MERGE`` the last split of each (request, kv
head) to finish then merges them straight into the output in q's dtype
(:mod:`cascadeinfer.kernels.split_merge`), else the launcher's merge kernel does.

The key loop runs whole tiles and then the partial last one with masked loads; with
``CLAMP_TAIL`` the partial tile runs inside the pipelined loop instead, its rows past the
range's end clamped to the range's last key (unmasked loads of a real key) and only their
scores masked, so they weigh exactly 0 (the ``"concurrent"`` schedule's tiles).

Inside the kernel scores are kept in base 2: ``log2(e) * sm_scale`` is folded into one
scale and the softmax uses ``exp2``; the LSE is turned back into a natural log at the store.

fp32 inputs use ``input_precision="ieee"`` for both products (exact fp32 on the GPU, no
tf32 rounding); fp16/bf16 inputs run the products on tensor cores with the probabilities
rounded to the input dtype before ``p @ v`` (the usual flash-attention trade: error about
one unit of the input precision).
"""

import triton
import triton.language as tl

from cascadeinfer.kernels.decode_balanced import attend_tile
from cascadeinfer.kernels.softmax import finish_state
from cascadeinfer.kernels.split_merge import arrive, merge_splits


@triton.jit
def decode_tile(
    acc, l_i, m_i,  # running state: [BLOCK_H, BLOCK_D] fp32, [BLOCK_H] fp32, [BLOCK_H] fp32 (base 2)
    q,  # [BLOCK_H, BLOCK_D] the packed query heads, input dtype
    k_ptr,  # K pool, already offset to this kv head
    v_ptr,  # V pool, already offset to this kv head
    page_ptr,  # [num_pages_of_request] int32: kv_indices + kv_indptr[request]
    t,  # first token of this tile (position inside the request)
    t_end,  # one past the last token this program reads
    stride_page, stride_token,
    qk_scale,  # sm_scale * log2(e)
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MASKED: tl.constexpr,  # the tile may reach past t_end (the tail tile): masked loads
    DOT_PRECISION: tl.constexpr,  # "ieee" for float32 inputs: exact fp32 products
    CLAMPED: tl.constexpr = False,  # the tile may reach past t_end: rows clamped, scores masked
):
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    key_ok = t + offs_n < t_end
    if CLAMPED:
        # Rows past t_end read the range's last key instead (a real key of this row, so
        # in bounds and never the pool's garbage); their scores are masked below, so they
        # weigh 0. Every load stays unmasked: the tail tile runs inside the pipelined loop.
        tok = tl.minimum(t + offs_n, t_end - 1)
    else:
        tok = t + offs_n  # [BLOCK_N]
    if PAGE_SIZE % BLOCK_N == 0:
        # The whole tile lies inside one page (t is a multiple of BLOCK_N): one index load.
        page = tl.load(page_ptr + t // PAGE_SIZE).to(tl.int64)
        rows = page * stride_page + (tok % PAGE_SIZE).to(tl.int64) * stride_token
    else:
        # Small pages: look up each token's page (BLOCK_N // PAGE_SIZE distinct indices).
        if MASKED:
            page = tl.load(page_ptr + tok // PAGE_SIZE, mask=tok < t_end, other=0)
        else:
            page = tl.load(page_ptr + tok // PAGE_SIZE)
        rows = page.to(tl.int64) * stride_page + (tok % PAGE_SIZE).to(tl.int64) * stride_token
    offs = rows[:, None] + offs_d[None, :]  # [BLOCK_N, BLOCK_D] int64

    # K and V stay in the input dtype: they only feed tl.dot (no elementwise math on them).
    if MASKED:
        mask_n = tok < t_end
        if BLOCK_D == HEAD_DIM:
            mask = mask_n[:, None]  # broadcast over head_dim by tl.load
        else:
            mask = mask_n[:, None] & (offs_d < HEAD_DIM)[None, :]
        k = tl.load(k_ptr + offs, mask=mask, other=0.0)
        v = tl.load(v_ptr + offs, mask=mask, other=0.0)
    elif BLOCK_D == HEAD_DIM:
        k = tl.load(k_ptr + offs)
        v = tl.load(v_ptr + offs)
    else:
        mask = (offs_n < BLOCK_N)[:, None] & (offs_d < HEAD_DIM)[None, :]
        k = tl.load(k_ptr + offs, mask=mask, other=0.0)
        v = tl.load(v_ptr + offs, mask=mask, other=0.0)

    return attend_tile(acc, l_i, m_i, q, k, v, qk_scale, key_ok, MASKED or CLAMPED, DOT_PRECISION)


@triton.jit
def decode_subtiles(
    acc, l_i, m_i,  # one running state per sub-tile: [SUBTILES, BLOCK_H, BLOCK_D], [SUBTILES, BLOCK_H] x2 (base 2)
    q3,  # [SUBTILES, BLOCK_H, BLOCK_D] the packed query heads, repeated per sub-tile, input dtype
    k_ptr, v_ptr,  # K and V pools, already offset to this kv head
    page_ptr,  # [num_pages_of_request] int32: kv_indices + kv_indptr[request]
    t,  # first token of this tile
    t_end,  # one past the last token this program reads
    stride_page, stride_token,
    qk_scale,  # sm_scale * log2(e)
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SUBTILES: tl.constexpr,
    MASKED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One BLOCK_N-key tile cut into SUBTILES runs of BLOCK_N // SUBTILES keys, each folded
    into its own online-softmax state. The products are one batched ``tl.dot`` over the
    sub-tiles, and Triton gives each batch entry its own warp (warps along the batch axis of
    a rank-3 dot), so every row max, row sum and the probabilities' path into ``p @ v``
    stay inside one warp. The 2-D form spreads its warps along the keys and exchanges
    them through shared memory every tile: its sm_90a loop body has 9 barriers and 7
    shared stores, this one 2 barriers (the copy pipeline's) and none (n32_w2_s5, bf16,
    D 128). The states meet once, in :func:`merge_subtiles`."""
    SUB: tl.constexpr = BLOCK_N // SUBTILES
    offs_w = tl.arange(0, SUBTILES)
    offs_n = tl.arange(0, SUB)
    offs_d = tl.arange(0, BLOCK_D)
    tok = t + offs_w[:, None] * SUB + offs_n[None, :]  # [SUBTILES, SUB]
    if MASKED:
        key_ok = tok < t_end
        page = tl.load(page_ptr + tok // PAGE_SIZE, mask=key_ok, other=0)
    else:
        page = tl.load(page_ptr + tok // PAGE_SIZE)
    rows = page.to(tl.int64) * stride_page + (tok % PAGE_SIZE).to(tl.int64) * stride_token
    offs = rows[:, :, None] + offs_d[None, None, :]  # [SUBTILES, SUB, BLOCK_D] int64
    if MASKED:
        if BLOCK_D == HEAD_DIM:
            mask = key_ok[:, :, None]
        else:
            mask = key_ok[:, :, None] & (offs_d < HEAD_DIM)[None, None, :]
        k = tl.load(k_ptr + offs, mask=mask, other=0.0)
        v = tl.load(v_ptr + offs, mask=mask, other=0.0)
    elif BLOCK_D == HEAD_DIM:
        k = tl.load(k_ptr + offs)
        v = tl.load(v_ptr + offs)
    else:
        mask = (offs_d < HEAD_DIM)[None, None, :]
        k = tl.load(k_ptr + offs, mask=mask, other=0.0)
        v = tl.load(v_ptr + offs, mask=mask, other=0.0)

    s = tl.dot(q3, tl.permute(k, (0, 2, 1)), input_precision=DOT_PRECISION)  # [SUBTILES, BLOCK_H, SUB]
    if MASKED:
        s = tl.where(key_ok[:, None, :], s, float("-inf"))
    # softmax.online_softmax_step along the last axis, with its empty-row guard: a
    # sub-tile may have seen only masked keys.
    m_new = tl.maximum(m_i, tl.max(s, 2) * qk_scale)
    m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s * qk_scale - m_sub[:, :, None])
    alpha = tl.math.exp2(m_i - m_sub)
    l_i = l_i * alpha + tl.sum(p, 2)
    acc = acc * alpha[:, :, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return acc, l_i, m_new


@triton.jit
def merge_subtiles(acc, l_i, m_i):
    """The sub-tiles' states ([SUBTILES, BLOCK_H, BLOCK_D], [SUBTILES, BLOCK_H] x2, base 2)
    folded into one ([BLOCK_H, BLOCK_D], [BLOCK_H] x2), once per program. A sub-tile that
    saw no key (m = -inf, l = 0) weighs 0; a NaN in any sub-tile's l or acc reaches the
    sum, and an +inf max gives exp2(inf - inf) = NaN: non-finite input stays loud."""
    m = tl.max(m_i, 0)
    m_sub = tl.where(m == float("-inf"), 0.0, m)
    w = tl.math.exp2(m_i - m_sub[None, :])  # [SUBTILES, BLOCK_H]
    return tl.sum(acc * w[:, :, None], 0), tl.sum(l_i * w, 0), m


@triton.jit
def split_token_range(kv_indptr_ptr, kv_last_page_len_ptr, req, split, num_splits, PAGE_SIZE: tl.constexpr):
    """Split ``split`` of request ``req``'s keys: pages ``[split * per, (split + 1) * per)``
    of the request, ``per = cdiv(num_pages, num_splits)``, as token positions. Returns
    ``(row_start, t_begin, t_end)``: the request's first entry in ``kv_indices`` and the
    split's tokens ``[t_begin, t_end)``, never past the row's last key (empty when
    ``t_end <= t_begin``). Every split-KV decode schedule cuts rows this way."""
    row_start = tl.load(kv_indptr_ptr + req)
    num_pages = tl.load(kv_indptr_ptr + req + 1) - row_start
    last_len = tl.load(kv_last_page_len_ptr + req)
    seq_len = tl.where(num_pages > 0, (num_pages - 1) * PAGE_SIZE + last_len, 0)
    per_split = tl.cdiv(num_pages, num_splits)
    t_begin = split * per_split * PAGE_SIZE
    t_end = tl.minimum((split + 1) * per_split * PAGE_SIZE, seq_len)
    return row_start, t_begin, t_end


@triton.jit(do_not_specialize=["num_kv_heads", "num_splits"])
def decode_kernel(
    q_ptr,  # [batch, num_qo_heads, head_dim], strides (stride_qb, stride_qh, 1)
    k_ptr,  # K pool: page/token/head strides below, head_dim stride 1
    v_ptr,  # V pool: same strides as K
    kv_indptr_ptr,  # [batch + 1] int32
    kv_indices_ptr,  # [>= kv_indptr[batch]] int32 page ids
    kv_last_page_len_ptr,  # [batch] int32
    o_ptr,  # [batch, num_qo_heads, head_dim] out, q's dtype, strides (stride_ob, stride_oh, 1)
    lse_ptr,  # [batch, num_qo_heads] float32 natural log, strides (stride_lb, stride_lh)
    part_o_ptr,  # [batch, num_splits, num_qo_heads, head_dim] float32 partial outputs (SPLIT)
    part_lse_ptr,  # [batch, num_splits, num_qo_heads] float32 natural-log partial LSEs (SPLIT)
    count_ptr,  # [batch * num_kv_heads] int32 arrival counters, zero (MERGE; left zero)
    qk_scale,  # sm_scale * log2(e)
    num_kv_heads,
    num_splits,
    stride_qb, stride_qh,
    stride_page, stride_token, stride_head,
    stride_ob, stride_oh,
    stride_lb, stride_lh,
    stride_pb, stride_ps, stride_ph,
    stride_plb, stride_pls, stride_plh,
    GROUP: tl.constexpr,  # num_qo_heads // num_kv_heads
    BLOCK_H: tl.constexpr,  # GROUP padded to a power of two >= 16
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # HEAD_DIM padded to a power of two >= 16
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,  # keys per tile
    SUBTILES: tl.constexpr,  # > 1: each tile cut into this many sub-tiles with a state each (decode_subtiles)
    CLAMP_TAIL: tl.constexpr,  # SUBTILES == 1: the partial last tile inside the loop, rows clamped (decode_tile)
    NUM_STAGES: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SPLIT: tl.constexpr,  # False: one split, write out and lse; True: write this split's partial state
    MERGE: tl.constexpr,  # SPLIT: the last split merges the partial states into out and lse
    BLOCK_G: tl.constexpr,  # MERGE: GROUP padded to a power of two
    SPLIT_BLOCK: tl.constexpr,  # MERGE: splits per tile of the merge
):
    pid = tl.program_id(0)
    kv_head = pid % num_kv_heads
    rest = pid // num_kv_heads
    split = rest % num_splits
    req = rest // num_splits

    row_start, t_begin, t_end = split_token_range(kv_indptr_ptr, kv_last_page_len_ptr, req, split, num_splits,
                                                  PAGE_SIZE)
    t_full = t_begin + tl.maximum(t_end - t_begin, 0) // BLOCK_N * BLOCK_N

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + offs_h  # [BLOCK_H] query heads of this kv head
    mask_h = offs_h < GROUP
    mask_q = mask_h[:, None] & (offs_d < HEAD_DIM)[None, :]
    q_offs = req.to(tl.int64) * stride_qb + heads.to(tl.int64)[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr + q_offs, mask=mask_q, other=0.0)  # input dtype: feeds tl.dot only

    head_off = kv_head.to(tl.int64) * stride_head
    k_head = k_ptr + head_off
    v_head = v_ptr + head_off
    page_ptr = kv_indices_ptr + row_start

    if SUBTILES == 1:
        acc = tl.zeros((BLOCK_H, BLOCK_D), dtype=tl.float32)
        l_i = tl.zeros((BLOCK_H,), dtype=tl.float32)
        m_i = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
        loop_end = t_full
        if CLAMP_TAIL:
            loop_end = t_end  # the partial last tile too, its rows clamped (decode_tile)
        for t in tl.range(t_begin, loop_end, BLOCK_N, num_stages=NUM_STAGES):
            acc, l_i, m_i = decode_tile(
                acc, l_i, m_i, q, k_head, v_head, page_ptr, t, t_end, stride_page, stride_token,
                qk_scale, PAGE_SIZE, BLOCK_N, HEAD_DIM, BLOCK_D, False, DOT_PRECISION, CLAMP_TAIL,
            )
        if not CLAMP_TAIL and t_full < t_end:
            acc, l_i, m_i = decode_tile(
                acc, l_i, m_i, q, k_head, v_head, page_ptr, t_full, t_end, stride_page, stride_token,
                qk_scale, PAGE_SIZE, BLOCK_N, HEAD_DIM, BLOCK_D, True, DOT_PRECISION,
            )
    else:
        q3 = tl.broadcast_to(q[None, :, :], (SUBTILES, BLOCK_H, BLOCK_D))
        acc3 = tl.zeros((SUBTILES, BLOCK_H, BLOCK_D), dtype=tl.float32)
        l3 = tl.zeros((SUBTILES, BLOCK_H), dtype=tl.float32)
        m3 = tl.full((SUBTILES, BLOCK_H), float("-inf"), dtype=tl.float32)
        for t in tl.range(t_begin, t_full, BLOCK_N, num_stages=NUM_STAGES):
            acc3, l3, m3 = decode_subtiles(
                acc3, l3, m3, q3, k_head, v_head, page_ptr, t, t_end, stride_page, stride_token,
                qk_scale, PAGE_SIZE, BLOCK_N, HEAD_DIM, BLOCK_D, SUBTILES, False, DOT_PRECISION,
            )
        if t_full < t_end:
            acc3, l3, m3 = decode_subtiles(
                acc3, l3, m3, q3, k_head, v_head, page_ptr, t_full, t_end, stride_page, stride_token,
                qk_scale, PAGE_SIZE, BLOCK_N, HEAD_DIM, BLOCK_D, SUBTILES, True, DOT_PRECISION,
            )
        acc, l_i, m_i = merge_subtiles(acc3, l3, m3)

    # Emptiness comes from the range, never from l: a NaN key leaves l = NaN, which must
    # reach the output, not pass for "no keys". finish_state changes the base: m and
    # log2(l) are base 2, the stored LSE is natural log.
    o, lse = finish_state(acc, l_i, m_i, t_end > t_begin)

    heads64 = heads.to(tl.int64)
    req64 = req.to(tl.int64)
    if SPLIT:
        p_offs = req64 * stride_pb + split.to(tl.int64) * stride_ps + heads64[:, None] * stride_ph + offs_d[None, :]
        tl.store(part_o_ptr + p_offs, o, mask=mask_q)
        p_lse_offs = req64 * stride_plb + split.to(tl.int64) * stride_pls + heads64 * stride_plh
        tl.store(part_lse_ptr + p_lse_offs, lse, mask=mask_h)
        if MERGE:
            # The last split of (request, kv head) to finish merges all of them into out
            # and lse (cascadeinfer.kernels.split_merge), over the GROUP real heads only.
            if arrive(count_ptr + req * num_kv_heads + kv_head, num_splits):
                offs_g = tl.arange(0, BLOCK_G)
                g_ok = offs_g < GROUP
                g_mask = g_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
                g_heads = (kv_head * GROUP + offs_g).to(tl.int64)
                o_all, lse_all = merge_splits(  # [BLOCK_G, BLOCK_D], [BLOCK_G]: new names, new shapes
                    part_o_ptr + req64 * stride_pb + g_heads[:, None] * stride_ph + offs_d[None, :],
                    part_lse_ptr + req64 * stride_plb + g_heads * stride_plh,
                    g_mask, g_ok, stride_ps, stride_pls, num_splits, SPLIT_BLOCK)
                o_offs = req64 * stride_ob + g_heads[:, None] * stride_oh + offs_d[None, :]
                tl.store(o_ptr + o_offs, o_all.to(o_ptr.dtype.element_ty), mask=g_mask)
                tl.store(lse_ptr + req64 * stride_lb + g_heads * stride_lh, lse_all, mask=g_ok)
    else:
        o_offs = req64 * stride_ob + heads64[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptr + o_offs, o.to(o_ptr.dtype.element_ty), mask=mask_q)
        tl.store(lse_ptr + req64 * stride_lb + heads64 * stride_lh, lse, mask=mask_h)
