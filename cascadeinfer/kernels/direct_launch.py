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
scratch, clusters, parameter types other than pointers, integers and floats), replays
go through Triton's launcher as before.

The parameter layout follows Triton 3.6's launcher (the version this package pins):
every non-constexpr parameter in signature order, then the global and the profile
scratch pointers.
"""

from __future__ import annotations

import functools
import logging
import os
import struct
from pathlib import Path

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


def pack_params(types: list[str], values: list, patches: dict[int, tuple[int, int]]
                ) -> tuple[bytes, bytes, list[tuple[int, int, int]]]:
    """The driver's view of one launch's parameters.

    ``types``/``values``: every kernel parameter in signature order (Triton types,
    ``"constexpr"`` ones skipped). ``patches``: parameter index -> (root index, byte
    offset) for the addresses that change from one replay to the next. Returns the
    parameter bytes (each value aligned to its size, the two scratch pointers last), the
    uint16 offset of each passed parameter, and the patches as (byte offset, root, add).
    """
    data = bytearray()
    offsets: list[int] = []
    out_patches = []
    for index, (ty, value) in enumerate(zip(types, values)):
        if ty == "constexpr":
            continue
        if index in patches:
            value = 0
        raw = _pack_value(ty, value)
        data += bytes(-len(data) % len(raw))  # natural alignment
        offsets.append(len(data))
        if index in patches:
            root, add = patches[index]
            out_patches.append((len(data), root, add))
        data += raw
    for _ in range(2):  # global and profile scratch: never used by a replayed kernel
        data += bytes(-len(data) % 8)
        offsets.append(len(data))
        data += bytes(8)
    return bytes(data), struct.pack(f"<{len(offsets)}H", *offsets), out_patches


def prepare(compiled, grid: tuple[int, int, int], params: list, patches: dict[int, tuple[int, int]]):
    """A prepared launch of ``compiled`` (a Triton CompiledKernel), or None where this
    launch must go through Triton's launcher. ``params``: every kernel parameter in
    order, the fixed addresses as ints; ``patches`` as in :func:`pack_params`."""
    mod = module()
    if mod is None:
        return None
    try:
        types = list(compiled.src.signature.values())
        launcher = compiled.run
        num_warps, num_ctas, shared = compiled.packed_metadata
        if (num_ctas != 1 or launcher.global_scratch_size or launcher.profile_scratch_size
                or len(types) != len(params) or getattr(compiled.metadata, "tensordesc_meta", None)):
            return None
        data, offsets, out_patches = pack_params(types, params, patches)
        return mod.prepare(int(compiled.function), *grid, 32 * num_warps, shared,
                           bool(launcher.launch_pdl), bool(launcher.launch_cooperative_grid),
                           data, offsets, out_patches)
    except (AttributeError, NotImplementedError, TypeError, ValueError, struct.error) as exc:
        _LOG.debug("cascadeinfer: %s launched through Triton (%s)", getattr(compiled, "name", "?"), exc)
        return None
