"""Merge attention states: the associative combine that cascade and split-KV rest on.

An attention state over a key set ``I`` is ``(v(I), s(I))``: the softmax-normalised
output ``v: [..., H, D]`` and its log-sum-exp ``s: [..., H]`` (float32, NATURAL log).
Merging ``I`` and ``J``::

    s(I∪J) = log(e^{s(I)} + e^{s(J)})
    v(I∪J) = (v(I)·e^{s(I)} + v(J)·e^{s(J)}) / (e^{s(I)} + e^{s(J)})

The empty state ``(0, -inf)`` is the identity; two empties merge to ``(0, -inf)``.

Public functions (all take and return natural-log LSE; the kernels use ``exp2``/``log2``
inside, with ``log2(e)`` folded into the natural-log differences)::

    merge_state(v_a, s_a, v_b, s_b, *, out=None, out_lse=None)        -> (v, s)
    merge_state_in_place(v, s, v_other, s_other, mask=None)           -> None
    merge_states(v, s, *, out=None, out_lse=None)                     -> (v, s)
    merge_states_ragged(v, s, indptr, *, out=None, out_lse=None, validate=True) -> (v, s)

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
  as ``(NaN, NaN)`` (:func:`finish_state`).
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from cascadeinfer._checks import (
    FLOAT_DTYPES,
    capturing,
    check_int32_vector,
    check_last_dim_contiguous,
    check_tensor,
    cuda_num_sms,
    next_power_of_2,
    use_triton,
)
from cascadeinfer.kernels.constants import KERNEL_LN2, KERNEL_LOG2E
from cascadeinfer.kernels.launch import LaunchCache, given, launch, recorded

# Recordings of the public merges' calls, by signature (see cascadeinfer.kernels.launch).
_MERGE_STATE, _MERGE_IN_PLACE, _MERGE_STATES, _MERGE_RAGGED = (LaunchCache() for _ in range(4))



# ----------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------


@triton.jit
def finish_state(acc, l, m, has_keys):
    """The attention state ``(o, lse)`` of a finished online softmax (every attention kernel).

    acc: [R, D] fp32 un-normalised output; l: [R] fp32 sum of exp2(score - m); m: [R] fp32
    running max score, base 2; has_keys: [R] or scalar, whether the row read any key — a
    count the caller knows, never inferred from l, because a NaN or +inf score leaves
    l = NaN and "l > 0" would pass it for an empty row that every merge then drops.
    Returns ``o`` [R, D] fp32 and the natural-log ``lse`` [R]: ``(0, -inf)`` for a row with
    no keys; ``(NaN, NaN)`` for a row whose keys held a NaN or inf anywhere (a NaN or +inf
    score gives l = NaN; a non-finite value leaves acc non-finite even at weight 0, as
    0 * inf = NaN). The whole row is poisoned, LSE included, so that the merges, which
    check only the LSE, carry it on. Runs once per row, after the key loop.
    """
    l_safe = tl.where(l == 0.0, 1.0, l)  # 0: every score was -inf (then m = -inf too); NaN stays NaN
    o = acc / l_safe[:, None]
    lse = (m + tl.log2(l_safe)) * KERNEL_LN2  # base change: log2 units -> natural log
    finite = (tl.min((tl.abs(o) < float("inf")).to(tl.int32), 1) > 0) & (lse == lse)  # NaN fails both compares
    lse = tl.where(finite, lse, float("nan"))
    lse = tl.where(has_keys, lse, float("-inf"))
    o = tl.where(finite[:, None], o, float("nan"))
    o = tl.where((lse == float("-inf"))[:, None], 0.0, o)  # no keys, or only -inf scores: v is 0
    return o, lse


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
# Launch configuration (host side, from sizes only: no autotuning, no host syncs)
# ----------------------------------------------------------------------------------

# Defaults from the H200 sweep in benchmarks/tools/tune_merge.py (see benchmarks/NOTES.md):
# (bytes of values one program holds per state, 16-byte vectors per thread and state).
# Two states: 2 vectors a thread was best at every tile size (1 or 4: 10-15% slower).
# Many states: small programs (bf16 D=128: 2 heads, one warp, one vector a thread and
# state) with 8 states per 3-D tile; larger 3-D tiles cost registers fast and the
# multi-warp ones ran up to 5x slower.
_TWO_TILE = (4096, 2)  # the two-state kernel
_MANY_TILE = (512, 1)  # the many-state kernel
_MAX_UNROLL = 8  # states per value tile (and LSE tile) in the many-state kernel
_MAX_UNROLL_FEW = 32  # the same when programs are too few to fill the GPU (latency-bound)
_MAX_GRID = 2**31 - 1


def _min_programs(device: torch.device) -> int:
    """Programs that keep every SM busy; the interpreter runs programs one by one."""
    return 4 * cuda_num_sms(device) if device.type == "cuda" else 1


def _tile_config(n: int, num_heads: int, head_dim: int, elem_size: int, device: torch.device,
                 tile: tuple[int, int] = _MANY_TILE) -> tuple[int, int, int]:
    """(BLOCK_H, BLOCK_D, num_warps): about ``tile[0]`` bytes of values per program and
    state, ``tile[1]`` 16-byte vectors per thread and state along head_dim, fewer heads
    per program when rows are few (so that every SM gets programs)."""
    min_programs = _min_programs(device)
    return _tile_config_for(min(n, min_programs), num_heads, head_dim, elem_size, min_programs, *tile)


@functools.cache
def _tile_config_for(n: int, num_heads: int, head_dim: int, elem_size: int, min_programs: int,
                     tile_bytes: int, vecs_per_thread: int) -> tuple[int, int, int]:
    tile = tile_bytes // elem_size
    block_d = min(next_power_of_2(head_dim), tile)
    block_h = max(1, min(tile // block_d, next_power_of_2(num_heads)))
    while block_h > 1 and n * triton.cdiv(num_heads, block_h) < min_programs:
        block_h //= 2
    vec = 16 // elem_size
    num_warps = max(1, min(16, block_h * block_d // (vecs_per_thread * vec * 32)))
    return block_h, block_d, num_warps


def _unroll(states_per_row: int, few_programs: bool) -> int:
    """States per value tile for a typical number of states per row: more when the grid
    is too small to fill the GPU (each tile is one round trip to memory)."""
    return min(_MAX_UNROLL_FEW if few_programs else _MAX_UNROLL, next_power_of_2(max(1, states_per_row)))


def _grid(name: str, n: int, num_heads: int, block_h: int) -> tuple[int]:
    programs = n * triton.cdiv(num_heads, block_h)
    if programs > _MAX_GRID:
        raise ValueError(f"{name}: {n} rows x {num_heads} heads need {programs} programs, more than one launch allows")
    return (programs,)


def _launch_two(v_a, s_a, v_b, s_b, out, out_lse, mask, *, config=None) -> None:
    n, num_heads, head_dim = v_a.shape
    block_h, block_d, num_warps = config or _tile_config(n, num_heads, head_dim, v_a.element_size(), v_a.device,
                                                         _TWO_TILE)
    mask_bytes = v_a if mask is None else mask.view(torch.uint8)
    launch(
        _merge_two_kernel, _grid("v_a", n, num_heads, block_h),
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


def merge_states_unchecked(v, s, out, out_lse) -> None:
    """Dense merge of ``v: [n, S, H, D]`` with LSEs ``s: [n, S, H]`` into ``out``/``out_lse``
    without any check: for launchers merging split states they laid out and checked
    themselves (:func:`merge_states` is the checked call). Two states take the two-state
    kernel (all loads issued up front, no pass over the LSEs first), more the many-state
    kernel."""
    if v.shape[1] == 2:
        _launch_two(v[:, 0], s[:, 0], v[:, 1], s[:, 1], out, out_lse, None)
    else:
        _launch_many(v, s, None, out, out_lse)


def _launch_many(v, s, indptr, out, out_lse, *, config=None, unroll=None) -> None:
    """Dense when ``indptr`` is None (v: [n, S, H, D]), else ragged (v: [nnz, H, D])."""
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
    block_h, block_d, num_warps = config or _tile_config(n, num_heads, head_dim, v.element_size(), v.device)
    unroll = unroll or _unroll(per_row, n * triton.cdiv(num_heads, block_h) < _min_programs(v.device))
    launch(
        _merge_many_kernel, _grid("v", n, num_heads, block_h),
        v, s, indptr if ragged else s, out, out_lse,
        num_states, num_heads,
        *v_strides, *s_strides,
        out.stride(0), out.stride(1),
        out_lse.stride(0), out_lse.stride(1),
        HEAD_DIM=head_dim, BLOCK_H=block_h, BLOCK_D=block_d, UNROLL=unroll, RAGGED=ragged, num_warps=num_warps,
    )


# ----------------------------------------------------------------------------------
# Argument checks
# ----------------------------------------------------------------------------------


def _output(name: str, t, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, *,
            any_float: bool = False) -> torch.Tensor:
    """A caller's output tensor, checked, or a fresh one of ``dtype`` (a replayed call
    takes :meth:`Recording.outputs` instead). With ``any_float`` a given tensor may have
    any of FLOAT_DTYPES."""
    if t is None:
        return torch.empty(shape, dtype=dtype, device=device)
    check_tensor(name, t, dtypes=FLOAT_DTYPES if any_float else (dtype,), device=device, shape=shape)
    if len(shape) == 3:
        check_last_dim_contiguous(name, t)
    if any(st == 0 and sz > 1 for sz, st in zip(t.shape, t.stride())):
        raise ValueError(f"{name}: has a zero stride (strides {tuple(t.stride())}); every output element needs its own memory")
    return t


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    last = sum((sz - 1) * st for sz, st in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def _surely_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Overlap that is certain and cheap to see: both tensors fill their byte ranges
    (dense, in any dim order) and the ranges meet. Interleaved strided views are not
    judged (like PyTorch's own ``out=`` check, which calls them too hard)."""
    if a.numel() == 0 or b.numel() == 0:
        return False
    (a0, a1), (b0, b1) = _byte_span(a), _byte_span(b)
    dense = a1 - a0 == a.numel() * a.element_size() and b1 - b0 == b.numel() * b.element_size()
    return dense and a0 < b1 and b0 < a1


