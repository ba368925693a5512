"""Continuous batching: which sequences run in the next step, and with how many tokens.

Each step is planned in three passes under a token budget (``max_num_batched_tokens``)
and a sequence cap (``max_num_seqs``):

1. **Decode**: every running sequence with one token left gets it, oldest first. Its
   next token may need a fresh page, or a private copy of a shared last page. When the
   pool cannot give one, the youngest running sequence is preempted (all its pages
   released, back to the waiting queue), possibly the one asking.
2. **Prefill, continued**: running sequences in the middle of a long prompt get their
   next chunk, as far as budget and pages allow (no preemption for these).
3. **Admission** (unless this step preempted): waiting sequences, oldest first, reuse
   cached prefix pages and get their first chunk. Admission stops at the first one that
   does not fit. One whose next full page another sequence is computing right now (in
   this step or in an earlier chunk) is passed over: it stays first in line and hits the
   cache once those pages are in, so a prompt shared by many requests that arrive
   together is prefilled once. Requests behind it that share nothing with it go ahead.

A step therefore mixes prefill chunks and decode tokens. A preempted sequence keeps its
tokens. It is either *recomputed*: when it is admitted again its prefill recomputes
prompt and generated tokens; or *swapped* (:mod:`cascadeinfer.engine.swap`): its pages
are copied to host memory and back when it is admitted again (swapped sequences are
older than the waiting ones, so they come first), and it carries on where it stopped.
The :class:`~cascadeinfer.engine.swap.SwapPolicy` chooses; when the host slots run out, a
victim is recomputed instead (logged). Either way it then samples exactly as it would
have — outputs do not depend on preemption.

The scheduler counts the tokens each step computes (:meth:`Scheduler.advance`): prompt
tokens, all tokens, and the prompt tokens served from the prefix cache instead.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass, field

from cascadeinfer.engine.prefix_cache import PrefixCache
from cascadeinfer.engine.sequence import Sequence, Status
from cascadeinfer.engine.swap import SwapPolicy, SwapSpace

_LOG = logging.getLogger("cascadeinfer.engine")


@dataclass(slots=True)
class ScheduledBatch:
    """One step's work: prefill chunks ``(sequence, tokens)`` and decode sequences."""

    prefill: list[tuple[Sequence, int]] = field(default_factory=list)
    decode: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.prefill) + len(self.decode)

    def __bool__(self) -> bool:
        return bool(self.prefill or self.decode)


