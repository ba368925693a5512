"""Test set-up: run Triton kernels through the interpreter when no GPU is present.

``TRITON_INTERPRET`` must be set before triton is first imported, so this runs before
any test module imports ``cascadeinfer``. Two measured traps of Triton 3.6's interpreter
are patched here, in test set-up only, so the kernel code stays identical on both paths
(see TRITON_NOTES.md):

1. numpy >= 2.4 breaks loops with run-time bounds: ``tensor.__index__`` calls
   ``int()`` on a 1-element array. We read the single element explicitly.
2. bf16 is stored as raw uint16, so a bf16 ``tl.dot`` multiplies the bit patterns.
   We convert bf16 dot operands to float32 first (exact).
3. ``.to(tl.bfloat16)`` of float32 truncates the mantissa; the GPU (and PyTorch) round to
   nearest even. Kernels that reproduce a reference's intermediate roundings (the fused
   elementwise ops) would be a unit in the last place off. We round as the GPU does.
"""

from __future__ import annotations

import os
import sys

import torch

HAS_GPU = torch.cuda.is_available()
if not HAS_GPU:
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("triton was imported before conftest could set TRITON_INTERPRET=1")
    os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import pytest  # noqa: E402


def _patch_interpreter() -> None:
    import triton.language as tl
    from triton.runtime import interpreter

    original_patch = interpreter._patch_lang_tensor

    def patch_lang_tensor(tensor, scope):
        original_patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    interpreter._patch_lang_tensor = patch_lang_tensor

    original_dot = interpreter.InterpreterBuilder.create_dot

    def as_fp32(h):
        if h.dtype.scalar == tl.bfloat16 or h.dtype == tl.bfloat16:
            data = interpreter._convert_float(h.data, tl.bfloat16, tl.float32, None).view(np.float32)
            return interpreter.TensorHandle(data.reshape(h.data.shape), tl.float32)
        return h

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original_dot(self, as_fp32(a), as_fp32(b), d, input_precision, max_num_imprecise_acc)

    interpreter.InterpreterBuilder.create_dot = create_dot

    original_cast = interpreter.InterpreterBuilder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            f32 = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32))
            bits = f32.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
            return interpreter.TensorHandle(bits.reshape(np.shape(src.data)), tl.bfloat16)
        return original_cast(self, src, dst_type)

    interpreter.InterpreterBuilder.cast_impl = cast_impl


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_interpreter()


def pytest_configure(config):
    """On a GPU, build the launchers' C++ hot path before any test: launchers otherwise
    build it on a background thread and take the Python path until it is done, so which
    path a test exercised would depend on timing."""
    if HAS_GPU:
        from cascadeinfer.kernels import hot_path

        hot_path.module()


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device() -> torch.device:
    """The device kernels run on: CUDA when present, else CPU through the interpreter."""
    return torch.device("cuda", torch.cuda.current_device()) if HAS_GPU else torch.device("cpu")


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models gain nothing from intra-op threads; on a shared CPU (and under
    pytest-xdist) their spin-waiting multiplies the CPU time. Restored afterwards.
    Modules of tiny-model tests opt in with ``pytestmark = pytest.mark.usefixtures(...)``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
