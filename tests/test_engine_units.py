"""Engine parts on their own: cascade grouping, the prefix cache, the sampler."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cascadeinfer.engine.model_runner import _buckets, cascade_tables
from cascadeinfer.engine.prefix_cache import PrefixCache
from cascadeinfer.engine.sampling import SamplingParams, sample, sample_seed, sample_uniforms
from cascadeinfer.engine.sequence import Sequence
from cascadeinfer.layouts.pool import OutOfPagesError, PagedKVPool

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ---- cascade_tables ---------------------------------------------------------------------


def _check_tables(page_lists, last_lens, num_levels, page_size, order, levels):
    n = len(page_lists)
    assert sorted(order) == list(range(n)) and len(levels) == num_levels
    rows_pages = [[] for _ in range(n)]
    for lv in levels:
        assert lv.qo_indptr[0] == 0 and lv.qo_indptr[-1] == n
        assert len(lv.kv_indptr) == len(lv.qo_indptr) and len(lv.kv_last_page_len) == len(lv.qo_indptr) - 1
        assert lv.kv_indptr[-1] == len(lv.kv_indices)
        for g in range(len(lv.qo_indptr) - 1):
            pages = lv.kv_indices[lv.kv_indptr[g]:lv.kv_indptr[g + 1]]
            for i in range(lv.qo_indptr[g], lv.qo_indptr[g + 1]):
                rows_pages[order[i]] += pages
    last = levels[-1]
    assert last.qo_indptr == list(range(n + 1))
    assert last.kv_last_page_len == [last_lens[r] for r in order]
    assert rows_pages == page_lists  # the levels of a row are its pages, in order
    for lv in levels[:-1]:  # upper levels: full pages only, groups nest in the level above
        assert all(x in (0, page_size) for x in lv.kv_last_page_len)
    for upper, lower in zip(levels, levels[1:]):
        for start, end in zip(lower.qo_indptr[:-1], lower.qo_indptr[1:]):
            assert any(a <= start and end <= b for a, b in zip(upper.qo_indptr[:-1], upper.qo_indptr[1:]))


def test_cascade_tables_groups_shared_prefixes():
    rows = {"A": [1, 2, 3, 4, 10], "B": [1, 2, 3, 5, 11], "C": [1, 2, 6, 12], "D": [7, 8, 13], "E": [20],
            "F": [1, 2, 3, 4, 14]}
    names = list(rows)
    pages = list(rows.values())
    lens = [3, 1, 4, 2, 4, 1]
    order, levels = cascade_tables(pages, lens, 2, 4)
    _check_tables(pages, lens, 2, 4, order, levels)
    assert [names[r] for r in order] == ["A", "F", "B", "C", "E", "D"]
    assert levels[0].qo_indptr == [0, 4, 6] and levels[0].kv_indices == [1, 2]
    order3, levels3 = cascade_tables(pages, lens, 3, 4)
    _check_tables(pages, lens, 3, 4, order3, levels3)
    assert levels3[1].qo_indptr == [0, 3, 4, 6] and levels3[1].kv_indices == [3]
    flat_order, flat = cascade_tables(pages, lens, 1, 4)
    _check_tables(pages, lens, 1, 4, flat_order, flat)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_cascade_tables_property(data):
    # Requests share prefixes the way the engine makes them: a tree of page runs.
    page_size = data.draw(st.integers(1, 4))
    num_rows = data.draw(st.integers(1, 9))
    fresh = iter(range(10**6))
    prefixes = [[]]
    page_lists = []
    for _ in range(num_rows):
        base = data.draw(st.sampled_from(prefixes))
        cut = data.draw(st.integers(0, len(base)))
        own = [next(fresh) for _ in range(data.draw(st.integers(0, 3)))]
        shared = base[:cut] + own
        prefixes.append(shared)
        page_lists.append(shared + [next(fresh)])  # the last page is always the row's own
    lens = [data.draw(st.integers(1, page_size)) for _ in range(num_rows)]
    num_levels = data.draw(st.integers(1, 4))
    order, levels = cascade_tables(page_lists, lens, num_levels, page_size)
    _check_tables(page_lists, lens, num_levels, page_size, order, levels)


def test_graph_buckets():
    assert _buckets(1) == [1]
    assert _buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert _buckets(256)[-3:] == [224, 240, 256]


# ---- prefix cache ---------------------------------------------------------------------


def _seq(seq_id, tokens):
    return Sequence(seq_id, seq_id, 0, tokens, SamplingParams(), None)


def _pool(num_pages, page_size=2):
    return PagedKVPool(1, num_pages, page_size, 1, 4, dtype=torch.float32, device="cpu")


def _compute(cache, seq):
    """What the scheduler and a step do for a whole prompt: pages, then register."""
    seq.pages = cache.allocate(-(-seq.num_tokens // cache.page_size) - len(seq.pages)) if not seq.pages else \
        seq.pages + cache.allocate(-(-seq.num_tokens // cache.page_size) - len(seq.pages))
    cache.claim_pending(seq)
    seq.num_computed = seq.num_tokens
    cache.register(seq)


def test_prefix_cache_hits_verify_tokens_and_leave_the_last_token():
    cache = PrefixCache(_pool(16))
    a = _seq(0, [1, 2, 3, 4, 5, 6])
    _compute(cache, a)
    assert cache.num_cached == 3
    b = _seq(1, [1, 2, 3, 4, 5, 6])
    hits, blocked = cache.match(b)
    assert hits == a.pages[:2] and not blocked  # (6 - 1) // 2 pages: the last token is computed
    c = _seq(2, [1, 2, 3, 9, 5, 6])
    assert cache.match(c) == (a.pages[:1], False)
    # A forged entry with the right hash but other tokens is not a hit.
    page = a.pages[0]
    h, _ = cache._entry[page]
    cache._entry[page] = (h, (9, 9))
    assert cache.match(b) == ([], False)


def test_prefix_cache_pending_blocks_duplicate_work():
    cache = PrefixCache(_pool(16))
    a = _seq(0, [1, 2, 3, 4, 5])
    a.pages = cache.allocate(3)
    cache.claim_pending(a)  # a is computing pages [1,2] and [3,4]
    b = _seq(1, [1, 2, 3, 4, 7])
    assert cache.match(b) == ([], True)
    cache.drop_pending(a)  # a preempted before computing: b may go ahead
    assert cache.match(b) == ([], False)
    assert cache.match(_seq(2, [8, 8, 8])) == ([], False)
    disabled = PrefixCache(_pool(4), enabled=False)
    s = _seq(3, [1, 2, 3])
    _compute(disabled, s)
    assert disabled.num_cached == 0 and disabled.match(_seq(4, [1, 2, 3])) == ([], False)


def test_prefix_cache_eviction_is_lru_tails_first():
    pool = _pool(6)
    cache = PrefixCache(pool)
    a = _seq(0, [1, 2, 3, 4, 5, 6])
    _compute(cache, a)
    b = _seq(1, [7, 8, 9, 10])
    _compute(cache, b)
    assert pool.num_free == 1 and cache.num_available == 1
    cache.release(a.pages)  # a's pages stay cached: evictable now
    assert cache.num_available == 4 and pool.num_free == 1
    first, second, third = a.pages
    got = cache.allocate(2)  # the free page, then a's tail (released last-first)
    assert third in got and cache.match(_seq(2, [1, 2, 3, 4, 5, 6, 0]))[0] == [first, second]
    with pytest.raises(OutOfPagesError):
        cache.allocate(3)
    assert cache.num_available == 2  # nothing was evicted by the failed call
    cache.release(b.pages)
    cache.release(got)
    cache.reset()
    assert pool.num_free == 6 and cache.num_cached == 0


def test_copy_on_write_only_when_shared():
    pool = _pool(4)
    cache = PrefixCache(pool)
    [p] = cache.allocate(1)
    assert cache.copy_on_write(p) == p
    cache.fork([p])
    q = cache.copy_on_write(p)
    assert q != p and pool.refcount(p) == 1 and pool.refcount(q) == 1 and cache.copies == 1


# ---- sampler ---------------------------------------------------------------------------


def test_sampler_follows_the_distribution():
    torch.manual_seed(0)
    vocab, rows = 6, 4000
    logits = torch.randn(vocab).repeat(rows, 1)
    p = SamplingParams(temperature=0.7)
    tokens = sample(logits, [p] * rows, [sample_seed(5, r) for r in range(rows)], [0] * rows)
    freq = torch.bincount(tokens, minlength=vocab).double() / rows
    want = torch.softmax(logits[0].double() / 0.7, -1)
    assert (freq - want).abs().max() < 0.03
    # one row over its steps follows it too
    steps = sample(logits, [p] * rows, [5] * rows, list(range(rows)))
    freq = torch.bincount(steps, minlength=vocab).double() / rows
    assert (freq - want).abs().max() < 0.03


def test_sampler_top_k_top_p_and_greedy_rows():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]]).repeat(400, 1)
    seeds, steps = list(range(400)), [0] * 400
    top_k = sample(logits, [SamplingParams(temperature=5.0, top_k=2)] * 400, seeds, steps)
    assert set(top_k.tolist()) == {0, 1}
    probs = torch.softmax(logits[0], -1)
    top_p = sample(logits, [SamplingParams(temperature=1.0, top_p=float(probs[0] + 0.01))] * 400, seeds, steps)
    assert set(top_p.tolist()) == {0, 1}
    mixed = [SamplingParams(temperature=0.0), SamplingParams(temperature=100.0)]
    out = sample(logits[:2], mixed, [None, 0], [0, 0])
    assert out[0] == 0
    # per-row parameters in one batch: greedy, top-k 1, a nucleus of one token, free rows
    mixed = [SamplingParams(temperature=0.0), SamplingParams(temperature=3.0, top_k=1),
             SamplingParams(temperature=1.0, top_p=0.1), SamplingParams(temperature=50.0)] * 100
    out = sample(logits, mixed, seeds, steps).view(100, 4)
    assert (out[:, :3] == 0).all() and len(set(out[:, 3].tolist())) == 5
    with pytest.raises(ValueError, match="seeds: row 0"):
        sample(logits[:1], [SamplingParams(temperature=1.0)], [None], [0])
    with pytest.raises(ValueError, match="params, seeds, steps"):
        sample(logits[:2], [SamplingParams()] * 2, [1], [0, 0])


def test_sampler_never_picks_a_masked_token():
    """Zero-probability tokens span empty intervals of the CDF, at any u (0 and 1 - 2**-53)."""
    import cascadeinfer.engine.sampling as sampling  # noqa: PLC0415

    logits = torch.tensor([[-math.inf, 1.0, -math.inf, 1.0, -math.inf]] * 2)
    probs = logits.softmax(-1)
    got = sampling._inverse_cdf(probs, torch.tensor([0.0, 1.0 - 2.0**-53], dtype=torch.float64))
    assert got.tolist() == [1, 3]


def test_seeds_are_reproducible_and_distinct():
    logits = torch.randn(3, 50)
    params = [SamplingParams(temperature=1.0)] * 3
    draw = lambda seed: sample(logits, params, [sample_seed(seed, i) for i in range(3)], [0] * 3).tolist()  # noqa: E731
    assert draw(7) == draw(7)
    assert sample_seed(7, 0) == 7 and sample_seed(7, 1) != 8
    assert any(draw(7) != draw(s) for s in range(8, 12))
    assert math.isfinite(float(sample_seed(2**63 - 1, 3)))
    # a row's draw depends on its own seed and step only, not on its neighbours
    u = sample_uniforms([7, 8, 2**63 - 1], [0, 5, 10**9])
    assert torch.equal(u[1:2], sample_uniforms([8], [5])) and ((u >= 0) & (u < 1)).all()
    # the samples of one request are not shifted copies of one stream
    a = sample_uniforms([sample_seed(7, 1)] * 8, range(8))
    b = sample_uniforms([sample_seed(7, 0)] * 9, range(9))
    assert not torch.equal(a, b[1:])
    many = sample_uniforms(list(range(20000)), [3] * 20000)
    assert abs(float(many.mean()) - 0.5) < 0.01 and len(set(many.tolist())) == 20000


# ---- scheduler ---------------------------------------------------------------------------


def test_scheduler_unsticks_prefills_that_hold_every_page():
    from cascadeinfer.engine.scheduler import Scheduler  # noqa: PLC0415
    from cascadeinfer.engine.sequence import Status  # noqa: PLC0415

    cache = PrefixCache(_pool(6), enabled=False)
    sched = Scheduler(cache, max_num_seqs=4, max_num_batched_tokens=64)
    old, young = _seq(0, list(range(10))), _seq(1, list(range(10, 20)))
    for seq in (old, young):  # both half prefilled, the pool full
        seq.pages = cache.allocate(3)
        seq.num_computed = 6
        seq.status = Status.RUNNING
        sched.running.append(seq)
    batch = sched.schedule()
    assert batch.preempted == [young] and sched.num_preemptions == 1
    # the old one finishes its prompt; the young one restarts from token 0 in the page left
    assert batch.prefill == [(old, 4), (young, 2)] and len(old.pages) == 5 and len(young.pages) == 1