class Scheduler:
    """``swap``/``policy``: where preempted sequences may be swapped to and when (None:
    every preemption recomputes)."""

    def __init__(self, cache: PrefixCache, *, max_num_seqs: int, max_num_batched_tokens: int,
                 swap: SwapSpace | None = None, policy: SwapPolicy | None = None) -> None:
        self.cache = cache
        self.swap = swap
        self.policy = policy
        self.num_swapped_out = 0  # preemptions that swapped
        self.num_swap_fallbacks = 0  # swaps the policy chose that the host slots could not take
        self.page_size = cache.page_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: list[Sequence] = []  # sorted by seq_id
        self.running: list[Sequence] = []  # sorted by seq_id
        self.num_preemptions = 0
        # Statistics: tokens whose K/V steps computed (prompt positions among them, a
        # prompt recomputed after a preemption counted again), and prompt tokens whose
        # K/V came from the prefix cache instead.
        self.num_computed_tokens = 0
        self.num_computed_prompt_tokens = 0
        self.num_cached_prompt_tokens = 0

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        bisect.insort(self.waiting, seq, key=lambda s: s.seq_id)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- planning a step ---------------------------------------------------------------

    def _pages_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Fresh pages ``seq`` needs to hold ``num_tokens`` more tokens (copy-on-write included)."""
        ps = self.page_size
        need = -(-(seq.num_computed + num_tokens) // ps) - len(seq.pages)
        if seq.num_computed % ps and self.cache.pool.refcount(seq.pages[-1]) > 1:
            need += 1  # the partly filled last page is shared: it gets copied first
        return need

    def _fit(self, seq: Sequence, want: int) -> int:
        """The most tokens (<= ``want``) whose pages are available now."""
        ps = self.page_size
        spare = self.cache.num_available
        while want > 0 and self._pages_needed(seq, want) > spare:
            # Shrink to the end of the pages we can have; at least one page less each time.
            want = min(want - 1, (len(seq.pages) + spare) * ps - seq.num_computed)
        return max(0, want)

    def _reserve(self, seq: Sequence, num_tokens: int) -> None:
        """Make ``seq``'s pages cover ``num_tokens`` more tokens; the caller checked the count."""
        ps = self.page_size
        if seq.num_computed % ps:
            if self.swap is not None and self.cache.pool.refcount(seq.pages[-1]) > 1:
                self.swap.flush_out()  # the copy below may land on a page a victim gave up this step
            seq.pages[-1] = self.cache.copy_on_write(seq.pages[-1])
        need = -(-(seq.num_computed + num_tokens) // ps) - len(seq.pages)
        if need > 0:
            seq.pages.extend(self.cache.allocate(need))

    def preempt(self, seq: Sequence) -> None:
        """Release all of ``seq``'s pages and send it back to the waiting queue, its pages
        swapped out or to be recomputed (see the module docstring)."""
        self.running.remove(seq)
        swapped = None
        if self.swap is not None and seq.pages and self.policy.prefers_swap(len(seq.pages), seq.num_computed):
            swapped = self.swap.swap_out(seq.pages, seq.num_computed)
            if swapped is None:
                self.num_swap_fallbacks += 1
                log = _LOG.warning if self.num_swap_fallbacks == 1 else _LOG.info
                log("preemption: the host swap space is full (%d of %d slots free, %d pages to swap): "
                    "sequence %d will be recomputed instead (fallback %d)", self.swap.num_free,
                    self.swap.num_slots, len(seq.pages), seq.seq_id, self.num_swap_fallbacks)
        self.cache.release(seq.pages)
        self.cache.drop_pending(seq)
        seq.pages = []
        if swapped is None:
            seq.num_computed = 0
            seq.num_registered = 0
        else:
            seq.swapped = swapped
            self.num_swapped_out += 1
        self.num_preemptions += 1
        self.add(seq)

    def _swap_in(self, seq: Sequence, budget: int) -> int:
        """Bring a swapped ``seq`` back if its pages and its next token fit; the tokens it
        gets (0: it stays swapped, nothing taken)."""
        ps = self.page_size
        grow = max(0, -(-(seq.num_computed + 1) // ps) - len(seq.swapped.slots))
        if self.swap.pages_to_swap_in(seq.swapped) + grow > self.cache.num_available:
            return 0
        seq.pages = self.swap.swap_in(seq.swapped)
        seq.swapped = None
        n = self._fit(seq, min(seq.num_remaining, budget))
        if n == 0:  # the count above includes every page it takes
            raise RuntimeError(f"scheduler: sequence {seq.seq_id} was swapped in but its next token does not fit")
        return n

    def schedule(self) -> ScheduledBatch:
        """Plan the next step. Should every running sequence be stuck (prefills waiting for
        pages that other prefills hold), the youngest is preempted until one can move: the
        oldest alone always fits, since no request needs more pages than the pool has.
        Beams waiting for their siblings' rows (``Sequence.awaiting``) go first, youngest
        first: they have nothing to compute and lose only their cached K/V."""
        preempted = []
        while True:
            batch = self._schedule_once()
            batch.preempted[:0] = preempted
            if batch or not self.running:
                return batch
            victim = next((s for s in reversed(self.running) if s.awaiting), self.running[-1])
            self.preempt(victim)
            preempted.append(victim)

    def _schedule_once(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens

        ps, refcount = self.page_size, self.cache.pool.refcount
        for seq in list(self.running):  # 1. decode, oldest first
            if not seq.is_decode or seq.status is not Status.RUNNING or budget == 0:
                continue
            if seq.num_computed % ps and refcount(seq.pages[-1]) == 1:
                # The common case, taken first: the token goes into the room left in the
                # sequence's own last page, with nothing to allocate or copy (what
                # _pages_needed and _reserve below would find, for three pool lookups less).
                batch.decode.append(seq)
                budget -= 1
                continue
            while self._pages_needed(seq, 1) > self.cache.num_available:
                victim = self.running[-1]  # the youngest; unscheduled, or `seq` itself
                self.preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is Status.RUNNING:
                self._reserve(seq, 1)
                batch.decode.append(seq)
                budget -= 1

        for seq in self.running:  # 2. prefill chunks of running sequences
            if seq.is_decode or budget == 0:
                continue
            n = self._fit(seq, min(seq.num_remaining, budget))
            if n:
                self._reserve(seq, n)
                batch.prefill.append((seq, n))
                budget -= n

        # 3. admission; not in a step that preempted (the pages just freed went to an older
        # sequence; admitting the victim again at once would only redo its prefill)
        if batch.preempted:
            return batch
        for seq in list(self.waiting):
            if budget == 0 or len(self.running) >= self.max_num_seqs:
                break
            if seq.awaiting:  # nothing to compute until its beam search decides
                continue
            if seq.swapped is not None:
                n = self._swap_in(seq, budget)
                if n == 0:
                    break
                self._start(seq, n, batch)
                budget -= n
                continue
            hits, blocked = self.cache.match(seq)
            if blocked:
                continue  # its prefix is being computed: it waits for those pages, the others need not
            self.cache.fork(hits)
            seq.pages = hits
            seq.num_computed = len(hits) * self.page_size
            seq.num_registered = len(hits)  # pages (the hits are cached already), not tokens
            n = self._fit(seq, min(seq.num_remaining, budget))
            if n == 0:
                self.cache.release(hits)
                seq.pages, seq.num_computed, seq.num_registered = [], 0, 0
                break
            self.cache.hits += len(hits)
            self.num_cached_prompt_tokens += min(seq.num_computed, seq.prompt_len)
            self._start(seq, n, batch)
            budget -= n
        return batch

    def _start(self, seq: Sequence, n: int, batch: ScheduledBatch) -> None:
        """Admit waiting ``seq`` (holding its cached or swapped-in pages) with ``n`` tokens."""
        self._reserve(seq, n)
        self.waiting.remove(seq)
        seq.status = Status.RUNNING
        bisect.insort(self.running, seq, key=lambda s: s.seq_id)
        self.cache.claim_pending(seq)
        if n == 1 and seq.num_remaining == 1:
            batch.decode.append(seq)
        else:
            batch.prefill.append((seq, n))

    # ---- after a step ------------------------------------------------------------------

    def advance(self, batch: ScheduledBatch) -> None:
        """The step's tokens are in the cache: move ``num_computed`` on, offer full pages."""
        register = self.cache.register
        for seq, n in batch.prefill:
            self.num_computed_tokens += n
            self.num_computed_prompt_tokens += max(0, min(seq.num_computed + n, seq.prompt_len) - seq.num_computed)
            seq.num_computed += n
            register(seq)
        # Decode rows, one token each: the same, with the cache offered only the rows
        # whose computed tokens now fill a page it has not seen (what register checks first).
        ps = self.page_size
        self.num_computed_tokens += len(batch.decode)
        for seq in batch.decode:
            computed = seq.num_computed
            if computed < seq.prompt_len:
                self.num_computed_prompt_tokens += 1
            seq.num_computed = computed = computed + 1
            if computed // ps > seq.num_registered:
                register(seq)

    def fork(self, parent: Sequence) -> list[Sequence]:
        """Start ``parent``'s waiting samples: they share all its pages and progress."""
        children, parent.forks = parent.forks, []
        for child in children:
            child.pages = self.cache.fork(parent.pages)
            child.num_computed = parent.num_computed
            child.num_registered = parent.num_registered
            child.page_hashes = list(parent.page_hashes)
            if parent.swapped is not None:  # a swapped beam's continuation: swapped like it
                child.swapped = self.swap.fork(parent.swapped)
                self.add(child)
                continue
            child.status = Status.RUNNING
            bisect.insort(self.running, child, key=lambda s: s.seq_id)
        return children

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:  # preempted while its last token was on its way
            self.waiting.remove(seq)
        self.cache.release(seq.pages)
        self.cache.drop_pending(seq)
        seq.pages = []
        if seq.swapped is not None:
            self.swap.drop(seq.swapped)
            seq.swapped = None