def _strides(t: torch.Tensor, dims) -> tuple[int, ...]:
    """Strides of ``dims``, with size-1 dims (whose stride means nothing) as 0."""
    return tuple(t.stride(i) if t.shape[i] > 1 else 0 for i in dims)


def _is_same_view(out: torch.Tensor, t: torch.Tensor) -> bool:
    return (out.dtype == t.dtype and out.data_ptr() == t.data_ptr()
            and _strides(out, range(out.dim())) == _strides(t, range(t.dim())))


def _is_state_slice(out: torch.Tensor, t: torch.Tensor) -> bool:
    """True when ``out`` ([n, *rest]) is ``t[:, j]`` ([n, S, *rest]) for some state j."""
    if out.dtype != t.dtype or _strides(out, range(out.dim())) != _strides(t, [0, *range(2, t.dim())]):
        return False
    offset = out.data_ptr() - t.data_ptr()
    step = t.stride(1) * t.element_size()
    if step == 0 or t.shape[1] == 1:
        return offset == 0
    return offset % step == 0 and 0 <= offset // step < t.shape[1]


def _check_aliasing(outputs, inputs, *, state_slices: bool = False, exact_ok: bool = True) -> None:
    """An output may be exactly an input (``merge_states``: an input's state slice); any
    other overlap it surely has with an input, or with the other output, is an error."""
    (o_name, o), (l_name, lse) = outputs
    if _surely_overlap(o, lse):
        raise ValueError(f"{o_name}: overlaps {l_name} in memory")
    for out_name, out in outputs:
        for in_name, t in inputs:
            if not _surely_overlap(out, t):
                continue
            if exact_ok and (_is_state_slice(out, t) if state_slices else _is_same_view(out, t)):
                continue
            allowed = (f"exactly {in_name}[:, j]" if state_slices else f"exactly {in_name}") if exact_ok else "disjoint"
            raise ValueError(f"{out_name}: overlaps {in_name} in memory; it must be {allowed} or not overlap it")


