"""The hot path of a replayed call, built as a C++ extension of PyTorch on first use.

A launcher called with ``validate=False`` and a signature it has replayed before hands
its tensors and options to its :class:`~cascadeinfer.kernels.launch.LaunchCache`'s
``hot`` first: one C++ call (``hot_path.cpp``) recognises the signature, allocates the
outputs the caller left out, and enqueues the recording's kernels through the direct
launches of :mod:`cascadeinfer.kernels.direct_launch` (benchmarks/NOTES.md, "Host cost"
v10). Where it declines, or where this module cannot be built, the Python path runs as
before, with the same result.

The module is compiled once per source text, torch version and Python ABI with the C++
compiler PyTorch extensions use (``$CXX``, else ``c++``), against the headers and
libraries of the installed torch, and cached under ``$CASCADEINFER_CACHE_DIR`` (default
``~/.cache/cascadeinfer``). The first build takes 10-30 s on a background thread, started by
the first replay that could use it; until it is done replays take the Python path.
``CASCADEINFER_HOT_PATH=0`` turns it off.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import subprocess
import sys
import sysconfig
import tempfile
import threading
from pathlib import Path

import torch

from cascadeinfer.kernels import direct_launch

_LOG = logging.getLogger(__name__)
_NAME = "cascadeinfer_hot_path"


def _build(src: str, target: Path) -> None:
    from torch.utils import cpp_extension  # noqa: PLC0415 - only for a build
    from triton.backends.nvidia.driver import include_dirs  # noqa: PLC0415 - Triton's cuda.h

    target.parent.mkdir(parents=True, exist_ok=True)
    # Built beside the target and renamed onto it (atomic within one file system): a
    # concurrent build of the same source writes the same bytes.
    out = target.with_name(f".{target.name}.{os.getpid()}.{threading.get_ident()}")
    with tempfile.TemporaryDirectory() as tmp:
        cpp = Path(tmp) / "hot_path.cpp"
        cpp.write_text(src)
        cmd = [os.environ.get("CXX", "c++"), "-O2", "-shared", "-fPIC", "-std=c++20", "-w", str(cpp), "-o", str(out),
               f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
               *(f"-I{d}" for d in [*cpp_extension.include_paths(), *include_dirs, sysconfig.get_paths()["include"]]),
               *(f"-L{d}" for d in cpp_extension.library_paths()),
               "-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python"]
        try:
            subprocess.run(cmd, check=True, capture_output=True, text=True)
            os.replace(out, target)
        finally:
            out.unlink(missing_ok=True)


def _target() -> tuple[str, Path]:
    """The module's source text and where its build for this torch and Python lives."""
    src = direct_launch.source("hot_path.cpp")
    digest = hashlib.sha256("\0".join([src, torch.__version__, sys.version, _NAME]).encode()).hexdigest()[:24]
    root = Path(os.environ.get("CASCADEINFER_CACHE_DIR", Path.home() / ".cache" / "cascadeinfer"))
    return src, root / digest / (_NAME + sysconfig.get_config_var("EXT_SUFFIX"))


def _load(target: Path):
    spec = importlib.util.spec_from_file_location(_NAME, target)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _unavailable(exc: Exception) -> None:
    detail = getattr(exc, "stderr", "") or ""
    _LOG.warning("cascadeinfer: the C++ hot path is unavailable (%s%s); replays take the Python path",
                 exc, ": " + detail[-500:] if detail else "")


def _off() -> bool:
    return os.environ.get("CASCADEINFER_HOT_PATH", "1") == "0" or direct_launch.module() is None


@functools.cache
def module():
    """The compiled module (built now if it is not yet), or None where the hot path is off
    or cannot be built."""
    if _off():
        return None
    try:
        src, target = _target()
        if not target.exists():
            _build(src, target)
        return _load(target)
    except Exception as exc:  # noqa: BLE001 - any build or load failure means: the Python path
        _unavailable(exc)
        return None


class _Background:
    """The build started by :func:`module_if_ready`: its thread, and its error if it failed."""

    thread: threading.Thread | None = None
    error: Exception | None = None
    gave_up = False  # the error was reported: the Python path from now on

    @classmethod
    def start(cls, src: str, target: Path) -> None:
        def build() -> None:
            try:
                _build(src, target)
            except Exception as exc:  # noqa: BLE001 - reported by the next module_if_ready
                cls.error = exc

        cls.thread = threading.Thread(target=build, name="cascadeinfer-hot-path-build", daemon=True)
        cls.thread.start()


def module_if_ready():
    """The compiled module where it is built already (by this process or an earlier one),
    else None at once: the first such call starts the build on a background thread, so
    that no launcher call waits for a compiler (replays take the Python path meanwhile)."""
    if module.cache_info().currsize:
        return module()
    if _off() or _Background.gave_up:
        return None
    if _Background.thread is None:
        try:
            src, target = _target()
        except Exception as exc:  # noqa: BLE001 - no build possible: the Python path
            _unavailable(exc)
            _Background.gave_up = True
            return None
        if target.exists():
            return module()
        _Background.start(src, target)
        return None
    if _Background.thread.is_alive():
        return None
    if _Background.error is not None:
        _unavailable(_Background.error)
        _Background.gave_up = True
        return None
    return module()
