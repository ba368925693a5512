"""The paged KV pool: storage views, the refcounting allocator, copy-on-write, copy_pages."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from cascadeinfer.layouts.paged_cache import unpack_paged_kv_cache
from cascadeinfer.kernels.copy_pages import copy_pages, copy_pages_unchecked
from cascadeinfer.layouts.pool import OutOfPagesError, PagedKVPool, copy_pages_torch

DEVICE = (torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu"))


def _pool(device, *, layout="NHD", dtype=torch.float32, num_pages=8, num_layers=2):
    return PagedKVPool(num_layers, num_pages, 2, 2, 8, dtype=dtype, device=device, kv_layout=layout)


def _state(pool: PagedKVPool):
    return [pool.refcount(p) for p in range(pool.num_pages)], pool.free_pages(), pool.cache.clone()


def _assert_same_state(pool: PagedKVPool, before) -> None:
    refs, free, cache = before
    assert [pool.refcount(p) for p in range(pool.num_pages)] == refs
    assert pool.free_pages() == free
    assert torch.equal(pool.cache, cache)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_storage_shapes_and_layer_views(device, layout):
    pool = PagedKVPool(3, 5, 4, 2, 24, dtype=torch.bfloat16, device=device, kv_layout=layout)
    inner = (4, 2) if layout == "NHD" else (2, 4)
    assert pool.cache.shape == (3, 5, 2, *inner, 24) and pool.cache.dtype == torch.bfloat16
    assert pool.cache.is_contiguous() and pool.num_free == 5
    layer = pool.layer(1)
    assert layer.shape == (5, 2, *inner, 24)
    assert layer.data_ptr() == pool.cache[1].data_ptr()  # a view
    kv = unpack_paged_kv_cache(layer, layout)
    assert (kv.num_pages, kv.page_size, kv.num_kv_heads, kv.head_dim) == (5, 4, 2, 24)
    layer[2, 1].fill_(3.0)
    assert bool((pool.cache[1, 2, 1] == 3).all()) and bool((pool.cache[0] == 0).all())
    with pytest.raises(IndexError, match="layer: index 3"):
        pool.layer(3)


def test_constructor_rejects():
    with pytest.raises(ValueError, match="num_pages: expected a positive int, got 0"):
        PagedKVPool(1, 0, 4, 1, 8, dtype=torch.float16, device="cpu")
    with pytest.raises(TypeError, match="head_dim: expected an int"):
        PagedKVPool(1, 2, 4, 1, 8.0, dtype=torch.float16, device="cpu")
    with pytest.raises(TypeError, match="dtype: expected one of"):
        PagedKVPool(1, 2, 4, 1, 8, dtype=torch.int32, device="cpu")
    with pytest.raises(ValueError, match="kv_layout: expected 'NHD' or 'HND'"):
        PagedKVPool(1, 2, 4, 1, 8, dtype=torch.float16, device="cpu", kv_layout="NDH")


def test_allocator_basics(device):
    pool = _pool(device)
    a = pool.allocate(3)
    assert a == [0, 1, 2] and pool.num_free == 5
    assert [pool.refcount(p) for p in a] == [1, 1, 1] and pool.refcount(7) == 0
    assert pool.fork(a[:2]) == a[:2] and pool.refcount(0) == 2
    pool.free(a)
    assert [pool.refcount(p) for p in range(3)] == [1, 1, 0] and pool.num_free == 6
    assert pool.allocate(1) == [2]  # the freed page is reused first
    assert pool.allocate(0) == []
    pool.free([0, 1, 2])
    assert pool.num_free == 8 and sorted(pool.free_pages()) == list(range(8))
    assert pool.page_table([[1, 0]], [3]).kv_indices.device.type == device.type


def test_allocator_errors_leave_pool_unchanged(device):
    pool = _pool(device)
    a = pool.allocate(6)
    before = _state(pool)
    with pytest.raises(OutOfPagesError, match="needs 3 free pages but only 2 of 8 are free") as info:
        pool.allocate(3)
    assert isinstance(info.value, RuntimeError) and (info.value.requested, info.value.free) == (3, 2)
    _assert_same_state(pool, before)
    with pytest.raises(ValueError, match="pages: page 7 is freed 1 time"):
        pool.free([a[0], 7])  # 7 is free: nothing at all is freed
    with pytest.raises(ValueError, match="pages: page 0 is freed 2 time"):
        pool.free([0, 0])
    with pytest.raises(ValueError, match="pages: page 6 at position 1 is free"):
        pool.fork([0, 6])
    with pytest.raises(ValueError, match="pages: page 6 at position 0 is free"):
        pool.copy_on_write([6])
    with pytest.raises(ValueError, match="pages: entry 1 is page 9, outside the pool of 8 pages"):
        pool.free([0, 9])
    with pytest.raises(TypeError, match="pages: entry 0 is a bool"):
        pool.fork([True])
    with pytest.raises(ValueError, match="page is page -1"):
        pool.refcount(-1)
    with pytest.raises(ValueError, match="n: expected a non-negative"):
        pool.allocate(-1)
    _assert_same_state(pool, before)
    # copy_on_write needing 3 copies with 2 free pages: all or nothing
    pool.fork(a[:3])
    before = _state(pool)
    with pytest.raises(OutOfPagesError, match="copy_on_write: needs 3 free pages but only 2"):
        pool.copy_on_write(a)
    _assert_same_state(pool, before)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_copy_on_write_copies_every_layer(device, layout, dtype):
    pool = PagedKVPool(3, 10, 4, 2, 24, dtype=dtype, device=device, kv_layout=layout)
    pool.cache.copy_(torch.randn(pool.cache.shape, device=device).to(dtype))
    pool.cache[:, 9] = float("nan")  # a page that must stay untouched
    a = pool.allocate(4)
    pool.fork([a[1], a[3]])  # shared with a second owner
    pool.fork([a[3]])  # and a third
    before = pool.cache.clone()
    new = pool.copy_on_write(a)
    assert new[0] == a[0] and new[2] == a[2]  # sole owner: kept
    assert new[1] not in a and new[3] not in a and new[1] != new[3]
    assert [pool.refcount(p) for p in new] == [1, 1, 1, 1]
    assert pool.refcount(a[1]) == 1 and pool.refcount(a[3]) == 2
    expect = before.clone()
    expect[:, new[1]] = before[:, a[1]]
    expect[:, new[3]] = before[:, a[3]]
    torch.testing.assert_close(pool.cache, expect, rtol=0, atol=0, equal_nan=True)


def test_copy_on_write_duplicates_in_list(device):
    pool = _pool(device)
    (p,) = pool.allocate(1)
    pool.fork([p])
    new = pool.copy_on_write([p, p])  # two references held by this caller: one copy is enough
    assert new[1] == p and new[0] != p
    assert pool.refcount(p) == 1 and pool.refcount(new[0]) == 1


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_copy_on_write_through_the_kernel_copy(device, layout):
    """A pool given the Triton page copy (as the engine builds it) copies what the
    default torch copy copies, bit for bit, in every layer, K and V."""
    pools = [PagedKVPool(3, 8, 2, 2, 8, dtype=torch.bfloat16, device=device, kv_layout=layout, copy_pages=fn)
             for fn in (None, copy_pages_unchecked)]
    fill = torch.randn(pools[0].cache.shape, generator=torch.Generator().manual_seed(3)).to(device, torch.bfloat16)
    news = []
    for pool in pools:
        pool.cache.copy_(fill)
        a = pool.allocate(4)
        pool.fork(a[1:])
        news.append(pool.copy_on_write(a))
    assert news[0] == news[1]
    assert torch.equal(pools[0].cache, pools[1].cache)
    assert not torch.equal(pools[0].cache, fill)  # copies happened


def test_layouts_default_copy_matches_the_launcher(device):
    cache = torch.randn(2, 6, 2, 3, 2, 5, device=device)
    src, dst = (torch.tensor(x, dtype=torch.int32, device=device) for x in ([1, 3, 5], [4, 0, 2]))
    a, b = cache.clone(), cache.clone()
    copy_pages_torch(a, src, dst)
    copy_pages(b, src, dst)
    assert torch.equal(a, b)


def test_copy_pages_torch_path_matches(monkeypatch):
    """Plain CPU without the interpreter takes the torch path; same result."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    cache = torch.randn(2, 6, 2, 3, 2, 5)
    want = cache.clone()
    want[:, [4, 0]] = cache[:, [1, 3]]
    copy_pages(cache, torch.tensor([1, 3], dtype=torch.int32), torch.tensor([4, 0], dtype=torch.int32))
    assert torch.equal(cache, want)


