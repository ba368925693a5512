"""Recorded launches: run a launcher once, then replay its kernel launches with new tensors.

Everything a launcher does on the host (argument checks, tile, split and schedule
choices, the grid, scratch sizes) depends only on the *signature* of its call: the
shapes, strides, dtypes, devices and 16-byte alignment of its tensors and its scalar
options; never on tensor contents. A second call with the same signature would launch
the same kernels with the same arguments, except for the addresses of the tensors. So a
launcher records its first call and replays the recording afterwards:

- ``recording(roots)`` runs the launcher as usual and keeps every kernel launch it makes
  through :func:`launch`: the compiled kernel, the grid and the argument list, in which
  each tensor argument is written as ``(root, byte offset)`` when it is a view of one of
  ``roots`` (the caller's tensors: q, the cache, the page table, out, lse), as a slice of
  the call's scratch buffer when it came from :func:`scratch`, as a slice of its counter
  block when it came from :func:`counters`, and kept as it is otherwise (tensors the owner
  of the recording keeps alive, e.g. a plan's metadata).
- ``Recording.replay(roots)`` reads the new roots' addresses and launches the same
  kernels. On CUDA every kernel of the recording goes out in one call of our C launcher
  (:mod:`cascadeinfer.kernels.direct_launch`: parameters packed once, the new addresses
  patched in, ``cuLaunchKernelEx``), or, where that launcher is unavailable, through each
  compiled kernel's generated Triton launcher called directly with integer addresses;
  either way without Triton's argument binding, specialisation, cache lookup and
  per-pointer driver query, and without the launcher's own Python checks
  (benchmarks/NOTES.md, "Host cost"). Under ``TRITON_INTERPRET=1`` it launches through
  the JIT function again with the new tensors, so the same recording and address logic
  is what CI tests.
- :class:`LaunchCache` keeps a launcher's recordings; :meth:`LaunchCache.find` recognises
  a signature seen lately through torch's C++ tensor guards before it builds a key.
- ``LaunchCache.hot`` (:mod:`cascadeinfer.kernels.hot_path`) does a whole replay in one
  C++ call: a launcher called with ``validate=False`` asks it first. Its entries are made
  (:meth:`LaunchCache.bind`) from replays the Python path completed through the direct
  launcher (:meth:`Recording.hot_program`), so it repeats exactly what they did, and it
  declines where it cannot.

A replay is exact only for a call with the recorded signature: the caller keys its
recordings by :func:`call_key`, which holds every property the launcher's host work and
Triton's specialisation (pointer alignment, integer values) read. The CUDA replay
follows the argument layout of Triton 3.6's generated launcher (the version this
package pins); a kernel that needs launch-time scratch memory is never replayed.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Hashable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from triton import knobs

from cascadeinfer._device import use_triton
from cascadeinfer.kernels import direct_launch, hot_path

try:  # torch's C++ tensor guards (those of torch.compile); without them every call is keyed in Python
    from torch._C._dynamo.guards import TensorGuards as _TensorGuards
except ImportError:  # pragma: no cover - every supported torch has them
    _TensorGuards = None

_SCRATCH_ALIGN = 256  # bytes: every scratch slice starts on the allocator's own alignment
_STREAM_SCRATCH_BYTES = 16 * 2**20  # a stream's shared scratch block grows up to this size (see Recording)


@dataclass(slots=True)
class _Launch:
    """One kernel launch of a recording.

    CUDA: ``args`` is the whole argument list of Triton's C launcher, grid and stream
    first (:data:`_HEAD` entries), then every kernel parameter in order; fixed tensors are
    stored as their addresses (``keep`` holds them alive). Interpreter: ``args`` and
    ``meta`` are the original call's positional and keyword arguments.
    """

    kernel: object  # the @triton.jit function
    compiled: object  # its CompiledKernel (CUDA); None under the interpreter
    grid: tuple[int, int, int]
    args: list
    meta: dict
    roots: list[tuple[int, int, int]]  # (arg index, root index, byte offset)
    scratch: list[tuple[int, int]]  # (arg index, byte offset in the scratch buffer)
    counters: list[tuple[int, int]]  # (arg index, byte offset in the counter block)
    views: dict[int, tuple | None]  # arg index -> (dtype, size, stride) of the view it was (interpreter); None: a root, whole
    keep: list[torch.Tensor] = field(default_factory=list)
    # (arg index, root index, byte offset, descriptor): TMA descriptors over a root (CUDA),
    # rebuilt on the new root's address by every replay (see _Descriptor).
    descriptors: list[tuple[int, int, int, object]] = field(default_factory=list)


class _Address:
    """Stands in for a descriptor's base tensor in a replay: all that Triton's launcher
    reads of it is ``data_ptr()``, from which it encodes the descriptor."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr

    def data_ptr(self) -> int:
        return self.ptr