def _check_states(names: tuple[str, str], v, s, ndim: int, *, shape=None, dtype=None, device=None):
    """Values (fp16/bf16/fp32, last dim stride 1) and their float32 LSE (one dim fewer)."""
    v_name, s_name = names
    check_tensor(v_name, v, ndim=ndim, dtypes=FLOAT_DTYPES if dtype is None else (dtype,),
                 device=device, shape=shape)
    check_last_dim_contiguous(v_name, v)
    check_tensor(s_name, s, dtypes=(torch.float32,), device=v.device, shape=tuple(v.shape[:-1]))


# ----------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------


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
    rec, key = _MERGE_STATE.find((v_a, s_a, v_b, s_b, *given(out, out_lse)), (out is None, out_lse is None))
    if rec is None:
        _check_states(("v_a", "s_a"), v_a, s_a, 3)
        _check_states(("v_b", "s_b"), v_b, s_b, 3, shape=v_a.shape, dtype=v_a.dtype, device=v_a.device)
        out = _output("out", out, v_a.shape, v_a.dtype, v_a.device)
        out_lse = _output("out_lse", out_lse, v_a.shape[:2], torch.float32, v_a.device)
    else:
        out, out_lse = rec.outputs(out, out_lse, 4)
    if validate or rec is None:
        _check_aliasing((("out", out), ("out_lse", out_lse)),
                        (("v_a", v_a), ("s_a", s_a), ("v_b", v_b), ("s_b", s_b)))
    roots = (v_a, s_a, v_b, s_b, out, out_lse)
    if rec is not None:
        rec.replay(roots)
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
    rec, key = _MERGE_IN_PLACE.find((v, s, v_other, s_other, *given(mask)), (mask is None,))
    if rec is None:
        _check_states(("v", "s"), v, s, 3)
        n, num_heads, head_dim = v.shape
        _check_states(("v_other", "s_other"), v_other, s_other, 3, shape=v.shape, dtype=v.dtype, device=v.device)
        _output("v", v, (n, num_heads, head_dim), v.dtype, v.device)
        _output("s", s, (n, num_heads), torch.float32, v.device)
        if mask is not None:
            check_tensor("mask", mask, dtypes=(torch.bool,), device=v.device, shape=(n,))
    if validate or rec is None:
        _check_aliasing((("v", v), ("s", s)), (("v_other", v_other), ("s_other", s_other)))
    roots = (v, s, v_other, s_other) + (() if mask is None else (mask,))
    if rec is not None:
        rec.replay(roots)
        return
    with recorded(_MERGE_IN_PLACE, key, roots):
        _merge_two(v, s, v_other, s_other, v, s, mask)