def test_copy_pages_rejects(device):
    cache = torch.randn(2, 6, 2, 3, 2, 5, device=device)
    src = torch.tensor([1, 3], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="dst_pages: page 6 at position 1 is outside the pool of 6 pages"):
        copy_pages(cache, src, torch.tensor([0, 6], dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="dst_pages: destinations must be distinct"):
        copy_pages(cache, src, torch.tensor([0, 0], dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="dst_pages: a destination is also a source"):
        copy_pages(cache, src, torch.tensor([3, 0], dtype=torch.int32, device=device))
    with pytest.raises(TypeError, match="src_pages: expected dtype torch.int32"):
        copy_pages(cache, src.long(), src)
    with pytest.raises(ValueError, match=r"dst_pages: expected shape \[2\]"):
        copy_pages(cache, src, src[:1])
    with pytest.raises(ValueError, match="cache: each page must be contiguous"):
        copy_pages(cache.transpose(4, 5), src, torch.tensor([0, 2], dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="src_pages: expected a tensor on"):
        copy_pages(cache, src.to("meta"), src)


class PoolMachine(RuleBasedStateMachine):
    """Random allocate / free / fork / copy_on_write against a model of who holds what.

    The model is a list of holders, each a list of page numbers. Invariants: a page's
    refcount is the number of times holders list it; the free list is exactly the pages
    with refcount 0, without repeats; copy-on-write copies every layer's content exactly.
    """

    def __init__(self):
        super().__init__()
        self.pool = PagedKVPool(2, 10, 2, 1, 4, dtype=torch.float32, device=DEVICE)
        self.pool.cache.copy_(torch.randn(self.pool.cache.shape, device=DEVICE))
        self.holders: list[list[int]] = []

    @rule(n=st.integers(0, 5))
    def allocate(self, n):
        if n > self.pool.num_free:
            before = _state(self.pool)
            with pytest.raises(OutOfPagesError):
                self.pool.allocate(n)
            _assert_same_state(self.pool, before)
            return
        pages = self.pool.allocate(n)
        assert len(set(pages)) == n
        # fresh random content, so copies are distinguishable
        if pages:
            idx = torch.tensor(pages, device=DEVICE)
            self.pool.cache[:, idx] = torch.randn(self.pool.cache[:, idx].shape, device=DEVICE)
        self.holders.append(pages)

    @precondition(lambda self: self.holders)
    @rule(data=st.data())
    def free(self, data):
        i = data.draw(st.integers(0, len(self.holders) - 1))
        self.pool.free(self.holders.pop(i))

    @precondition(lambda self: self.holders)
    @rule(data=st.data())
    def fork(self, data):
        i = data.draw(st.integers(0, len(self.holders) - 1))
        self.holders.append(self.pool.fork(self.holders[i]))

    @precondition(lambda self: self.holders)
    @rule(data=st.data())
    def copy_on_write(self, data):
        i = data.draw(st.integers(0, len(self.holders) - 1))
        old = self.holders[i]
        counts = Counter(p for h in self.holders for p in h)
        need = sum(1 for p in old if counts[p] > 1)  # holders never list a page twice
        before = _state(self.pool)
        if need > self.pool.num_free:
            with pytest.raises(OutOfPagesError):
                self.pool.copy_on_write(old)
            _assert_same_state(self.pool, before)
            return
        new = self.pool.copy_on_write(old)
        assert len(new) == len(old)
        cache = before[2]
        for p, q in zip(old, new):
            if counts[p] > 1:
                assert q != p and counts[q] == 0
                assert torch.equal(self.pool.cache[:, q], cache[:, p])
            else:
                assert q == p
        untouched = [p for p in range(self.pool.num_pages) if p not in new or p in old]
        assert torch.equal(self.pool.cache[:, untouched], cache[:, untouched])
        self.holders[i] = new

    @precondition(lambda self: self.pool.num_free < self.pool.num_pages)
    @rule(data=st.data())
    def free_a_free_page_raises(self, data):
        free = self.pool.free_pages()
        if not free:
            return
        page = data.draw(st.sampled_from(free))
        before = _state(self.pool)
        with pytest.raises(ValueError):
            self.pool.free([page])
        _assert_same_state(self.pool, before)

    @invariant()
    def refcounts_match_holders(self):
        counts = Counter(p for h in self.holders for p in h)
        free = self.pool.free_pages()
        assert len(free) == len(set(free)) == self.pool.num_free
        for p in range(self.pool.num_pages):
            assert self.pool.refcount(p) == counts[p]
            assert (p in free) == (counts[p] == 0)


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
