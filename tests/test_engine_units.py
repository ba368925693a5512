"""Engine parts on their own: cascade grouping, the prefix cache, the sampler."""

from __future__ import annotations

import datetime
import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cascadeinfer.cascade.grouping import group_levels
from cascadeinfer.engine.model_runner import _buckets
from cascadeinfer.engine.prefix_cache import PrefixCache
from cascadeinfer.engine.sampling import SamplingParams, sample, sample_seed, sample_uniforms
from cascadeinfer.engine.sequence import Sequence
from cascadeinfer.layouts.pool import OutOfPagesError, PagedKVPool

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ---- group_levels -----------------------------------------------------------------------


def _lists(level):
    """A level's tables as host lists (what the checks below read)."""
    return SimpleNamespace(qo_indptr=level.qo_indptr.tolist(), kv_indptr=level.kv_indptr.tolist(),
                           kv_indices=level.kv_indices.tolist(), kv_last_page_len=level.kv_last_page_len.tolist())


def _check_tables(page_lists, last_lens, num_levels, page_size, order, levels):
    levels = [_lists(lv) for lv in levels]
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


def test_group_levels_groups_shared_prefixes():
    rows = {"A": [1, 2, 3, 4, 10], "B": [1, 2, 3, 5, 11], "C": [1, 2, 6, 12], "D": [7, 8, 13], "E": [20],
            "F": [1, 2, 3, 4, 14]}
    names = list(rows)
    pages = list(rows.values())
    lens = [3, 1, 4, 2, 4, 1]
    order, levels = group_levels(pages, lens, 2, 4)
    _check_tables(pages, lens, 2, 4, order, levels)
    assert [names[r] for r in order] == ["A", "F", "B", "C", "D", "E"]
    assert _lists(levels[0]).qo_indptr == [0, 4, 6] and _lists(levels[0]).kv_indices == [1, 2]
    order3, levels3 = group_levels(pages, lens, 3, 4)
    _check_tables(pages, lens, 3, 4, order3, levels3)
    assert _lists(levels3[1]).qo_indptr == [0, 3, 4, 6] and _lists(levels3[1]).kv_indices == [3]
    flat_order, flat = group_levels(pages, lens, 1, 4)
    _check_tables(pages, lens, 1, 4, flat_order, flat)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_group_levels_property(data):
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
    order, levels = group_levels(page_lists, lens, num_levels, page_size)
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


# ---- CLI and config errors ------------------------------------------------------------


def _update(text, finished, reason=None, tokens=3):
    from types import SimpleNamespace  # noqa: PLC0415

    sample = SimpleNamespace(text=text, token_ids=list(range(tokens)), finish_reason=reason)
    return 0, SimpleNamespace(outputs=[sample], finished=finished)


def test_streamed_text_is_flushed_with_its_finish_reason():
    import io  # noqa: PLC0415

    from cascadeinfer.engine.cli import _print_stream  # noqa: PLC0415

    # Half a character is held back while running, written once the request ends.
    out, err = io.StringIO(), io.StringIO()
    _print_stream([_update("a", False), _update("ab\ufffd", False), _update("ab\ufffd", True, "length")], out, err)
    assert out.getvalue() == "ab\ufffd\n" and err.getvalue() == "(3 tokens, length)\n"
    # A completed character is shown as soon as it is whole.
    out, err = io.StringIO(), io.StringIO()
    _print_stream([_update("\ufffd", False), _update("é", False), _update("é!", True, "stop", 2)], out, err)
    assert out.getvalue() == "é!\n" and err.getvalue() == "(2 tokens, stop)\n"
    # Text rewritten behind what was shown: the final text in full on a new line.
    out, err = io.StringIO(), io.StringIO()
    _print_stream([_update("ab", False), _update("xy", True, "stop")], out, err)
    assert out.getvalue() == "ab\nxy\n"


