"""Ragged ``indptr`` tensors: the offsets that split a flat array into rows.

Row ``i`` of a ragged array owns ``data[indptr[i]:indptr[i + 1]]``. A valid indptr is
int32, 1-D with ``n + 1`` entries, starts at 0 and never decreases; its last entry is the
total number of elements. ``qo_indptr``, ``kv_indptr`` and ``append_indptr`` all follow it.

The conversions take tensors (on any device; the result stays there and no host sync is
needed to compute it) or Python sequences of ints (the result goes to ``device``, CPU by
default). Checks of tensor *contents* (no negative length, no int32 overflow, monotone)
read the tensor on the host; they run when ``validate`` is true and no CUDA graph is
being captured. Python sequences are always checked (it costs nothing).
"""

from __future__ import annotations

import operator
from collections.abc import Iterable

import numpy as np
import torch

from cascadeinfer._checks import check_tensor
from cascadeinfer._device import capturing

INT32_MAX = 2**31 - 1

_INT_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)

IntVector = torch.Tensor | Iterable[int]


def as_int_list(name: str, values: object) -> list[int]:
    """A Python iterable of integers as a list; names ``name`` on anything else."""
    if isinstance(values, (str, bytes)):
        raise TypeError(f"{name}: expected a tensor or a sequence of ints, got {type(values).__name__}")
    try:
        items = list(values)  # type: ignore[call-overload]
    except TypeError:
        raise TypeError(
            f"{name}: expected a tensor or a sequence of ints, got {type(values).__name__}"
        ) from None
    out = []
    for i, x in enumerate(items):
        if isinstance(x, bool):
            raise TypeError(f"{name}: entry {i} is a bool, expected an int")
        try:
            out.append(operator.index(x))
        except TypeError:
            raise TypeError(f"{name}: entry {i} is {type(x).__name__} {x!r}, expected an int") from None
    return out


def _check_int_tensor(name: str, t: torch.Tensor) -> None:
    check_tensor(name, t, ndim=1)
    if t.dtype not in _INT_DTYPES:
        raise TypeError(f"{name}: expected an integer dtype (int32 preferred), got {t.dtype}")


def _target_device(name: str, t: torch.Tensor, device: torch.device | str | None) -> torch.device:
    if device is not None and torch.device(device) != t.device:
        raise ValueError(
            f"{name}: is on {t.device} but device={device!r} was asked; "
            "the result of a tensor input stays on the tensor's device (move it first)"
        )
    return t.device


def _check_lengths_values(name: str, lengths: list[int]) -> None:
    for i, x in enumerate(lengths):
        if x < 0:
            raise ValueError(f"{name}: length {x} at position {i} is negative")
    total = sum(lengths)
    if total > INT32_MAX:
        raise ValueError(f"{name}: the lengths sum to {total}, which does not fit in int32")


def _check_indptr_values(name: str, values: list[int], total: int | None) -> None:
    if len(values) == 0:
        raise ValueError(f"{name}: expected at least one entry (an indptr of n rows has n + 1)")
    if values[0] != 0:
        raise ValueError(f"{name}: expected the first entry to be 0, got {values[0]}")
    for i in range(len(values) - 1):
        if values[i + 1] < values[i]:
            raise ValueError(
                f"{name}: expected monotone non-decreasing entries, got "
                f"{name}[{i}] = {values[i]} > {name}[{i + 1}] = {values[i + 1]}"
            )
    if values[-1] > INT32_MAX:
        raise ValueError(f"{name}: last entry {values[-1]} does not fit in int32")
    if total is not None and values[-1] != total:
        raise ValueError(f"{name}: expected the last entry to be {total}, got {values[-1]}")


def host_array(values: torch.Tensor | np.ndarray) -> np.ndarray:
    """A host tensor's values as a numpy array: a view of a CPU tensor (no copy), a copy
    from another device. Host checks run on numpy: a numpy op on a few hundred entries
    costs well under a microsecond, a torch op several."""
    return values.numpy(force=True) if isinstance(values, torch.Tensor) else np.asarray(values)


