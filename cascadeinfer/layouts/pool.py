"""The paged KV pool: one cache tensor for every layer, and a host-side page allocator.

Storage. One tensor holds the K and V pages of all layers:

    NHD: [num_layers, num_pages, 2, page_size, num_kv_heads, head_dim]
    HND: [num_layers, num_pages, 2, num_kv_heads, page_size, head_dim]

``pool.layer(i)`` is layer ``i``'s slice, a view in the single-tensor form every kernel
takes (``[num_pages, 2, ...]``). Page ``p`` means the same slot range in every layer, so
one page table serves the whole model.

Ownership. The allocator lives on the host and counts references per page. Whoever holds
a page number holds one reference to it:

* :meth:`PagedKVPool.allocate` hands out fresh pages with refcount 1 (all-or-nothing).
* :meth:`PagedKVPool.fork` adds one reference per listed page: a second sequence now
  shares those pages (a shared prefix). Shared pages must be treated as read-only.
* :meth:`PagedKVPool.free` drops one reference per listed page; a page goes back to the
  free list when its count reaches 0. Freeing a page that is already free raises.
* :meth:`PagedKVPool.copy_on_write` is what a holder calls before writing into pages it
  may share: every listed page with refcount > 1 is replaced by a private copy (all
  layers, K and V, in one call of the pool's page copy) and the holder's reference to the
  original is dropped. Pages it already owns alone are returned unchanged.

Every operation checks its whole argument first and either succeeds completely or raises
leaving the pool exactly as it was: running out of pages raises :class:`OutOfPagesError`
(a ``RuntimeError``), bad page numbers raise ``ValueError``. The cache contents of a
freshly allocated page are whatever was there before (zeros for a new pool).
"""

from __future__ import annotations

import operator
from collections import Counter
from collections.abc import Callable, Iterable, Sequence

import torch

from cascadeinfer._checks import FLOAT_DTYPES
from cascadeinfer.layouts.page_table import PageTable
from cascadeinfer.layouts.paged_cache import check_kv_layout


def copy_pages_torch(cache: torch.Tensor, src_pages: torch.Tensor, dst_pages: torch.Tensor) -> None:
    """Page ``src_pages[c]`` onto page ``dst_pages[c]`` of ``cache`` ``[num_layers,
    num_pages, ...]`` in every layer, by a torch gather and scatter: the pool's default
    copy (an engine passes :func:`cascadeinfer.kernels.copy_pages`, one Triton launch).
    The pool's bookkeeping guarantees pages inside the pool, destinations distinct and
    disjoint from the sources."""
    cache[:, dst_pages.long()] = cache[:, src_pages.long()]


class OutOfPagesError(RuntimeError):
    """The pool has fewer free pages than an operation needs; the pool is unchanged."""

    def __init__(self, requested: int, free: int, num_pages: int, what: str = "allocate") -> None:
        self.requested = requested
        self.free = free
        self.num_pages = num_pages
        super().__init__(
            f"PagedKVPool.{what}: needs {requested} free pages but only {free} of {num_pages} are free"
        )