class _Descriptor:
    """A recorded TMA descriptor (Gluon's host ``TensorDescriptor``) re-pointed at a new
    base address: the same shape, strides, block and padding, which the call's signature
    fixes. Triton's launcher encodes a fresh ``CUtensorMap`` from it for each launch."""

    __slots__ = ("base", "block_shape", "layout", "padding", "shape", "strides")

    def __init__(self, recorded, ptr: int) -> None:
        self.base = _Address(ptr)
        self.shape, self.strides, self.padding = recorded.shape, recorded.strides, recorded.padding
        self.block_shape, self.layout = recorded.block_shape, recorded.layout


# The kinds of a HotProgram's steps.
LAUNCH, RECORD, WAIT = 0, 1, 2


class HotProgram(NamedTuple):
    """A replay as the C++ hot path repeats it (:mod:`cascadeinfer.kernels.hot_path`).

    ``sources``: per root, the index of the call's tensor it is, ``-1`` where the call
    allocates it like ``templates[root]``, ``-2`` for the fixed buffer ``templates[root]``.
    ``returned``: the roots the call returns (``single``: the one root itself, not a
    tuple). ``steps``: ``(LAUNCH, stream, direct launches)``, ``(RECORD, stream, event
    handle)`` or ``(WAIT, stream, event handle)``, in order; ``stream`` None is the
    caller's current stream, else a raw handle. ``bound``: the scratch (``base``) and
    counters (``counts``) belong to raw ``stream`` (and, with ``scratch_key``, to the
    block ``_STREAM_SCRATCH[scratch_key]`` must still be), so the program runs only there
    and never while captured. ``keep``: what must outlive the entry (the recordings).
    """

    sources: tuple[int, ...]
    templates: tuple
    returned: tuple[int, ...]
    single: bool
    steps: tuple
    bound: bool
    stream: int
    base: int
    counts: int
    scratch_key: tuple | None
    scratch_block: torch.Tensor | None
    keep: object


# The C launcher's leading arguments: grid x/y/z, stream, function, cooperative, PDL,
# global and profile scratch, packed metadata, launch metadata, enter and exit hooks.
_HEAD = 13
_STREAM = 3


