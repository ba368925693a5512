"""The ``"all_heads"`` paged decode schedule: one program reads a key tile of several kv heads.

The per-request kernel (:mod:`cascadeinfer.kernels.decode_kernel`) gives each (request,
kv head) a program and packs the head's query group into the M side of ``tl.dot``, padded
to 16 rows; one 4-8 KiB tile a step. Beside a prefill kernel on another stream that keeps
too few bytes in flight on the SMs it gets (benchmarks/NOTES.md, "Cascade" v15, v16). Here
a program takes
``HEADS`` kv heads of one request (all 8 of a Llama-3-8B layer) and reads each key tile of
all of them at once: a 32 KiB K and a 32 KiB V load a step at bf16, head_dim 128 and 16
keys. The products are batched over the heads and transposed, the tile's keys on the M
side and the query group on N (``S^T = K Q^T``, ``O^T += V^T P^T``): no query row is padded
to 16, and the accumulator ``[HEADS, BLOCK_D, BLOCK_G]`` holds 4,096 floats at group 4,
so a program of 8 warps fits in 128 registers and two of them share an SM.

One program per (request, head block, split). A split owns pages ``[split * per, (split +
1) * per)`` of its request, ``per = cdiv(num_pages, num_splits)`` (the per-request kernel's
rule). Whole tiles run in the pipelined loop, one page index and one 64-bit base a tile
(pages of a multiple of 16 keys); the partial last tile runs after it, its keys past the
end reading the range's last key (a real key of the row, so the pool's garbage past a
row is never read) with only their scores masked. Smaller pages run every tile that way.
With one split the kernel writes ``(o, natural-log lse)``; with more, each split writes
its fp32 state and :func:`cascadeinfer.kernels.merge_many.merge_states`' kernel merges
them after.

Scores are kept in base 2 inside (``log2(e) * sm_scale`` folded into one scale, ``exp2``);
the stored LSE is a natural log; a row with no keys gives ``(0, -inf)``; a NaN or inf key
or value poisons its row (``finish_state``).
"""

import triton
import triton.language as tl

from cascadeinfer.kernels.decode_kernel import split_token_range
from cascadeinfer.kernels.softmax import finish_state


