"""Merge attention states: the associative combine that cascade and split-KV rest on.

An attention state over a key set ``I`` is ``(v(I), s(I))``: the softmax-normalised
output ``v: [..., H, D]`` and its log-sum-exp ``s: [..., H]`` (float32, NATURAL log).
Merging ``I`` and ``J``::

    s(I∪J) = log(e^{s(I)} + e^{s(J)})
    v(I∪J) = (v(I)·e^{s(I)} + v(J)·e^{s(J)}) / (e^{s(I)} + e^{s(J)})

The empty state ``(0, -inf)`` is the identity; two empties merge to ``(0, -inf)``.

Public functions (all take and return natural-log LSE; the kernels use ``exp2``/``log2``
inside, with ``log2(e)`` folded into the natural-log differences)::

    merge_state(v_a, s_a, v_b, s_b, *, out=None, out_lse=None)        -> (v, s)   this module
    merge_state_in_place(v, s, v_other, s_other, mask=None)           -> None     this module
    merge_states(v, s, *, out=None, out_lse=None)                     -> (v, s)   merge_many.py
    merge_states_ragged(v, s, indptr, *, out=None, out_lse=None, validate=True) -> (v, s)  merge_many.py

Without checks, for launchers that laid out their states themselves and for tests and
tuning sweeps: :func:`launch_merge_two` here, ``launch_merge_many`` and
``merge_states_unchecked`` in :mod:`cascadeinfer.kernels.merge_many`.

This module holds the two-state kernel and the argument handling both kernel families
share; merge_many.py the many-state kernel (dense and ragged). Their tiles are launch
policy (:func:`cascadeinfer.kernels.policy.merge_tile_config`); their float64
references are in :mod:`cascadeinfer.kernels.reference`.

Contract shared by all of them:

* values ``v`` are fp16, bf16 or fp32 (all inputs of one dtype; ``out`` of the same
  dtype, except that ``merge_states`` and ``merge_states_ragged`` accept an ``out`` of
  any of the three and cast at the store); LSEs are float32; accumulation is float32.
  Any head count and any head dim (non-powers of two are padded to the next power of
  two and masked; very large head dims are tiled).
* Inputs may have any strides (slices, transposes, broadcasts) except that the last
  dimension of every value tensor must have stride 1. Outputs may be strided too but
  must not have zero strides. An output may be *exactly* one of the inputs (``out is
  v_a``; for ``merge_states`` also ``out`` = ``v[:, j]``); any other overlap between an
  output and an input is an error, rejected where it is cheap to see (both dense) and
  undefined where it is not (interleaved strided views).
* A state with LSE ``-inf`` is empty: its ``v`` is ignored, even if it holds NaN or
  inf. Merging with an empty state returns the other state bit for bit.
* LSE values of ``+inf`` or NaN are not valid states. They are not rejected (that
  would need a host sync on the hot path); instead every (row, head) of the output that
  takes such a state gets ``v = NaN`` and ``s = NaN``, the same on every path, and no
  other row or head is affected. A NaN or inf inside ``v`` of a state that is not empty
  likewise stays inside its own (row, head) — at any weight: one far enough below the
  row's largest LSE to underflow to 0 in float32 (about 87 in natural log) still gives
  ``0 * NaN = NaN``, as the float64 reference does, where it does not underflow. The
  attention kernels never produce such a state: a row that met a NaN or inf comes out
  as ``(NaN, NaN)`` (:func:`cascadeinfer.kernels.softmax.finish_state`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cascadeinfer._checks import (
    FLOAT_DTYPES,
    check_aliasing,
    check_last_dim_contiguous,
    check_tensor,
)
from cascadeinfer._device import use_triton
from cascadeinfer.kernels import policy
from cascadeinfer.kernels.constants import KERNEL_LN2, KERNEL_LOG2E
from cascadeinfer.kernels.launch import LaunchCache, given, launch, recorded
from cascadeinfer.kernels.reference import merge_states_ref

# Recordings of the public two-state merges' calls, by signature (see cascadeinfer.kernels.launch).
_MERGE_STATE, _MERGE_IN_PLACE = LaunchCache(), LaunchCache()
_MAX_GRID = 2**31 - 1


# ----------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------


@triton.jit
def _merge_two_kernel(
    va_ptr,  # [n, H, D] fp16/bf16/fp32
    sa_ptr,  # [n, H] float32, natural log
    vb_ptr,  # [n, H, D] same dtype as va
    sb_ptr,  # [n, H] float32, natural log
    o_ptr,  # [n, H, D] fp16/bf16/fp32 (may be va_ptr or vb_ptr itself)
    lse_ptr,  # [n, H] float32, natural log (may be sa_ptr or sb_ptr itself)
    mask_ptr,  # [n] uint8 (a bool tensor's bytes); read only when HAS_MASK
    num_heads,
    stride_va_n, stride_va_h,
    stride_sa_n, stride_sa_h,
    stride_vb_n, stride_vb_h,
    stride_sb_n, stride_sb_h,
    stride_o_n, stride_o_h,
    stride_lse_n, stride_lse_h,
    stride_mask,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,  # heads per program
    BLOCK_D: tl.constexpr,  # head-dim chunk, a power of two; HEAD_DIM is covered in chunks
    HAS_MASK: tl.constexpr,
):
    """One program merges BLOCK_H heads of one row, all of head_dim, so it reads its LSEs
    and values before it writes: ``out`` may alias ``va``/``vb`` exactly."""
    num_hblocks = tl.cdiv(num_heads, BLOCK_H)
    pid = tl.program_id(0)
    row = (pid // num_hblocks).to(tl.int64)
    heads = (pid % num_hblocks) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = heads < num_heads
    if HAS_MASK:
        # an unmarked row issues no load and no store: it stays bit for bit
        h_ok = h_ok & (tl.load(mask_ptr + row * stride_mask) != 0)
    heads = heads.to(tl.int64)
    va_rows = va_ptr + row * stride_va_n + heads[:, None] * stride_va_h
    vb_rows = vb_ptr + row * stride_vb_n + heads[:, None] * stride_vb_h
    o_rows = o_ptr + row * stride_o_n + heads[:, None] * stride_o_h

    # The first head-dim chunk's values are loaded before the LSE math (they do not
    # depend on it), so their latency overlaps that of the LSE loads and the division.
    d = tl.arange(0, BLOCK_D)[None, :]
    ok = h_ok[:, None] & (d < HEAD_DIM)
    v_a = tl.load(va_rows + d, mask=ok, other=0.0).to(tl.float32)
    v_b = tl.load(vb_rows + d, mask=ok, other=0.0).to(tl.float32)

    s_a = tl.load(sa_ptr + row * stride_sa_n + heads * stride_sa_h, mask=h_ok, other=float("-inf"))
    s_b = tl.load(sb_ptr + row * stride_sb_n + heads * stride_sb_h, mask=h_ok, other=float("-inf"))
    bad = (s_a != s_a) | (s_a == float("inf")) | (s_b != s_b) | (s_b == float("inf"))

    m = tl.maximum(s_a, s_b)
    m_safe = tl.where(m == float("-inf"), 0.0, m)  # both empty: never -inf - -inf
    # Base change: natural-log differences (small, so large LSEs keep their precision)
    # times log2(e), then exp2.
    e_a = tl.exp2((s_a - m_safe) * KERNEL_LOG2E)
    e_b = tl.exp2((s_b - m_safe) * KERNEL_LOG2E)
    denom = e_a + e_b  # in [1, 2], or 0 when both are empty
    denom = tl.where(denom > 0, denom, 1.0)
    # correctly rounded division: merging with an empty state gives weight exactly 1
    w_a = tl.div_rn(e_a, denom)[:, None]
    w_b = tl.div_rn(e_b, denom)[:, None]
    # Back to natural log: log2 of the denominator times ln(2).
    lse = tl.where(m == float("-inf"), float("-inf"), m + tl.log2(denom) * KERNEL_LN2)
    lse = tl.where(bad, float("nan"), lse)
    empty_a = (s_a == float("-inf"))[:, None]
    empty_b = (s_b == float("-inf"))[:, None]

    for d0 in tl.static_range(0, HEAD_DIM, BLOCK_D):
        if d0 > 0:  # compile-time: later chunks load here
            d = d0 + tl.arange(0, BLOCK_D)[None, :]
            ok = h_ok[:, None] & (d < HEAD_DIM)
            v_a = tl.load(va_rows + d, mask=ok, other=0.0).to(tl.float32)
            v_b = tl.load(vb_rows + d, mask=ok, other=0.0).to(tl.float32)
        # An empty state contributes exactly zero, whatever its v holds; any other state's
        # NaN or inf stays (even at a weight that underflows to 0: 0 * NaN = NaN), as it
        # does in the float64 reference, where that weight does not underflow.
        o = tl.where(empty_a, 0.0, w_a * v_a) + tl.where(empty_b, 0.0, w_b * v_b)
        o = tl.where(bad[:, None], float("nan"), o)
        tl.store(o_rows + d, o.to(o_ptr.dtype.element_ty), mask=ok)
    tl.store(lse_ptr + row * stride_lse_n + heads * stride_lse_h, lse, mask=h_ok)


# ----------------------------------------------------------------------------------
# Argument handling and grid, shared with merge_many.py
# ----------------------------------------------------------------------------------


def check_states(names: tuple[str, str], v: object, s: object, ndim: int, *, shape=None, dtype=None,
                 device=None) -> None:
    """Values (fp16/bf16/fp32, ``ndim`` dims, last dim stride 1) and their float32
    natural-log LSEs (``v``'s shape without the last dim); raises naming the argument."""
    v_name, s_name = names
    check_tensor(v_name, v, ndim=ndim, dtypes=FLOAT_DTYPES if dtype is None else (dtype,),
                 device=device, shape=shape)
    check_last_dim_contiguous(v_name, v)
    check_tensor(s_name, s, dtypes=(torch.float32,), device=v.device, shape=tuple(v.shape[:-1]))


def state_output(name: str, t: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device, *, any_float: bool = False) -> torch.Tensor:
    """A caller's output tensor, checked, or a fresh one of ``dtype`` (a replayed call
    takes :meth:`Recording.outputs` instead). Values ``[n, H, D]`` need last dim stride 1;
    no output may have a zero stride. With ``any_float`` a given tensor may have any of
    FLOAT_DTYPES (the kernels cast at the store)."""
    if t is None:
        return torch.empty(shape, dtype=dtype, device=device)
    check_tensor(name, t, dtypes=FLOAT_DTYPES if any_float else (dtype,), device=device, shape=shape)
    if len(shape) == 3:
        check_last_dim_contiguous(name, t)
    if any(st == 0 and sz > 1 for sz, st in zip(t.shape, t.stride())):
        raise ValueError(f"{name}: has a zero stride (strides {tuple(t.stride())}); every output element needs its own memory")
    return t


def merge_grid(name: str, n: int, num_heads: int, block_h: int) -> tuple[int]:
    """The 1-D grid of a merge kernel: one program per row and block of ``block_h`` heads."""
    programs = n * triton.cdiv(num_heads, block_h)
    if programs > _MAX_GRID:
        raise ValueError(f"{name}: {n} rows x {num_heads} heads need {programs} programs, more than one launch allows")
    return (programs,)


# ----------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------


def launch_merge_two(v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor,
                     out: torch.Tensor, out_lse: torch.Tensor, mask: torch.Tensor | None = None, *,
                     config: tuple[int, int, int] | None = None) -> None:
    """Launch the two-state kernel without any check (the checked call is :func:`merge_state`).

    ``v_a, v_b: [n, H, D]`` fp16/bf16/fp32 (one dtype), ``s_a, s_b: [n, H]`` float32
    natural-log LSE; ``out [n, H, D]`` (v's dtype) and ``out_lse [n, H]`` float32 get the
    merged state and may be ``v_a``/``s_a`` (or ``v_b``/``s_b``) exactly. ``mask``:
    optional bool ``[n]``, rows not marked are neither read nor written. ``config``:
    ``(BLOCK_H, BLOCK_D, num_warps)``, by default :func:`policy.merge_tile_config`'s
    (tests and the tuning sweeps force others). CUDA tensors, or CPU under the interpreter.
    """
    n, num_heads, head_dim = v_a.shape
    block_h, block_d, num_warps = config or policy.merge_tile_config(
        n, num_heads, head_dim, v_a.element_size(), v_a.device, policy.MERGE_TWO_TILE)
    mask_bytes = v_a if mask is None else mask.view(torch.uint8)
    launch(
        _merge_two_kernel, merge_grid("v_a", n, num_heads, block_h),
        v_a, s_a, v_b, s_b, out, out_lse, mask_bytes,
        num_heads,
        v_a.stride(0), v_a.stride(1),
        s_a.stride(0), s_a.stride(1),
        v_b.stride(0), v_b.stride(1),
        s_b.stride(0), s_b.stride(1),
        out.stride(0), out.stride(1),
        out_lse.stride(0), out_lse.stride(1),
        0 if mask is None else mask.stride(0),
        HEAD_DIM=head_dim, BLOCK_H=block_h, BLOCK_D=block_d, HAS_MASK=mask is not None,
        num_warps=num_warps,
    )


def merge_state(
    v_a: torch.Tensor,
    s_a: torch.Tensor,
    v_b: torch.Tensor,
    s_b: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    out_lse: torch.Tensor | None = None,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two attention states.

    Args:
        v_a, v_b: ``[n, H, D]`` fp16/bf16/fp32 (the same dtype), last dim stride 1.
        s_a, s_b: ``[n, H]`` float32 natural-log LSE; ``-inf`` marks an empty state.
        out: optional ``[n, H, D]`` output of v's dtype; may be ``v_a`` or ``v_b`` itself.
        out_lse: optional ``[n, H]`` float32 output; may be ``s_a`` or ``s_b`` itself.
        validate: check that the outputs overlap no input other than as allowed above
            (host arithmetic on addresses, no sync). Shapes, dtypes and devices are
            always checked.

    Returns:
        ``(v, s)``: ``v [n, H, D]`` in v's dtype, ``s [n, H]`` float32 natural-log LSE of
        the union. Two empties give ``(0, -inf)``. An LSE of ``+inf`` or NaN gives
        ``(NaN, NaN)`` in that (row, head) only (see the module docstring).
    """
    tensors = (v_a, s_a, v_b, s_b, *given(out, out_lse))
    options = (out is None, out_lse is None)
    if not validate:
        done = _MERGE_STATE.hot(tensors, options)
        if done is not None:
            return done
    rec, key, ptrs = _MERGE_STATE.find(tensors, options, hot=not validate)
    if rec is None:
        check_states(("v_a", "s_a"), v_a, s_a, 3)
        check_states(("v_b", "s_b"), v_b, s_b, 3, shape=v_a.shape, dtype=v_a.dtype, device=v_a.device)
        out = state_output("out", out, v_a.shape, v_a.dtype, v_a.device)
        out_lse = state_output("out_lse", out_lse, v_a.shape[:2], torch.float32, v_a.device)
    else:
        out, out_lse = rec.outputs(out, out_lse, 4)
    if validate or rec is None:
        check_aliasing((("out", out), ("out_lse", out_lse)),
                       (("v_a", v_a), ("s_a", s_a), ("v_b", v_b), ("s_b", s_b)))
    roots = (v_a, s_a, v_b, s_b, out, out_lse)
    if rec is not None:
        rec.replay(roots, known=ptrs[:4])
        return out, out_lse
    with recorded(_MERGE_STATE, key, roots):
        _merge_two(v_a, s_a, v_b, s_b, out, out_lse, None)
    return out, out_lse


def merge_state_in_place(
    v: torch.Tensor,
    s: torch.Tensor,
    v_other: torch.Tensor,
    s_other: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    validate: bool = True,
) -> None:
    """Merge ``(v_other, s_other)`` into ``(v, s)``, overwriting ``v`` and ``s``.

    Args:
        v: ``[n, H, D]`` fp16/bf16/fp32, last dim stride 1, no zero strides; updated in place.
        s: ``[n, H]`` float32 natural-log LSE, no zero strides; updated in place.
        v_other: ``[n, H, D]`` of v's dtype; s_other: ``[n, H]`` float32 natural log.
        mask: optional bool ``[n]``; only rows marked True are merged, the others are
            neither read nor written (they stay bit for bit).
        validate: check that ``v``/``s`` overlap neither other input (no sync).

    LSE conventions as in :func:`merge_state`.
    """
    tensors, options = (v, s, v_other, s_other, *given(mask)), (mask is None,)
    if not validate and _MERGE_IN_PLACE.hot(tensors, options) is not None:
        return
    rec, key, ptrs = _MERGE_IN_PLACE.find(tensors, options, hot=not validate)
    if rec is None:
        check_states(("v", "s"), v, s, 3)
        n, num_heads, head_dim = v.shape
        check_states(("v_other", "s_other"), v_other, s_other, 3, shape=v.shape, dtype=v.dtype, device=v.device)
        state_output("v", v, (n, num_heads, head_dim), v.dtype, v.device)
        state_output("s", s, (n, num_heads), torch.float32, v.device)
        if mask is not None:
            check_tensor("mask", mask, dtypes=(torch.bool,), device=v.device, shape=(n,))
    if validate or rec is None:
        check_aliasing((("v", v), ("s", s)), (("v_other", v_other), ("s_other", s_other)))
    roots = (v, s, v_other, s_other) + (() if mask is None else (mask,))
    if rec is not None:
        rec.replay(roots, known=ptrs)
        return
    with recorded(_MERGE_IN_PLACE, key, roots):
        _merge_two(v, s, v_other, s_other, v, s, mask)


def _merge_two(v_a, s_a, v_b, s_b, out, out_lse, mask) -> None:
    """The kernel where Triton runs, else the float64 reference (plain-CPU tensors)."""
    if out.numel() == 0 and out_lse.numel() == 0:
        return
    if use_triton(v_a.device):
        launch_merge_two(v_a, s_a, v_b, s_b, out, out_lse, mask)
        return
    o, lse = merge_states_ref(torch.stack([v_a, v_b], 1), torch.stack([s_a, s_b], 1))
    if mask is None:
        out.copy_(o)
        out_lse.copy_(lse)
    else:
        out[mask] = o[mask].to(out.dtype)
        out_lse[mask] = lse[mask].float()
