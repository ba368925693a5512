"""The rotary embedding and the K/V append of a decoder layer, in one pass over K.

    append_paged_kv_cache_rope(q, append_key, append_value, batch_indices, positions,
                               paged_kv_cache, kv_indices, kv_indptr, kv_last_page_len,
                               rope_positions, cos_sin_cache, *, kv_layout="NHD",
                               validate=True) -> None

does what :func:`~cascadeinfer.kernels.fused.apply_rope` followed by
:func:`~cascadeinfer.kernels.append.append_paged_kv_cache` do, with the same bits: q and
k rotated in place (each product rounded to the activation dtype, as HF rounds), then
the rotated k and the unchanged v written to their slots of the paged cache. Run apart,
the two kernels read and write k twice and pay two launches; here one program per
(token, share of heads) loads the token's cos/sin row once, rotates its q heads, rotates
its k heads, and stores each rotated k head both back into k (callers that read k later,
like a ragged prefill over the step's own K/V, see what they saw before) and into the
cache, with v beside it.

The rotation positions (``rope_positions``: where the token sits in its sequence) and
the append positions (``positions``: where it lands in its page-table row) are separate
arguments: an engine may append through a table that starts at a later page of the row
(the last level of a cascade), so the two may differ. A token with ``batch_indices < 0``
is padding: it is rotated like every token (as ``apply_rope`` rotates it) and appends
nothing (as ``append_paged_kv_cache`` skips it).

Host cost follows the other launchers: the first call of a signature checks its
arguments and records its launch (:mod:`cascadeinfer.kernels.launch`); later calls of
the same signature replay it with the new tensors, without the Python checks. CUDA
tensors (and CPU tensors under ``TRITON_INTERPRET=1``) run the kernel; other CPU tensors
run the two PyTorch paths of the kernels it fuses.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cascadeinfer._checks import check_disjoint, check_tensor
from cascadeinfer._device import capturing, use_triton
from cascadeinfer.kernels.append import (
    _append_torch,
    _check_append_args,
    _check_contents,
    _slot_offset,
)
from cascadeinfer.kernels.fused import (
    _EXACT,
    _check_positions_in_table,
    _check_rope_args,
    _cos_sin_row,
    _rope_launch_plan,
    _rotate_heads,
)
from cascadeinfer.kernels.launch import LaunchCache, launch, recorded
from cascadeinfer.kernels.reference import apply_rope_ref
from cascadeinfer.layouts.paged_cache import (
    PagedKV,
    PagedKVCache,
    cache_tensors,
    unpack_paged_kv_cache,
)


@triton.jit
def _rope_append_kernel(
    q_ptr,  # [T, Hq, D] fp16/bf16/fp32, rotated in place
    key_ptr,  # [T, Hkv, D] same dtype, rotated in place
    value_ptr,  # [T, Hkv, D] same dtype, read
    batch_indices_ptr,  # [T] int32, < 0 = padding (rotated, not appended)
    positions_ptr,  # [T] int32, each token's position in its page-table row
    rope_pos_ptr,  # [T] int32/int64, each token's rotation position
    cs_ptr,  # [max_positions, D]: cos in [:, :D/2], sin in [:, D/2:]
    k_cache_ptr,  # [num_pages, page_size, Hkv, D] or HND, via strides
    v_cache_ptr,  # same shape and strides as k_cache_ptr
    kv_indices_ptr,  # [nnz_pages] int32
    kv_indptr_ptr,  # [batch + 1] int32
    num_q_heads,
    num_kv_heads,
    q_heads_per_program,
    kv_heads_per_program,
    stride_q_t,
    stride_q_h,
    stride_key_tok,
    stride_key_head,
    stride_value_tok,
    stride_value_head,
    stride_rope_pos,
    stride_cs,
    stride_page,
    stride_slot,
    stride_head,
    page_size,
    HALF: tl.constexpr,  # D // 2
    BLOCK_HALF: tl.constexpr,  # next power of two >= HALF
    BLOCK_HQ: tl.constexpr,  # next power of two >= q_heads_per_program
    BLOCK_HK: tl.constexpr,  # next power of two >= kv_heads_per_program
):
    """Program (t, j) rotates token t's j-th share of the q heads and of the k heads, and
    appends that share of its k and v heads (the split of the RoPE kernel, so the
    rotation is the same code on the same tiles)."""
    t = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    cos, sin = _cos_sin_row(cs_ptr, rope_pos_ptr + t * stride_rope_pos, stride_cs, HALF, BLOCK_HALF)
    _rotate_heads(q_ptr + t * stride_q_t, stride_q_h, split * q_heads_per_program, q_heads_per_program,
                  num_q_heads, cos, sin, HALF, BLOCK_HALF, BLOCK_HQ)
    # k goes back in place like q, and the same registers go on to the cache: k is read once.
    heads, ok, k_lo, k_hi = _rotate_heads(key_ptr + t * stride_key_tok, stride_key_head,
                                          split * kv_heads_per_program, kv_heads_per_program, num_kv_heads,
                                          cos, sin, HALF, BLOCK_HALF, BLOCK_HK)
    row = tl.load(batch_indices_ptr + t)
    if row >= 0:
        pos = tl.load(positions_ptr + t)
        dst = _slot_offset(row, pos, kv_indices_ptr, kv_indptr_ptr, page_size, stride_page, stride_slot)
        d = tl.arange(0, BLOCK_HALF)
        heads64 = heads.to(tl.int64)[:, None]
        slot = dst + heads64 * stride_head + d[None, :]
        tl.store(k_cache_ptr + slot, k_lo, mask=ok)
        tl.store(k_cache_ptr + slot + HALF, k_hi, mask=ok)
        # v moves in the same two half tiles as k (same heads, same mask), bits unchanged.
        src_v = value_ptr + t * stride_value_tok + heads64 * stride_value_head + d[None, :]
        tl.store(v_cache_ptr + slot, tl.load(src_v, mask=ok), mask=ok)
        tl.store(v_cache_ptr + slot + HALF, tl.load(src_v + HALF, mask=ok), mask=ok)


def _check_args(q, append_key, append_value, batch_indices, positions, paged_kv_cache, kv_indices, kv_indptr,
                kv_last_page_len, rope_positions, cos_sin_cache, kv_layout: str) -> PagedKV:
    """Every check that reads no tensor contents: the append's, then the rotation's."""
    kv = _check_append_args(append_key, append_value, batch_indices, positions, paged_kv_cache, kv_indices,
                            kv_indptr, kv_last_page_len, kv_layout, validate=False)
    check_tensor("q", q, ndim=3, dtypes=(kv.dtype,), device=kv.device, shape=(append_key.shape[0], None, kv.head_dim))
    _check_rope_args(q, append_key, rope_positions, cos_sin_cache, k_name="append_key",
                     positions_name="rope_positions")
    # The kernel reads v after it has written k and q: v must not share their memory.
    check_disjoint("append_value", append_value, "append_key", append_key)
    check_disjoint("append_value", append_value, "q", q)
    return kv


def _check_values(kv: PagedKV, batch_indices, positions, kv_indices, kv_indptr, kv_last_page_len,
                  rope_positions, cos_sin_cache) -> None:
    """The content checks of ``validate=True`` (host reads)."""
    _check_contents(kv, batch_indices, positions, kv_indices, kv_indptr, kv_last_page_len)
    _check_positions_in_table(rope_positions, cos_sin_cache, "rope_positions")


def append_paged_kv_cache_rope(
    q: torch.Tensor,
    append_key: torch.Tensor,
    append_value: torch.Tensor,
    batch_indices: torch.Tensor,
    positions: torch.Tensor,
    paged_kv_cache: PagedKVCache,
    kv_indices: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_last_page_len: torch.Tensor,
    rope_positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    *,
    kv_layout: str = "NHD",
    validate: bool = True,
) -> None:
    """Rotate ``q`` and ``append_key`` in place and append the rotated K and ``append_value``
    to a paged cache: ``apply_rope`` then ``append_paged_kv_cache``, bit for bit, in one launch.

    Args:
        q: ``[nnz, Hq, D]``, the cache's dtype (float16, bfloat16 or float32) and device;
            any token and head strides, last dim stride 1; ``D`` even. Rotated in place.
        append_key: ``[nnz, Hkv, D]`` like ``q``, the cache's head count and head dim; may
            be a view of the same buffer as ``q`` (the qkv projection's output) but must
            not overlap it. Rotated in place; the rotated rows are what the cache receives.
        append_value: ``[nnz, Hkv, D]`` like ``append_key``, not overlapping it or ``q``;
            written to the cache as it is.
        batch_indices: int32 ``[nnz]``, each token's page-table row (``< 0``: padding:
            rotated, not appended).
        positions: int32 ``[nnz]``, each token's position in its row (its slot).
        paged_kv_cache: single tensor or ``(k, v)`` tuple in ``kv_layout`` ("NHD"/"HND").
        kv_indices, kv_indptr, kv_last_page_len: the CSR page table (int32), whose
            lengths already count the appended tokens.
        rope_positions: int32/int64 ``[nnz]``, each token's rotation position (FlashInfer's
            ``pos_ids``), in ``[0, max_positions)`` for every token, padding included.
        cos_sin_cache: ``[max_positions, D]`` float16/bfloat16/float32 on q's device, last
            dim stride 1: cos of the ``D / 2`` frequencies, then their sin.
        kv_layout: "NHD" or "HND".
        validate: check the contents on the host before launching (a sync; skipped while
            a CUDA graph is being captured): the page table and the append targets as
            :func:`~cascadeinfer.kernels.append.append_paged_kv_cache` checks them, and
            every rotation position inside the cos/sin table.

    For token ``j`` with ``p = rope_positions[j]``, every head ``x`` of ``q[j]`` and
    ``append_key[j]`` becomes ``(x1 * cos - x2 * sin, x2 * cos + x1 * sin)`` with
    ``x1, x2`` its halves and ``cos, sin = cos_sin_cache[p].chunk(2)``, each product
    rounded to the dtype before the sum (as :func:`~cascadeinfer.kernels.fused.apply_rope`);
    then, when ``b = batch_indices[j] >= 0``, the rotated ``append_key[j]`` and
    ``append_value[j]`` go to page ``kv_indices[kv_indptr[b] + positions[j] // page_size]``,
    slot ``positions[j] % page_size``. Nothing else in the cache changes. Shape, dtype,
    device and layout errors raise ``ValueError``/``TypeError`` naming the argument before
    any launch. The launch reads no tensor contents on the host, so with
    ``validate=False`` it is CUDA-graph safe. Returns ``None``.
    """
    cache = cache_tensors(paged_kv_cache)
    roots = (q, append_key, append_value, batch_indices, positions, *cache, kv_indices, kv_indptr,
             kv_last_page_len, rope_positions, cos_sin_cache)
    options = (len(cache), kv_layout)
    if not validate and _LAUNCHES.hot(roots, options) is not None:
        return
    rec, key, ptrs = _LAUNCHES.find(roots, options, lengthless=(5 + len(cache),), hot=not validate)
    if rec is not None:  # a call of this signature passed every shape check already
        if validate and not capturing():
            _check_values(unpack_paged_kv_cache(paged_kv_cache, kv_layout), batch_indices, positions, kv_indices,
                          kv_indptr, kv_last_page_len, rope_positions, cos_sin_cache)
        rec.replay(roots, known=ptrs)
        return
    kv = _check_args(q, append_key, append_value, batch_indices, positions, paged_kv_cache, kv_indices, kv_indptr,
                     kv_last_page_len, rope_positions, cos_sin_cache, kv_layout)
    if validate and not capturing():
        _check_values(kv, batch_indices, positions, kv_indices, kv_indptr, kv_last_page_len, rope_positions,
                      cos_sin_cache)
    nnz = q.shape[0]
    if not use_triton(kv.device):
        if nnz:
            _rope_append_torch(q, append_key, append_value, batch_indices, positions, kv, kv_indices, kv_indptr,
                               rope_positions, cos_sin_cache)
        return
    with recorded(_LAUNCHES, key, roots):
        if nnz:
            _launch(q, append_key, append_value, batch_indices, positions, kv, kv_indices, kv_indptr,
                    rope_positions, cos_sin_cache)


# Recordings of append_paged_kv_cache_rope's calls, by signature (see cascadeinfer.kernels.launch).
_LAUNCHES = LaunchCache()


def _launch(q, append_key, append_value, batch_indices, positions, kv: PagedKV, kv_indices, kv_indptr,
            rope_positions, cos_sin_cache) -> None:
    nnz, num_q_heads, head_dim = q.shape
    splits, q_per, kv_per, meta = _rope_launch_plan(nnz, num_q_heads, kv.num_kv_heads, head_dim, q.device)
    launch(
        _rope_append_kernel, (nnz, splits),
        q, append_key, append_value, batch_indices, positions, rope_positions, cos_sin_cache, kv.k, kv.v,
        kv_indices, kv_indptr,
        num_q_heads, kv.num_kv_heads, q_per, kv_per,
        q.stride(0), q.stride(1), append_key.stride(0), append_key.stride(1),
        append_value.stride(0), append_value.stride(1), rope_positions.stride(0), cos_sin_cache.stride(0),
        kv.stride_page, kv.stride_token, kv.stride_head, kv.page_size,
        **meta, num_warps=4, **_EXACT,
    )


def _rope_append_torch(q, append_key, append_value, batch_indices, positions, kv: PagedKV, kv_indices, kv_indptr,
                       rope_positions, cos_sin_cache) -> None:
    """Plain CPU tensors: the PyTorch paths of ``apply_rope`` and ``append_paged_kv_cache``
    (the same numbers). The append's bounds checks run before anything is written, so a
    token outside its row or the pool leaves q, k and the cache as they were."""
    q_rot, k_rot = apply_rope_ref(q, append_key, rope_positions, cos_sin_cache)
    _append_torch(k_rot, append_value, batch_indices, positions, kv, kv_indices, kv_indptr)
    q.copy_(q_rot)
    append_key.copy_(k_rot)