def test_cli_device_without_cuda_is_a_one_line_usage_error(monkeypatch, capsys):
    from cascadeinfer.engine.cli import main  # noqa: PLC0415

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["generate", "--model", "nowhere", "--prompt", "[1]", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--device cuda: CUDA is not available" in err and "Traceback" not in err
    assert main(["generate", "--model", "nowhere", "--prompt", "[1]", "--device", "gpu0"]) == 2
    assert "--device 'gpu0' is not a device" in capsys.readouterr().err


@pytest.mark.parametrize("key, value", [
    ("num_attention_heads", 0), ("num_hidden_layers", -1), ("num_key_value_heads", 0), ("head_dim", 0),
])
def test_config_errors_name_the_files_key(key, value):
    from cascadeinfer.engine.model_loader import ModelConfig, ModelLoadError  # noqa: PLC0415

    cfg = {"model_type": "llama", "vocab_size": 100, "hidden_size": 32, "intermediate_size": 64,
           "num_hidden_layers": 1, "num_attention_heads": 4}
    with pytest.raises(ModelLoadError, match=f"config.json: {key} must be a positive int, got {value}") as exc:
        ModelConfig.from_dict({**cfg, key: value})
    assert "num_qo_heads" not in str(exc.value) and "num_kv_heads" not in str(exc.value)
    parsed = ModelConfig.from_dict({**cfg, "num_key_value_heads": None, "head_dim": None})  # null: the default
    assert (parsed.num_kv_heads, parsed.head_dim) == (4, 8)


def _run_prefill(sched, sample=False):
    """Schedule one step and pretend it ran: the K/V of its tokens are in the pages (and,
    with ``sample``, the sequences at their last token sampled token 0)."""
    batch = sched.schedule()
    sched.advance(batch)
    if sample:
        for seq in sched.running:
            if seq.num_computed == seq.num_tokens:
                seq.tokens.append(0)
    return batch


def test_scheduler_registers_pages_computed_after_a_cache_hit():
    from cascadeinfer.engine.scheduler import Scheduler  # noqa: PLC0415

    cache = PrefixCache(_pool(32))
    sched = Scheduler(cache, max_num_seqs=4, max_num_batched_tokens=64)
    first = _seq(0, [1, 2, 3, 4, 5, 6, 7])  # pages [1,2] [3,4] [5,6] are cached after its prefill
    sched.add(first)
    _run_prefill(sched)
    assert cache.num_cached == 3
    second = _seq(1, [1, 2, 3, 4, 5, 6, 8, 9, 10, 11, 12])  # hits 3 pages, computes [8,9] [10,11] and 12
    sched.add(second)
    batch = _run_prefill(sched)
    assert (second, 5) in batch.prefill and second.num_registered == 5
    assert cache.num_cached == 5 and not cache._pending  # its new full pages are offered
    third = _seq(2, [1, 2, 3, 4, 5, 6, 8, 9, 10, 11, 13])
    assert cache.match(third) == (second.pages[:5], False)


def test_scheduler_admits_past_requests_waiting_for_a_prefix():
    from cascadeinfer.engine.scheduler import Scheduler  # noqa: PLC0415

    cache = PrefixCache(_pool(32))
    sched = Scheduler(cache, max_num_seqs=8, max_num_batched_tokens=64)
    a0, a1 = _seq(0, [1, 2, 3, 4, 5, 6, 7]), _seq(1, [1, 2, 3, 4, 5, 6, 8])
    b0, b1 = _seq(2, [9, 9, 9, 9, 10]), _seq(3, [9, 9, 9, 9, 11])
    for seq in (a0, a1, b0, b1):
        sched.add(seq)
    first = _run_prefill(sched, sample=True)  # a1 and b1 wait for the pages a0 and b0 compute
    assert first.prefill == [(a0, 7), (b0, 5)] and sched.waiting == [a1, b1]
    second = _run_prefill(sched, sample=True)  # then they hit them: one token each is left
    assert second.prefill == [] and second.decode == [a0, b0, a1, b1] and not sched.waiting
    assert sched.num_cached_prompt_tokens == 6 + 4 and sched.num_computed_prompt_tokens == 7 + 5 + 1 + 1
    assert sched.num_computed_tokens == 7 + 5 + 1 + 1 + 2  # and the first tokens a0 and b0 sampled


def test_prefix_cache_waiting_sequence_is_answered_without_a_walk():
    cache = PrefixCache(_pool(16))
    a = _seq(0, [1, 2, 3, 4, 5])
    a.pages = cache.allocate(3)
    cache.claim_pending(a)
    b = _seq(1, [1, 2, 3, 4, 7])
    assert cache.match(b) == ([], True)
    b.tokens[0] = 99  # were the chain walked again, b would not wait
    assert cache.match(b) == ([], True)
    a.num_computed = 5
    cache.register(a)  # a's pages are in: b walks its chain again
    b.tokens[0] = 1
    assert cache.match(b) == (a.pages[:2], False)


# ---- bench floors --------------------------------------------------------------------------


def test_bench_floors_by_hand():
    from cascadeinfer.engine.bench import Ceilings, ModelCosts, Workload, memory_needed  # noqa: PLC0415
    from cascadeinfer.engine.model_loader import preset  # noqa: PLC0415

    costs = ModelCosts(weight_bytes=1000, body_params=10, head_params=5, kv_bytes_per_token=2, flops_per_pair=3)
    w = Workload(requests=2, prefix=4, suffix=2, new_tokens=3)
    # prefill: 4 + 2 * 2 tokens in 2 steps of 4; pairs 4*5/2 + 2 * (2*4 + 2*3/2); 2 rows of logits
    bandwidth_bound, compute_bound = Ceilings(100.0, 1000.0), Ceilings(1e6, 10.0)
    assert w.prefill_floor(costs, bandwidth_bound, 4) == pytest.approx((2 * 1000 + 8 * 2) / 100)
    assert w.prefill_floor(costs, compute_bound, 4) == pytest.approx((2 * 10 * 8 + 2 * 5 * 2 + 3 * 32) / 10)
    # decode: 2 steps (the first token comes from the prefill), 7 then 8 keys per request, the prefix read once
    assert w.decode_floors(costs, bandwidth_bound, 2) == pytest.approx([(1000 + (10 + 2) * 2) / 100,
                                                                        (1000 + (12 + 2) * 2) / 100])
    assert w.decode_floors(costs, compute_bound, 2)[0] == pytest.approx((2 * 10 * 2 + 2 * 5 * 2 + 3 * 14) / 10)
    assert len(w.decode_floors(costs, compute_bound, 1)) == 4  # two waves of one request
    llama = ModelCosts.of(preset("llama3-8b"), 15 * 10**9, 2)
    assert llama.body_params + llama.head_params == pytest.approx(7.5e9, rel=0.01)
    assert llama.kv_bytes_per_token == 128 * 1024 and llama.flops_per_pair == 4 * 32 * 32 * 128
    assert memory_needed(preset("tiny"), w, 4) > 0
    big = preset("llama3-70b")
    assert big.num_parameters() == pytest.approx(70.6e9, rel=0.01)
    one, two = memory_needed(big, w, 2), memory_needed(big, w, 2, 2)
    head = 2 * big.vocab_size * big.hidden_size * 2  # the embedding and output projection, whole on each device
    assert two == pytest.approx((one - head) / 2 + head, rel=1e-6)
    with pytest.raises(ValueError, match="copy_bytes_per_s"):
        Ceilings(0.0, 1.0)
    with pytest.raises(ValueError, match="new_tokens"):
        Workload(requests=2, prefix=4, suffix=2, new_tokens=0)


def test_step_profile_cuts_steps_at_markers_and_counts_overlap_once():
    """benchmarks/tools/profile_engine_step: a step runs from its marker to the next one;
    kernels of one kind side by side count once in that kind's busy time."""
    from benchmarks.tools.profile_engine_step import split_at_markers, summarize  # noqa: PLC0415

    k = lambda name, ts, dur: {"name": name, "ts": ts, "dur": dur, "cat": "kernel"}  # noqa: E731
    events = [k("gemm_before_any_marker", -5, 2), k("spin_kernel", 0, 1), k("nvjet_tst_128x256", 2, 5),
              k("_prefill_kernel", 3, 5), k("_decode_kernel", 4, 2), k("spin_kernel", 20, 1), k("argmax", 22, 1),
              k("spin_kernel", 30, 1), k("after_the_last_marker", 40, 1)]
    steps = split_at_markers(events)
    assert [(a, b, [e["name"] for e in evs]) for a, b, evs in steps] == [
        (1, 20, ["nvjet_tst_128x256", "_prefill_kernel", "_decode_kernel"]), (21, 30, ["argmax"])]
    first = summarize(*steps[0])
    assert (first["span_us"], first["busy_us"], first["idle_us"]) == (19, 6, 13)
    assert first["kinds"]["attention"] == {"sum_us": 7, "busy_us": 5, "count": 2}
    assert first["kinds"]["gemm"]["busy_us"] == 5
    assert summarize(*steps[1])["kinds"] == {"other": {"sum_us": 1, "busy_us": 1, "count": 1}}


def test_host_profile_splits_a_step_into_host_work_and_wait(capsys, tmp_path, monkeypatch):
    """benchmarks/tools/profile_engine_step --host: the bare steps' wall, host and wait
    times (host + wait = wall, per step), then the Python functions by own time."""
    import argparse  # noqa: PLC0415
    import json  # noqa: PLC0415

    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the kernels' PyTorch path: this is about the host loop

    from benchmarks.tools.profile_engine_step import profile_host  # noqa: PLC0415
    from cascadeinfer.engine.llm import LLM  # noqa: PLC0415
    from cascadeinfer.engine.model_loader import preset  # noqa: PLC0415
    from cascadeinfer.engine.sampling import SamplingParams  # noqa: PLC0415

    llm = LLM.from_config(preset("tiny"), device="cpu", dtype=torch.float32, record_steps=True, page_size=4)
    for i in range(3):
        llm.add_request([1 + i, 2, 3, 4, 5], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    llm.step()
    out = tmp_path / "host.json"
    profile_host(llm, argparse.Namespace(steps=3, top=5, json=str(out)))
    assert not llm.has_unfinished()
    result = json.loads(out.read_text())
    assert result["step"]["step wall us"] >= result["step"]["host us (wall less wait)"] > 0
    assert len(result["functions"]) == 5 and result["functions"][0]["own us per step"] > 0
    assert all(s.wait_seconds == 0 for s in llm.step_stats)  # the CPU's tokens need no copy
    assert "functions of most own time" in capsys.readouterr().out


def test_host_probe_times_a_stubbed_step_by_part(capsys, monkeypatch, tmp_path):
    """benchmarks/tools/probe_engine_host: the engine around a stubbed model, timed bare
    and by part; every part ran in every timed step."""
    import json  # noqa: PLC0415
    import sys  # noqa: PLC0415

    from benchmarks.tools import probe_engine_host  # noqa: PLC0415

    out = tmp_path / "parts.json"
    monkeypatch.setattr(sys, "argv", ["probe_engine_host", "--requests", "4", "--prefix", "40", "--suffix", "6",
                                      "--page-size", "4", "--steps", "3", "--json", str(out)])
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the probe switches the prefill to the PyTorch path itself
    probe_engine_host.main()
    parts = {r["part"]: r["ms"] for r in json.loads(out.read_text())["parts"]}
    assert parts["a step, bare"] > 0 and parts["a step, parts timed"] >= parts["execute"] > 0
    assert all(ms > 0 for ms in parts.values()), parts
    assert parts["execute"] >= parts["execute: group_levels"] + parts["execute: plan, fill, replay"]
    assert "(the model stubbed)" in capsys.readouterr().out


def test_host_tensor_copies_a_list_exactly():
    from cascadeinfer._host import host_tensor  # noqa: PLC0415

    values = [0, 7, -3, 2**31 - 1]
    for dtype in (torch.int32, torch.int64):
        t = host_tensor(values, dtype)
        assert t.dtype == dtype and t.tolist() == values and t.device.type == "cpu"
    assert host_tensor([], torch.int32).shape == (0,)
    assert host_tensor([2**40], torch.int64).item() == 2**40
    with pytest.raises(OverflowError):
        host_tensor([2**31], torch.int32)


def test_engine_power_tool(tmp_path, capsys, monkeypatch):
    """benchmarks/tools/engine_power: the decode steps located in the power log by the
    run's end and their times, the samples outside them left out; each step's own samples,
    and the steps' GPU times against their clock."""
    import json  # noqa: PLC0415
    import sys  # noqa: PLC0415

    from benchmarks.tools import engine_power  # noqa: PLC0415

    end = 1_800_000_000.0
    # three steps: [end - 0.5, end - 0.4], [end - 0.4, end - 0.1] (the slow one), [end - 0.1, end]
    bench = {"rows": [{"mode": "cascade", "decode_steps_ms": [100.0, 300.0, 100.0],
                       "decode_steps_gpu_ms": [99.0, 299.0, 99.0], "ended_unix_s": end}]}
    lines = ["timestamp, power.draw.instant [W], clocks.current.sm [MHz], clocks_event_reasons.active"]
    # 500 W before the steps; at the cap during them, the slow step at the low clock; 80 W after
    for t, watts, mhz, reasons in [(end - 1.0, 500, 1980, 0), (end - 0.45, 300, 1600, 4), (end - 0.3, 300, 1500, 4),
                                   (end - 0.2, 300, 1500, 4), (end - 0.05, 300, 1600, 4), (end + 0.5, 80, 345, 0)]:
        stamp = datetime.datetime.fromtimestamp(t, datetime.UTC).strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]
        lines.append(f"{stamp}, {watts} W, {mhz} MHz, 0x{reasons:016x}")
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    (tmp_path / "smi.csv").write_text("\n".join(lines))
    out = tmp_path / "out.json"
    monkeypatch.setattr(sys, "argv", ["x", "--bench", str(tmp_path / "bench.json"), "--smi", str(tmp_path / "smi.csv"),
                                      "--json", str(out)])
    engine_power.main()
    got = json.loads(out.read_text())
    assert got["samples"] == 4 and got["W"] == 300 and got["SM MHz"] == 1550 and got["SM MHz range"] == [1500, 1600]
    assert got["power capped"] == 1 and got["decode step ms"] == pytest.approx(100.0)
    assert got["J per step"] == pytest.approx(30.0)
    assert [(r["step"], r["SM MHz"]) for r in got["steps"]] == [(0, 1600), (1, 1500), (2, 1600)]
    assert got["corr(step GPU ms, SM MHz)"] == pytest.approx(-1.0)
    assert "J per step" in capsys.readouterr().out
