"""Facts about the device a launch runs on, read from the host without touching tensors.

Which path runs (:func:`use_triton`), whether a CUDA graph is being captured (then no
host reads are allowed), how many multiprocessors a CUDA device has, and the block-size
arithmetic every launch plan shares (:func:`next_power_of_2`). None of these reads a
tensor's contents, so all are safe during capture. Plain torch: the Triton-free
``layouts`` package imports from here too.
"""

from __future__ import annotations

import functools
import os

import torch


def normalize_device(device: torch.device | str) -> torch.device:
    """``torch.device("cuda")`` as the tensor device it means (``cuda:<current>``)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def use_triton(device: torch.device) -> bool:
    """Triton runs on CUDA tensors, and on CPU tensors under ``TRITON_INTERPRET=1``.

    CPU tensors without the interpreter take the vectorised PyTorch path instead.
    """
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def capturing() -> bool:
    """True while a CUDA graph is being captured: no host reads are allowed then. Cheap
    enough for every launcher call (0.1-0.2 µs where CUDA is present)."""
    return _has_cuda() and torch._C._cuda_isCurrentStreamCapturing()


@functools.cache
def _has_cuda() -> bool:
    return torch.cuda.is_available()


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def cuda_num_sms(device: torch.device) -> int:
    """Multiprocessors of a CUDA device (cached; reads no tensor, safe during capture)."""
    return _sm_count(torch.cuda.current_device() if device.index is None else device.index)


def next_power_of_2(n: int) -> int:
    """The smallest power of two ``>= n`` (1 for ``n <= 1``): Triton block sizes."""
    return 1 << max(0, (n - 1).bit_length())