def _merge_two(v_a, s_a, v_b, s_b, out, out_lse, mask) -> None:
    if out.numel() == 0 and out_lse.numel() == 0:
        return
    if use_triton(v_a.device):
        _launch_two(v_a, s_a, v_b, s_b, out, out_lse, mask)
        return
    o, lse = merge_states_ref(torch.stack([v_a, v_b], 1), torch.stack([s_a, s_b], 1))
    if mask is None:
        out.copy_(o)
        out_lse.copy_(lse)
    else:
        out[mask] = o[mask].to(out.dtype)
        out_lse[mask] = lse[mask].float()


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
    rec, key = _MERGE_STATES.find((v, s, *given(out, out_lse)), (out is None, out_lse is None))
    if rec is None:
        _check_states(("v", "s"), v, s, 4)
        shape = (v.shape[0], *v.shape[2:])
        out = _output("out", out, shape, v.dtype, v.device, any_float=True)
        out_lse = _output("out_lse", out_lse, shape[:2], torch.float32, v.device)
    else:
        out, out_lse = rec.outputs(out, out_lse, 2)
    if validate or rec is None:
        _check_aliasing((("out", out), ("out_lse", out_lse)), (("v", v), ("s", s)), state_slices=True)
    if rec is not None:
        rec.replay((v, s, out, out_lse))
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
    rec, key = _MERGE_RAGGED.find((v, s, indptr, *given(out, out_lse)), (out is None, out_lse is None))
    if rec is None:
        _check_states(("v", "s"), v, s, 3)
        check_int32_vector("indptr", indptr, v.device)
        if indptr.numel() == 0:
            raise ValueError("indptr: expected n + 1 >= 1 entries, got an empty tensor")
        shape = (indptr.shape[0] - 1, *v.shape[1:])
        out = _output("out", out, shape, v.dtype, v.device, any_float=True)
        out_lse = _output("out_lse", out_lse, shape[:2], torch.float32, v.device)
    else:
        out, out_lse = rec.outputs(out, out_lse, 3)
    if validate or rec is None:
        _check_aliasing((("out", out), ("out_lse", out_lse)), (("v", v), ("s", s), ("indptr", indptr)),
                        exact_ok=False)
    if validate and not capturing():
        _check_indptr(indptr, v.shape[0])
    roots = (v, s, indptr, out, out_lse)
    if rec is not None:
        rec.replay(roots)
        return out, out_lse
    if out.numel() == 0 and out_lse.numel() == 0:
        return out, out_lse
    if use_triton(v.device):
        with recorded(_MERGE_RAGGED, key, roots):
            _launch_many(v, s, indptr, out, out_lse)
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


