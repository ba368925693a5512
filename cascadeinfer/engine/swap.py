"""Preemption by swapping: host copies of a preempted sequence's pages.

When the device pool runs out, the scheduler preempts the youngest running sequence.
Recomputing it later redoes its whole prefill; swapping it instead copies its pages to
a host pool (:class:`SwapSpace`, pinned memory beside the device pool) and back when it
is admitted again, and it carries on where it stopped. Which one is cheaper depends on
the model and the machine (:class:`SwapPolicy`).

Shared pages are copied once. A device page that several preempted sequences hold (a
shared prompt, the common pages of n > 1 samples or of beams) goes to one host slot with
a reference per holder. A full page is never written again, so a later victim that holds
a full page already on the host, and a returning sequence whose full page is still on
the device (held by others, or cached), reuse it instead of copying; a partly filled page
may still be written by its other holders, so such reuse is limited to copies within one
step. Pages are named by ``(page, generation)`` (:meth:`PagedKVPool.generation`), so a
page freed and handed out again in between is never mistaken for the one copied.

The copies of a step go in one batch (:meth:`SwapSpace.flush`, called by the engine
before the step's kernels): a gather of the pages swapped out (on the current stream, so
before the step reuses them) whose copy to the host slots then runs on a stream of its
own beside the step; then the host slots swapped in, copied up and scattered into their
new pages on the current stream (the step needs them), after any copy out still running.
Nothing here waits for the device. Slots freed by a swap-in are reused only after that
flush, so a copy never overwrites a slot that another copy of the batch still reads.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from cascadeinfer.engine.prefix_cache import PrefixCache


@dataclass(slots=True)
class SwappedPages:
    """Where a swapped-out sequence's pages are: one host slot per page, in order, and
    per slot whether the page was full (complete, never written again) when copied."""

    slots: list[int]
    full: list[bool]


class SwapSpace:
    """A host pool of ``num_bytes // page_bytes`` page slots beside ``cache``'s device pool.

    Each slot holds one page of every layer (``[num_slots, num_layers, 2, ...page]``,
    pinned when the device pool is on a GPU). Slots have reference counts like device
    pages. Counters: ``pages_out``/``pages_in`` (copies made, shared pages once),
    ``bytes_out``/``bytes_in``, and :meth:`seconds` (time of the copies).
    """

    def __init__(self, cache: PrefixCache, num_bytes: int) -> None:
        if isinstance(num_bytes, bool) or not isinstance(num_bytes, int) or num_bytes < 0:
            raise ValueError(f"num_bytes: expected a non-negative int, got {num_bytes!r}")
        pool = cache.pool
        self.cache = cache
        self.pool = pool
        self.page_bytes = pool.cache[:, 0].numel() * pool.cache.element_size()  # one page of every layer
        self.num_slots = num_slots = num_bytes // self.page_bytes
        self._shape = (num_slots, pool.cache.shape[0], *pool.cache.shape[2:])
        self._host: torch.Tensor | None = None  # allocated on the first swap
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out low slots first
        self._ref = [0] * num_slots
        self._origin: dict[int, tuple[int, int, bool]] = {}  # slot -> (device page, generation, full)
        self._slot_of: dict[int, tuple[int, int, bool]] = {}  # device page -> (slot, generation, full)
        self._out: list[tuple[int, int]] = []  # (device page, slot) copies of the next flush
        self._in: list[tuple[int, int]] = []  # (slot, device page)
        self._freed: list[int] = []  # slots to free after the next flush
        self.pages_out = self.pages_in = 0
        # Per batch of copies: its start, its end on the current stream, and the end of its
        # copies out on their own stream (None: there were none).
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event, torch.cuda.Event | None]] = []
        self._stream: torch.cuda.Stream | None = None  # the copies out (GPU)
        self._out_done: torch.cuda.Event | None = None  # recorded after the latest of them
        self._seconds = 0.0  # of the batches counted so far

    @property
    def host(self) -> torch.Tensor:
        """The host slots ``[num_slots, num_layers, 2, ...page]``, allocated on first use."""
        if self._host is None:
            self._host = torch.empty(self._shape, dtype=self.pool.dtype, pin_memory=self.pool.device.type == "cuda")
        return self._host

    @property
    def num_held(self) -> int:
        """Slots some swapped sequence holds."""
        return sum(r > 0 for r in self._ref)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def bytes_out(self) -> int:
        return self.pages_out * self.page_bytes

    @property
    def bytes_in(self) -> int:
        return self.pages_in * self.page_bytes

    def fork(self, swapped: SwappedPages) -> SwappedPages:
        """A second holder of the same host pages (a swapped sequence's fork)."""
        for slot in swapped.slots:
            self._ref[slot] += 1
        return SwappedPages(list(swapped.slots), list(swapped.full))

    def seconds(self) -> float:
        """Time the copies took so far: per batch, GPU time from its start to the later of
        its end on the step's stream and the end of its copies out (waits for the last of
        them), or host time on a CPU."""
        self._count(wait=True)
        return self._seconds

    def _count(self, *, wait: bool) -> None:
        """Add the batches whose copies are done (all of them, waiting, with ``wait``) to
        the time counted, and forget their events."""
        while self._events:
            start, *ends = self._events[0]
            ends = [e for e in ends if e is not None]
            if not wait and not all(e.query() for e in ends):
                return
            for e in ends:
                e.synchronize()
            self._seconds += max(start.elapsed_time(e) for e in ends) / 1e3
            self._events.pop(0)

    # ---- out ------------------------------------------------------------------------

    def _known(self, page: int) -> int | None:
        """The slot that holds ``page``'s current content, if any (see the module docstring)."""
        hit = self._slot_of.get(page)
        if hit is None:
            return None
        slot, gen, full = hit
        if self._ref[slot] == 0 or gen != self.pool.generation(page):
            return None
        if not full and not any(p == page and s == slot for p, s in self._out):
            return None  # a partly filled page copied in an earlier step may have changed since
        return slot

    def swap_out(self, pages: list[int], num_tokens: int) -> SwappedPages | None:
        """Take host slots for a sequence's ``pages`` (its first ``num_tokens`` tokens'
        K/V) and queue their copies; None (nothing taken) when the slots run out. The
        caller then drops its references to the device pages."""
        ps = self.pool.page_size
        full = [(i + 1) * ps <= num_tokens for i in range(len(pages))]
        known = [self._known(p) for p in pages]
        if sum(k is None for k in known) > len(self._free):
            return None
        slots = []
        for page, slot, is_full in zip(pages, known, full):
            if slot is None:
                slot = self._free.pop()
                self._out.append((page, slot))
                gen = self.pool.generation(page)
                self._slot_of[page] = (slot, gen, is_full)
                self._origin[slot] = (page, gen, is_full)
                self.pages_out += 1
            self._ref[slot] += 1
            slots.append(slot)
        return SwappedPages(slots, full)

    # ---- in -------------------------------------------------------------------------

    def _resident(self, slot: int) -> int | None:
        """The device page still holding ``slot``'s content (a full page, allocated since)."""
        page, gen, full = self._origin[slot]
        if full and self.pool.refcount(page) > 0 and self.pool.generation(page) == gen:
            return page
        return None

    def pages_to_swap_in(self, swapped: SwappedPages) -> int:
        """Available pages :meth:`swap_in` would use up: fresh pages for the slots whose
        page is gone, and the resident pages that are only cached (evictable) now."""
        resident = [self._resident(s) for s in swapped.slots]
        return sum(p is None or self.cache.evictable(p) for p in resident)

    def swap_in(self, swapped: SwappedPages) -> list[int] | None:
        """Device pages holding ``swapped`` again: resident full pages shared, the others
        fresh pages with their copies queued; the slots' references are dropped. None
        (nothing taken) when the pool cannot give the fresh pages."""
        resident = [self._resident(s) for s in swapped.slots]
        kept = [p for p in resident if p is not None]
        self.cache.fork(kept)  # pinned first: the allocation below may evict cached pages
        need = sum(p is None for p in resident)
        if need > self.cache.num_available:
            self.cache.release(kept)
            return None
        fresh = iter(self.cache.allocate(need))
        pages = []
        for slot, page, full in zip(swapped.slots, resident, swapped.full):
            if page is None:
                page = next(fresh)
                self._in.append((slot, page))
                self.pages_in += 1
                if full:  # the new page holds the slot's content now: later holders share it
                    gen = self.pool.generation(page)
                    self._origin[slot] = (page, gen, True)
                    self._slot_of[page] = (slot, gen, True)
            pages.append(page)
        self.drop(swapped)
        return pages

    def drop(self, swapped: SwappedPages) -> None:
        """Drop ``swapped``'s slot references (a swap-in, or a swapped sequence that ends)."""
        for slot in swapped.slots:
            self._ref[slot] -= 1
            if self._ref[slot] == 0:
                self._freed.append(slot)
        swapped.slots, swapped.full = [], []

    # ---- the copies -------------------------------------------------------------------

    def flush(self) -> None:
        """Enqueue the step's copies (out before in), then release the freed slots."""
        if self._out or self._in:
            self._timed(self._copy_out, self._copy_in)
        for page in [p for p, (s, _, full) in self._slot_of.items() if not full or self._ref[s] == 0]:
            del self._slot_of[page]  # partly filled pages may change from now on
        for slot in self._freed:
            if self._ref[slot] == 0:
                self._origin.pop(slot, None)
                self._free.append(slot)
        self._freed.clear()

    def flush_out(self) -> None:
        """Enqueue the copies out queued so far: before anything writes a device page out
        of step order (a copy-on-write while the step is planned may reuse a page a
        victim just gave up)."""
        if self._out:
            self._timed(self._copy_out)

    def _timed(self, *copies) -> None:
        cuda = self.pool.device.type == "cuda"
        if cuda:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            before = self._out_done
        else:
            t0 = time.perf_counter()
        for copy in copies:
            copy()
        if cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            side = self._out_done if self._out_done is not before else None  # this batch's copies out
            self._count(wait=False)  # so that the events kept stay few over a long run
            self._events.append((start, end, side))
        else:
            self._seconds += time.perf_counter() - t0

    def _copy_out(self) -> None:
        """The gather runs on the current stream (before the step can reuse the pages);
        on a GPU its copy to the host runs on a stream of its own, beside the step."""
        if not self._out:
            return
        self._out.sort(key=lambda ps: ps[1])
        src = torch.tensor([p for p, _ in self._out], dtype=torch.long).to(self.pool.device, non_blocking=True)
        staged = self.pool.cache.index_select(1, src).transpose(0, 1).contiguous()  # [n, layers, 2, ...]
        runs = list(_runs([s for _, s in self._out]))
        self._out.clear()
        if self.pool.device.type != "cuda":
            for i, j, first in runs:
                self.host[first:first + j - i].copy_(staged[i:j])
            return
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.pool.device)
        # After the gather and everything before it (earlier copies in of the same slots).
        self._stream.wait_stream(torch.cuda.current_stream(self.pool.device))
        with torch.cuda.stream(self._stream):
            for i, j, first in runs:
                self.host[first:first + j - i].copy_(staged[i:j], non_blocking=True)
            self._out_done = torch.cuda.Event(enable_timing=True)
            self._out_done.record()
        staged.record_stream(self._stream)  # its memory stays reserved until those copies are done

    def _copy_in(self) -> None:
        if not self._in:
            return
        if self._out_done is not None:  # a slot copied out beside an earlier step may be read now
            torch.cuda.current_stream(self.pool.device).wait_event(self._out_done)
        self._in.sort()
        staged = torch.empty((len(self._in), *self.host.shape[1:]), dtype=self.host.dtype, device=self.pool.device)
        for i, j, first in _runs([s for s, _ in self._in]):
            staged[i:j].copy_(self.host[first:first + j - i], non_blocking=True)
        dst = torch.tensor([p for _, p in self._in], dtype=torch.long).to(self.pool.device, non_blocking=True)
        self.pool.cache.index_copy_(1, dst, staged.transpose(0, 1))
        self._in.clear()