def check_monotone(name: str, indptr: torch.Tensor | np.ndarray) -> None:
    """A host indptr (tensor or numpy array) never decreases; raise ``ValueError`` naming
    the first drop."""
    values = host_array(indptr)
    down = values[1:] < values[:-1]
    if down.any():
        i = int(down.argmax())
        raise ValueError(f"{name}: expected monotone non-decreasing entries, got "
                         f"{name}[{i}] = {int(values[i])} > {name}[{i + 1}] = {int(values[i + 1])}")


def indptr_from_lengths(
    lengths: IntVector,
    *,
    device: torch.device | str | None = None,
    validate: bool = True,
) -> torch.Tensor:
    """Exclusive prefix sum: ``lengths [n]`` -> ``indptr`` int32 ``[n + 1]`` starting at 0.

    ``lengths`` is a 1-D integer tensor (any integer dtype, any device: the result is on
    the same device, computed without a host sync) or a sequence of ints (the result goes
    to ``device``, CPU by default). With ``validate`` (and not while a CUDA graph is being
    captured) negative lengths and totals beyond int32 raise ``ValueError``; sequences are
    always checked.
    """
    if isinstance(lengths, torch.Tensor):
        _check_int_tensor("lengths", lengths)
        dev = _target_device("lengths", lengths, device)
        if validate and not capturing():
            _check_lengths_values("lengths", lengths.cpu().tolist())
        out = torch.zeros(lengths.shape[0] + 1, dtype=torch.int32, device=dev)
        out[1:] = torch.cumsum(lengths, 0, dtype=torch.int32)
        return out
    values = as_int_list("lengths", lengths)
    _check_lengths_values("lengths", values)
    prefix = [0]
    for x in values:
        prefix.append(prefix[-1] + x)
    return torch.tensor(prefix, dtype=torch.int32, device=device)


def lengths_from_indptr(
    indptr: IntVector,
    *,
    device: torch.device | str | None = None,
    validate: bool = True,
) -> torch.Tensor:
    """Row lengths ``indptr[1:] - indptr[:-1]`` as int32 ``[n]``.

    ``indptr`` is a 1-D integer tensor with at least one entry (the result stays on its
    device, no host sync) or a sequence of ints (result on ``device``, CPU by default).
    With ``validate`` (and not while capturing) the indptr must start at 0 and be
    monotone (see :func:`validate_indptr`); sequences are always checked.
    """
    if isinstance(indptr, torch.Tensor):
        _check_int_tensor("indptr", indptr)
        dev = _target_device("indptr", indptr, device)
        if indptr.shape[0] == 0:
            raise ValueError("indptr: expected at least one entry (an indptr of n rows has n + 1)")
        if validate and not capturing():
            _check_indptr_values("indptr", indptr.cpu().tolist(), None)
        return (indptr[1:] - indptr[:-1]).to(device=dev, dtype=torch.int32)
    values = as_int_list("indptr", indptr)
    _check_indptr_values("indptr", values, None)
    return torch.tensor([b - a for a, b in zip(values[:-1], values[1:])], dtype=torch.int32, device=device)


def validate_indptr(name: str, indptr: IntVector, *, total: int | None = None) -> None:
    """Check that ``indptr`` is a valid ragged offset array; raise naming ``name``.

    A tensor must be int32 and 1-D (any device; its contents are read on the host, which
    synchronises, so do not call this while capturing a CUDA graph). A sequence must hold
    ints. Either way: at least one entry, first entry 0, monotone non-decreasing, last
    entry inside int32 and equal to ``total`` when given. Raises ``TypeError`` (dtype,
    type) or ``ValueError`` (shape, contents) whose message starts with ``name``.
    """
    if isinstance(indptr, torch.Tensor):
        check_tensor(name, indptr, ndim=1, dtypes=(torch.int32,))
        values = indptr.cpu().tolist()
    else:
        values = as_int_list(name, indptr)
    _check_indptr_values(name, values, total)