class PagedKVPool:
    """A paged KV cache for ``num_layers`` layers plus the allocator of its pages.

    ``PagedKVPool(num_layers, num_pages, page_size, num_kv_heads, head_dim, *, dtype,
    device, kv_layout="NHD", copy_pages=None)`` allocates ``cache`` (zeros) in the shape
    given in the module docstring; see there for the ownership model. ``layer(i)`` is the
    per-layer view kernels take. The allocator is plain host state (not thread-safe); it
    never touches the device except to copy pages in :meth:`copy_on_write`, through
    ``copy_pages(cache, src_pages, dst_pages)`` (int32 page ids on the cache's device;
    default :func:`copy_pages_torch`; an engine passes the one-launch Triton copy,
    ``functools.partial(cascadeinfer.kernels.copy_pages, validate=False)``).
    """

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        kv_layout: str = "NHD",
        copy_pages: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None] | None = None,
    ) -> None:
        for name, value in (("num_layers", num_layers), ("num_pages", num_pages), ("page_size", page_size),
                            ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
            if value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value}")
        if dtype not in FLOAT_DTYPES:
            raise TypeError(f"dtype: expected one of {FLOAT_DTYPES}, got {dtype}")
        self.kv_layout = check_kv_layout(kv_layout)
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        inner = (page_size, num_kv_heads) if kv_layout == "NHD" else (num_kv_heads, page_size)
        self.cache = torch.zeros(
            (num_layers, num_pages, 2, *inner, head_dim), dtype=dtype, device=device
        )
        self._refcount = [0] * num_pages
        # Bumped each time a page is handed out: (page, generation) names one content
        # lifetime of a page, so a copy of it made elsewhere (a swap) can tell whether the
        # page still holds what was copied.
        self._generation = [0] * num_pages
        # A stack: pop() hands out low page numbers first; freed pages are reused first.
        self._free = list(range(num_pages - 1, -1, -1))
        # When a list: every page copy copy_on_write makes, as (source, copy) (an engine
        # whose other processes hold other heads of the same pages repeats them there).
        self.copy_log: list[tuple[int, int]] | None = None
        # copy_on_write's device copy: (cache, src_pages, dst_pages) with int32 page ids.
        self._copy_pages = copy_pages_torch if copy_pages is None else copy_pages

    # ---- storage -----------------------------------------------------------------

    @property
    def dtype(self) -> torch.dtype:
        return self.cache.dtype

    @property
    def device(self) -> torch.device:
        return self.cache.device

    def layer(self, i: int) -> torch.Tensor:
        """Layer ``i``'s cache as one tensor ``[num_pages, 2, ...]`` (a view, not a copy)."""
        i = operator.index(i)
        if not 0 <= i < self.num_layers:
            raise IndexError(f"layer: index {i} out of range for {self.num_layers} layers")
        return self.cache[i]

    # ---- allocator ---------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self._free)

    def free_pages(self) -> list[int]:
        """The free page numbers (a copy, in the order they will be handed out last-first)."""
        return list(self._free)

    def refcount(self, page: int) -> int:
        """References held on ``page`` (0 when free)."""
        return self._refcount[self._page("page", page, None)]

    def generation(self, page: int) -> int:
        """How many times ``page`` has been handed out by :meth:`allocate`: while a page
        stays allocated its generation stays, and it changes when the page is reused."""
        return self._generation[self._page("page", page, None)]

    def allocate(self, n: int) -> list[int]:
        """``n`` fresh pages, each with refcount 1. All or nothing: raises
        :class:`OutOfPagesError` (pool unchanged) when fewer than ``n`` are free."""
        if isinstance(n, bool) or not isinstance(n, int):
            raise TypeError(f"n: expected an int, got {type(n).__name__}")
        if n < 0:
            raise ValueError(f"n: expected a non-negative number of pages, got {n}")
        if n > len(self._free):
            raise OutOfPagesError(n, len(self._free), self.num_pages)
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._refcount[p] = 1
            self._generation[p] += 1
        return pages

    def fork(self, pages: Iterable[int]) -> list[int]:
        """Add one reference to each listed page (sharing); returns the pages as a list.

        Every page must be allocated; a page listed twice gains two references.
        """
        pages = self._pages(pages)
        self._require_allocated(pages)
        refcount = self._refcount
        for p in pages:
            refcount[p] += 1
        return pages

    def free(self, pages: Iterable[int]) -> None:
        """Drop one reference per listed page; pages reaching 0 return to the free list.

        Raises ``ValueError`` (pool unchanged) if a page would drop below zero references,
        e.g. freeing a free page or listing a page more times than it is referenced.
        """
        pages = self._pages(pages)
        refcount = self._refcount
        # The common case, every page listed once and held, in one pass; else count them.
        if not all(refcount[p] for p in pages) or len(set(pages)) != len(pages):
            for p, count in Counter(pages).items():
                if refcount[p] < count:
                    raise ValueError(
                        f"pages: page {p} is freed {count} time(s) but holds {refcount[p]} reference(s)"
                    )
        self._release(pages)

    def copy_on_write(self, pages: Iterable[int]) -> list[int]:
        """Make the caller the sole owner of each listed page; returns the new page list.

        Pages are handled in order: a page whose refcount is > 1 (counting the references
        this call has already dropped, so a page listed twice by its two holders is copied
        once) is replaced by a fresh page holding a copy of its contents in every layer
        (K and V), and one reference to the original is dropped; a page whose reference is
        the caller's alone is kept.
        All copies go to the pool's page copy at once. All or nothing: raises
        :class:`OutOfPagesError` (pool and cache unchanged) when there are not enough
        free pages for the copies, ``ValueError`` for pages that are not allocated.
        """
        pages = self._pages(pages)
        self._require_allocated(pages)
        # Plan without touching the pool, so that failing leaves it as it was.
        pending = Counter()
        needs_copy = []
        for p in pages:
            needs_copy.append(self._refcount[p] - pending[p] > 1)
            if needs_copy[-1]:
                pending[p] += 1
        num_copies = sum(needs_copy)
        if num_copies > len(self._free):
            raise OutOfPagesError(num_copies, len(self._free), self.num_pages, "copy_on_write")
        if num_copies == 0:
            return pages
        free_before = list(self._free)
        fresh = self.allocate(num_copies)
        src = [p for p, copy in zip(pages, needs_copy) if copy]
        try:
            idx = torch.tensor([src, fresh], dtype=torch.int32).to(self.device)
            self._copy_pages(self.cache, idx[0], idx[1])
        except BaseException:
            for p in fresh:  # undo the allocation exactly, free-list order included
                self._refcount[p] = 0
            self._free = free_before
            raise
        self._release(src)
        if self.copy_log is not None:
            self.copy_log.extend(zip(src, fresh))
        it = iter(fresh)
        return [next(it) if copy else p for p, copy in zip(pages, needs_copy)]

    def page_table(
        self, page_lists: Sequence[Sequence[int]], seq_lens: Sequence[int] | torch.Tensor
    ) -> PageTable:
        """A :class:`PageTable` over this pool (on its device) from host page lists."""
        return PageTable.from_page_lists(
            page_lists, seq_lens, self.page_size, num_pages=self.num_pages, device=self.device
        )

    # ---- internals ---------------------------------------------------------------

    def _page(self, name: str, page: object, i: int | None) -> int:
        what = name if i is None else f"{name}: entry {i}"
        if isinstance(page, bool):
            raise TypeError(f"{what} is a bool, expected a page number")
        try:
            p = operator.index(page)
        except TypeError:
            raise TypeError(f"{what} is {type(page).__name__}, expected a page number") from None
        if not 0 <= p < self.num_pages:
            raise ValueError(f"{what} is page {p}, outside the pool of {self.num_pages} pages")
        return p

    def _pages(self, pages: Iterable[int]) -> list[int]:
        if isinstance(pages, torch.Tensor):
            pages = pages.tolist()
        pages = list(pages)
        # An engine passes hundreds of plain ints per call: checked in bulk, one by one only
        # to name what is wrong.
        if pages and all(type(p) is int for p in pages) and 0 <= min(pages) and max(pages) < self.num_pages:
            return pages
        return [self._page("pages", p, i) for i, p in enumerate(pages)]

    def _require_allocated(self, pages: list[int]) -> None:
        if all(self._refcount[p] for p in pages):
            return
        for i, p in enumerate(pages):
            if self._refcount[p] == 0:
                raise ValueError(f"pages: page {p} at position {i} is free (not allocated)")

    def _release(self, pages: list[int]) -> None:
        """Drop one reference per page (checked by the caller); free those reaching 0."""
        refcount, free = self._refcount, self._free
        for p in pages:
            refcount[p] -= 1
            if refcount[p] == 0:
                free.append(p)

    def __repr__(self) -> str:
        return (
            f"PagedKVPool(num_layers={self.num_layers}, num_pages={self.num_pages}, "
            f"page_size={self.page_size}, num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"dtype={self.dtype}, device={self.device}, kv_layout={self.kv_layout!r}, "
            f"num_free={self.num_free})"
        )
