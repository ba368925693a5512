"""Append new tokens' K and V into a paged KV cache.

Token ``j`` of the append belongs to page-table row ``b = batch_indices[j]`` at sequence
position ``p = positions[j]`` and is written to

    page = kv_indices[kv_indptr[b] + p // page_size],   slot = p % page_size

of both the K and the V cache, in either layout and either cache form. A token with
``batch_indices[j] < 0`` is padding and is skipped (what
:func:`~cascadeinfer.layouts.page_table.get_batch_indices_positions` produces past the
real tokens), so a CUDA graph can be captured for a padded ``nnz``.

The launch reads no tensor contents on the host (grid from ``nnz`` and shapes only), so
it is CUDA-graph safe with ``validate=False``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cascadeinfer._checks import (
    check_int32_vector,
    check_last_dim_contiguous,
    check_tensor,
)
from cascadeinfer._device import capturing, next_power_of_2, use_triton
from cascadeinfer.kernels.launch import LaunchCache, launch, recorded
from cascadeinfer.layouts.page_table import (
    check_pages_in_pool,
    get_seq_lens,
    validate_page_table,
)
from cascadeinfer.layouts.paged_cache import (
    PagedKV,
    PagedKVCache,
    cache_tensors,
    unpack_paged_kv_cache,
)


@triton.jit
def _slot_offset(
    row,  # page-table row of the token (>= 0)
    pos,  # the token's position in that row's sequence
    kv_indices_ptr,  # [nnz_pages] int32
    kv_indptr_ptr,  # [batch + 1] int32
    page_size,
    stride_page,
    stride_slot,
):
    """int64 element offset of the token's slot (head 0, dim 0) in either cache tensor."""
    page_start = tl.load(kv_indptr_ptr + row)
    page = tl.load(kv_indices_ptr + page_start + pos // page_size).to(tl.int64)
    slot = (pos % page_size).to(tl.int64)
    return page * stride_page + slot * stride_slot


@triton.jit
def _append_paged_kv_kernel(
    key_ptr,  # [nnz, num_kv_heads, head_dim]
    value_ptr,  # [nnz, num_kv_heads, head_dim]
    batch_indices_ptr,  # [nnz] int32, < 0 = padding
    positions_ptr,  # [nnz] int32
    k_cache_ptr,  # [num_pages, page_size, num_kv_heads, head_dim] or HND, via strides
    v_cache_ptr,  # same shape and strides as k_cache_ptr
    kv_indices_ptr,  # [nnz_pages] int32
    kv_indptr_ptr,  # [batch + 1] int32
    stride_key_tok,
    stride_key_head,
    stride_value_tok,
    stride_value_head,
    stride_page,
    stride_slot,
    stride_head,
    num_kv_heads,
    head_dim,
    page_size,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    tok = tl.program_id(0)
    head_block = tl.program_id(1)
    row = tl.load(batch_indices_ptr + tok)
    if row >= 0:
        pos = tl.load(positions_ptr + tok)
        slot = _slot_offset(row, pos, kv_indices_ptr, kv_indptr_ptr, page_size, stride_page, stride_slot)

        heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
        dims = tl.arange(0, BLOCK_D)
        mask = (heads < num_kv_heads)[:, None] & (dims < head_dim)[None, :]
        heads64 = heads.to(tl.int64)[:, None]
        tok64 = tok.to(tl.int64)
        src_k = key_ptr + tok64 * stride_key_tok + heads64 * stride_key_head + dims[None, :]
        src_v = value_ptr + tok64 * stride_value_tok + heads64 * stride_value_head + dims[None, :]
        dst = slot + heads64 * stride_head + dims[None, :]
        # A plain copy: no arithmetic, so no float32 upcast; the bits move unchanged
        # (exact for fp16, bf16 and fp32 alike, on the GPU and in the interpreter).
        tl.store(k_cache_ptr + dst, tl.load(src_k, mask=mask), mask=mask)
        tl.store(v_cache_ptr + dst, tl.load(src_v, mask=mask), mask=mask)


def _check_append_args(
    append_key: torch.Tensor,
    append_value: torch.Tensor,
    batch_indices: torch.Tensor,
    positions: torch.Tensor,
    paged_kv_cache: PagedKVCache,
    kv_indices: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_last_page_len: torch.Tensor,
    kv_layout: str,
    validate: bool,
) -> PagedKV:
    kv = unpack_paged_kv_cache(paged_kv_cache, kv_layout)
    check_tensor("append_key", append_key, ndim=3, dtypes=(kv.dtype,), device=kv.device,
                 shape=(None, kv.num_kv_heads, kv.head_dim))
    nnz = append_key.shape[0]
    check_tensor("append_value", append_value, ndim=3, dtypes=(kv.dtype,), device=kv.device,
                 shape=(nnz, kv.num_kv_heads, kv.head_dim))
    check_last_dim_contiguous("append_key", append_key)
    check_last_dim_contiguous("append_value", append_value)
    check_int32_vector("batch_indices", batch_indices, kv.device, length=nnz)
    check_int32_vector("positions", positions, kv.device, length=nnz)
    check_tensor("kv_indptr", kv_indptr, device=kv.device)
    if validate and not capturing():
        _check_contents(kv, batch_indices, positions, kv_indices, kv_indptr, kv_last_page_len)
    else:
        validate_page_table(kv_indptr, kv_indices, kv_last_page_len, kv.page_size, kv.num_pages, contents=False)
    return kv


def _check_contents(kv: PagedKV, batch_indices, positions, kv_indices, kv_indptr, kv_last_page_len) -> None:
    """The content checks (a host read): the page-table rule against this pool, then the
    tokens' targets (:func:`_check_targets`)."""
    validate_page_table(kv_indptr, kv_indices, kv_last_page_len, kv.page_size, kv.num_pages)
    _check_targets(batch_indices, positions, kv_indptr, kv_indices, kv_last_page_len, kv.page_size)


def _check_targets(
    batch_indices: torch.Tensor,
    positions: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_last_page_len: torch.Tensor,
    page_size: int,
) -> None:
    """Every real token lands inside its row's length, and no two land on one slot."""
    n = kv_indptr.shape[0] - 1
    rows = batch_indices.cpu().long()
    pos = positions.cpu().long()
    bad = rows >= n
    if bool(bad.any()):
        j = int(bad.nonzero()[0, 0])
        raise ValueError(f"batch_indices: entry {j} is {int(rows[j])}, outside the {n} rows of kv_indptr")
    real = rows >= 0
    if not bool(real.any()):
        return
    seq_lens = get_seq_lens(kv_indptr, kv_last_page_len, page_size).cpu().long()
    safe_rows = rows.clamp(min=0)
    bad = real & ((pos < 0) | (pos >= seq_lens[safe_rows]))
    if bool(bad.any()):
        j = int(bad.nonzero()[0, 0])
        b = int(rows[j])
        raise ValueError(
            f"positions: entry {j} is {int(pos[j])} but row {b} holds {int(seq_lens[b])} tokens "
            "(kv_last_page_len must count the appended tokens)"
        )
    indptr = kv_indptr.cpu().long()
    pages = kv_indices.cpu().long()[indptr[safe_rows[real]] + pos[real] // page_size]
    target = pages * page_size + pos[real] % page_size
    uniq, counts = torch.unique(target, return_counts=True)
    if bool((counts > 1).any()):
        slot = int(uniq[counts > 1][0])
        tokens = real.nonzero()[:, 0][target == slot].tolist()
        raise ValueError(
            f"positions: tokens {tokens[0]} and {tokens[1]} both write page {slot // page_size} "
            f"slot {slot % page_size} (a page shared by two rows needs copy-on-write first)"
        )


def append_paged_kv_cache(
    append_key: torch.Tensor,
    append_value: torch.Tensor,
    batch_indices: torch.Tensor,
    positions: torch.Tensor,
    paged_kv_cache: PagedKVCache,
    kv_indices: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_last_page_len: torch.Tensor,
    *,
    kv_layout: str = "NHD",
    validate: bool = True,
) -> None:
    """Write ``nnz`` new tokens' K and V into their slots of a paged cache, in place.

    Args:
        append_key, append_value: ``[nnz, num_kv_heads, head_dim]``, the cache's dtype
            (float16, bfloat16 or float32) and device; any strides with the last one 1.
        batch_indices: int32 ``[nnz]``, the page-table row of each token (``< 0``: skip).
        positions: int32 ``[nnz]``, each token's position in its row's sequence.
        paged_kv_cache: single tensor or ``(k, v)`` tuple in ``kv_layout`` ("NHD"/"HND").
        kv_indices, kv_indptr, kv_last_page_len: the CSR page table (int32; see
            :mod:`cascadeinfer.layouts.page_table`), whose lengths already count the
            appended tokens.

    Token ``j`` goes to page ``kv_indices[kv_indptr[b] + p // page_size]``, slot
    ``p % page_size`` with ``b = batch_indices[j]``, ``p = positions[j]``; nothing else in
    the cache changes. Shape, dtype and device errors always raise
    ``ValueError``/``TypeError`` naming the argument before any launch. With ``validate``
    (not while capturing a CUDA graph; it syncs) the page table is checked as in
    :func:`~cascadeinfer.layouts.page_table.validate_page_table`, every real token must
    lie inside its row (``0 <= p < seq_len``) and no two tokens may target one slot.
    ``kv_last_page_len`` is read only by that check. Returns ``None``.
    """
    cache = cache_tensors(paged_kv_cache)
    roots = (append_key, append_value, batch_indices, positions, *cache, kv_indices, kv_indptr, kv_last_page_len)
    options = (len(cache), kv_layout)
    if not validate and _LAUNCHES.hot(roots, options) is not None:
        return
    rec, key, ptrs = _LAUNCHES.find(roots, options, lengthless=(4 + len(cache),), hot=not validate)
    if rec is not None:  # a call of this signature passed every shape check already
        if validate and not capturing():
            _check_contents(unpack_paged_kv_cache(paged_kv_cache, kv_layout), batch_indices, positions,
                            kv_indices, kv_indptr, kv_last_page_len)
        rec.replay(roots, known=ptrs)
        return
    kv = _check_append_args(append_key, append_value, batch_indices, positions, paged_kv_cache,
                            kv_indices, kv_indptr, kv_last_page_len, kv_layout, validate)
    nnz = append_key.shape[0]
    if not use_triton(kv.device):
        if nnz:
            _append_torch(append_key, append_value, batch_indices, positions, kv, kv_indices, kv_indptr)
        return
    with recorded(_LAUNCHES, key, roots):
        if nnz:
            _launch(append_key, append_value, batch_indices, positions, kv, kv_indices, kv_indptr)


# Recordings of append_paged_kv_cache's calls, by signature (see cascadeinfer.kernels.launch).
_LAUNCHES = LaunchCache()


def _launch(append_key, append_value, batch_indices, positions, kv: PagedKV, kv_indices, kv_indptr) -> None:
    nnz = append_key.shape[0]
    block_d = next_power_of_2(kv.head_dim)
    block_h = min(next_power_of_2(kv.num_kv_heads), max(1, 4096 // block_d))
    grid = (nnz, triton.cdiv(kv.num_kv_heads, block_h))
    launch(
        _append_paged_kv_kernel, grid,
        append_key, append_value, batch_indices, positions, kv.k, kv.v, kv_indices, kv_indptr,
        append_key.stride(0), append_key.stride(1), append_value.stride(0), append_value.stride(1),
        kv.stride_page, kv.stride_token, kv.stride_head,
        kv.num_kv_heads, kv.head_dim, kv.page_size,
        BLOCK_H=block_h, BLOCK_D=block_d,
    )


def _append_torch(
    append_key: torch.Tensor,
    append_value: torch.Tensor,
    batch_indices: torch.Tensor,
    positions: torch.Tensor,
    kv: PagedKV,
    kv_indices: torch.Tensor,
    kv_indptr: torch.Tensor,
) -> None:
    """Vectorised PyTorch path for plain CPU tensors (no sync-freedom needed there). Its
    bounds are checked whatever ``validate`` says: a token outside its row or the pool is
    an ``IndexError``, never a write elsewhere."""
    check_pages_in_pool(kv_indptr, kv_indices, kv.num_pages)
    real = batch_indices >= 0
    rows = batch_indices[real].long()
    pos = positions[real].long()
    n = kv_indptr.numel() - 1
    if rows.numel() and int(rows.max()) >= n:
        raise IndexError(f"batch_indices: row {int(rows.max())} is outside the {n} rows of kv_indptr")
    slot_of = kv_indptr.long()[rows] + pos // kv.page_size
    outside = (pos < 0) | (slot_of >= kv_indptr.long()[rows + 1])
    if bool(outside.any()):
        j = int(outside.nonzero()[0, 0])
        raise IndexError(f"positions: token {j} at position {int(pos[j])} lies outside its row's pages")
    pages = kv_indices.long()[slot_of]
    slots = pos % kv.page_size
    for cache, src in ((kv.k, append_key), (kv.v, append_value)):
        nhd = cache if kv.kv_layout == "NHD" else cache.transpose(1, 2)  # view [P, page_size, H, D]
        nhd[pages, slots] = src[real]
