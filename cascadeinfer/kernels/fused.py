"""Fused elementwise work of a Llama-family decoder layer: RMSNorm (alone, or with the
residual add before it), SwiGLU's ``silu(gate) * up``, and the rotary embedding.

Public functions::

    rms_norm(x, weight, eps, *, out=None)                          -> out [T, N]
    fused_add_rms_norm(x, residual, weight, eps)                   -> None (in place)
    silu_and_mul(gate_up, *, out=None)                             -> out [T, I]
    apply_rope(q, k, positions, cos_sin_cache, *, validate=False)  -> None (in place)

Numerics follow Hugging Face's Llama / Qwen2 modules, roundings included, so that a model
built on these ops gives the same tokens as transformers: the math runs in float32, and
the result is cast to the activation dtype exactly where HF's code casts it —

* RMSNorm: ``weight * (x32 * rsqrt(mean(x32²) + eps)).to(dtype)``; the product with the
  weight is rounded once more (HF multiplies two tensors of the activation dtype);
* the residual add ``residual + x`` is rounded to the activation dtype before the norm
  reads it (HF adds two activation tensors);
* SwiGLU: ``silu(gate)`` is rounded before the product with ``up``;
* RoPE: ``x * cos + rotate_half(x) * sin`` with each product rounded, then the sum.

For fp16/bf16 inputs the products of two activation-dtype numbers are exact in float32, so
these roundings make each op match PyTorch's own op-by-op result up to the last bit of the
reductions and transcendental functions (``rsqrt``, ``exp``), which may differ by one unit
in the last place. The float32 references (``rms_norm_ref`` and its siblings in
:mod:`cascadeinfer.kernels.reference`) state the contract; tests compare the kernels
with them.

Inputs are token-major: rows ``[T, ...]`` with any row stride and the last dimension
contiguous (stride 1). ``T = 0`` launches nothing. CUDA tensors (and CPU tensors under
``TRITON_INTERPRET=1``) run the Triton kernels; other CPU tensors run the references.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from cascadeinfer._checks import (
    FLOAT_DTYPES,
    check_disjoint,
    check_last_dim_contiguous,
    check_tensor,
)
from cascadeinfer._device import capturing, next_power_of_2, use_triton
from cascadeinfer.kernels import policy
from cascadeinfer.kernels.reference import (
    apply_rope_ref,
    rms_norm_ref,
    silu_and_mul_ref,
)

# One program normalises one whole row held in registers; beyond this a row would need a
# two-pass loop (not needed: the largest Llama hidden size is 16384).
MAX_HIDDEN = 32768

# Launch option of every kernel here: no multiply-add contraction. With it, the compiler
# turns HF's ``round(round(a*b) - round(c*d))`` into one bf16 fma (seen in the sm_90 PTX
# of the RoPE kernel), which rounds once where HF rounds twice. These kernels are
# bandwidth-bound; separate multiplies and adds cost nothing measurable.
_EXACT = {"enable_fp_fusion": False}


# ----------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [T, N] fp16/bf16/fp32; read (and, with FUSED_ADD, the norm's output in place)
    res_ptr,  # [T, N] same dtype; read and overwritten with x + residual when FUSED_ADD
    w_ptr,  # [N] same dtype, contiguous
    out_ptr,  # [T, N] same dtype (x_ptr itself when FUSED_ADD)
    num_cols,
    eps,
    stride_x,
    stride_res,
    stride_out,
    BLOCK: tl.constexpr,  # next power of two >= num_cols: the whole row in one tile
    FUSED_ADD: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < num_cols
    dtype = out_ptr.dtype.element_ty
    # Upcast right after every load: bf16 arithmetic is not portable (interpreter).
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    if FUSED_ADD:
        r = tl.load(res_ptr + row * stride_res + cols, mask=ok, other=0.0).to(tl.float32)
        # HF adds in the activation dtype: the norm reads the rounded sum.
        s = (x + r).to(dtype)
        tl.store(res_ptr + row * stride_res + cols, s, mask=ok)
        x = s.to(tl.float32)
    # Masked columns load as 0: they add nothing to the sum of squares.
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / num_cols + eps)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    # HF rounds the normalised row to the activation dtype before the weight multiplies it.
    y = (x * rstd).to(dtype).to(tl.float32) * w
    tl.store(out_ptr + row * stride_out + cols, y.to(dtype), mask=ok)


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,  # [T, 2 * I] fp16/bf16/fp32: gate in [:, :I], up in [:, I:]
    out_ptr,  # [T, I] same dtype
    inter,
    stride_x,
    stride_out,
    BLOCK: tl.constexpr,  # columns per program
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inter
    dtype = out_ptr.dtype.element_ty
    x_row = x_ptr + row * stride_x
    gate = tl.load(x_row + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_row + inter + cols, mask=ok, other=0.0).to(tl.float32)
    # silu as PyTorch computes it, x / (1 + e^-x) (inf for very negative x gives -0), and
    # rounded to the activation dtype before the product as in HF's act_fn(gate) * up.
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (act * up).to(dtype), mask=ok)


@triton.jit
def _cos_sin_row(
    cs_ptr,  # [max_positions, D]: cos in [:, :D/2], sin in [:, D/2:]
    pos_ptr,  # pointer to one token's position (int32/int64)
    stride_cs,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """``(cos, sin)`` of one token's position, float32 ``[BLOCK_HALF]`` (0 past ``HALF``)."""
    pos = tl.load(pos_ptr).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)
    cs_row = cs_ptr + pos * stride_cs
    cos = tl.load(cs_row + d, mask=d < HALF, other=0.0).to(tl.float32)
    sin = tl.load(cs_row + HALF + d, mask=d < HALF, other=0.0).to(tl.float32)
    return cos, sin


