"""Argument checks shared by every launcher.

Every check raises before any kernel launches and names the argument it rejects, so a
caller sees ``ValueError: kv_indices: expected dtype torch.int32, got torch.int64``
rather than a fault inside a kernel. Checks that read tensor *contents* (monotone
indptr, indices inside the pool) need a device-to-host copy; launchers run them only
when asked (``validate=True``) and never while a CUDA graph is being captured.

The overlap checks (:func:`check_disjoint`, :func:`check_aliasing`) read addresses,
shapes and strides on the host, never contents: no sync, safe during capture. Facts about
the device (which path runs, capture, SM counts) live in :mod:`cascadeinfer._device`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from cascadeinfer._device import normalize_device

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_tensor(
    name: str,
    t: object,
    *,
    ndim: int | None = None,
    dtypes: Iterable[torch.dtype] | None = None,
    device: torch.device | None = None,
    shape: Sequence[int | None] | None = None,
) -> torch.Tensor:
    """Check that ``t`` is a tensor with the given rank, dtype, device and shape.

    ``shape`` entries that are ``None`` are not checked. Returns ``t`` for chaining.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {tuple(t.shape)}")
    if dtypes is not None:
        dtypes = tuple(dtypes)
        if t.dtype not in dtypes:
            want = " or ".join(str(d) for d in dtypes)
            raise TypeError(f"{name}: expected dtype {want}, got {t.dtype}")
    if device is not None and t.device != normalize_device(device):
        raise ValueError(f"{name}: expected a tensor on {device}, got one on {t.device}")
    if shape is not None:
        if len(shape) != t.dim() or any(w is not None and w != g for w, g in zip(shape, t.shape)):
            want = "[" + ", ".join("*" if w is None else str(w) for w in shape) + "]"
            raise ValueError(f"{name}: expected shape {want}, got {list(t.shape)}")
    return t


def check_int32_vector(name: str, t: object, device: torch.device, length: int | None = None) -> torch.Tensor:
    """An int32, 1-D, contiguous tensor on ``device`` (metadata: indptr, indices, lengths)."""
    check_tensor(name, t, ndim=1, dtypes=(torch.int32,), device=device,
                 shape=None if length is None else (length,))
    if t.stride(0) != 1 and t.numel() > 1:
        raise ValueError(f"{name}: expected a contiguous tensor, got stride {t.stride(0)}")
    return t


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    """Kernels read head_dim as one vector; other strides may be anything."""
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(
            f"{name}: the last dimension must have stride 1 (got strides {tuple(t.stride())}); "
            "other strides may be arbitrary"
        )


def same_device(*named: tuple[str, torch.Tensor]) -> torch.device:
    """The common device of the named tensors; names the first one that differs."""
    first_name, first = named[0]
    for name, t in named[1:]:
        if t.device != first.device:
            raise ValueError(f"{name}: expected a tensor on {first.device} (like {first_name}), got {t.device}")
    return first.device


def default_sm_scale(head_dim: int, sm_scale: float | None) -> float:
    """The softmax scale: ``sm_scale`` checked (a positive finite float), or ``head_dim ** -0.5``."""
    if sm_scale is None:
        return head_dim ** -0.5
    if not isinstance(sm_scale, (int, float)) or isinstance(sm_scale, bool):
        raise TypeError(f"sm_scale: expected a float, got {type(sm_scale).__name__}")
    if not (sm_scale > 0 and sm_scale != float("inf")):
        raise ValueError(f"sm_scale: expected a positive finite float, got {sm_scale}")
    return float(sm_scale)


# ----------------------------------------------------------------------------------
# Overlap between outputs and inputs (addresses and strides only: no sync)
# ----------------------------------------------------------------------------------


def byte_span(t: torch.Tensor) -> tuple[int, int]:
    """``[first, last + 1)`` byte addresses that ``t``'s elements reach (non-negative strides)."""
    last = sum((sz - 1) * st for sz, st in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def surely_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Overlap that is certain and cheap to see: both tensors fill their byte ranges
    (dense, in any dim order) and the ranges meet. Interleaved strided views are not
    judged (like PyTorch's own ``out=`` check, which calls them too hard)."""
    if a.numel() == 0 or b.numel() == 0:
        return False
    (a0, a1), (b0, b1) = byte_span(a), byte_span(b)
    dense = a1 - a0 == a.numel() * a.element_size() and b1 - b0 == b.numel() * b.element_size()
    return dense and a0 < b1 and b0 < a1


def check_disjoint(a_name: str, a: torch.Tensor, b_name: str, b: torch.Tensor) -> None:
    """Reject overlap that is cheap to see: the same first element, or both tensors dense
    and their byte ranges meeting. Interleaved strided views are not judged."""
    if a.numel() == 0 or b.numel() == 0:
        return
    if a.data_ptr() == b.data_ptr() or surely_overlap(a, b):
        raise ValueError(f"{a_name}: overlaps {b_name} in memory; they must be separate tensors")


def _strides(t: torch.Tensor, dims) -> tuple[int, ...]:
    """Strides of ``dims``, with size-1 dims (whose stride means nothing) as 0."""
    return tuple(t.stride(i) if t.shape[i] > 1 else 0 for i in dims)


def _is_same_view(out: torch.Tensor, t: torch.Tensor) -> bool:
    """True when ``out`` is ``t`` itself: same dtype, first element and strides."""
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


def check_aliasing(outputs: Sequence[tuple[str, torch.Tensor]], inputs: Sequence[tuple[str, torch.Tensor]], *,
                   state_slices: bool = False, exact_ok: bool = True) -> None:
    """Outputs ``((o_name, o), (lse_name, lse))`` against named inputs.

    An output may be exactly an input when ``exact_ok`` (with ``state_slices``: exactly
    an input's state slice ``t[:, j]``, for outputs ``[n, ...]`` of inputs ``[n, S,
    ...]``); any other overlap it surely has with an input (:func:`surely_overlap`), or
    the two outputs with each other, raises ``ValueError`` naming both.
    """
    (o_name, o), (l_name, lse) = outputs
    if surely_overlap(o, lse):
        raise ValueError(f"{o_name}: overlaps {l_name} in memory")
    for out_name, out in outputs:
        for in_name, t in inputs:
            if not surely_overlap(out, t):
                continue
            if exact_ok and (_is_state_slice(out, t) if state_slices else _is_same_view(out, t)):
                continue
            allowed = (f"exactly {in_name}[:, j]" if state_slices else f"exactly {in_name}") if exact_ok else "disjoint"
            raise ValueError(f"{out_name}: overlaps {in_name} in memory; it must be {allowed} or not overlap it")