def _runs(slots: list[int]):
    """``(i, j, slots[i])`` for each run ``slots[i:j]`` of consecutive slot numbers."""
    i = 0
    for j in range(1, len(slots) + 1):
        if j == len(slots) or slots[j] != slots[j - 1] + 1:
            yield i, j, slots[i]
            i = j


_LOG = logging.getLogger("cascadeinfer.engine")

PREEMPTION_MODES = ("auto", "swap", "recompute")


class SwapPolicy:
    """Swap or recompute a victim: ``"swap"`` or ``"recompute"`` always, or ``"auto"``:
    swap when copying its pages out and back (at the host link's measured bandwidth) is
    faster than recomputing its tokens (``flops_per_token`` at the measured matmul rate
    of the model's dtype). The two rates are measured once, on the first preemption.
    """

    def __init__(self, mode: str, *, page_bytes: int, flops_per_token: float, device: torch.device,
                 dtype: torch.dtype) -> None:
        if mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode: expected one of {PREEMPTION_MODES}, got {mode!r}")
        self.mode = mode
        self.page_bytes = page_bytes
        self.flops_per_token = flops_per_token
        self.device, self.dtype = device, dtype
        self.copy_bytes_per_s: float | None = None
        self.flops_per_s: float | None = None

    def prefers_swap(self, num_pages: int, num_tokens: int) -> bool:
        if self.mode != "auto":
            return self.mode == "swap"
        if self.copy_bytes_per_s is None:
            self.copy_bytes_per_s, self.flops_per_s = _measure(self.device, self.dtype)
            _LOG.info("preemption: host copies at %.1f GB/s, matmuls at %.1f TFLOP/s",
                      self.copy_bytes_per_s / 1e9, self.flops_per_s / 1e12)
        copy_s = 2 * num_pages * self.page_bytes / self.copy_bytes_per_s
        return copy_s < num_tokens * self.flops_per_token / self.flops_per_s


def _measure(device: torch.device, dtype: torch.dtype) -> tuple[float, float]:
    """(host <-> device copy bytes/s, one direction; matmul FLOP/s) on ``device``, the best
    of three timings each (a few tens of ms in all)."""
    cuda = device.type == "cuda"
    n = 1 << 24  # 64 MiB of float32
    host = torch.empty(n, pin_memory=cuda)
    dev = torch.empty(n, device=device)
    m = 2048 if cuda else 256
    a = torch.randn(m, m, device=device, dtype=dtype)

    def best(fn) -> float:
        times = []
        for _ in range(3):
            if cuda:
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            fn()
            if cuda:
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
        return min(times)

    copy_s = best(lambda: (dev.copy_(host, non_blocking=True), host.copy_(dev, non_blocking=True))) / 2
    mm_s = best(lambda: a @ a)
    return 4 * n / copy_s, 2 * m ** 3 / mm_s