@triton.jit
def _rotate_heads(
    base,  # pointer to head 0 of one token: [num_heads, D]
    stride_h,
    first,  # first head of this program
    count,  # heads of this program
    num_heads,
    cos,  # [BLOCK_HALF] float32
    sin,  # [BLOCK_HALF] float32
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Rotate heads ``[first, first + count)`` of one token in place. Returns
    ``(heads [BLOCK_H], ok [BLOCK_H, BLOCK_HALF], lo, hi)``: the rotated halves as stored
    (in the tensor's dtype), for a caller that writes them elsewhere too (the K/V append)."""
    i = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_HALF)
    heads = first + i
    ok = ((i < count) & (heads < num_heads))[:, None] & (d < HALF)[None, :]
    lo = base + heads.to(tl.int64)[:, None] * stride_h + d[None, :]
    dtype = base.dtype.element_ty
    x1 = tl.load(lo, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(lo + HALF, mask=ok, other=0.0).to(tl.float32)
    c = cos[None, :]
    s = sin[None, :]
    # x * cos + rotate_half(x) * sin with rotate_half(x) = (-x2, x1); every product is
    # rounded to the activation dtype as in HF, then the sum. Both halves are loaded
    # before either is stored, so the rotation is safe in place.
    new_lo = ((x1 * c).to(dtype).to(tl.float32) - (x2 * s).to(dtype).to(tl.float32)).to(dtype)
    new_hi = ((x2 * c).to(dtype).to(tl.float32) + (x1 * s).to(dtype).to(tl.float32)).to(dtype)
    tl.store(lo, new_lo, mask=ok)
    tl.store(lo + HALF, new_hi, mask=ok)
    return heads, ok, new_lo, new_hi


@triton.jit
def _rope_kernel(
    q_ptr,  # [T, Hq, D] fp16/bf16/fp32, rotated in place
    k_ptr,  # [T, Hkv, D] same dtype, rotated in place
    pos_ptr,  # [T] int32/int64
    cs_ptr,  # [max_positions, D]: cos in [:, :D/2], sin in [:, D/2:]
    num_q_heads,
    num_k_heads,
    q_heads_per_program,
    k_heads_per_program,
    stride_q_t,
    stride_q_h,
    stride_k_t,
    stride_k_h,
    stride_pos,
    stride_cs,
    HALF: tl.constexpr,  # D // 2
    BLOCK_HALF: tl.constexpr,  # next power of two >= HALF
    BLOCK_HQ: tl.constexpr,  # next power of two >= q_heads_per_program
    BLOCK_HK: tl.constexpr,  # next power of two >= k_heads_per_program
):
    """Program (t, j) rotates token t's j-th share of the q heads and of the k heads: the
    token's cos/sin row is read once for all of them."""
    t = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    cos, sin = _cos_sin_row(cs_ptr, pos_ptr + t * stride_pos, stride_cs, HALF, BLOCK_HALF)
    _rotate_heads(q_ptr + t * stride_q_t, stride_q_h, split * q_heads_per_program, q_heads_per_program,
                  num_q_heads, cos, sin, HALF, BLOCK_HALF, BLOCK_HQ)
    _rotate_heads(k_ptr + t * stride_k_t, stride_k_h, split * k_heads_per_program, k_heads_per_program,
                  num_k_heads, cos, sin, HALF, BLOCK_HALF, BLOCK_HK)


# ----------------------------------------------------------------------------------
# Argument checks
# ----------------------------------------------------------------------------------


def _check_rows(name: str, t: object, ndim: int, *, dtype: torch.dtype | None = None,
                device: torch.device | None = None, shape=None) -> torch.Tensor:
    check_tensor(name, t, ndim=ndim, dtypes=FLOAT_DTYPES if dtype is None else (dtype,), device=device, shape=shape)
    check_last_dim_contiguous(name, t)
    return t


def _check_eps(eps: object) -> float:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"eps: expected a float, got {type(eps).__name__}")
    if not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps: expected a finite float >= 0, got {eps}")
    return float(eps)


def _check_weight(weight: object, x: torch.Tensor) -> torch.Tensor:
    check_tensor("weight", weight, ndim=1, dtypes=(x.dtype,), device=x.device, shape=(x.shape[1],))
    if weight.shape[0] > 1 and weight.stride(0) != 1:
        raise ValueError(f"weight: expected a contiguous tensor, got stride {weight.stride(0)}")
    return weight


def _check_hidden(x: torch.Tensor) -> None:
    if x.shape[1] > MAX_HIDDEN:
        raise ValueError(f"x: hidden size {x.shape[1]} exceeds the {MAX_HIDDEN} one program holds")


def _check_rope_args(q: object, k: object, positions: object, cos_sin_cache: object, *,
                     k_name: str = "k", positions_name: str = "positions") -> None:
    """What the rotation kernel assumes of its tensors (see :func:`apply_rope`); the
    K/V-append launcher names its key and rotation positions differently."""
    _check_rows("q", q, 3)
    tokens, _, head_dim = q.shape
    if head_dim % 2:
        raise ValueError(f"q: expected an even head_dim, got shape {list(q.shape)}")
    _check_rows(k_name, k, 3, dtype=q.dtype, device=q.device, shape=(tokens, None, head_dim))
    check_tensor(positions_name, positions, ndim=1, dtypes=(torch.int32, torch.int64), device=q.device,
                 shape=(tokens,))
    _check_rows("cos_sin_cache", cos_sin_cache, 2, device=q.device, shape=(None, head_dim))
    if q.numel() and k.numel() and q.data_ptr() == k.data_ptr():
        raise ValueError(f"{k_name}: overlaps q in memory; they must be separate tensors or disjoint views")


def _check_positions_in_table(positions: torch.Tensor, cos_sin_cache: torch.Tensor, name: str = "positions") -> None:
    """Every position has a row in the cos/sin table (a host read: never while capturing)."""
    if positions.numel() == 0:
        return
    lo, hi = int(positions.min()), int(positions.max())
    if lo < 0 or hi >= cos_sin_cache.shape[0]:
        raise ValueError(f"{name}: expected values in [0, {cos_sin_cache.shape[0]}), got [{lo}, {hi}]")


def _rope_launch_plan(tokens: int, num_q_heads: int, num_k_heads: int, head_dim: int,
                     device: torch.device) -> tuple[int, int, int, dict]:
    """``(splits, q_heads_per_program, k_heads_per_program, constexprs)`` of a rotation
    launch over grid ``(tokens, splits)``, from shapes only: the RoPE kernel's and the
    rotating K/V append's (:mod:`cascadeinfer.kernels.rope_append`), which share the
    head split so that they rotate alike."""
    splits = policy.rope_splits(tokens, max(1, num_k_heads), device)
    q_per, k_per = triton.cdiv(num_q_heads, splits), triton.cdiv(num_k_heads, splits)
    half = head_dim // 2
    meta = dict(HALF=half, BLOCK_HALF=next_power_of_2(half), BLOCK_HQ=next_power_of_2(max(1, q_per)),
                BLOCK_HK=next_power_of_2(max(1, k_per)))
    return splits, q_per, k_per, meta


def _num_warps(block: int) -> int:
    """Warps for a one-row tile of ``block`` elements: 8 to 16 elements per thread."""
    return 4 if block <= 2048 else 8 if block <= 8192 else 16


# ----------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Root-mean-square norm of each row, scaled by ``weight`` (HF's LlamaRMSNorm).

    Args:
        x: ``[T, N]`` fp16/bf16/fp32, any row stride, last dim stride 1; ``N <= 32768``.
        weight: ``[N]``, x's dtype, contiguous.
        eps: added to the mean square (a float >= 0).
        out: optional ``[T, N]`` output of x's dtype, last dim stride 1; may be ``x``
            itself (each row is read before it is written).

    Returns:
        ``out`` (a new ``[T, N]`` tensor if None):
        ``weight * (x * rsqrt(mean(x², -1) + eps)).to(x.dtype)``, float32 inside.
    """
    _check_rows("x", x, 2)
    _check_hidden(x)
    _check_weight(weight, x)
    eps = _check_eps(eps)
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    else:
        _check_rows("out", out, 2, dtype=x.dtype, device=x.device, shape=tuple(x.shape))
        if not (out.data_ptr() == x.data_ptr() and out.stride() == x.stride()):
            check_disjoint("out", out, "x", x)
    if x.shape[0] == 0:
        return out
    if not use_triton(x.device):
        out.copy_(rms_norm_ref(x, weight, eps))
        return out
    block = next_power_of_2(x.shape[1])
    _rms_norm_kernel[(x.shape[0],)](
        x, x, weight, out, x.shape[1], eps, x.stride(0), 0, out.stride(0),
        BLOCK=block, FUSED_ADD=False, num_warps=_num_warps(block), **_EXACT)
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """``residual += x``, then ``x = rms_norm(residual, weight, eps)``, in one pass.

    The pre-norm block's residual update and the next norm (vLLM's and FlashInfer's
    ``fused_add_rms_norm``). Both tensors are overwritten in place.

    Args:
        x: ``[T, N]`` fp16/bf16/fp32, any row stride, last dim stride 1; ``N <= 32768``.
            On return: the normalised, weighted sum.
        residual: ``[T, N]`` of x's dtype and device, last dim stride 1, not overlapping
            ``x``. On return: ``(residual + x)`` rounded to the dtype, as HF adds.
        weight: ``[N]``, x's dtype, contiguous.
        eps: added to the mean square (a float >= 0).
    """
    _check_rows("x", x, 2)
    _check_hidden(x)
    _check_rows("residual", residual, 2, dtype=x.dtype, device=x.device, shape=tuple(x.shape))
    _check_weight(weight, x)
    eps = _check_eps(eps)
    check_disjoint("residual", residual, "x", x)
    if x.shape[0] == 0:
        return
    if not use_triton(x.device):
        residual.add_(x)
        x.copy_(rms_norm_ref(residual, weight, eps))
        return
    block = next_power_of_2(x.shape[1])
    _rms_norm_kernel[(x.shape[0],)](
        x, residual, weight, x, x.shape[1], eps, x.stride(0), residual.stride(0), x.stride(0),
        BLOCK=block, FUSED_ADD=True, num_warps=_num_warps(block), **_EXACT)


def silu_and_mul(gate_up: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """SwiGLU's activation on the fused gate/up projection: ``silu(gate) * up``.

    Args:
        gate_up: ``[T, 2 * I]`` fp16/bf16/fp32, gate in ``[:, :I]`` and up in ``[:, I:]``;
            any row stride, last dim stride 1.
        out: optional ``[T, I]`` output of gate_up's dtype, last dim stride 1, not
            overlapping ``gate_up``.

    Returns:
        ``out`` (a new contiguous ``[T, I]`` tensor if None), ``silu(gate)`` rounded to
        the dtype before the product, float32 inside.
    """
    _check_rows("gate_up", gate_up, 2)
    if gate_up.shape[1] % 2:
        raise ValueError(f"gate_up: expected an even number of columns [T, 2 * I], got shape {list(gate_up.shape)}")
    tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
    if out is None:
        out = torch.empty(tokens, inter, dtype=gate_up.dtype, device=gate_up.device)
    else:
        _check_rows("out", out, 2, dtype=gate_up.dtype, device=gate_up.device, shape=(tokens, inter))
        check_disjoint("out", out, "gate_up", gate_up)
    if tokens == 0 or inter == 0:
        return out
    if not use_triton(gate_up.device):
        out.copy_(silu_and_mul_ref(gate_up))
        return out
    block = min(1024, next_power_of_2(inter))
    _silu_and_mul_kernel[(tokens, triton.cdiv(inter, block))](
        gate_up, out, inter, gate_up.stride(0), out.stride(0), BLOCK=block, num_warps=4, **_EXACT)
    return out


def apply_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, *,
               validate: bool = False) -> None:
    """Rotate ``q`` and ``k`` in place by their tokens' positions (HF's ``rotate_half``).

    For each token at position ``p`` and each head: ``x[:h], x[h:]`` (``h = D / 2``)
    become ``x[:h] * cos - x[h:] * sin`` and ``x[h:] * cos + x[:h] * sin`` with
    ``cos = cos_sin_cache[p, :h]`` and ``sin = cos_sin_cache[p, h:]``.

    Args:
        q: ``[T, Hq, D]`` fp16/bf16/fp32, any token and head strides, last dim stride 1;
            ``D`` even.
        k: ``[T, Hkv, D]`` of q's dtype and device, same rules. ``q`` and ``k`` may be
            views of one buffer (the fused qkv projection's output) but must not overlap.
        positions: int32/int64 ``[T]`` on q's device, each in ``[0, max_positions)``.
        cos_sin_cache: ``[max_positions, D]`` fp16/bf16/fp32 on q's device, last dim stride
            1: cos of the ``D / 2`` frequencies, then their sin. HF rounds cos and sin to
            the activation dtype; a cache in q's dtype reproduces that.
        validate: check that every position lies in the cache (a host sync; never while
            a CUDA graph is being captured). Shapes, dtypes and devices are always checked.
    """
    _check_rope_args(q, k, positions, cos_sin_cache)
    tokens, num_q_heads, head_dim = q.shape
    if tokens == 0:
        return
    if validate and not capturing():
        _check_positions_in_table(positions, cos_sin_cache)
    if not use_triton(q.device):
        q_rot, k_rot = apply_rope_ref(q, k, positions, cos_sin_cache)
        q.copy_(q_rot)
        k.copy_(k_rot)
        return
    num_k_heads = k.shape[1]
    splits, q_per, k_per, meta = _rope_launch_plan(tokens, num_q_heads, num_k_heads, head_dim, q.device)
    _rope_kernel[(tokens, splits)](
        q, k, positions, cos_sin_cache, num_q_heads, num_k_heads, q_per, k_per,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), positions.stride(0), cos_sin_cache.stride(0),
        **meta, num_warps=4, **_EXACT)