@dataclass(slots=True)
class Recording:
    """The kernel launches of one launcher call, replayable with new roots.

    ``keep_scratch``: the scratch and counter tensors of the recorded call stay owned by
    the recording and every replay reuses them (for an owner whose replays are ordered on
    its streams, like a cascade plan). Otherwise a replay's scratch is its stream's block,
    shared by every recording replayed there (kernels on one stream run one after the
    other, so each replay's kernels are done with it before the next replay's start), and
    its counters another such block, zero between kernels (each kernel leaves its counters
    zero). While a CUDA graph is captured (its replays may run beside eager work on the
    same stream's blocks), or past ``_STREAM_SCRATCH_BYTES``, or off the current device,
    the replay takes a fresh block of its own instead, and zeroes its counters inside the graph.
    """

    keep_scratch: bool
    valid: bool = True  # False: an argument could not be traced to one root; never replay
    launches: list[_Launch] = field(default_factory=list)
    scratch_bytes: int = 0
    counter_bytes: int = 0
    _scratch: list[torch.Tensor] = field(default_factory=list)  # while recording
    _scratch_offsets: list[int] = field(default_factory=list)
    _counters: list[torch.Tensor] = field(default_factory=list)  # while recording
    _counter_offsets: list[int] = field(default_factory=list)
    _root_spans: list[tuple[int, int, int]] = field(default_factory=list)  # (storage ptr, data ptr, index)
    _roots: list[torch.Tensor] = field(default_factory=list)  # while recording
    _direct: tuple | None = None  # the prepared direct launches (empty: not possible), once replayed
    _templates: tuple[torch.Tensor, ...] = ()  # per root: a memoryless tensor of its dtype, device and shape
    # (raw stream, block, its address): the counter block of the last eager replay, held
    # here so that the next replay on that stream skips the lookup by stream.
    _kept_counts: tuple[int, torch.Tensor, int] | None = None
    # (first output root, out left to the launcher, lse left to it): set by outputs().
    _out_slots: tuple[int, bool, bool] | None = None
    # How the last replay launched, for the C++ hot path (LaunchCache.hot): (bound to the
    # stream, stream, scratch base, counter base, scratch key, scratch block, blocks to
    # hold); None: it went through Triton's launcher, or a path the hot one does not take.
    _hot_state: tuple | None = None

    def fresh(self, index: int) -> torch.Tensor:
        """A new contiguous tensor of root ``index``'s recorded dtype, device and shape:
        an output the launcher allocates for the caller. ``empty_like`` of a memoryless
        template (:func:`_template`) costs a fraction of ``torch.empty(shape, dtype=...,
        device=...)``, whose keyword parsing dominates a small allocation
        (benchmarks/NOTES.md, "Host cost")."""
        return torch.empty_like(self._templates[index])

    def outputs(self, out: torch.Tensor | None, lse: torch.Tensor | None, index: int) -> tuple[torch.Tensor, ...]:
        """A replayed call's ``(out, lse)``: each one given as it is (a call of the
        recorded signature passed its checks), each None :meth:`fresh` like the recorded
        roots ``index`` and ``index + 1``."""
        self._out_slots = (index, out is None, lse is None)
        return (self.fresh(index) if out is None else out, self.fresh(index + 1) if lse is None else lse)

    def replay(self, roots: Sequence[torch.Tensor], stream: int | None = None, known: Sequence[int] = ()) -> None:
        """Launch the recorded kernels on ``roots`` (same signature as when recorded),
        on ``stream`` (a raw CUDA stream handle; default: the current stream).
        ``known``: the addresses of the first ``len(known)`` roots, where the caller has
        them already (:meth:`LaunchCache.find` returns them)."""
        if not self.launches:
            return
        device_index = roots[0].get_device()  # -1: a CPU tensor (the interpreter)
        if device_index >= 0:
            ptrs = [*known, *(t.data_ptr() for t in roots[len(known):])] if known else [t.data_ptr() for t in roots]
            self._replay_cuda(roots, ptrs, device_index, stream)
        else:
            self._replay_interpreted(roots)

    def _replay_cuda(self, roots, ptrs: list[int], device_index: int, stream: int | None) -> None:
        current = torch._C._cuda_getCurrentRawStream(device_index)
        if stream is None:
            stream = current
        self._hot_state = None
        if self.keep_scratch or not (self.scratch_bytes or self.counter_bytes):
            # kept scratch and counters sit in the argument lists
            if self._launch_cuda(ptrs, stream, 0, 0):
                self._hot_state = (False, 0, 0, 0, None, None, None)
            return
        capturing = torch._C._cuda_isCurrentStreamCapturing()
        zeroed = None  # a graph's own counters, alive until its launches are captured
        counts = 0
        counts_block = None
        if self.counter_bytes:
            kept_counts = self._kept_counts
            if capturing:
                zeroed = torch.zeros(self.counter_bytes // 4, dtype=torch.int32, device=roots[0].device)
                counts = zeroed.data_ptr()
            elif kept_counts is not None and kept_counts[0] == stream:
                counts, counts_block = kept_counts[2], kept_counts[1]
            else:
                counts_block = _stream_counters(roots[0].device, device_index, stream, current, self.counter_bytes)
                counts = counts_block.data_ptr()
                self._kept_counts = (stream, counts_block, counts)
        hot = not capturing and stream == current
        if not self.scratch_bytes:
            if self._launch_cuda(ptrs, stream, 0, counts) and hot:
                self._hot_state = (True, stream, 0, counts, None, None, counts_block)
            return
        if device_index != torch._C._cuda_getDevice():  # the raw allocator serves the current device
            scratch = torch.empty(self.scratch_bytes, dtype=torch.uint8, device=roots[0].device)
            self._launch_cuda(ptrs, stream, scratch.data_ptr(), counts)
            return
        if not capturing and self.scratch_bytes <= _STREAM_SCRATCH_BYTES:
            # The stream's block, checked out while this replay enqueues its kernels: a
            # replay another thread interleaves on the same stream finds none and takes
            # a block of its own (below), never this one between two of our kernels.
            where = (device_index, stream)
            block = _STREAM_SCRATCH.pop(where, None)
            if block is None or block.numel() < self.scratch_bytes:
                block = _stream_block(roots[0].device, stream, current, self.scratch_bytes, block)
            try:
                if self._launch_cuda(ptrs, stream, block.data_ptr(), counts) and hot:
                    self._hot_state = (True, stream, block.data_ptr(), counts, where, block, counts_block)
            finally:
                _keep(_STREAM_SCRATCH, where, block)
            return
        # The scratch is taken from PyTorch's caching allocator on this stream and given
        # back once the kernels are enqueued, as a temporary tensor would be (stream-ordered
        # reuse; inside a graph capture, from the graph's pool), without a tensor object.
        base = _raw_alloc(self.scratch_bytes, stream)
        try:
            self._launch_cuda(ptrs, stream, base, counts)
        finally:
            _raw_free(base)

    def hot_program(self, num_tensors: int) -> HotProgram | None:
        """What the C++ hot path needs to repeat this recording's last replay for a call
        of ``num_tensors`` tensors (see :class:`HotProgram`), or None where it cannot."""
        state = self._hot_state
        roots = hot_roots(self._out_slots, num_tensors)
        if state is None or not self._direct or roots is None or len(roots[0]) != len(self._templates):
            return None
        sources, returned = roots
        bound, stream, base, counts, scratch_key, scratch_block, counts_block = state
        return HotProgram(sources, tuple(self._templates[r] if src < 0 else None for r, src in enumerate(sources)),
                          returned, False, ((LAUNCH, None, self._direct),), bound, stream, base, counts,
                          scratch_key, scratch_block, (self, counts_block))

    def _launch_cuda(self, ptrs: list[int], stream: int, base: int, counts: int) -> bool:
        """Enqueue the launches; True where they went out through the direct launcher."""
        hooked = bool(knobs.runtime.launch_enter_hook.calls or knobs.runtime.launch_exit_hook.calls)
        if not hooked:
            direct = self._direct if self._direct is not None else self._prepare_direct(len(ptrs))
            # False: this thread has no current CUDA context yet; Triton's launcher below makes it.
            if direct and direct_launch.module().run(direct, (*ptrs, base, counts), stream):
                return True
        for ln in self.launches:
            args = ln.args.copy()
            args[_STREAM] = stream
            for i, r, off in ln.roots:
                args[i] = ptrs[r] + off
            for i, off in ln.scratch:
                args[i] = base + off
            for i, off in ln.counters:
                args[i] = counts + off
            for i, r, off, desc in ln.descriptors:
                args[i] = _Descriptor(desc, ptrs[r] + off)
            if hooked:  # a profiler listens: Triton's own path, with launch metadata and hooks
                c = ln.compiled
                c.run(*ln.grid, stream, c.function, c.packed_metadata,
                      c.launch_metadata(ln.grid, stream, *args[_HEAD:]),
                      knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *args[_HEAD:])
            else:
                ln.compiled.run.launch(*args)
        return False

    def _prepare_direct(self, num_roots: int) -> tuple:
        """Every launch prepared for :mod:`~cascadeinfer.kernels.direct_launch` (the
        scratch base is root ``num_roots``, the counter block's ``num_roots + 1``), or
        ``()`` if any one cannot be."""
        prepared = []
        for ln in self.launches:
            patches = {i - _HEAD: (r, off) for i, r, off in ln.roots}
            patches.update({i - _HEAD: (num_roots, off) for i, off in ln.scratch})
            patches.update({i - _HEAD: (num_roots + 1, off) for i, off in ln.counters})
            params = ln.args[_HEAD:]
            if ln.descriptors:  # TMA descriptors over a root: encoded at each launch (direct_launch)
                params = list(params)
                for i, r, off, desc in ln.descriptors:
                    params[i - _HEAD] = desc
                    patches[i - _HEAD] = (r, off)
            one = direct_launch.prepare(ln.compiled, ln.grid, params, patches)
            if one is None:
                prepared = []
                break
            prepared.append(one)
        self._direct = tuple(prepared)
        return self._direct

    def _replay_interpreted(self, roots) -> None:
        device = roots[0].device
        buf = torch.empty(self.scratch_bytes, dtype=torch.uint8, device=device) if self.scratch_bytes else None
        counts = torch.zeros(self.counter_bytes, dtype=torch.uint8, device=device) if self.counter_bytes else None
        for ln in self.launches:
            args = ln.args.copy()
            for i, r, off in ln.roots:
                view = ln.views[i]
                args[i] = roots[r] if view is None else _view(roots[r], off, *view)
            for i, off in ln.scratch:
                args[i] = _view(buf, off, *ln.views[i])
            for i, off in ln.counters:
                args[i] = _view(counts, off, *ln.views[i])
            ln.kernel[ln.grid](*args, **ln.meta)

    # ---- recording side

    def _add(self, kernel, compiled, grid, args: list, meta: dict) -> None:
        grid = _grid3(grid)
        head = 0
        if compiled is not None:  # CUDA: every param in signature order, constexprs included
            given = dict(zip(kernel.arg_names, args))
            given.update(meta)
            launcher = compiled.run
            if launcher.global_scratch_size or launcher.profile_scratch_size:
                self.valid = False  # kernels that need launch-time scratch are not replayed
            args = [*grid, None, compiled.function, launcher.launch_cooperative_grid, launcher.launch_pdl,
                    None, None, compiled.packed_metadata, None, None, None,
                    *(given[p.name] if p.name in given else p.default for p in kernel.params)]
            head = _HEAD
            meta = {}
        roots, scratch, counts, views, kept, keep, descriptors = [], [], [], {}, list(args), [], []
        for i, a in enumerate(args):
            base = getattr(a, "base", None)
            if i >= head and isinstance(base, torch.Tensor):
                # A TMA descriptor: over a root it is rebuilt on the new address in every
                # replay (through Triton's launcher, which encodes it); over a tensor the
                # owner keeps it stays as it is; over anything else it cannot be replayed.
                ref = self._where(base)
                if ref is None:
                    continue
                if ref[0] != "root" or compiled is None:
                    self.valid = False
                    continue
                descriptors.append((i, ref[1], ref[2], _Descriptor(a, 0)))
                kept[i] = None  # never keep the caller's tensor alive
                continue
            if i < head or not isinstance(a, torch.Tensor):
                continue
            ref = self._where(a)
            if ref is None:  # a tensor the recording's owner keeps alive: its address is fixed
                if compiled is not None:
                    keep.append(a)
                    kept[i] = a.data_ptr()
                continue
            if ref[0] == "ambiguous":
                self.valid = False
                continue
            kind, index, off = ref
            if kind == "root":
                roots.append((i, index, off))
            elif kind == "scratch":
                scratch.append((i, off))
            else:
                counts.append((i, off))
            # A root passed whole is passed whole again (its length may differ: lengthless keys).
            whole = kind == "root" and off == 0 and self._is_root(a, index)
            views[i] = None if whole else (a.dtype, tuple(a.shape), tuple(a.stride()))
            if kind == "root" or not self.keep_scratch:
                kept[i] = None  # never keep the caller's tensors (or per-replay scratch) alive
            elif compiled is not None:
                keep.append(a)
                kept[i] = a.data_ptr()
        if self.keep_scratch:
            scratch, counts = [], []  # the scratch and counter tensors themselves stay in the argument list
        self.launches.append(_Launch(kernel, compiled, grid, kept, meta, roots, scratch, counts, views, keep,
                                     descriptors))

    def _is_root(self, t: torch.Tensor, index: int) -> bool:
        root = self._roots[index]
        return t.dtype == root.dtype and t.shape == root.shape and t.stride() == root.stride()

    def _where(self, t: torch.Tensor) -> tuple[str, int, int] | None:
        storage, ptr = t.untyped_storage().data_ptr(), t.data_ptr()
        roots = [(root_ptr, index) for root_storage, root_ptr, index in self._root_spans if root_storage == storage]
        if len(roots) > 1:
            # Roots that share storage (q, k and v cut from one projection): the view is
            # of the root it starts at, else of the nearest root starting below it.
            below = [r for r in roots if r[0] <= ptr]
            if not below or sum(r[0] == max(below)[0] for r in below) > 1:
                return "ambiguous", -1, 0
            roots = [max(below)]
        if roots:
            root_ptr, index = roots[0]
            return "root", index, ptr - root_ptr
        for kind, tensors, offsets in (("scratch", self._scratch, self._scratch_offsets),
                                       ("counter", self._counters, self._counter_offsets)):
            for index, s in enumerate(tensors):
                if storage == s.untyped_storage().data_ptr():
                    return kind, index, offsets[index] + t.data_ptr() - s.data_ptr()
        return None


def _raw_alloc(nbytes: int, stream: int) -> int:
    return torch._C._cuda_cudaCachingAllocator_raw_alloc(nbytes, stream)


def _raw_free(ptr: int) -> None:
    torch._C._cuda_cudaCachingAllocator_raw_delete(ptr)


_TEMPLATE_BYTES = 4 * 2**20  # roots up to this size get a dense template (see _template)
_TEMPLATE_STORAGE: dict[torch.device, torch.UntypedStorage] = {}
_ONE: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _template(t: torch.Tensor) -> torch.Tensor:
    """A tensor of ``t``'s dtype, device and shape, contiguous, that owns no memory of
    its own: what ``torch.empty_like`` needs to make an output like ``t``. Up to
    ``_TEMPLATE_BYTES`` it is a dense view of one never-written storage per device
    (``empty_like`` copies a dense tensor's strides, about 1 µs cheaper per call than
    the layout it must work out for an expanded one); larger, a view of one element
    expanded to the shape."""
    if t.numel() * t.element_size() <= _TEMPLATE_BYTES:
        storage = _TEMPLATE_STORAGE.get(t.device)
        if storage is None:
            storage = torch.empty(_TEMPLATE_BYTES, dtype=torch.uint8, device=t.device).untyped_storage()
            _TEMPLATE_STORAGE[t.device] = storage
        return torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, 0, t.shape)
    key = (t.dtype, t.device)
    one = _ONE.get(key)
    if one is None:
        one = _ONE[key] = torch.empty(1, dtype=t.dtype, device=t.device)
    return one.expand(t.shape)