# ----------------------------------------------------------------------------------
# Float64 references (also the path for CPU tensors without the Triton interpreter)
# ----------------------------------------------------------------------------------


def merge_states_ref(v: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 merge of ``v: [n, S, H, D]``, ``s: [n, S, H]`` (natural log) over dim 1.

    Returns ``(v [n, H, D], s [n, H])`` in float64, with the module's contract: empty
    rows give ``(0, -inf)``; empty states contribute exactly zero, any other state's NaN
    or inf in ``v`` stays; an LSE of ``+inf``/NaN makes its (row, head) ``(NaN, NaN)``.
    """
    s = s.double()
    lse = torch.logsumexp(s, dim=1)  # [n, H]; -inf where every state is empty
    finite = torch.isfinite(lse)
    w = torch.where(finite[:, None], torch.exp(s - torch.where(finite, lse, 0.0)[:, None]), 0.0)
    w = w[..., None]
    o = torch.where((s == -math.inf)[..., None], 0.0, w * v.double()).sum(dim=1)
    bad = (torch.isnan(s) | (s == math.inf)).any(dim=1)
    o = torch.where(bad[..., None], math.nan, o)
    lse = torch.where(bad, math.nan, lse)
    return o, lse


def merge_states_ragged_ref(
    v: torch.Tensor, s: torch.Tensor, indptr: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 merge of row ``i``'s states ``v[indptr[i]:indptr[i+1]]`` (``v: [nnz, H, D]``,
    ``s: [nnz, H]`` natural log). Returns ``(v [n, H, D], s [n, H])`` float64, as
    :func:`merge_states_ref` on the rows padded with empty states."""
    indptr = indptr.long()
    counts = indptr[1:] - indptr[:-1]
    width = int(counts.max()) if counts.numel() else 0
    slot = torch.arange(width, device=v.device)
    live = slot[None, :] < counts[:, None]  # [n, width]
    idx = torch.where(live, indptr[:-1, None] + slot[None, :], 0)
    s_pad = torch.where(live[..., None], s.double()[idx], -math.inf)  # [n, width, H]
    v_pad = torch.where(live[..., None, None], v.double()[idx], 0.0)  # [n, width, H, D]
    return merge_states_ref(v_pad, s_pad)
