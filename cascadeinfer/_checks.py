"""Argument checks shared by every launcher.

Every check raises before any kernel launches and names the argument it rejects, so a
caller sees ``ValueError: kv_indices: expected dtype torch.int32, got torch.int64``
rather than a fault inside a kernel. Checks that read tensor *contents* (monotone
indptr, indices inside the pool) need a device-to-host copy; launchers run them only
when asked (``validate=True``) and never while a CUDA graph is being captured.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable, Sequence

import torch

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


def normalize_device(device: torch.device | str) -> torch.device:
    """``torch.device("cuda")`` as the tensor device it means (``cuda:<current>``)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


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


def use_triton(device: torch.device) -> bool:
    """Triton runs on CUDA tensors, and on CPU tensors under ``TRITON_INTERPRET=1``.

    CPU tensors without the interpreter take the vectorised PyTorch path instead.
    """
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def capturing() -> bool:
    """True while a CUDA graph is being captured: no host reads are allowed then."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def default_sm_scale(head_dim: int, sm_scale: float | None) -> float:
    if sm_scale is None:
        return head_dim ** -0.5
    if not isinstance(sm_scale, (int, float)) or isinstance(sm_scale, bool):
        raise TypeError(f"sm_scale: expected a float, got {type(sm_scale).__name__}")
    if not (sm_scale > 0 and sm_scale != float("inf")):
        raise ValueError(f"sm_scale: expected a positive finite float, got {sm_scale}")
    return float(sm_scale)


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def cuda_num_sms(device: torch.device) -> int:
    """Multiprocessors of a CUDA device (cached; reads no tensor, safe during capture)."""
    return _sm_count(torch.cuda.current_device() if device.index is None else device.index)


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