def _grid3(grid: Sequence[int]) -> tuple[int, int, int]:
    g = tuple(int(x) for x in grid)
    return (g + (1, 1))[:3]


def _view(base: torch.Tensor, byte_offset: int, dtype: torch.dtype, size, stride) -> torch.Tensor:
    """``dtype`` view of ``base``'s storage at ``byte_offset`` from ``base``'s first byte."""
    start = base.storage_offset() * base.element_size() + byte_offset
    itemsize = torch.empty((), dtype=dtype).element_size()
    return torch.empty(0, dtype=dtype, device=base.device).set_(base.untyped_storage(), start // itemsize, size, stride)


_RECORDING: ContextVar[Recording | None] = ContextVar("cascadeinfer_recording", default=None)


@contextlib.contextmanager
def recording(roots: Sequence[torch.Tensor], *, keep_scratch: bool = False) -> Iterator[Recording]:
    """Record the kernel launches made inside the block (see the module docstring).

    ``roots`` are the tensors a replay passes anew, in this order. Roots may share
    storage (q, k and v cut from one projection); a tensor argument is then taken as a
    view of the root it starts at, or of the nearest root starting below it; where that
    is ambiguous (two roots at one address) the recording is marked not ``valid``.
    """
    rec = Recording(keep_scratch=keep_scratch)
    for index, t in enumerate(roots):
        rec._root_spans.append((t.untyped_storage().data_ptr(), t.data_ptr(), index))
    rec._roots = list(roots)
    token = _RECORDING.set(rec)
    try:
        yield rec
    finally:
        _RECORDING.reset(token)
        rec._templates = tuple(_template(t) for t in roots)
        if not keep_scratch:
            rec._scratch.clear()  # replays allocate their own
            rec._counters.clear()
        rec._root_spans.clear()
        rec._roots = []


@contextlib.contextmanager
def recorded(cache: "LaunchCache", key: Hashable | None, roots: Sequence[torch.Tensor]) -> Iterator[None]:
    """Record the launches made inside the block into ``cache[key]`` (nothing when ``key``
    is None, or when the roots are CPU tensors without the interpreter: that path
    launches no kernel, so there is nothing to replay). Inside another recording (a
    launcher called by a recorded launcher, e.g. a split's merge) the launches belong to
    that one, and nothing is cached here."""
    if key is None or _RECORDING.get() is not None or not use_triton(roots[0].device):
        yield
        return
    with recording(roots) as rec:
        yield
    cache.put(key, rec)


def recording_active() -> bool:
    """Whether a recording is in progress (the launches made now will be replayed)."""
    return _RECORDING.get() is not None


@contextlib.contextmanager
def unrecorded() -> Iterator[None]:
    """Launches inside the block run now and are kept by no recording in progress (a
    launcher's one-off work on its first call, e.g. compiling another form of a kernel)."""
    token = _RECORDING.set(None)
    try:
        yield
    finally:
        _RECORDING.reset(token)


def launch(kernel, grid: Sequence[int], *args, **meta) -> None:
    """``kernel[grid](*args, **meta)``, kept by the recording in progress if there is one."""
    compiled = kernel[grid](*args, **meta)
    rec = _RECORDING.get()
    if rec is not None:
        rec._add(kernel, compiled if hasattr(compiled, "packed_metadata") else None, grid, list(args), meta)


def scratch(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised scratch tensor of a launcher (partial states); a recording in
    progress keeps it or re-creates it in every replay (see :class:`Recording`)."""
    t = torch.empty(shape, dtype=dtype, device=device)
    rec = _RECORDING.get()
    if rec is not None:
        rec._scratch.append(t)
        rec._scratch_offsets.append(rec.scratch_bytes)
        nbytes = t.numel() * t.element_size()
        rec.scratch_bytes += -(-nbytes // _SCRATCH_ALIGN) * _SCRATCH_ALIGN
    return t


def counters(n: int, device: torch.device) -> torch.Tensor:
    """``n`` int32 zeros in which a kernel's programs count their arrivals (the last of
    a row's KV splits to finish merges them: :mod:`cascadeinfer.kernels.split_merge`).
    The kernel must leave every counter zero when it ends, so that the next kernel on the
    stream finds them zero without a memset. A recording in progress keeps them or gives
    every replay zeroed ones (see :class:`Recording`)."""
    t = torch.zeros(n, dtype=torch.int32, device=device)
    rec = _RECORDING.get()
    if rec is not None:
        rec._counters.append(t)
        rec._counter_offsets.append(rec.counter_bytes)
        rec.counter_bytes += -(-4 * n // _SCRATCH_ALIGN) * _SCRATCH_ALIGN
    return t


# (device index, raw stream) -> the zeroed counter block of replays on that stream.
_STREAM_COUNTERS: dict[tuple[int, int], torch.Tensor] = {}
# (device index, raw stream) -> the scratch block of replays on that stream, while none has it
# checked out (at most _STREAM_SCRATCH_BYTES each).
_STREAM_SCRATCH: dict[tuple[int, int], torch.Tensor] = {}
# Blocks are kept for the _STREAMS_KEPT streams that replayed last (an engine uses a few);
# a program that makes a stream per task does not keep a block per stream it ever made.
_STREAMS_KEPT = 16


def _keep(blocks: dict[tuple[int, int], torch.Tensor], where: tuple[int, int], block: torch.Tensor) -> None:
    """``blocks[where] = block`` as the most recent entry, dropping the oldest past
    ``_STREAMS_KEPT``. A dropped block goes back to the caching allocator on its own
    stream, reused there only behind the kernels already enqueued (a recording or a hot
    path entry that still holds it keeps it alive)."""
    blocks.pop(where, None)
    blocks[where] = block
    while len(blocks) > _STREAMS_KEPT:
        del blocks[next(iter(blocks))]


def _stream_block(device: torch.device, stream: int, current: int, nbytes: int,
                  old: torch.Tensor | None) -> torch.Tensor:
    """A new scratch block for ``stream``: ``nbytes`` at least, twice ``old`` where that is
    larger (so a stream whose calls grow reallocates a few times only), up to
    ``_STREAM_SCRATCH_BYTES``. Allocated on ``stream``: the caching allocator then reuses
    ``old``, dropped here, only behind the kernels already enqueued there."""
    size = max(nbytes, min(_STREAM_SCRATCH_BYTES, 0 if old is None else 2 * old.numel()))
    return _on_stream(stream, current, device, lambda: torch.empty(size, dtype=torch.uint8, device=device))


def _on_stream(stream: int, current: int, device: torch.device, make):
    """``make()`` with raw ``stream`` current: a block it allocates belongs to that stream's
    pool, and whatever it enqueues (a zero fill) runs there."""
    if stream == current:
        return make()
    with torch.cuda.stream(torch.cuda.ExternalStream(stream, device=device)):
        return make()


def _stream_counters(device: torch.device, device_index: int, stream: int, current: int,
                     nbytes: int) -> torch.Tensor:
    """``stream``'s counter block, at least ``nbytes`` long and zero between kernels
    (each kernel resets what it counted). A larger block replaces a smaller one for later
    lookups; recordings that hold the old one keep using it on that stream, in order."""
    block = _STREAM_COUNTERS.get((device_index, stream))
    if block is None or block.numel() * 4 < nbytes:
        size = max(nbytes // 4, 0 if block is None else 2 * block.numel())
        # zeroed on the stream whose kernels will count in it
        block = _on_stream(stream, current, device, lambda: torch.zeros(size, dtype=torch.int32, device=device))
        _keep(_STREAM_COUNTERS, (device_index, stream), block)
    return block


# ---- call signatures


def _spec(x) -> Hashable:
    if isinstance(x, torch.Tensor):
        # data_ptr % 16: Triton specialises pointer arguments on 16-byte alignment.
        return (x.dtype, x.shape, x.stride(), x.data_ptr() & 15, x.get_device())
    if isinstance(x, (tuple, list)):
        return (type(x), *map(_spec, x))
    return x


def call_key(*args) -> Hashable:
    """The signature of a launcher call: per tensor its dtype, shape, strides, address
    modulo 16 and device; per tuple of tensors the same for each; other values as they
    are (they must be hashable for the key to be used)."""
    key = []
    for x in args:  # _spec, inlined for tensors: this runs on every call
        if isinstance(x, torch.Tensor):
            key.append((x.dtype, x.shape, x.stride(), x.data_ptr() & 15, x.get_device()))
        else:
            key.append(_spec(x))
    return tuple(key)


def given(a: torch.Tensor | None, b: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """Those of a call's (at most two) optional tensors that are not None, for
    :meth:`LaunchCache.find` (written out: this runs on every call)."""
    if a is None:
        return () if b is None else (b,)
    return (a,) if b is None else (a, b)


def _signature(tensors: Sequence[torch.Tensor], options: tuple, lengthless: tuple[int, ...]) -> Hashable:
    """:func:`call_key` of ``(*tensors, *options)``, with the tensors at ``lengthless``
    keyed by their rank instead of their shape."""
    key = call_key(*tensors, *options)
    if not lengthless:
        return key
    key = list(key)
    for i in lengthless:
        dtype, shape, *rest = key[i]
        key[i] = (dtype, len(shape), *rest)
    return tuple(key)


def hot_roots(out_slots: tuple[int, bool, bool] | None, num_tensors: int
              ) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """Where a replay's roots come from, for the C++ hot path: per root the index of the
    call's tensor it is, or -1 where the launcher allocates it; and the roots the call
    returns. ``out_slots`` is :meth:`Recording.outputs`' note ``(index, out left, lse
    left)``: the roots are the first ``index`` tensors, then out and lse, each the next
    tensor where given (None: a launcher without outputs, whose roots are its tensors).
    None where the tensors do not add up."""
    if out_slots is None:
        return tuple(range(num_tensors)), ()
    index, out_none, lse_none = out_slots
    sources, t = list(range(index)), index
    for none in (out_none, lse_none):
        sources.append(-1 if none else t)
        t += 0 if none else 1
    return (tuple(sources), (index, index + 1)) if t == num_tensors else None


def _decline(tensors: tuple, options: tuple) -> None:
    """The hot path of a cache with no entries yet (or none possible): always declines."""
    return None


_HOT: list = []  # the configured C++ hot path, once it is loaded


def _hot_module():
    """The C++ hot path (:mod:`cascadeinfer.kernels.hot_path`), configured with this
    module's stream scratch blocks, or None (off, unavailable, or still being built)."""
    if _HOT:
        return _HOT[0]
    mod = hot_path.module_if_ready()
    if mod is not None:
        mod.configure(_STREAM_SCRATCH, torch._C._cuda_getCurrentRawStream, knobs.runtime, _RECORDING)
        _HOT.append(mod)
    return mod


@dataclass(slots=True)
class _Recent:
    """A recently replayed signature, checked in C++: ``guards`` (torch's own tensor
    guards, the ones ``torch.compile`` checks its graphs with) compare the dispatch keys,
    dtype, device, shape and strides of every tensor; the addresses must all be 16-byte
    aligned, as they were when it was found."""

    options: tuple
    count: int  # of tensors
    guards: object
    rec: Recording


class LaunchCache:
    """Recordings of a launcher's calls, by :func:`call_key`, the ``maxsize`` most recently
    used kept. Unhashable keys are never found (the caller records nothing then).

    :meth:`find` looks a call up in two steps: first among the last few signatures it
    returned, compared in C++ by torch's tensor guards (about 0.1 µs per tensor), then by
    the full :func:`call_key` (about 1 µs per tensor in Python). An engine calling a
    launcher with one or two signatures per step pays only the first.

    :attr:`hot` ``(tensors, options) -> outputs or None`` is the C++ hot path over the
    signatures :meth:`bind` gave it (a function that always declines until the first).
    """

    def __init__(self, maxsize: int = 64, recent: int = 4) -> None:
        self.maxsize = maxsize
        self._items: OrderedDict[Hashable, Recording] = OrderedDict()
        self._recent: list[_Recent] = []
        self._num_recent = recent if _TensorGuards is not None else 0
        self._hot = None  # the C++ hot path's entries (a capsule), made on the first bind
        self.hot = _decline

    def _hot_cache(self):
        """The hot path's module, with this cache's entries made on first use; None while
        it is unavailable."""
        mod = _hot_module()
        if mod is not None and self._hot is None:
            self._hot = mod.new_cache()
            self.hot = mod.caller(self._hot)
        return mod

    def bind(self, program: HotProgram | None, tensors: Sequence[torch.Tensor], options: tuple,
             lengthless: tuple[int, ...] = ()) -> None:
        """Give the C++ hot path an entry: calls with ``tensors``' signature and ``options``
        run ``program`` (None, or CPU tensors: nothing to add). The caller's :attr:`hot`
        then takes such calls."""
        if program is None or not tensors or tensors[0].get_device() < 0:
            return
        mod = self._hot_cache()
        if mod is not None:
            mod.add(self._hot, options, tuple(tensors), tuple(lengthless), program.sources, program.templates,
                    program.returned, program.single, program.steps, tensors[0].get_device(), program.bound,
                    program.stream, program.base, program.counts, program.scratch_key, program.scratch_block,
                    program.keep)

    def find(self, tensors: Sequence[torch.Tensor], options: tuple = (), *,
             lengthless: tuple[int, ...] = (), hot: bool = False) -> tuple[Recording | None, Hashable, list[int]]:
        """The recording for a call whose tensor arguments are ``tensors`` (every one,
        tuples flattened, in a fixed order) and whose other arguments are ``options``
        (hashable; they must also tell apart calls whose tensors differ in number or
        role, e.g. an output given or not). ``lengthless``: indices of 1-D tensors whose
        length the launcher's host work never reads (a page list read only by the
        kernels), so a call with another length replays the same recording.

        Returns ``(recording or None, key, addresses)``: on a miss, ``key`` is what to
        record the call under (:func:`recorded`), None while another recording is in
        progress; ``addresses`` are the tensors' data pointers, read once for the alignment
        check and handed on to :meth:`Recording.replay` (``known``).

        ``hot``: the caller asked :attr:`hot` first (``validate=False``) and it declined;
        a recording found now, whose last replay the hot path can repeat, gets an entry
        there, so the next such call takes it.
        """
        if _RECORDING.get() is not None:
            return None, None, []
        try:
            ptrs = [t.data_ptr() for t in tensors]
        except AttributeError:  # not a tensor: never recorded; the launcher's checks name it
            return None, None, []
        bits = 0
        for p in ptrs:
            bits |= p
        aligned = not bits & 15  # every tensor on a 16-byte boundary, as Triton specialises
        if aligned:
            for entry in self._recent:
                if entry.options == options and entry.count == len(tensors) and entry.guards.check(*tensors):
                    if hot:
                        self.bind(entry.rec.hot_program(len(tensors)), tensors, options, lengthless)
                    return entry.rec, None, ptrs
        key = _signature(tensors, options, lengthless)
        rec = self.get(key)
        if rec is not None and hot and aligned:
            self.bind(rec.hot_program(len(tensors)), tensors, options, lengthless)
        if rec is not None and self._num_recent and aligned:
            sizes = [list(t.shape) for t in tensors]
            for i in lengthless:
                sizes[i] = [None]
            guards = _TensorGuards(*tensors, dynamic_dims_sizes=sizes,
                                   dynamic_dims_strides=[list(t.stride()) for t in tensors])
            self._recent = [_Recent(options, len(tensors), guards, rec), *self._recent[:self._num_recent - 1]]
        return rec, key, ptrs

    def get(self, key: Hashable) -> Recording | None:
        """The recording for ``key``; None when there is none, or while another
        recording is in progress (whose launches must go through :func:`launch`)."""
        if _RECORDING.get() is not None:
            return None
        try:
            rec = self._items.get(key)
        except TypeError:  # an unhashable option: never cached
            return None
        if rec is not None:
            self._items.move_to_end(key)
        return rec

    def put(self, key: Hashable, rec: Recording) -> None:
        if not rec.valid:
            return
        try:
            self._items[key] = rec
        except TypeError:
            return
        if len(self._items) > self.maxsize:
            _, dropped = self._items.popitem(last=False)
            self._recent = [e for e in self._recent if e.rec is not dropped]

    def clear(self) -> None:
        self._items.clear()
        self._recent.clear()
        if self._hot is not None:
            _hot_module().clear(self._hot)

    def __len__(self) -> int:
        return len(self._items)
