"""The balanced schedule of :func:`cascadeinfer.kernels.decode.batch_decode_paged`: the KV
of the whole batch split evenly over a fixed grid (balanced split-KV, planned on the device).

The per-request schedule (in :mod:`cascadeinfer.kernels.decode`) cuts every request into the
same number of splits; with equal lengths and full waves it is the faster of the two. This
one wins where that plan leaves SMs idle: requests of different lengths (one 64K-token
request among short ones) and grids that end in a partial wave. The public entry point, its
checks and the choice between the two live in ``decode.py``; this module holds the kernels
and their launch.

Work: for one kv head, the pages of all requests laid end to end — ``kv_indptr`` is
exactly the prefix sum of that concatenation. The grid is fixed from shapes only: ``P``
programs per kv head (``num_splits``; by default one wave of the chosen launch config,
:func:`cascadeinfer.kernels.decode.balanced_num_programs`). Program ``p`` reads ``total = kv_indptr[batch] -
kv_indptr[0]`` on the device, takes pages ``[p*W, (p+1)*W)`` of the concatenation with
``W = max(cdiv(total, P), min_pages)``, finds the request that holds its first page by
counting the ``kv_indptr`` entries at or below it (a vector compare over blocks of
``kv_indptr``, no chain of scalar loads), and walks the requests until its range ends.
Each (program, request) piece is a *segment*; a segment covering its request's whole
page range writes ``out``/``lse`` directly, a partial one writes an fp32 attention state
into scratch slot ``p + r`` (the programs touching request ``r`` form a contiguous range
``a_r..b_r`` and ``a_{r+1} >= b_r``, so ``p + r`` is unique: ``P + batch`` slots).
Stage 2 (``_balanced_merge_kernel``, one program per (stage-1 program p, block of query
heads)) repeats the search for p's pages, finds the request that starts in them and runs
past them (if any), and merges its slots ``a_r + r .. b_r + r`` into ``out``/``lse``;
every other program exits. Its plan reads only ``kv_indptr``, so on sm_90+ it is a
programmatic dependent launch that plans while stage 1 runs and waits only to merge.
Requests with no pages get ``(0, -inf)`` from the one stage-1 program whose range ends at
or after their position (program 0 for the leading ones).

Nothing is read on the host (the grid comes from shapes, ``W`` and the split points from
the device), so one captured CUDA graph serves any page table of the same shapes —
including a different total number of pages — and variable lengths are balanced: one
64K-token request among a hundred short ones is cut into ``P`` equal pieces, not one.

Inside a segment the query heads that share a kv head are packed into the M dimension of
a ``tl.dot`` (padded to 16 rows and masked), so each K/V tile is read from memory once
for the whole group and the products run on tensor cores. Scores are kept in base 2:
``log2(e) * sm_scale`` is folded into one scale and the softmax uses ``exp2``; the LSE is
turned back into a natural log at the store. fp32 inputs use ``input_precision="ieee"``
(exact fp32 products); fp16/bf16 inputs round the probabilities to the input dtype before
``p @ v`` (the usual flash-attention trade: error about one unit of the input precision).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from cascadeinfer._device import next_power_of_2
from cascadeinfer.kernels.constants import KERNEL_LN2, KERNEL_LOG2E
from cascadeinfer.kernels.launch import launch, scratch
from cascadeinfer.kernels.softmax import finish_state, online_softmax_step
from cascadeinfer.layouts.paged_cache import PagedKV


@triton.jit
def _clamped_tile(
    acc, l_i, m_i,  # running state: [BLOCK_H, BLOCK_D] fp32, [BLOCK_H] fp32, [BLOCK_H] fp32 (base 2)
    q,  # [BLOCK_H, BLOCK_D] the packed query heads, input dtype
    k_ptr,  # K pool, already offset to this kv head
    v_ptr,  # V pool, already offset to this kv head
    page_ptr,  # [num_pages_of_request] int32: kv_indices + kv_indptr[request]
    t,  # first token of this tile (position inside the request)
    t_end,  # one past the last token of this segment
    stride_page, stride_token,
    qk_scale,  # sm_scale * log2(e)
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for float32 inputs: exact fp32 products
):
    """One BLOCK_N-key tile of the online softmax; keys at or past t_end are masked."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    tok = t + offs_n  # [BLOCK_N]
    # Keys past t_end (the segment's last tile) read the last real key again — its page id
    # is in the table and its memory valid — rather than predicated loads (sm_90a: ~30 PTX
    # instructions fewer per tile, 168 registers against 210); their scores are masked.
    tok_ld = tl.minimum(tok, t_end - 1)
    if PAGE_SIZE % BLOCK_N == 0:
        # The whole tile lies inside one page (t is a multiple of BLOCK_N): one index load.
        page = tl.load(page_ptr + t // PAGE_SIZE).to(tl.int64)
    else:
        # Small pages: look up each token's page (BLOCK_N // PAGE_SIZE distinct indices).
        page = tl.load(page_ptr + tok_ld // PAGE_SIZE).to(tl.int64)
    rows = page * stride_page + (tok_ld % PAGE_SIZE).to(tl.int64) * stride_token
    offs = rows[:, None] + offs_d[None, :]  # [BLOCK_N, BLOCK_D] int64

    # K and V stay in the input dtype: they only feed tl.dot (no elementwise math on them).
    if BLOCK_D == HEAD_DIM:
        k = tl.load(k_ptr + offs)
        v = tl.load(v_ptr + offs)
    else:
        mask = (offs_n < BLOCK_N)[:, None] & (offs_d < HEAD_DIM)[None, :]
        k = tl.load(k_ptr + offs, mask=mask, other=0.0)
        v = tl.load(v_ptr + offs, mask=mask, other=0.0)

    return attend_tile(acc, l_i, m_i, q, k, v, qk_scale, tok < t_end, True, DOT_PRECISION)


@triton.jit
def attend_tile(
    acc, l_i, m_i,  # running state: [BLOCK_H, BLOCK_D] fp32, [BLOCK_H] fp32, [BLOCK_H] fp32 (base 2)
    q,  # [BLOCK_H, BLOCK_D] the packed query heads, input dtype
    k, v,  # [BLOCK_N, BLOCK_D] the tile's keys and values, input dtype
    qk_scale,  # sm_scale * log2(e)
    key_ok,  # [BLOCK_N] keys that count (used when MASKED)
    MASKED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for float32 inputs
):
    """One loaded K/V tile into the online softmax (both decode schedules): the scores
    ``q @ k^T`` of the packed heads, keys outside ``key_ok`` masked, then the shared step.
    A decode row is one token's query head: it may have seen no key yet only when a
    masked tile or non-finite input made every score -inf, and the step guards that
    on every tile (one select per head, nothing beside the tile's loads)."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_H, BLOCK_N], unscaled
    if MASKED:
        s = tl.where(key_ok[None, :], s, float("-inf"))
    return online_softmax_step(acc, l_i, m_i, s, v, qk_scale, True, DOT_PRECISION)


@triton.jit
def _tile_mask(row_mask, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """[rows, BLOCK_D] mask from a row mask; no head_dim compare when nothing is padded."""
    if BLOCK_D == HEAD_DIM:
        return row_mask[:, None]  # broadcast over head_dim by tl.load / tl.store
    else:
        return row_mask[:, None] & (offs_d < HEAD_DIM)[None, :]


@triton.jit
def _split_points(kv_indptr_ptr, batch, num_programs, min_pages, prog, BLOCK_B: tl.constexpr):
    """Where program ``prog``'s pages lie in the concatenation of the batch's pages, and
    which requests hold them. Returns ``(ip0, total, per, x0, x1, d_x0m, d_x0, d_x1m, d_x1,
    end_x1)``: ``per`` = W pages per program, the pages ``[x0, x1)``, ``d(x) = #{r :
    kv_indptr[r + 1] - ip0 <= x}`` (the first request that holds page x) at x0 - 1, x0,
    x1 - 1 and x1, and ``end_x1`` the absolute end of request d(x1) (the smallest
    kv_indptr[r + 1] above x1). Each step compares a block of BLOCK_B entries at once; the
    first block is loaded before anything needs the totals, so batches up to BLOCK_B cost
    one round trip."""
    offs_b = tl.arange(0, BLOCK_B)
    big = 2147483647
    ends = tl.load(kv_indptr_ptr + 1 + offs_b, mask=offs_b < batch, other=big)
    ip0 = tl.load(kv_indptr_ptr)
    total = tl.load(kv_indptr_ptr + batch) - ip0  # pages of the whole batch
    per = tl.maximum(tl.cdiv(total, num_programs), min_pages)  # W >= 1
    x0 = prog * per
    x1 = tl.minimum(x0 + per, total)
    a0 = ip0 + x0  # absolute positions, comparable with kv_indptr entries
    a1 = ip0 + x1
    d_x0m = tl.sum((ends <= a0 - 1).to(tl.int32), 0)
    d_x0 = tl.sum((ends <= a0).to(tl.int32), 0)
    d_x1m = tl.sum((ends <= a1 - 1).to(tl.int32), 0)
    d_x1 = tl.sum((ends <= a1).to(tl.int32), 0)
    end_x1 = tl.min(tl.where(ends > a1, ends, big), 0)
    for b0 in range(BLOCK_B, batch, BLOCK_B):
        offs = b0 + offs_b
        ends = tl.load(kv_indptr_ptr + 1 + offs, mask=offs < batch, other=big)
        d_x0m += tl.sum((ends <= a0 - 1).to(tl.int32), 0)
        d_x0 += tl.sum((ends <= a0).to(tl.int32), 0)
        d_x1m += tl.sum((ends <= a1 - 1).to(tl.int32), 0)
        d_x1 += tl.sum((ends <= a1).to(tl.int32), 0)
        end_x1 = tl.minimum(end_x1, tl.min(tl.where(ends > a1, ends, big), 0))
    return ip0, total, per, x0, x1, d_x0m, d_x0, d_x1m, d_x1, end_x1


@triton.jit(do_not_specialize=["batch", "num_kv_heads", "num_programs", "min_pages"])
def _balanced_kernel(
    q_ptr,  # [batch, num_qo_heads, head_dim], strides (stride_qb, stride_qh, 1)
    k_ptr,  # K pool: page/token/head strides below, head_dim stride 1
    v_ptr,  # V pool: same strides as K
    kv_indptr_ptr,  # [batch + 1] int32, non-decreasing
    kv_indices_ptr,  # [>= kv_indptr[batch]] int32 page ids
    kv_last_page_len_ptr,  # [batch] int32
    o_ptr,  # [batch, num_qo_heads, head_dim] out, q's dtype, strides (stride_ob, stride_oh, 1)
    lse_ptr,  # [batch, num_qo_heads] float32 natural log, strides (stride_lb, stride_lh)
    part_o_ptr,  # [num_programs + batch, num_qo_heads, head_dim] float32 partial states, slot p + r
    part_lse_ptr,  # [num_programs + batch, num_qo_heads] float32 natural-log partial LSEs
    qk_scale,  # sm_scale * log2(e)
    batch,
    num_kv_heads,
    num_programs,  # P: programs per kv head
    min_pages,  # W is at least this (>= 1)
    stride_qb, stride_qh,
    stride_page, stride_token, stride_head,
    stride_ob, stride_oh,
    stride_lb, stride_lh,
    stride_ps, stride_ph,
    stride_pls, stride_plh,
    GROUP: tl.constexpr,  # num_qo_heads // num_kv_heads
    BLOCK_H: tl.constexpr,  # GROUP padded to a power of two >= 16
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # HEAD_DIM padded to a power of two >= 16
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,  # keys per tile
    NUM_STAGES: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_B: tl.constexpr,  # kv_indptr entries compared per step of the request search
    PDL: tl.constexpr,  # stage 2 is a programmatic dependent launch (CUDA, sm_90+)
):
    if PDL:
        # Let stage 2's programs start now: they plan from kv_indptr while this grid runs
        # and wait (griddepcontrol.wait) for its completion before reading what it writes.
        gdc_launch_dependents()
    pid = tl.program_id(0)
    # kv head innermost: the programs of all kv heads for the same page range are launched
    # together, so the heads of one NHD page are read at about the same time.
    kv_head = pid % num_kv_heads
    prog = pid // num_kv_heads
    ip0, total, per, x0, x1, d_x0m, d_x0, d_x1m, d_x1, end_x1 = _split_points(
        kv_indptr_ptr, batch, num_programs, min_pages, prog, BLOCK_B)
    # Requests [lo, hi): from the one holding page x0 (program 0: from request 0, so the
    # empty requests before page 0 are written), to the last ending at or before x1 — plus
    # the one holding page x1 when it also holds x1 - 1 (it runs on into the next program).
    # Empty requests at a boundary x thus belong to the program whose range ends at x.
    active = (x0 < total) | (prog == 0)  # programs past the last page have nothing to do
    lo = tl.where(prog == 0, 0, d_x0)
    hi = d_x1 + ((x1 < total) & (d_x1m == d_x1)).to(tl.int32)
    hi = tl.where(active, hi, lo)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + offs_h  # [BLOCK_H] query heads of this kv head
    heads64 = heads.to(tl.int64)
    mask_h = offs_h < GROUP
    head_off = kv_head.to(tl.int64) * stride_head
    k_head = k_ptr + head_off
    v_head = v_ptr + head_off

    # The first request's row; each iteration then loads the next one's while its own K/V
    # loop runs, so a request boundary waits for q and the page ids only.
    r0 = tl.minimum(lo, batch - 1)
    row_start = tl.load(kv_indptr_ptr + r0)
    row_end = tl.load(kv_indptr_ptr + r0 + 1)
    last_len = tl.load(kv_last_page_len_ptr + r0)
    for req in range(lo, hi):
        r_next = tl.minimum(req + 1, batch - 1)
        next_end = tl.load(kv_indptr_ptr + r_next + 1)
        next_last = tl.load(kv_last_page_len_ptr + r_next)
        first = row_start - ip0  # the request's pages [first, end) in the concatenation
        end = row_end - ip0
        num_pages = row_end - row_start
        seq_len = tl.where(num_pages > 0, (num_pages - 1) * PAGE_SIZE + last_len, 0)
        # This segment's tokens; t_end never passes the row's last token.
        t_begin = (tl.maximum(first, x0) - first) * PAGE_SIZE
        t_end = tl.minimum((tl.minimum(end, x1) - first) * PAGE_SIZE, seq_len)

        req64 = tl.cast(req, tl.int64)  # (the interpreter iterates plain ints)
        q_rows = req64 * stride_qb + heads64 * stride_qh  # [BLOCK_H]
        q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=_tile_mask(mask_h, offs_d, HEAD_DIM, BLOCK_D),
                    other=0.0)  # input dtype: feeds tl.dot only
        page_ptr = kv_indices_ptr + row_start

        acc = tl.zeros((BLOCK_H, BLOCK_D), dtype=tl.float32)
        l_i = tl.zeros((BLOCK_H,), dtype=tl.float32)
        m_i = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
        # One loop, the segment's last (partial) tile included: a tail tile after the loop
        # loads K/V into registers (sm_90a, bf16 D=128: 248 registers against 168) and
        # waits for them at every segment's end; inside the pipeline its loads overlap
        # the previous tiles.
        for t in tl.range(t_begin, t_end, BLOCK_N, num_stages=NUM_STAGES):
            acc, l_i, m_i = _clamped_tile(
                acc, l_i, m_i, q, k_head, v_head, page_ptr, t, t_end, stride_page, stride_token,
                qk_scale, PAGE_SIZE, BLOCK_N, HEAD_DIM, BLOCK_D, DOT_PRECISION,
            )

        # Emptiness comes from the segment's range, never from l: a NaN key leaves l = NaN,
        # which must reach the output, not pass for "no keys". finish_state changes the
        # base: m and log2(l) are base 2, the stored LSE is natural log.
        o, lse = finish_state(acc, l_i, m_i, t_end > t_begin)

        # The request's only segment writes the result; a part of a longer one, its slot.
        whole = (first >= x0) & (end <= x1)
        o_rows = req64 * stride_ob + heads64 * stride_oh
        tl.store(o_ptr + o_rows[:, None] + offs_d[None, :], o.to(o_ptr.dtype.element_ty),
                 mask=_tile_mask(mask_h & whole, offs_d, HEAD_DIM, BLOCK_D))
        tl.store(lse_ptr + req64 * stride_lb + heads64 * stride_lh, lse, mask=mask_h & whole)
        slot = prog.to(tl.int64) + req64
        p_rows = slot * stride_ps + heads64 * stride_ph
        tl.store(part_o_ptr + p_rows[:, None] + offs_d[None, :], o,
                 mask=_tile_mask(mask_h & ~whole, offs_d, HEAD_DIM, BLOCK_D))
        tl.store(part_lse_ptr + slot * stride_pls + heads64 * stride_plh, lse, mask=mask_h & ~whole)
        row_start = row_end
        row_end = next_end
        last_len = next_last


@triton.jit(do_not_specialize=["batch", "num_programs", "min_pages", "num_qo_heads"])
def _balanced_merge_kernel(
    kv_indptr_ptr,  # [batch + 1] int32, as given to _balanced_kernel
    part_o_ptr,  # [num_programs + batch, num_qo_heads, head_dim] float32, slot p + r
    part_lse_ptr,  # [num_programs + batch, num_qo_heads] float32 natural log
    o_ptr,  # [batch, num_qo_heads, head_dim] q's dtype
    lse_ptr,  # [batch, num_qo_heads] float32 natural log
    batch,
    num_programs,
    min_pages,
    num_qo_heads,
    stride_ps, stride_ph,
    stride_pls, stride_plh,
    stride_ob, stride_oh,
    stride_lb, stride_lh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,  # query heads per program
    UNROLL: tl.constexpr,  # partial states per load (the longest chain when it fits)
    BLOCK_B: tl.constexpr,
    PDL: tl.constexpr,
):
    """Stage 2: program (p, head block) merges the request that starts in stage-1 program
    p's pages and runs past them — the one holding pages x1 - 1 and x1 and not x0 - 1 —
    over its slots p + r .. b + r (b: the program holding its last page), in one online
    pass. The plan reads only kv_indptr, so with PDL it runs while stage 1 does."""
    prog = tl.program_id(0)
    ip0, total, per, x0, x1, d_x0m, d_x0, d_x1m, d_x1, end_x1 = _split_points(
        kv_indptr_ptr, batch, num_programs, min_pages, prog, BLOCK_B)
    req = d_x1
    chained = (x1 < total) & (d_x1m == req) & ((prog == 0) | (d_x0m != req))
    count = (end_x1 - ip0 - 1) // per - prog + 1  # partial states, >= 2 when chained
    if PDL:
        gdc_wait()  # stage 1 complete and its writes visible (every program waits: see the launcher)
    if chained:
        first_slot = (prog + req).to(tl.int64)
        heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        h_ok = heads < num_qo_heads
        heads64 = heads.to(tl.int64)
        offs_d = tl.arange(0, BLOCK_D)
        tile_ok = _tile_mask(h_ok, offs_d, HEAD_DIM, BLOCK_D)  # [BLOCK_H, BLOCK_D]
        u = tl.arange(0, UNROLL)
        m = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)  # natural log
        l = tl.zeros((BLOCK_H,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_H, BLOCK_D), dtype=tl.float32)
        for j0 in range(0, count, UNROLL):
            live = j0 + u < count
            slot = first_slot + j0 + u.to(tl.int64)
            # LSEs and values together: one round trip per UNROLL states
            s = tl.load(part_lse_ptr + slot[:, None] * stride_pls + heads64[None, :] * stride_plh,
                        mask=live[:, None] & h_ok[None, :], other=float("-inf"))  # [UNROLL, BLOCK_H]
            v = tl.load(part_o_ptr + slot[:, None, None] * stride_ps + heads64[None, :, None] * stride_ph
                        + offs_d[None, None, :], mask=live[:, None, None] & tile_ok[None, :, :], other=0.0)
            m_new = tl.maximum(m, tl.max(s, 0))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # all empty so far: never -inf - -inf
            # Base change: natural-log differences times log2(e), then exp2.
            alpha = tl.exp2((m - m_safe) * KERNEL_LOG2E)
            w = tl.exp2((s - m_safe[None, :]) * KERNEL_LOG2E)
            l = l * alpha + tl.sum(w, 0)
            # An empty slot contributes exactly zero, whatever it holds; any other slot's
            # NaN stays, even at a weight that underflows to 0 (0 * NaN = NaN).
            empty = (s == float("-inf"))[:, :, None]
            acc = acc * alpha[:, None] + tl.sum(tl.where(empty, 0.0, w[:, :, None] * v), 0)
            m = m_new
        # All slots empty: l == 0, (0, -inf). A NaN or +inf LSE leaves l = NaN (exp2 of
        # NaN, or of inf - inf), which must come out as NaN, so "empty" is l == 0, never
        # "not l > 0".
        empty = l == 0.0
        l_safe = tl.where(empty, 1.0, l)
        o = acc / l_safe[:, None]
        lse = tl.where(empty, float("-inf"), m + tl.log2(l_safe) * KERNEL_LN2)  # back to natural log
        req64 = req.to(tl.int64)
        tl.store(o_ptr + (req64 * stride_ob + heads64 * stride_oh)[:, None] + offs_d[None, :],
                 o.to(o_ptr.dtype.element_ty), mask=tile_ok)
        tl.store(lse_ptr + req64 * stride_lb + heads64 * stride_lh, lse, mask=h_ok)



# --------------------------------------------------------------------------- launch

MAX_PROGRAMS = 4096  # programs per kv head (the grid is P x num_kv_heads)
_BLOCK_B = 512  # kv_indptr entries per step of the in-kernel request search
_MERGE_BLOCK_H = 2  # stage 2: query heads per program (more programs for a long chain's merge)
# stage 2: partial states per load, up to P: one round trip for any chain when P <= 16
_MERGE_MAX_UNROLL = 16


def has_pdl(device: torch.device) -> bool:
    """Programmatic dependent launch (griddepcontrol) needs CUDA on sm_90 or newer."""
    return device.type == "cuda" and _capability(device.index if device.index is not None
                                                 else torch.cuda.current_device()) >= (9, 0)


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def launch_balanced(
    q: torch.Tensor, kv: PagedKV, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
    kv_last_page_len: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, *, qk_scale: float,
    programs: int, min_pages: int, block_n: int, num_warps: int, num_stages: int, pdl: bool,
) -> None:
    """Launch both stages into ``out [batch, Hq, D]`` (q's dtype) and ``lse`` float32
    ``[batch, Hq]`` (natural log). Internal: every argument has been checked by
    :func:`cascadeinfer.kernels.decode.batch_decode_paged`, ``batch >= 1``.

    ``programs``: P, programs per kv head; each takes ``max(cdiv(total pages, P),
    min_pages)`` pages of the batch's concatenated page list. ``qk_scale``: sm_scale *
    log2(e). ``pdl``: stage 2 as a programmatic dependent launch (needs :func:`has_pdl`).
    """
    batch, num_qo_heads, head_dim = q.shape
    device = q.device
    pdl = pdl and programs > 1
    group = num_qo_heads // kv.num_kv_heads
    block_d = max(16, next_power_of_2(head_dim))
    # Scratch for the partial states, slot p + r (see the module docstring); only the
    # segments that do not cover their whole request write one.
    part_o = scratch((programs + batch, num_qo_heads, head_dim), torch.float32, device)
    part_lse = scratch((programs + batch, num_qo_heads), torch.float32, device)
    launch(
        _balanced_kernel, (programs * kv.num_kv_heads,),
        q, kv.k, kv.v, kv_indptr, kv_indices, kv_last_page_len, out, lse, part_o, part_lse,
        qk_scale, batch, kv.num_kv_heads, programs, min_pages,
        q.stride(0), q.stride(1),
        kv.stride_page, kv.stride_token, kv.stride_head,
        out.stride(0), out.stride(1),
        lse.stride(0), lse.stride(1),
        part_o.stride(0), part_o.stride(1),
        part_lse.stride(0), part_lse.stride(1),
        GROUP=group,
        BLOCK_H=max(16, next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        PAGE_SIZE=kv.page_size,
        BLOCK_N=block_n,
        NUM_STAGES=num_stages,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        BLOCK_B=_BLOCK_B,
        PDL=pdl,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if programs > 1:  # one program per kv head never cuts a request
        # With PDL every stage-2 program waits for stage 1 before it exits, even one with
        # nothing to merge, so stage 2's completion implies stage 1's for later work.
        extra = dict(launch_pdl=True) if pdl else {}
        launch(
            _balanced_merge_kernel, (programs, triton.cdiv(num_qo_heads, _MERGE_BLOCK_H)),
            kv_indptr, part_o, part_lse, out, lse, batch, programs, min_pages, num_qo_heads,
            part_o.stride(0), part_o.stride(1),
            part_lse.stride(0), part_lse.stride(1),
            out.stride(0), out.stride(1),
            lse.stride(0), lse.stride(1),
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_H=_MERGE_BLOCK_H,
            UNROLL=min(next_power_of_2(programs), _MERGE_MAX_UNROLL), BLOCK_B=_BLOCK_B, PDL=pdl,
            num_warps=4, **extra,
        )
