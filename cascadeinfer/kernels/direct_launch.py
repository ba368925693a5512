"""Direct launches of a recording's kernels: one C call per replay, not one per kernel.

A replayed call (:mod:`cascadeinfer.kernels.launch`) used to hand every kernel's whole
argument list to Triton's generated C launcher, which parses each of the 30-60 arguments
from Python objects on every launch (5 µs of a replay's CPU time per kernel on an H100
machine: benchmarks/NOTES.md, "Host cost"). Everything but the caller's addresses is the
same in every replay, so :func:`prepare` packs each kernel's parameters once, as the
driver reads them, and notes where each address goes; :func:`run` then launches all the
kernels of a recording in one call to the C module beside this file
(``direct_launch.c``), which copies the packed bytes, writes the new addresses and calls
``cuLaunchKernelEx`` with the launch settings Triton would use.

The module is built on first use with Triton's own C build (the compiler and the
``cuda.h`` Triton ships, the way Triton builds its launchers) and cached by Triton. It
needs no GPU to build; libcuda is opened on the first launch. A thread with no current
CUDA context (its first CUDA work) gets ``False`` from ``run`` and nothing launched: the
caller goes through Triton's launcher then, which makes the context current. Where it cannot be built,
or with ``CASCADEINFER_DIRECT_LAUNCH=0``, or for a kernel it does not handle (launch-time
scratch, clusters, parameter types other than pointers, integers, floats and TMA
descriptors over a root), replays go through Triton's launcher as before. A TMA
descriptor (the Hopper prefix kernel's) is encoded anew at each launch with the new base
address, exactly as Triton's launcher encodes it, which :func:`prepare` checks.

The parameter layout follows Triton 3.6's launcher (the version this package pins):
every non-constexpr parameter in signature order, then the global and the profile
scratch pointers.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import struct
from pathlib import Path
from typing import NamedTuple

_LOG = logging.getLogger(__name__)

# struct formats of the scalar parameter types in a Triton signature (bf16: see _pack_value).
_FORMATS = {
    "i1": "b", "i8": "b", "u1": "B", "u8": "B", "i16": "h", "u16": "H", "i32": "i", "u32": "I",
    "i64": "q", "u64": "Q", "fp16": "e", "bf16": "H", "fp32": "f", "f32": "f", "fp64": "d",
}


@functools.cache
def module():
    """The compiled C module, or None where direct launches are off or cannot be built."""
    if os.environ.get("CASCADEINFER_DIRECT_LAUNCH", "1") == "0":
        return None
    try:
        from triton.backends.nvidia.driver import include_dirs  # noqa: PLC0415
        from triton.runtime.build import compile_module_from_src  # noqa: PLC0415

        return compile_module_from_src(src=source("direct_launch.c"), name="cascadeinfer_direct_launch", include_dirs=list(include_dirs))
    except Exception as exc:  # noqa: BLE001 - any build failure means: use Triton's launcher
        _LOG.warning("cascadeinfer: direct kernel launches unavailable (%s); using Triton's launcher", exc)
        return None


def source(name: str) -> str:
    """The text of the C/C++ file ``name`` beside this module with ``direct_launch.h``
    inlined where it is included, so that a build cached by its source text is rebuilt
    when the header changes."""
    here = Path(__file__).parent
    return (here / name).read_text().replace('#include "direct_launch.h"', (here / "direct_launch.h").read_text())


def _pack_value(ty: str, value) -> bytes:
    if ty.startswith("*"):
        return struct.pack("<Q", 0 if value is None else int(value))
    fmt = _FORMATS.get(ty)
    if fmt is None:
        raise NotImplementedError(f"parameter type {ty!r}")
    if ty == "bf16":  # the upper half of the float32 bits, as Triton's launcher truncates
        return struct.pack("<H", struct.unpack("<I", struct.pack("<f", float(value)))[0] >> 16)
    if ty.startswith(("fp", "f3")):
        return struct.pack("<" + fmt, float(value))
    return struct.pack("<" + fmt, int(value))


class Packed(NamedTuple):
    """One launch's parameters as the driver reads them (:func:`pack_params`)."""

    data: bytes  # every parameter at its natural alignment, the two scratch pointers last
    offsets: bytes  # the uint16 byte offset of each passed parameter
    patches: list[tuple[int, int, int]]  # (byte offset, root, add) of each changing address
    tmas: list[tuple]  # TMA descriptors encoded at each launch (direct_launch.c's read_tma)
    sizes: list[int]  # each passed parameter's size in bytes