@triton.jit
def all_heads_kernel(
    q_ptr,  # [batch, num_qo_heads, head_dim], strides (stride_qb, stride_qh, 1)
    k_ptr,  # K pool: page/token/head strides below, head_dim stride 1
    v_ptr,  # V pool: same strides as K
    kv_indptr_ptr,  # [batch + 1] int32
    kv_indices_ptr,  # [>= kv_indptr[batch]] int32 page ids
    kv_last_page_len_ptr,  # [batch] int32
    o_ptr,  # out [batch, num_qo_heads, head_dim] (q's dtype), or fp32 partial outputs [batch, splits, ...]
    lse_ptr,  # lse [batch, num_qo_heads] fp32 natural log, or partial LSEs [batch, splits, num_qo_heads]
    qk_scale,  # sm_scale * log2(e)
    num_kv_heads,
    num_head_blocks,  # cdiv(num_kv_heads, HEADS)
    num_splits,
    stride_qb, stride_qh,
    stride_page, stride_token, stride_head,
    stride_ob, stride_os, stride_oh,  # stride_os: between splits' states (0 with one split)
    stride_lb, stride_ls, stride_lh,
    GROUP: tl.constexpr,  # num_qo_heads // num_kv_heads
    BLOCK_G: tl.constexpr,  # GROUP padded to a power of two
    HEADS: tl.constexpr,  # kv heads per program, a power of two
    PAD_HEADS: tl.constexpr,  # num_kv_heads is not a multiple of HEADS: the last block's heads masked
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # HEAD_DIM padded to a power of two >= 16
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,  # keys per tile, >= 16 (the products' K side)
    NUM_STAGES: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for float32 inputs: exact fp32 products
):
    pid = tl.program_id(0)
    split = pid % num_splits
    rest = pid // num_splits
    head_block = rest % num_head_blocks
    req = rest // num_head_blocks

    # This split's token range: pages [split * per, (split + 1) * per) of the request.
    row_start, t_begin, t_end = split_token_range(kv_indptr_ptr, kv_last_page_len_ptr, req, split, num_splits,
                                                  PAGE_SIZE)

    offs_h = tl.arange(0, HEADS)
    offs_g = tl.arange(0, BLOCK_G)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    kv_heads = head_block * HEADS + offs_h  # [HEADS]
    qo_heads = kv_heads[:, None] * GROUP + offs_g[None, :]  # [HEADS, BLOCK_G]
    rows_ok = (kv_heads < num_kv_heads)[:, None] & (offs_g < GROUP)[None, :]  # [HEADS, BLOCK_G]
    req64 = req.to(tl.int64)
    # Q^T: [HEADS, BLOCK_D, BLOCK_G], the products' N side (input dtype: feeds tl.dot only).
    qt = tl.load(q_ptr + req64 * stride_qb + qo_heads.to(tl.int64)[:, None, :] * stride_qh + offs_d[None, :, None],
                 mask=rows_ok[:, None, :] & (offs_d < HEAD_DIM)[None, :, None], other=0.0)
    # Loads are masked only where heads or head_dim are padded (constexpr), so the usual
    # shapes pipeline plain loads.
    PADDED: tl.constexpr = PAD_HEADS or BLOCK_D != HEAD_DIM
    kv_ok = (kv_heads < num_kv_heads)[:, None, None] & (offs_d < HEAD_DIM)[None, None, :]  # [HEADS, 1, BLOCK_D]
    vt_ok = (kv_heads < num_kv_heads)[:, None, None] & (offs_d < HEAD_DIM)[None, :, None]  # [HEADS, BLOCK_D, 1]
    head_off = kv_heads * stride_head  # [HEADS] int32: offsets inside one page
    page_ptr = kv_indices_ptr + row_start

    acc = tl.zeros((HEADS, BLOCK_D, BLOCK_G), dtype=tl.float32)  # O^T, un-normalised
    l_i = tl.zeros((HEADS, BLOCK_G), dtype=tl.float32)
    m_i = tl.full((HEADS, BLOCK_G), float("-inf"), dtype=tl.float32)
    if PAGE_SIZE % BLOCK_N == 0:
        # Whole tiles lie inside one page (splits start on a page): one index load and one
        # int64 base a tile, the rest offsets inside the page that never change.
        t_full = t_begin + tl.maximum(t_end - t_begin, 0) // BLOCK_N * BLOCK_N
        k_in = head_off[:, None, None] + offs_n[None, :, None] * stride_token + offs_d[None, None, :]
        vt_in = head_off[:, None, None] + offs_d[None, :, None] + offs_n[None, None, :] * stride_token
        for t in tl.range(t_begin, t_full, BLOCK_N, num_stages=NUM_STAGES):
            page = tl.load(page_ptr + t // PAGE_SIZE).to(tl.int64)
            base = page * stride_page + (t % PAGE_SIZE) * stride_token
            if PADDED:
                k = tl.load(k_ptr + base + k_in, mask=kv_ok, other=0.0)
                vt = tl.load(v_ptr + base + vt_in, mask=vt_ok, other=0.0)
            else:
                k = tl.load(k_ptr + base + k_in)
                vt = tl.load(v_ptr + base + vt_in)
            acc, l_i, m_i = _heads_step(acc, l_i, m_i, qt, k, vt, qk_scale, offs_n, False, DOT_PRECISION)
        if t_full < t_end:
            acc, l_i, m_i = _clamped_tile(acc, l_i, m_i, qt, k_ptr, v_ptr, page_ptr, t_full, t_end, head_off,
                                          kv_ok, vt_ok, stride_page, stride_token, qk_scale, offs_n, offs_d,
                                          PAGE_SIZE, PADDED, DOT_PRECISION)
    else:
        # Pages smaller than a tile (or not a multiple of it): one page index a key.
        for t in tl.range(t_begin, t_end, BLOCK_N, num_stages=NUM_STAGES):
            acc, l_i, m_i = _clamped_tile(acc, l_i, m_i, qt, k_ptr, v_ptr, page_ptr, t, t_end, head_off,
                                          kv_ok, vt_ok, stride_page, stride_token, qk_scale, offs_n, offs_d,
                                          PAGE_SIZE, PADDED, DOT_PRECISION)

    # Rows (kv head, query of its group) of the finished state: [HEADS * BLOCK_G, BLOCK_D].
    acc = tl.reshape(tl.permute(acc, (0, 2, 1)), (HEADS * BLOCK_G, BLOCK_D))
    o, lse = finish_state(acc, tl.reshape(l_i, (HEADS * BLOCK_G,)), tl.reshape(m_i, (HEADS * BLOCK_G,)),
                          t_end > t_begin)
    heads64 = tl.reshape(qo_heads, (HEADS * BLOCK_G,)).to(tl.int64)
    ok = tl.reshape(rows_ok, (HEADS * BLOCK_G,))
    split64 = split.to(tl.int64)
    o_offs = req64 * stride_ob + split64 * stride_os + heads64[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptr + o_offs, o.to(o_ptr.dtype.element_ty), mask=ok[:, None] & (offs_d < HEAD_DIM)[None, :])
    tl.store(lse_ptr + req64 * stride_lb + split64 * stride_ls + heads64 * stride_lh, lse, mask=ok)


@triton.jit
def _heads_step(acc, l_i, m_i, qt, k, vt, qk_scale, key_ok, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One key tile of every head into the transposed online softmax (the step of
    :mod:`cascadeinfer.kernels.softmax` over axis 1, the keys): ``k`` [HEADS, BLOCK_N,
    BLOCK_D] and ``vt`` [HEADS, BLOCK_D, BLOCK_N] in the input dtype; the state ``acc``
    [HEADS, BLOCK_D, BLOCK_G], ``l_i`` and ``m_i`` [HEADS, BLOCK_G] (base 2); with
    ``MASKED``, keys outside ``key_ok`` [BLOCK_N] score -inf."""
    s = tl.dot(k, qt, input_precision=DOT_PRECISION)  # S^T [HEADS, BLOCK_N, BLOCK_G], unscaled
    if MASKED:
        s = tl.where(key_ok[None, :, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    # A row that has seen only -inf scores (non-finite input) keeps m = -inf: subtract 0
    # there so that exp2(-inf - 0) = 0 rather than NaN (softmax.online_softmax_step).
    m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s * qk_scale - m_sub[:, None, :])
    alpha = tl.math.exp2(m_i - m_sub)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None, :]
    acc = tl.dot(vt, p.to(vt.dtype), acc, input_precision=DOT_PRECISION)  # O^T += V^T P^T
    return acc, l_i, m_new


@triton.jit
def _clamped_tile(acc, l_i, m_i, qt, k_ptr, v_ptr, page_ptr, t, t_end, head_off, kv_ok, vt_ok,
                  stride_page, stride_token, qk_scale, offs_n, offs_d,
                  PAGE_SIZE: tl.constexpr, PADDED: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """The tile of keys ``[t, t + BLOCK_N)`` with one page index per key; keys past
    ``t_end`` read the range's last key (a real key of the row, never the pool's garbage)
    and only their scores are masked, so they weigh exactly 0."""
    tok = tl.minimum(t + offs_n, t_end - 1)
    page = tl.load(page_ptr + tok // PAGE_SIZE).to(tl.int64)
    rows = page * stride_page + (tok % PAGE_SIZE) * stride_token  # [BLOCK_N] int64
    k_offs = head_off[:, None, None] + rows[None, :, None] + offs_d[None, None, :]
    vt_offs = head_off[:, None, None] + offs_d[None, :, None] + rows[None, None, :]
    if PADDED:
        k = tl.load(k_ptr + k_offs, mask=kv_ok, other=0.0)
        vt = tl.load(v_ptr + vt_offs, mask=vt_ok, other=0.0)
    else:
        k = tl.load(k_ptr + k_offs)
        vt = tl.load(v_ptr + vt_offs)
    return _heads_step(acc, l_i, m_i, qt, k, vt, qk_scale, t + offs_n < t_end, True, DOT_PRECISION)
