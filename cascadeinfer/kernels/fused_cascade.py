"""The last two cascade levels in one launch: a shared (prefill) level and the suffix decode.

A cascade's shared-prefix level is compute-bound (hundreds of packed query rows per KV tile
on tensor cores) and its per-request suffix level is bandwidth-bound (each key is read once
for one query). Run one after the other, their times add; two streams do not overlap them
either, since a 128x128 prefix program takes a whole SM (224 KiB of shared memory, every
register). This kernel interleaves them *inside* each program: every iteration of its key
loop folds one prefix tile into the prefix state and one suffix tile of some request into a
small decode state, so the suffix's HBM traffic streams in while the tensor cores work on
the prefix.

Work assignment (planned on the host by :func:`plan_fused`, written into device buffers):

* The prefix level runs the prefill kernel's tile map (``tile`` x KV head x KV split, the
  query heads of a KV head packed into M). Split ``s`` of token ``t`` writes its state to
  slot ``state_indptr[t] + s``.
* The suffix level's keys are cut into items of ``SUF_N`` keys, request after request; the
  items are dealt out in contiguous, equal runs to the programs of each KV head (every KV
  head has the same runs). A program folds its items into one decode state per request
  segment and writes it, at the segment's last item, to that item's slot (the slots of
  token ``t`` after its prefix splits).
* :func:`cascadeinfer.kernels.merge.merge_states_ragged` then merges each token's slots
  ``state_indptr[t] : state_indptr[t + 1]`` into the output: one launch for both levels'
  split states.

The item table (token, first key, page-table offset, keys, slot) is sized from shapes, so
re-planning with tables of the same shapes rewrites it in place and a captured CUDA graph
stays valid.

LSE: natural log at every boundary; base 2 inside the kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from cascadeinfer._checks import next_power_of_2
from cascadeinfer.kernels.merge import merge_states_ragged
from cascadeinfer.kernels.prefill import (
    LOG2E,
    _full_tile,
    _full_tiles,
    _group_of_tile,
    _load_tile,
    _masked_tiles,
    _paged_rows,
    _softmax_step,
    default_num_splits,
    num_m_tiles,
)
from cascadeinfer.layouts.paged_cache import PagedKV

_LN2 = tl.constexpr(0.6931471805599453)  # log2 -> natural log at the stores
_BLOCK_N = 64  # prefix keys per tile (see fused_config)
_ITEM_FIELDS = tl.constexpr(5)  # (token, first key, page-table offset of the request, keys in the item, slot or -1)


@triton.jit
def _suffix_item(
    item_ptr,  # [num_items, _ITEM_FIELDS] int32
    item,  # index of the item to read
    ok,  # False: past this program's items (returns an empty item)
    suffix_indices_ptr,  # the suffix level's kv_indices
    PAGE_SIZE: tl.constexpr,
    SUF_N: tl.constexpr,
):
    """``(token, first key, keys, slot, page ids [SUF_N])`` of one suffix item.

    Loaded one iteration before its K/V, like the prefix page ids: the K/V loads of an
    iteration then hang off registers, not off a load of the same iteration.
    """
    rec = item_ptr + item.to(tl.int64) * _ITEM_FIELDS
    tok = tl.load(rec, mask=ok, other=0)
    key0 = tl.load(rec + 1, mask=ok, other=0)
    page_off = tl.load(rec + 2, mask=ok, other=0)
    n_keys = tl.load(rec + 3, mask=ok, other=0)
    slot = tl.load(rec + 4, mask=ok, other=-1)
    offs = tl.arange(0, SUF_N)
    page = tl.load(suffix_indices_ptr + page_off + (key0 + offs) // PAGE_SIZE, mask=offs < n_keys, other=0)
    return tok, key0, n_keys, slot, page


@triton.jit
def _suffix_tile(
    acc,  # [BLOCK_H, BLOCK_D] float32, the current request segment's un-normalised output
    l_i,  # [BLOCK_H] float32
    m_i,  # [BLOCK_H] float32, log2 units (-inf: no key yet)
    tok, key0, n_keys, slot, page,  # the item (see _suffix_item)
    q_ptr,  # [nnz_qo, Hq, D]
    k_head,  # K pool at this KV head
    v_head,  # V pool at this KV head
    so_ptr,  # [num_states, Hq, D] state values
    slse_ptr,  # [num_states, Hq] float32 state LSEs (natural log)
    kv_head,
    stride_qt, stride_qh,
    stride_kp, stride_kt,
    stride_st, stride_sh,
    stride_lt, stride_lh,
    qk_scale,
    GROUP_SIZE: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    SUF_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Fold one suffix item into the decode state; at a segment's last item store the
    state to its slot and start the next segment from the identity (0, -inf)."""
    offs_n = tl.arange(0, SUF_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_h = tl.arange(0, BLOCK_H)
    h_ok = offs_h < GROUP_SIZE
    hd_ok = h_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    heads64 = (kv_head * GROUP_SIZE + offs_h).to(tl.int64)
    n_ok = offs_n < n_keys
    q = tl.load(q_ptr + tok.to(tl.int64) * stride_qt + heads64[:, None] * stride_qh + offs_d[None, :],
                mask=hd_ok, other=0.0)
    rows = _paged_rows(page, key0, stride_kp, stride_kt, PAGE_SIZE, SUF_N)
    k = _load_tile(k_head + rows[:, None] + offs_d[None, :], n_ok, offs_d, True, HEAD_DIM, BLOCK_D)
    v = _load_tile(v_head + rows[:, None] + offs_d[None, :], n_ok, offs_d, True, HEAD_DIM, BLOCK_D)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    s = tl.where(n_ok[None, :], s, float("-inf"))
    acc, l_i, m_i = _softmax_step(acc, l_i, m_i, s, v, qk_scale, True, DOT_PRECISION)

    # Branch-free flush: the stores are masked off and the reset is a select unless this
    # item ends its segment (an scf.if here would split the pipelined loop).
    done = slot >= 0
    seen = l_i > 0.0
    o = acc / tl.where(seen, l_i, 1.0)[:, None]
    # Base change: (m + log2 l) is the LSE in log2 units; times ln 2 gives natural log.
    lse = tl.where(seen, (m_i + tl.math.log2(tl.where(seen, l_i, 1.0))) * _LN2, float("-inf"))
    slot64 = tl.maximum(slot, 0).to(tl.int64)
    tl.store(so_ptr + slot64 * stride_st + heads64[:, None] * stride_sh + offs_d[None, :],
             o.to(so_ptr.dtype.element_ty), mask=hd_ok & done)
    tl.store(slse_ptr + slot64 * stride_lt + heads64 * stride_lh, lse, mask=h_ok & done)
    acc = tl.where(done, 0.0, acc)
    l_i = tl.where(done, 0.0, l_i)
    m_i = tl.where(done, float("-inf"), m_i)
    return acc, l_i, m_i


@triton.jit
def _fused_kernel(
    q_ptr,  # [nnz_qo, Hq, D] fp16/bf16
    k_ptr,  # K pool [num_pages, page_size, Hkv, D] in any layout (page/token/head strides)
    v_ptr,  # V pool, same strides as K
    so_ptr,  # [num_states, Hq, D] q's dtype: every state slot
    slse_ptr,  # [num_states, Hq] float32, natural log
    state_indptr_ptr,  # [nnz_qo + 1] int32: token t's slots start at state_indptr[t]
    qo_indptr_ptr,  # prefix level: [num_groups + 1] int32
    kv_indptr_ptr,  # prefix level: [num_groups + 1] int32 pages
    kv_indices_ptr,  # prefix level: page ids
    kv_last_page_len_ptr,  # prefix level: [num_groups] int32
    suffix_indices_ptr,  # suffix level: page ids
    item_indptr_ptr,  # [num_tiles * num_splits + 1] int32: program (tile, split)'s items, same for every KV head
    item_ptr,  # [num_items, _ITEM_FIELDS] int32
    search_steps,  # ceil(log2(num_groups))
    num_groups,
    stride_qt, stride_qh,
    stride_kp, stride_kt, stride_kh,  # K and V share their strides (one PagedKV)
    stride_st, stride_sh,
    stride_lt, stride_lh,
    qk_scale,  # sm_scale * log2(e)
    GROUP_SIZE: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,  # GROUP_SIZE padded to a power of two >= 16 (the decode dot's M)
    SUF_N: tl.constexpr,  # keys per suffix item
    DOT_PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    prog = tile * num_splits + split
    item_lo = tl.load(item_indptr_ptr + prog)
    item_hi = tl.load(item_indptr_ptr + prog + 1)

    qo_start, qo_len, local_tile, kv_start, kv_len = _group_of_tile(
        tile, qo_indptr_ptr, kv_indptr_ptr, kv_last_page_len_ptr, search_steps, num_groups,
        GROUP_SIZE, PAGE_SIZE, BLOCK_M, True)
    row0 = local_tile * BLOCK_M
    if row0 >= qo_len * GROUP_SIZE:
        return  # a slot of the upper-bound grid that holds no tile: the plan gives it no items

    # ---- the prefix level's packed query rows (non-causal: every row sees every key)
    offs_m = row0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    tok = offs_m // GROUP_SIZE
    head = kv_head * GROUP_SIZE + offs_m % GROUP_SIZE
    row_ok = offs_m < qo_len * GROUP_SIZE
    d_ok = offs_d < HEAD_DIM
    q_off = (qo_start + tok).to(tl.int64) * stride_qt + head.to(tl.int64) * stride_qh
    q = tl.load(q_ptr + q_off[:, None] + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    chunk = tl.cdiv(tl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N
    split_lo = split * chunk
    split_hi = tl.minimum(split_lo + chunk, kv_len)
    full_end = split_lo + tl.maximum(split_hi - split_lo, 0) // BLOCK_N * BLOCK_N
    n_both = tl.minimum((full_end - split_lo) // BLOCK_N, item_hi - item_lo)
    fused_end = split_lo + n_both * BLOCK_N

    head_off = kv_head.to(tl.int64) * stride_kh
    k_head = k_ptr + head_off
    v_head = v_ptr + head_off
    page_ptr = kv_indices_ptr + kv_start

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    acc_s = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    l_s = tl.zeros([BLOCK_H], dtype=tl.float32)
    m_s = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)

    # ---- both levels, one tile of each per iteration; page ids and items one ahead
    last = full_end - BLOCK_N
    page = tl.load(page_ptr + (split_lo + offs_n) // PAGE_SIZE, mask=n_both > 0, other=0)
    s_tok, s_key0, s_n, s_slot, s_page = _suffix_item(item_ptr, item_lo, item_lo < item_hi, suffix_indices_ptr,
                                                      PAGE_SIZE, SUF_N)
    for i in tl.range(0, n_both):
        start = split_lo + i * BLOCK_N
        rows = _paged_rows(page, start, stride_kp, stride_kt, PAGE_SIZE, BLOCK_N)
        page = tl.load(page_ptr + (tl.minimum(start + BLOCK_N, last) + offs_n) // PAGE_SIZE)
        acc, l_i, m_i = _full_tile(acc, l_i, m_i, q, k_head + rows[:, None], v_head + rows[:, None], qk_scale,
                                   HEAD_DIM, BLOCK_N, BLOCK_D, DOT_PRECISION)
        nxt = item_lo + i + 1
        n_tok, n_key0, n_n, n_slot, n_page = _suffix_item(item_ptr, nxt, nxt < item_hi, suffix_indices_ptr,
                                                          PAGE_SIZE, SUF_N)
        acc_s, l_s, m_s = _suffix_tile(
            acc_s, l_s, m_s, s_tok, s_key0, s_n, s_slot, s_page, q_ptr, k_head, v_head, so_ptr, slse_ptr, kv_head,
            stride_qt, stride_qh, stride_kp, stride_kt, stride_st, stride_sh, stride_lt, stride_lh, qk_scale,
            GROUP_SIZE, PAGE_SIZE, HEAD_DIM, BLOCK_D, BLOCK_H, SUF_N, DOT_PRECISION)
        s_tok, s_key0, s_n, s_slot, s_page = n_tok, n_key0, n_n, n_slot, n_page

    # ---- what is left of either level
    acc, l_i, m_i = _full_tiles(
        acc, l_i, m_i, q, k_head, v_head, page_ptr, fused_end, full_end,
        stride_kp, stride_kt, stride_kt, qk_scale,
        True, PAGE_SIZE, HEAD_DIM, BLOCK_N, BLOCK_D, DOT_PRECISION,
    )
    row_lim = tl.full([BLOCK_M], 0, tl.int32) + kv_len
    acc, l_i, m_i = _masked_tiles(
        acc, l_i, m_i, q, k_head, v_head, page_ptr, full_end, split_hi, row_lim,
        stride_kp, stride_kt, stride_kt, qk_scale,
        True, PAGE_SIZE, HEAD_DIM, BLOCK_N, BLOCK_D, DOT_PRECISION,
    )
    for j in tl.range(n_both, item_hi - item_lo):
        nxt = item_lo + j + 1
        n_tok, n_key0, n_n, n_slot, n_page = _suffix_item(item_ptr, nxt, nxt < item_hi, suffix_indices_ptr,
                                                          PAGE_SIZE, SUF_N)
        acc_s, l_s, m_s = _suffix_tile(
            acc_s, l_s, m_s, s_tok, s_key0, s_n, s_slot, s_page, q_ptr, k_head, v_head, so_ptr, slse_ptr, kv_head,
            stride_qt, stride_qh, stride_kp, stride_kt, stride_st, stride_sh, stride_lt, stride_lh, qk_scale,
            GROUP_SIZE, PAGE_SIZE, HEAD_DIM, BLOCK_D, BLOCK_H, SUF_N, DOT_PRECISION)
        s_tok, s_key0, s_n, s_slot, s_page = n_tok, n_key0, n_n, n_slot, n_page

    # ---- the prefix state of this split, into each row's slot (a row that saw no key: (0, -inf))
    seen = l_i > 0.0
    o = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, (m_i + tl.math.log2(tl.where(seen, l_i, 1.0))) * _LN2, float("-inf"))
    slot = tl.load(state_indptr_ptr + qo_start + tok, mask=row_ok, other=0) + split
    slot64 = slot.to(tl.int64)
    head64 = head.to(tl.int64)
    tl.store(so_ptr + slot64[:, None] * stride_st + head64[:, None] * stride_sh + offs_d[None, :],
             o.to(so_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    tl.store(slse_ptr + slot64 * stride_lt + head64 * stride_lh, lse, mask=row_ok)


# --------------------------------------------------------------------------------------
# Host side: tiles, the plan, the launch
# --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FusedConfig:
    """Tiles of the fused kernel: the prefix level's ``block_m x block_n`` and ``suf_n``
    keys per suffix item."""

    block_m: int
    block_n: int
    suf_n: int
    num_warps: int
    num_stages: int


def fused_supported(head_dim: int, dtype: torch.dtype) -> bool:
    """Whether the fused kernel has tiles for these inputs (fp16/bf16, head_dim <= 128).

    Larger head dims and fp32 do not leave room in 227 KiB of shared memory for both
    levels' pipelined tiles; the cascade runs its levels one after the other there.
    """
    return dtype in (torch.float16, torch.bfloat16) and head_dim <= 128


def fused_config(rows_per_group: int, prefix_tiles_per_program: int, suffix_keys_per_program: int) -> FusedConfig:
    """Tiles from shape bounds (not table contents, so that a re-plan keeps them).

    The prefix tile is 128x64 (64x64 with 4 warps for groups of <= 64 packed rows):
    128x128 with three stages leaves no shared memory for the suffix tiles. ``suf_n`` is
    the smallest of 16/32/64 keys that gives a program no more suffix items than prefix
    tiles, so the two levels share the loop instead of one running alone after it. sm_90a
    builds (bf16, D=128, group 4; ptxas -v): 128x64 + 32 keys: 255 registers, 172 KiB of
    shared memory, no spills; 128x64 + 64 keys: 252 registers, 204 KiB.
    """
    block_m, num_warps = (64, 4) if rows_per_group <= 64 else (128, 8)
    suf_n = 64
    for cand in (16, 32, 64):
        if -(-suffix_keys_per_program // cand) <= max(1, prefix_tiles_per_program):
            suf_n = cand
            break
    return FusedConfig(block_m, _BLOCK_N, suf_n, num_warps, 3)


@dataclass(slots=True)
class FusedPlan:
    """Device buffers of one fused launch, and the constants its grid was built from."""

    config: FusedConfig
    num_tiles: int  # M tiles of the grid (an upper bound from shapes)
    num_splits: int  # KV splits of the prefix level
    state_indptr: torch.Tensor  # int32 [nnz_qo + 1]: token t's slots
    item_indptr: torch.Tensor  # int32 [num_tiles * num_splits + 1]: program (tile, split)'s items
    items: torch.Tensor  # int32 [item capacity, 5]
    num_slots: int  # state slots allocated (an upper bound from shapes)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.state_indptr, self.item_indptr, self.items

    def ints(self) -> list[int]:
        """The constants, flat (the custom op's ``plan_ints``)."""
        c = self.config
        return [c.block_m, c.block_n, c.suf_n, c.num_warps, c.num_stages, self.num_tiles, self.num_splits,
                self.num_slots]


def plan_fused(
    prefix_qo_indptr: torch.Tensor,
    prefix_kv_indptr: torch.Tensor,
    prefix_num_indices: int,
    suffix_kv_indptr: torch.Tensor,
    suffix_kv_lens: torch.Tensor,
    suffix_num_indices: int,
    *,
    num_qo_heads: int,
    num_kv_heads: int,
    page_size: int,
    device: torch.device,
    num_splits: int | None = None,
    old: FusedPlan | None = None,
) -> FusedPlan:
    """Lay out the fused launch from host (CPU, int64 or int32) tables already validated.

    ``prefix_*`` describe the prefill level (groups of tokens), ``suffix_*`` the decode
    level (one group per token, in token order; ``suffix_kv_lens`` its keys per token);
    ``*_num_indices`` are the lengths of the
    two ``kv_indices`` tensors (shape bounds). ``num_splits``: the prefix level's KV
    splits (default: the prefill kernel's rule, one wave of programs). Grid, tiles and buffer sizes depend only on
    shapes; with an ``old`` plan of the same shapes the buffers are rewritten in place.
    """
    group_size = num_qo_heads // num_kv_heads
    nnz_qo = int(prefix_qo_indptr[-1])
    num_groups = prefix_qo_indptr.numel() - 1
    rows_per_group = -(-nnz_qo * group_size // max(1, num_groups))
    block_m = fused_config(rows_per_group, 1, 0).block_m
    num_tiles = num_m_tiles(nnz_qo, num_groups, group_size, block_m)
    prefix_keys = prefix_num_indices * page_size  # bound on one group's keys
    if num_splits is None:
        num_splits = default_num_splits(num_tiles, num_kv_heads, prefix_keys, device)
    programs = num_tiles * num_splits
    config = fused_config(rows_per_group, prefix_keys // max(1, num_groups) // (num_splits * _BLOCK_N),
                          -(-suffix_num_indices * page_size // max(1, programs)))

    # Real tiles of the upper-bound tile map (groups without queries own none).
    q_starts = prefix_qo_indptr[:-1].long()
    g = torch.arange(num_groups)
    rows = (prefix_qo_indptr[1:] - prefix_qo_indptr[:-1]).long() * group_size
    first_tile = (q_starts * group_size + g * (config.block_m - 1)) // config.block_m
    tiles_per_group = (rows + config.block_m - 1) // config.block_m
    real_tiles = torch.repeat_interleave(first_tile, tiles_per_group) + (
        torch.arange(int(tiles_per_group.sum())) - torch.repeat_interleave(
            torch.cumsum(tiles_per_group, 0) - tiles_per_group, tiles_per_group))
    real_programs = (real_tiles[:, None] * num_splits + torch.arange(num_splits)[None, :]).reshape(-1)

    # Suffix items: every token's keys in runs of suf_n, token after token.
    suf_n = config.suf_n
    lens = suffix_kv_lens.long()
    per_tok = (lens + suf_n - 1) // suf_n
    n_items = int(per_tok.sum())
    tok = torch.repeat_interleave(torch.arange(nnz_qo), per_tok)
    idx_in_tok = torch.arange(n_items) - torch.repeat_interleave(torch.cumsum(per_tok, 0) - per_tok, per_tok)
    key0 = idx_in_tok * suf_n
    n_keys = torch.clamp(lens[tok] - key0, max=suf_n)
    page_off = suffix_kv_indptr.long()[:-1][tok]

    # Equal runs of items to the real programs, in order; a run of one token is a segment.
    n_real = max(1, real_programs.numel())
    bounds = torch.arange(n_real + 1) * n_items // n_real
    run_len = bounds[1:] - bounds[:-1]
    rank = torch.repeat_interleave(torch.arange(n_real), run_len)
    new_seg = torch.ones(n_items, dtype=torch.bool)
    new_seg[1:] = (tok[1:] != tok[:-1]) | (rank[1:] != rank[:-1])
    seg_end = torch.ones(n_items, dtype=torch.bool)
    seg_end[:-1] = new_seg[1:]
    seg_id = torch.cumsum(new_seg.long(), 0) - 1
    segs_per_tok = torch.bincount(tok[new_seg], minlength=nnz_qo)
    first_seg = torch.cumsum(segs_per_tok, 0) - segs_per_tok
    state_indptr = torch.zeros(nnz_qo + 1, dtype=torch.long)
    state_indptr[1:] = torch.cumsum(num_splits + segs_per_tok, 0)
    slot = torch.where(seg_end, state_indptr[:-1][tok] + num_splits + seg_id - first_seg[tok],
                       torch.full_like(tok, -1))
    items = torch.stack([tok, key0, page_off, n_keys, slot], 1)

    counts = torch.zeros(programs, dtype=torch.long)
    if real_programs.numel():
        counts[real_programs] = run_len
    item_indptr = torch.zeros(programs + 1, dtype=torch.long)
    item_indptr[1:] = torch.cumsum(counts, 0)

    # Capacities from shapes: sum(ceil(len / suf_n)) <= pages * page_size / suf_n + tokens.
    item_cap = suffix_num_indices * page_size // suf_n + nnz_qo + 1
    slot_cap = nnz_qo * num_splits + min(item_cap, nnz_qo + programs)
    items_full = torch.zeros((item_cap, 5), dtype=torch.int32)
    items_full[:n_items] = items.to(torch.int32)
    new = (state_indptr.to(torch.int32), item_indptr.to(torch.int32), items_full)
    if old is not None and old.config == config and (old.num_tiles, old.num_splits) == (num_tiles, num_splits) \
            and all(o.shape == n.shape for o, n in zip(old.tensors(), new)):
        for o, n in zip(old.tensors(), new):
            o.copy_(n)  # in place: a CUDA graph captured on these buffers sees the new plan
        return old
    return FusedPlan(config, num_tiles, num_splits, *(t.to(device) for t in new), slot_cap)


def fused_cascade_attention(
    q: torch.Tensor,
    kv: PagedKV,
    prefix_qo_indptr: torch.Tensor,
    prefix_kv_indptr: torch.Tensor,
    prefix_kv_indices: torch.Tensor,
    prefix_kv_last_page_len: torch.Tensor,
    suffix_kv_indices: torch.Tensor,
    plan: FusedPlan,
    *,
    sm_scale: float,
    out: torch.Tensor,
    lse: torch.Tensor,
) -> None:
    """Both levels' attention merged into ``out [nnz_qo, Hq, D]`` (q's dtype) and ``lse``
    (float32 ``[nnz_qo, Hq]``, natural log): one fused launch, then one ragged merge.

    Internal to the cascade: the tables are the device copies ``plan()`` validated, and
    ``plan`` came from :func:`plan_fused` over the same tables. No host reads.
    """
    nnz_qo, num_qo_heads, head_dim = q.shape
    cfg = plan.config
    states = torch.empty((plan.num_slots, num_qo_heads, head_dim), dtype=q.dtype, device=q.device)
    states_lse = torch.empty((plan.num_slots, num_qo_heads), dtype=torch.float32, device=q.device)
    num_groups = prefix_qo_indptr.shape[0] - 1
    if nnz_qo and plan.num_tiles:
        _fused_kernel[(plan.num_tiles, kv.num_kv_heads, plan.num_splits)](
            q, kv.k, kv.v, states, states_lse, plan.state_indptr,
            prefix_qo_indptr, prefix_kv_indptr, prefix_kv_indices, prefix_kv_last_page_len,
            suffix_kv_indices, plan.item_indptr, plan.items,
            (num_groups - 1).bit_length(), num_groups,
            q.stride(0), q.stride(1),
            kv.stride_page, kv.stride_token, kv.stride_head,
            states.stride(0), states.stride(1),
            states_lse.stride(0), states_lse.stride(1),
            sm_scale * LOG2E,
            GROUP_SIZE=num_qo_heads // kv.num_kv_heads,
            PAGE_SIZE=kv.page_size,
            HEAD_DIM=head_dim,
            BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n,
            BLOCK_D=max(16, next_power_of_2(head_dim)),
            BLOCK_H=max(16, next_power_of_2(num_qo_heads // kv.num_kv_heads)),
            SUF_N=cfg.suf_n,
            DOT_PRECISION="tf32",
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
    merge_states_ragged(states, states_lse, plan.state_indptr, out=out, out_lse=lse, validate=False)