# A CUtensorMap: 128 bytes, passed by value, 64-byte aligned (cuda.h).
_TENSOR_MAP_BYTES, _TENSOR_MAP_ALIGN = 128, 64


def _tensor_map(desc, meta: dict, root: int, add: int) -> tuple[tuple, list[int], list[int]]:
    """A TMA descriptor parameter over a root, as Triton 3.6's launcher passes it
    (``make_tensordesc_arg``): the CUtensorMap, encoded as ``fill_tma_descriptor``
    encodes it (dimensions innermost first, strides in bytes), then the shape (i32) and
    strides (i64) it was made with. Returns the encoding's arguments (``read_tma``,
    offset left 0), the shape and the strides."""
    from triton.backends.nvidia.driver import TMA_DTYPE_DEVICE_TO_HOST  # noqa: PLC0415

    shape, strides = list(desc.shape), list(desc.strides)
    if meta["fp4_padded"]:
        shape[-1] *= 2
    block = list(meta["block_size"])
    rank = len(block)
    if len(shape) != rank or strides[-1] != 1:
        raise ValueError("a TMA descriptor's shape or strides do not match its block")
    elem_size = meta["elem_size"]
    tma = (0, root, add, TMA_DTYPE_DEVICE_TO_HOST[meta["elem_type"]], rank, tuple(reversed(shape)),
           tuple(elem_size * x for x in reversed(strides[:-1])), tuple(reversed(block)), meta["swizzle"],
           1 if desc.padding == "nan" else 0)  # CU_TENSOR_MAP_FLOAT_OOB_FILL_NAN_REQUEST_ZERO_FMA or NONE
    return tma, shape, strides


def pack_params(types: list[str], values: list, patches: dict[int, tuple[int, int]],
                tensordesc_meta: list[dict] | None = None) -> Packed:
    """The driver's view of one launch's parameters.

    ``types``/``values``: every kernel parameter in signature order (Triton types,
    ``"constexpr"`` ones skipped; a ``tensordesc<...>`` value is the host descriptor,
    whose base must be a root). ``patches``: parameter index -> (root index, byte offset)
    for the addresses that change from one replay to the next (a descriptor's base
    included). ``tensordesc_meta``: the compiled kernel's, one per descriptor parameter.
    """
    data = bytearray()
    offsets: list[int] = []
    sizes: list[int] = []
    out_patches, tmas = [], []

    def put(raw: bytes, align: int) -> int:
        data.extend(bytes(-len(data) % align))
        offsets.append(len(data))
        sizes.append(len(raw))
        data.extend(raw)
        return offsets[-1]

    metas = iter(tensordesc_meta or ())
    for index, (ty, value) in enumerate(zip(types, values)):
        if ty == "constexpr":
            continue
        if ty.startswith("tensordesc"):
            meta = next(metas, None)
            if meta is None or index not in patches:
                raise NotImplementedError("a TMA descriptor not over a root, or without its metadata")
            tma, shape, strides = _tensor_map(value, meta, *patches[index])
            tmas.append((put(bytes(_TENSOR_MAP_BYTES), _TENSOR_MAP_ALIGN), *tma[1:]))
            for x in shape:
                put(struct.pack("<i", x), 4)
            for x in strides:
                put(struct.pack("<q", x), 8)
            continue
        raw = _pack_value(ty, 0 if index in patches else value)
        offset = put(raw, len(raw))  # natural alignment
        if index in patches:
            out_patches.append((offset, *patches[index]))
    for _ in range(2):  # global and profile scratch: never used by a replayed kernel
        put(bytes(8), 8)
    return Packed(bytes(data), struct.pack(f"<{len(offsets)}H", *offsets), out_patches, tmas, sizes)


