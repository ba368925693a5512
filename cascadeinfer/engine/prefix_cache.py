"""Pages of the KV pool, shared by content: the engine's block manager.

Every page operation of the engine goes through :class:`PrefixCache`, which sits on top of
:class:`~cascadeinfer.layouts.pool.PagedKVPool` and its reference counts:

* A sequence holds one reference on each of its pages.
* A **full** page whose K/V are computed is identified by a hash chain,
  ``h_i = blake2b(h_{i-1} || tokens of page i)``, so equal hashes mean equal prefixes. The
  cache keeps its own reference on such a page and maps ``h_i -> page``. A new sequence
  whose prompt hashes hit takes a reference on those pages instead of computing them
  (after checking that the page's tokens really are its tokens).
* A cached page that no sequence holds (refcount 1: the cache's) is *evictable*. When
  the pool runs short, evictable pages go back to it, least recently released first.
  Releasing pages in reverse order makes a prefix's tail older than its head, so tails
  are evicted first.
* Pages another sequence is computing right now are *pending*: a request that would hit
  them waits a step rather than computing the same prefix again.
* Sharing is read-only: before a sequence writes into a page it shares (the last, partly
  filled page after ``fork`` for n > 1 samples), :meth:`copy_on_write` gives it a copy.

Only full pages are ever cached, and a hit never covers a prompt's last token (its
logits are needed), so a cached page is never written again.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable

from cascadeinfer.engine.sequence import Sequence
from cascadeinfer.layouts.pool import OutOfPagesError, PagedKVPool


def page_hash(prev: bytes, tokens: list[int]) -> bytes:
    """Link of the hash chain: the previous page's hash and this page's token ids."""
    return hashlib.blake2b(prev + array("q", tokens).tobytes(), digest_size=16).digest()


class PrefixCache:
    """Allocation, sharing and eviction of pool pages (see the module docstring).

    ``enabled=False`` turns off content sharing (no hashing, nothing cached); allocation,
    fork and copy-on-write still go through here.
    """

    def __init__(self, pool: PagedKVPool, *, enabled: bool = True) -> None:
        self.pool = pool
        self.page_size = pool.page_size
        self.enabled = enabled
        self._page_of: dict[bytes, int] = {}  # hash -> cached page
        self._entry: dict[int, tuple[bytes, tuple[int, ...]]] = {}  # cached page -> (hash, tokens)
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, refcount 1; oldest first
        self._pending: dict[bytes, int] = {}  # hash -> seq_id of the sequence computing it
        self._waits_for: dict[int, bytes] = {}  # seq_id -> the pending hash it waited for last
        self.hits = 0  # pages served from the cache (statistics)
        self.copies = 0  # shared pages copied before a write (statistics)

    # ---- capacity ----------------------------------------------------------------------

    @property
    def num_available(self) -> int:
        """Pages an allocation can get: free ones plus evictable cached ones."""
        return self.pool.num_free + len(self._evictable)

    @property
    def num_cached(self) -> int:
        return len(self._entry)

    def allocate(self, n: int) -> list[int]:
        """``n`` fresh pages (refcount 1), evicting cached pages as needed.

        Raises :class:`OutOfPagesError` (nothing evicted) when fewer are available.
        """
        if n > self.num_available:
            raise OutOfPagesError(n, self.num_available, self.pool.num_pages)
        self._evict(n - self.pool.num_free)
        return self.pool.allocate(n)

    def release(self, pages: list[int]) -> None:
        """Drop one reference per page (a sequence finished or was preempted)."""
        self.pool.free(pages)
        self._maybe_evictable(reversed(pages))

    def evictable(self, page: int) -> bool:
        """Whether ``page`` is cached and held by no sequence (it counts as available)."""
        return page in self._evictable

    def fork(self, pages: list[int]) -> list[int]:
        """One more reference on each page (a second holder); they become read-only."""
        self.pool.fork(pages)
        for p in pages:
            self._evictable.pop(p, None)
        return list(pages)

    def copy_on_write(self, page: int) -> int:
        """A page the caller may write: ``page`` itself when the caller is its only holder,
        else a fresh copy (the caller's reference to ``page`` is dropped)."""
        if self.pool.refcount(page) == 1:
            return page
        if self.pool.num_free == 0:
            self._evict(1)
        new = self.pool.copy_on_write([page])[0]
        self.copies += 1
        self._maybe_evictable([page])
        return new

    def _maybe_evictable(self, pages: Iterable[int]) -> None:
        """Make the cached ones among ``pages`` that only the cache holds now evictable,
        the last listed most recently released."""
        if not self._entry:
            return
        # The pool's counts read directly: the pages were just checked by the pool, and an
        # engine releases hundreds at once.
        entry, evictable, refcount = self._entry, self._evictable, self.pool._refcount
        for p in pages:
            if p in entry and refcount[p] == 1:
                evictable[p] = None
                evictable.move_to_end(p)

    def _evict(self, n: int) -> None:
        for _ in range(max(0, n)):
            page, _ = self._evictable.popitem(last=False)
            h, _ = self._entry.pop(page)
            del self._page_of[h]
            self.pool.free([page])

    def reset(self) -> None:
        """Forget every cached page no sequence holds (e.g. between benchmark runs)."""
        self._evict(len(self._evictable))

    # ---- content sharing ---------------------------------------------------------------

    def _hashes(self, seq: Sequence, count: int) -> list[bytes]:
        """The first ``count`` links of ``seq``'s hash chain (extended as needed)."""
        ps = self.page_size
        hashes = seq.page_hashes
        while len(hashes) < count:
            i = len(hashes)
            hashes.append(page_hash(hashes[-1] if i else b"", seq.tokens[i * ps:(i + 1) * ps]))
        return hashes[:count]

    def match(self, seq: Sequence) -> tuple[list[int], bool]:
        """Cached pages of ``seq``'s leading full pages, and whether it should wait.

        At most ``(num_tokens - 1) // page_size`` pages are matched, so the last token is
        always computed. Returns ``(pages, blocked)``: ``blocked`` (and no pages) when the
        first page that misses is being computed by another sequence right now. Takes no
        references. A sequence asking again while that page is still being computed is
        answered at once, without walking its chain (many may wait for one prefix).
        """
        if not self.enabled:
            return [], False
        waited = self._waits_for.pop(seq.seq_id, None)
        if waited is not None and self._pending.get(waited, seq.seq_id) != seq.seq_id:
            self._waits_for[seq.seq_id] = waited
            return [], True
        ps = self.page_size
        pages: list[int] = []
        for i, h in enumerate(self._hashes(seq, (seq.num_tokens - 1) // ps)):
            page = self._page_of.get(h)
            if page is None or self._entry[page][1] != tuple(seq.tokens[i * ps:(i + 1) * ps]):
                owner = self._pending.get(h)
                if owner is None or owner == seq.seq_id:
                    return pages, False
                self._waits_for[seq.seq_id] = h
                return [], True
            pages.append(page)
        return pages, False

    def claim_pending(self, seq: Sequence) -> None:
        """Mark ``seq``'s full pages past its cached ones as being computed by it."""
        if not self.enabled:
            return
        ps = self.page_size
        first = seq.num_computed // ps
        for h in self._hashes(seq, seq.num_tokens // ps)[first:]:
            if h not in self._page_of and h not in self._pending:
                self._pending[h] = seq.seq_id
                seq.pending_hashes.append(h)

    def drop_pending(self, seq: Sequence) -> None:
        for h in seq.pending_hashes:
            if self._pending.get(h) == seq.seq_id:
                del self._pending[h]
        seq.pending_hashes.clear()

    def register(self, seq: Sequence) -> None:
        """Offer ``seq``'s newly computed full pages to the cache (after a step)."""
        if not self.enabled:
            return
        ps = self.page_size
        full = seq.num_computed // ps
        if full <= seq.num_registered:
            return
        hashes = self._hashes(seq, full)
        for i in range(seq.num_registered, full):
            h, page = hashes[i], seq.pages[i]
            if self._pending.get(h) == seq.seq_id:
                del self._pending[h]
            if h in self._page_of or page in self._entry:
                continue  # the same content is cached already (or this page under another chain)
            self.pool.fork([page])  # the cache's own reference
            self._page_of[h] = page
            self._entry[page] = (h, tuple(seq.tokens[i * ps:(i + 1) * ps]))
        seq.num_registered = full
