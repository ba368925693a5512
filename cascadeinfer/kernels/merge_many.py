"""Merge many attention states per row: dense ``[n, S, H, D]`` or ragged by an indptr.

The contract (natural-log LSE, empty states, non-finite input, strides, aliasing) is the
one in :mod:`cascadeinfer.kernels.merge`, which also holds the two-state kernel and the
argument handling both families share. Public functions::

    merge_states(v, s, *, out=None, out_lse=None)                     -> (v, s)
    merge_states_ragged(v, s, indptr, *, out=None, out_lse=None, validate=True) -> (v, s)
    merge_states_unchecked(v, s, out, out_lse)                        -> None (no checks)
    launch_merge_many(v, s, indptr, out, out_lse, *, config=None, unroll=None) -> None (no checks)

One kernel serves both layouts: pass 1 folds a row's LSEs, pass 2 streams its values
once with the final weights. Its tiles are launch policy
(:func:`cascadeinfer.kernels.policy.merge_tile_config` and ``merge_unroll``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cascadeinfer._checks import check_aliasing, check_int32_vector
from cascadeinfer._device import capturing, use_triton
from cascadeinfer.kernels import policy
from cascadeinfer.kernels.constants import KERNEL_LN2, KERNEL_LOG2E
from cascadeinfer.kernels.launch import LaunchCache, given, launch, recorded
from cascadeinfer.kernels.merge import (
    check_states,
    launch_merge_two,
    merge_grid,
    state_output,
)
from cascadeinfer.kernels.reference import merge_states_ragged_ref, merge_states_ref

# Recordings of the public many-state merges' calls, by signature (see cascadeinfer.kernels.launch).
_MERGE_STATES, _MERGE_RAGGED = LaunchCache(), LaunchCache()


# ----------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------


@triton.jit
def _add_states(acc, v, s, m_safe, log2_l):
    """acc + sum_u w_u v_u over a group of states, w_u = exp2((s_u - m) log2 e - log2 l) final.

    acc: [BLOCK_H, BLOCK_D] fp32; v: [UNROLL, BLOCK_H, BLOCK_D] fp32; s: [UNROLL, BLOCK_H]
    natural log; m_safe, log2_l: [BLOCK_H] from pass 1."""
    # Base change: the natural-log difference times log2(e); log2_l is already base 2.
    w = tl.exp2((s - m_safe[None, :]) * KERNEL_LOG2E - log2_l[None, :])[:, :, None]
    # An empty state (and a slot past the row's count, loaded as -inf) contributes exactly
    # zero, whatever its v holds; any other state's NaN or inf stays, even where its weight
    # underflows to 0 (0 * NaN = NaN), as in the float64 reference.
    return acc + tl.sum(tl.where((s == float("-inf"))[:, :, None], 0.0, w * v), axis=0)


@triton.jit
def _merge_many_kernel(
    v_ptr,  # dense: [n, num_states, H, D]; ragged: [nnz, H, D]; fp16/bf16/fp32
    s_ptr,  # dense: [n, num_states, H]; ragged: [nnz, H]; float32, natural log
    indptr_ptr,  # ragged: [n + 1] int32, row i owns states indptr[i]:indptr[i+1]; dense: unused
    o_ptr,  # [n, H, D] fp16/bf16/fp32 (any float dtype, not necessarily v's)
    lse_ptr,  # [n, H] float32, natural log
    num_states,  # dense: states per row; ragged: unused
    num_heads,
    stride_v_n, stride_v_state, stride_v_h,  # ragged: stride_v_n unused, stride_v_state = v.stride(0)
    stride_s_n, stride_s_state, stride_s_h,
    stride_o_n, stride_o_h,
    stride_lse_n, stride_lse_h,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,  # heads per program
    BLOCK_D: tl.constexpr,  # head-dim chunk, a power of two
    UNROLL: tl.constexpr,  # states per value tile (one 3-D load: all in flight together); also the LSE tile
    RAGGED: tl.constexpr,
):
    """Pass 1 folds the LSEs with an online max into (m, log2 l); pass 2 streams the
    values once with final weights, UNROLL states per 3-D tile (one load, so all of its
    vectors are in flight together; the last tile masked past the row's count). The first
    value tile is loaded before pass 1 (it does not depend on the LSEs), so its latency
    overlaps pass 1's. One program owns BLOCK_H heads of one row for all of head_dim, so
    ``out`` may alias one of the row's input states exactly."""
    num_hblocks = tl.cdiv(num_heads, BLOCK_H)
    pid = tl.program_id(0)
    row = (pid // num_hblocks).to(tl.int64)
    heads = (pid % num_hblocks) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = heads < num_heads
    heads = heads.to(tl.int64)
    if RAGGED:
        begin = tl.load(indptr_ptr + row)
        count = tl.load(indptr_ptr + row + 1) - begin
        first = begin.to(tl.int64)
        v_row = v_ptr + first * stride_v_state
        s_row = s_ptr + first * stride_s_state
    else:
        count = num_states
        v_row = v_ptr + row * stride_v_n
        s_row = s_ptr + row * stride_s_n
    s_heads = s_row + heads * stride_s_h  # [BLOCK_H] pointers of state 0
    v_heads = v_row + heads[:, None] * stride_v_h  # [BLOCK_H, 1] pointers of state 0
    o_heads = o_ptr + row * stride_o_n + heads[:, None] * stride_o_h
    u = tl.arange(0, UNROLL)
    u64 = u.to(tl.int64)

    # Prefetch: the first UNROLL states' values of the first head-dim chunk.
    d = tl.arange(0, BLOCK_D)[None, :]
    tile_ok = h_ok[:, None] & (d < HEAD_DIM)  # [BLOCK_H, BLOCK_D]
    v_first = tl.load(v_heads[None, :, :] + u64[:, None, None] * stride_v_state + d[None, :, :],
                      mask=(u < count)[:, None, None] & tile_ok[None, :, :], other=0.0)

    # Pass 1: m = max LSE (natural log), l = sum of exp2((s - m) * log2 e), bad = any +inf/NaN.
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    bad = tl.zeros([BLOCK_H], tl.int32)
    for j0 in range(0, count, UNROLL):
        j = j0 + u64
        ok = (j < count)[:, None] & h_ok[None, :]
        s = tl.load(s_heads[None, :] + j[:, None] * stride_s_state, mask=ok, other=float("-inf"))
        bad = tl.maximum(bad, tl.max(((s != s) | (s == float("inf"))).to(tl.int32), axis=0))
        m_new = tl.maximum(m, tl.max(s, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # all empty so far: never -inf - -inf
        # Base change: natural-log differences times log2(e), then exp2.
        l = l * tl.exp2((m - m_safe) * KERNEL_LOG2E) + tl.sum(tl.exp2((s - m_safe[None, :]) * KERNEL_LOG2E), axis=0)
        m = m_new
    is_bad = bad > 0
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    log2_l = tl.log2(tl.where(l > 0, l, 1.0))  # 0 for empty rows
    # Back to natural log for the boundary: log2(l) times ln(2).
    lse = tl.where(m == float("-inf"), float("-inf"), m + log2_l * KERNEL_LN2)
    lse = tl.where(is_bad, float("nan"), lse)

    # Pass 2: acc = sum_j w_j v_j with final weights, UNROLL states per tile (states past
    # count load as s = -inf: weight exactly 0).
    for d0 in tl.static_range(0, HEAD_DIM, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)[None, :]
        tile_ok = h_ok[:, None] & (d < HEAD_DIM)
        v_tile = v_heads[None, :, :] + d[None, :, :]  # [1, BLOCK_H, BLOCK_D] pointers of state 0
        s_first = tl.load(s_heads[None, :] + u64[:, None] * stride_s_state, mask=(u < count)[:, None] & h_ok[None, :],
                          other=float("-inf"))
        if d0 == 0:  # compile-time: the first chunk's first tile was prefetched
            v_u = v_first
        else:
            v_u = tl.load(v_tile + u64[:, None, None] * stride_v_state,
                          mask=(u < count)[:, None, None] & tile_ok[None, :, :], other=0.0)
        acc = _add_states(tl.zeros([BLOCK_H, BLOCK_D], tl.float32), v_u.to(tl.float32), s_first, m_safe, log2_l)
        for j0 in range(UNROLL, count, UNROLL):
            j = j0 + u64
            live = j < count
            s_j = tl.load(s_heads[None, :] + j[:, None] * stride_s_state, mask=live[:, None] & h_ok[None, :],
                          other=float("-inf"))
            v_j = tl.load(v_tile + j[:, None, None] * stride_v_state,
                          mask=live[:, None, None] & tile_ok[None, :, :], other=0.0).to(tl.float32)
            acc = _add_states(acc, v_j, s_j, m_safe, log2_l)
        acc = tl.where(is_bad[:, None], float("nan"), acc)
        tl.store(o_heads + d, acc.to(o_ptr.dtype.element_ty), mask=tile_ok)
    tl.store(lse_ptr + row * stride_lse_n + heads * stride_lse_h, lse, mask=h_ok)


# ----------------------------------------------------------------------------------
# Launchers (no checks)
# ----------------------------------------------------------------------------------


def launch_merge_many(v: torch.Tensor, s: torch.Tensor, indptr: torch.Tensor | None, out: torch.Tensor,
                      out_lse: torch.Tensor, *, config: tuple[int, int, int] | None = None,
                      unroll: int | None = None) -> None:
    """Launch the many-state kernel without any check (the checked calls are
    :func:`merge_states` and :func:`merge_states_ragged`).

    Dense when ``indptr`` is None: ``v: [n, S, H, D]``, ``s: [n, S, H]``; else ragged:
    ``v: [nnz, H, D]``, ``s: [nnz, H]``, ``indptr: [n + 1]`` int32. Values fp16/bf16/fp32,
    LSEs float32 natural log; ``out [n, H, D]`` (any float dtype: cast at the store) and
    ``out_lse [n, H]`` float32 get the merged states. ``config``: ``(BLOCK_H, BLOCK_D,
    num_warps)`` and ``unroll`` (states per tile), by default the policy's
    (:func:`policy.merge_tile_config`, :func:`policy.merge_unroll`); tests and the tuning
    sweeps force others. CUDA tensors, or CPU under the interpreter.
    """
    n, num_heads, head_dim = out.shape
    ragged = indptr is not None
    if ragged:
        per_row = -(-v.shape[0] // max(1, n))  # the mean, from shapes: no sync
        v_strides = (0, v.stride(0), v.stride(1))
        s_strides = (0, s.stride(0), s.stride(1))
        num_states = 0
    else:
        per_row = num_states = v.shape[1]
        v_strides = (v.stride(0), v.stride(1), v.stride(2))
        s_strides = (s.stride(0), s.stride(1), s.stride(2))
    block_h, block_d, num_warps = config or policy.merge_tile_config(n, num_heads, head_dim, v.element_size(), v.device)
    few_programs = n * triton.cdiv(num_heads, block_h) < policy.merge_min_programs(v.device)
    unroll = unroll or policy.merge_unroll(per_row, few_programs)
    launch(
        _merge_many_kernel, merge_grid("v", n, num_heads, block_h),
        v, s, indptr if ragged else s, out, out_lse,
        num_states, num_heads,
        *v_strides, *s_strides,
        out.stride(0), out.stride(1),
        out_lse.stride(0), out_lse.stride(1),
        HEAD_DIM=head_dim, BLOCK_H=block_h, BLOCK_D=block_d, UNROLL=unroll, RAGGED=ragged, num_warps=num_warps,
    )


def merge_states_unchecked(v: torch.Tensor, s: torch.Tensor, out: torch.Tensor, out_lse: torch.Tensor) -> None:
    """Dense merge of ``v: [n, S, H, D]`` (fp16/bf16/fp32) with float32 natural-log LSEs
    ``s: [n, S, H]`` into ``out [n, H, D]`` / ``out_lse [n, H]`` (float32, natural log)
    without any check: for launchers merging split states they laid out and checked
    themselves (:func:`merge_states` is the checked call). Two states take the two-state
    kernel (all loads issued up front, no pass over the LSEs first), more the many-state
    kernel. Triton only (CUDA, or CPU under the interpreter)."""
    if v.shape[1] == 2:
        launch_merge_two(v[:, 0], s[:, 0], v[:, 1], s[:, 1], out, out_lse, None)
    else:
        launch_merge_many(v, s, None, out, out_lse)


# ----------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------


def merge_states(
    v: torch.Tensor,
    s: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    out_lse: torch.Tensor | None = None,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge ``num_states`` attention states per row (e.g. the partial states of split-KV).

    Args:
        v: ``[n, num_states, H, D]`` fp16/bf16/fp32, last dim stride 1.
        s: ``[n, num_states, H]`` float32 natural-log LSE; ``-inf`` marks an empty state.
        out: optional ``[n, H, D]`` output, fp16/bf16/fp32 (default: v's dtype; another
            float dtype is cast to at the store, e.g. fp32 partial states merged straight
            into a bf16 output); may be ``v[:, j]`` itself when it has v's dtype.
        out_lse: optional ``[n, H]`` float32 output; may be ``s[:, j]`` itself.
        validate: check the outputs' overlap with the inputs (no sync).

    Returns:
        ``(v [n, H, D], s [n, H])``: the merged state, LSE float32 natural log. A row
        whose states are all empty (or ``num_states == 0``) gives ``(0, -inf)``; an LSE of
        ``+inf`` or NaN gives ``(NaN, NaN)`` in that (row, head) only.
    """
    tensors, options = (v, s, *given(out, out_lse)), (out is None, out_lse is None)
    if not validate:
        done = _MERGE_STATES.hot(tensors, options)
        if done is not None:
            return done
    rec, key, ptrs = _MERGE_STATES.find(tensors, options, hot=not validate)
    if rec is None:
        check_states(("v", "s"), v, s, 4)
        shape = (v.shape[0], *v.shape[2:])
        out = state_output("out", out, shape, v.dtype, v.device, any_float=True)
        out_lse = state_output("out_lse", out_lse, shape[:2], torch.float32, v.device)
    else:
        out, out_lse = rec.outputs(out, out_lse, 2)
    if validate or rec is None:
        check_aliasing((("out", out), ("out_lse", out_lse)), (("v", v), ("s", s)), state_slices=True)
    if rec is not None:
        rec.replay((v, s, out, out_lse), known=ptrs[:2])
        return out, out_lse
    if out.numel() == 0 and out_lse.numel() == 0:
        return out, out_lse
    if use_triton(v.device):
        with recorded(_MERGE_STATES, key, (v, s, out, out_lse)):
            merge_states_unchecked(v, s, out, out_lse)
    else:
        o, lse = merge_states_ref(v, s)
        out.copy_(o)
        out_lse.copy_(lse)
    return out, out_lse


def merge_states_ragged(
    v: torch.Tensor,
    s: torch.Tensor,
    indptr: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    out_lse: torch.Tensor | None = None,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge a variable number of states per row: row ``i`` merges ``v[indptr[i]:indptr[i+1]]``.

    Args:
        v: ``[nnz, H, D]`` fp16/bf16/fp32, last dim stride 1.
        s: ``[nnz, H]`` float32 natural-log LSE; ``-inf`` marks an empty state.
        indptr: int32 ``[n + 1]``, contiguous, non-decreasing, ``0 <= indptr[0]``,
            ``indptr[n] <= nnz``. The launch grid comes from ``indptr``'s length, so the
            call never reads it on the host unless ``validate``.
        out: optional ``[n, H, D]`` output, fp16/bf16/fp32 (default: v's dtype), not
            overlapping any input.
        out_lse: optional ``[n, H]`` float32 output, not overlapping any input.
        validate: check ``indptr``'s contents (a host sync; skipped while a CUDA graph
            is being captured).

    Returns:
        ``(v [n, H, D], s [n, H])``, LSE float32 natural log; a row with no states gives
        ``(0, -inf)``; an LSE of ``+inf`` or NaN gives ``(NaN, NaN)`` in that (row, head).
    """
    tensors, options = (v, s, indptr, *given(out, out_lse)), (out is None, out_lse is None)
    if not validate:
        done = _MERGE_RAGGED.hot(tensors, options)
        if done is not None:
            return done
    rec, key, ptrs = _MERGE_RAGGED.find(tensors, options, hot=not validate)
    if rec is None:
        check_states(("v", "s"), v, s, 3)
        check_int32_vector("indptr", indptr, v.device)
        if indptr.numel() == 0:
            raise ValueError("indptr: expected n + 1 >= 1 entries, got an empty tensor")
        shape = (indptr.shape[0] - 1, *v.shape[1:])
        out = state_output("out", out, shape, v.dtype, v.device, any_float=True)
        out_lse = state_output("out_lse", out_lse, shape[:2], torch.float32, v.device)
    else:
        out, out_lse = rec.outputs(out, out_lse, 3)
    if validate or rec is None:
        check_aliasing((("out", out), ("out_lse", out_lse)), (("v", v), ("s", s), ("indptr", indptr)),
                       exact_ok=False)
    if validate and not capturing():
        _check_indptr(indptr, v.shape[0])
    roots = (v, s, indptr, out, out_lse)
    if rec is not None:
        rec.replay(roots, known=ptrs[:3])
        return out, out_lse
    if out.numel() == 0 and out_lse.numel() == 0:
        return out, out_lse
    if use_triton(v.device):
        with recorded(_MERGE_RAGGED, key, roots):
            launch_merge_many(v, s, indptr, out, out_lse)
    else:
        o, lse = merge_states_ragged_ref(v, s, indptr)
        out.copy_(o)
        out_lse.copy_(lse)
    return out, out_lse


def _check_indptr(indptr: torch.Tensor, nnz: int) -> None:
    ip = indptr.cpu()
    if int(ip[0]) < 0:
        raise ValueError(f"indptr: expected indptr[0] >= 0, got {int(ip[0])}")
    if bool((ip[1:] < ip[:-1]).any()):
        i = int(torch.nonzero(ip[1:] < ip[:-1])[0])
        raise ValueError(f"indptr: expected non-decreasing values, got indptr[{i}]={int(ip[i])} > indptr[{i + 1}]={int(ip[i + 1])}")
    if int(ip[-1]) > nnz:
        raise ValueError(f"indptr: indptr[-1]={int(ip[-1])} exceeds the {nnz} states in v")