class _Repointed:
    """``desc`` with its base at ``address``, as Triton's ``make_tensordesc_arg`` reads a
    host descriptor (shape, strides, padding, ``base.data_ptr()``)."""

    def __init__(self, desc, address: int) -> None:
        self.shape, self.strides, self.padding = desc.shape, desc.strides, desc.padding
        self.base, self._address = self, address

    def data_ptr(self) -> int:
        return self._address


def _tritons_tensor_map(desc, meta: dict, address: int) -> bytes | None:
    """The CUtensorMap Triton's launcher would pass for ``desc`` re-pointed at
    ``address``, or None where its object is not laid out as Triton 3.6 builds it (the map
    128-byte aligned after the object header)."""
    from triton.backends.nvidia.driver import make_tensordesc_arg  # noqa: PLC0415

    obj = make_tensordesc_arg(_Repointed(desc, address), meta)[0]
    if type(obj).__basicsize__ != 2 * _TENSOR_MAP_BYTES:
        return None
    return ctypes.string_at(id(obj) + _TENSOR_MAP_BYTES, _TENSOR_MAP_BYTES)


def prepare(compiled, grid: tuple[int, int, int], params: list, patches: dict[int, tuple[int, int]]):
    """A prepared launch of ``compiled`` (a Triton CompiledKernel), or None where this
    launch must go through Triton's launcher. ``params``: every kernel parameter in
    order, the fixed addresses as ints and TMA descriptors as host descriptors over a
    root; ``patches`` as in :func:`pack_params`.

    A launch with TMA descriptors is prepared only where two checks pass: each
    descriptor, encoded at a test address, is byte for byte the one Triton's launcher
    encodes, and every parameter has the size the driver reads for it
    (``cuFuncGetParamInfo``)."""
    mod = module()
    if mod is None:
        return None
    try:
        types = list(compiled.src.signature.values())
        launcher = compiled.run
        num_warps, num_ctas, shared = compiled.packed_metadata
        if (num_ctas != 1 or launcher.global_scratch_size or launcher.profile_scratch_size
                or len(types) != len(params)):
            return None
        metas = getattr(compiled.metadata, "tensordesc_meta", None)
        packed = pack_params(types, params, patches, metas)
        if packed.tmas and not _tensor_maps_agree(mod, types, params, metas, packed, int(compiled.function)):
            return None
        return mod.prepare(int(compiled.function), *grid, 32 * num_warps, shared,
                           bool(launcher.launch_pdl), bool(launcher.launch_cooperative_grid),
                           packed.data, packed.offsets, packed.patches, packed.tmas)
    except (AttributeError, LookupError, NotImplementedError, TypeError, ValueError, RuntimeError,
            struct.error) as exc:
        _LOG.debug("cascadeinfer: %s launched through Triton (%s)", getattr(compiled, "name", "?"), exc)
        return None


_TEST_ADDRESS = 1 << 32  # 16-byte aligned, as a TMA base must be; never dereferenced by an encoding


def _tensor_maps_agree(mod, types, params, metas, packed: Packed, function: int) -> bool:
    """Whether our packing of a launch with TMA descriptors is what Triton's launcher
    would pass: the driver's parameter sizes match ours, and each descriptor we encode
    equals Triton's at the same address."""
    if mod.param_sizes(function) != tuple(packed.sizes):
        return False
    descs = [v for ty, v in zip(types, params) if ty.startswith("tensordesc")]
    for desc, meta, tma in zip(descs, metas, packed.tmas, strict=True):
        theirs = _tritons_tensor_map(desc, meta, _TEST_ADDRESS)
        if theirs is None or mod.encode(tma, _TEST_ADDRESS) != theirs:
            return False
    return True
