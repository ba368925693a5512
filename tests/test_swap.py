"""Preemption by swapping: the host swap space, its policy, and the engine under memory
pressure with swapping (outputs equal to an unconstrained run's, nothing lost or leaked)."""

from __future__ import annotations

import logging

import pytest
import torch

from cascadeinfer.engine.prefix_cache import PrefixCache
from cascadeinfer.engine.swap import SwapPolicy, SwapSpace
from cascadeinfer.layouts.pool import PagedKVPool

PS = 4


def space(num_pages=16, slots=8):
    pool = PagedKVPool(2, num_pages, PS, 2, 8, dtype=torch.float32, device="cpu")
    pool.cache.copy_(torch.randn(pool.cache.shape))
    cache = PrefixCache(pool, enabled=False)
    page_bytes = pool.cache[:, 0].numel() * 4
    return pool, cache, SwapSpace(cache, slots * page_bytes)


def test_pages_come_back_with_their_contents():
    pool, cache, swap = space()
    pages = cache.allocate(3)
    before = pool.cache[:, pages].clone()
    out = swap.swap_out(pages, num_tokens=2 * PS + 1)  # two full pages and a partial one
    assert out.full == [True, True, False]
    cache.release(pages)
    swap.flush()
    cache.allocate(pool.num_free)  # every freed page reused and overwritten
    pool.cache.zero_()
    cache.release(list(range(pool.num_pages)))
    back = swap.swap_in(out)
    swap.flush()
    assert len(back) == 3 and swap.num_held == 0
    torch.testing.assert_close(pool.cache[:, back], before, rtol=0, atol=0)
    assert swap.pages_out == 3 and swap.pages_in == 3
    assert swap.bytes_out == 3 * swap.page_bytes and swap.seconds() > 0


def test_a_shared_page_is_swapped_once():
    pool, cache, swap = space()
    shared = cache.allocate(1)
    a = shared + cache.allocate(1)
    b = cache.fork(shared) + cache.allocate(1)
    out_a = swap.swap_out(a, 2 * PS)
    out_b = swap.swap_out(b, 2 * PS)
    assert out_a.slots[0] == out_b.slots[0] and swap.pages_out == 3
    cache.release(a)
    cache.release(b)
    swap.flush()
    back_a = swap.swap_in(out_a)
    back_b = swap.swap_in(out_b)
    swap.flush()
    torch.testing.assert_close(pool.cache[:, back_a[0]], pool.cache[:, back_b[0]], rtol=0, atol=0)
    assert swap.num_held == 0


def test_full_pages_still_on_the_device_are_not_copied_again():
    pool, cache, swap = space()
    prefix = cache.allocate(1)
    a = prefix + cache.allocate(1)
    b = cache.fork(prefix) + cache.allocate(1)  # b keeps running on the prefix page
    out_a = swap.swap_out(a, PS + 2)
    cache.release(a)
    swap.flush()
    out_b = swap.swap_out(b, PS + 2)  # a later step: the full prefix page is on the host already
    assert swap.pages_out == 3 and out_b.slots[0] == out_a.slots[0]
    cache.release(b)
    swap.flush()
    keep = cache.fork(prefix[:0])  # nothing: the prefix page is free now
    assert keep == [] and pool.refcount(prefix[0]) == 0
    # a comes back while nobody holds its prefix page any more: copied in
    back_a = swap.swap_in(out_a)
    assert swap.pages_in == 2
    swap.flush()
    # b comes back while a holds that page again: shared, not copied
    back_b = swap.swap_in(out_b)
    assert back_b[0] == back_a[0] and pool.refcount(back_a[0]) == 2 and swap.pages_in == 3
    swap.flush()
    assert swap.num_held == 0


def test_a_partly_filled_page_is_copied_again_in_a_later_step():
    """Its other holder may write into it once it is the sole owner."""
    pool, cache, swap = space()
    page = cache.allocate(1)
    other = cache.fork(page)
    first = swap.swap_out(page, 2)
    cache.release(page)
    swap.flush()
    pool.cache[:, other[0]] += 1  # the other holder writes its next token
    second = swap.swap_out(other, 3)
    assert second.slots != first.slots and swap.pages_out == 2
    cache.release(other)
    swap.flush()
    a, b = swap.swap_in(first), swap.swap_in(second)
    swap.flush()
    assert not torch.equal(pool.cache[:, a[0]], pool.cache[:, b[0]])


def test_a_reused_device_page_is_not_mistaken_for_the_one_copied():
    pool, cache, swap = space()
    page = cache.allocate(1)
    other = cache.fork(page)  # another holder keeps the page allocated
    out = swap.swap_out(page, PS)
    cache.release(page)
    swap.flush()
    assert swap.pages_to_swap_in(out) == 0  # still the page it copied: shared on the way back
    cache.release(other)
    again = cache.allocate(1)  # the same page number, handed out anew (a new generation)
    assert again == page
    assert swap.pages_to_swap_in(out) == 1


def test_the_swap_space_takes_all_or_nothing():
    pool, cache, swap = space(slots=2)
    pages = cache.allocate(3)
    assert swap.swap_out(pages, 3 * PS) is None
    assert swap.num_free == 2 and swap.pages_out == 0
    assert swap.swap_out(pages[:2], 2 * PS) is not None and swap.num_free == 0


def test_auto_policy_compares_copy_and_recompute_time():
    policy = SwapPolicy("auto", page_bytes=1 << 20, flops_per_token=2e9, device=torch.device("cpu"),
                        dtype=torch.float32)
    policy.copy_bytes_per_s, policy.flops_per_s = 10e9, 100e12  # 1 MiB page: 0.21 ms out and back
    assert policy.prefers_swap(1, 16)  # 16 tokens of 2 GFLOP: 0.32 ms to recompute
    assert not policy.prefers_swap(1, 8)  # 0.16 ms
    assert SwapPolicy("swap", page_bytes=1, flops_per_token=1, device=torch.device("cpu"),
                      dtype=torch.float32).prefers_swap(10**6, 1)
    with pytest.raises(ValueError, match="preemption_mode"):
        SwapPolicy("sometimes", page_bytes=1, flops_per_token=1, device=torch.device("cpu"), dtype=torch.float32)
    measured = SwapPolicy("auto", page_bytes=1, flops_per_token=1, device=torch.device("cpu"), dtype=torch.float32)
    measured.prefers_swap(1, 1)
    assert measured.copy_bytes_per_s > 0 and measured.flops_per_s > 0


# ---- the engine ---------------------------------------------------------------------

transformers = pytest.importorskip("transformers")

from cascadeinfer.engine import LLM, BeamSearchParams, SamplingParams  # noqa: E402
from test_engine import GREEDY, SHARED, UNSHARED, _assert_no_leak, _llm, _tiny, hf_greedy  # noqa: E402


@pytest.fixture
def torch_path(monkeypatch, device):
    if device.type == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "0")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {}
    for arch in ("llama", "qwen2"):
        path = tmp_path_factory.mktemp(arch)
        out[arch] = (path, _tiny(arch, path))
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_swapping_gives_the_same_outputs(arch, models, device, torch_path):
    path, model = models[arch]
    prompts = SHARED + UNSHARED
    llm = _llm(path, device, num_pages=12, use_cascade=True, preemption_mode="swap")
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, **GREEDY))
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(model, prompt, 12, device)
    stats = llm.stats
    assert stats.swapped_preemptions == stats.preemptions > 0 and stats.swap_fallbacks == 0
    assert stats.swapped_out_bytes > 0 and stats.swapped_in_bytes > 0
    # Nothing is computed twice: every prompt token once (or from the cache), every output once.
    assert stats.prefill_tokens + stats.cached_prompt_tokens == stats.prompt_tokens
    _assert_no_leak(llm)
    # Seeded sampling with n > 1: the same tokens as an engine that never preempts.
    sampled = [SamplingParams(temperature=0.9, top_k=50, top_p=0.9, max_tokens=12, seed=3 + i, n=1 + (i == 1),
                              ignore_eos=True) for i in range(len(prompts))]
    tight = [[s.token_ids for s in o.outputs] for o in llm.generate(prompts, sampled)]
    roomy = [[s.token_ids for s in o.outputs] for o in _llm(path, device).generate(prompts, sampled)]
    assert tight == roomy
    assert llm.stats.swapped_preemptions > stats.swapped_preemptions
    _assert_no_leak(llm)


def test_beam_search_with_swapping(models, torch_path):
    path, _ = models["llama"]
    prompts = SHARED + UNSHARED
    params = BeamSearchParams(beam_width=4, max_tokens=7)
    expected = LLM(path, device="cpu", dtype=torch.float32, page_size=4, num_pages=200).beam_search(prompts, params)
    tight = LLM(path, device="cpu", dtype=torch.float32, page_size=4, num_pages=22, max_num_batched_tokens=24,
                preemption_mode="swap")
    got = tight.beam_search(prompts, params)
    for a, b in zip(got, expected):
        assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
        assert [s.score for s in a.sequences] == pytest.approx([s.score for s in b.sequences], abs=1e-5)
    assert tight.stats.swapped_preemptions > 0
    _assert_no_leak(tight)


def test_a_full_swap_space_falls_back_to_recompute(models, device, torch_path, caplog):
    path, model = models["qwen2"]
    prompts = SHARED + UNSHARED
    page_bytes = 2 * 2 * PS * 2 * 16 * 4  # layers x (K, V) x page x kv heads x head_dim x fp32
    llm = _llm(path, device, num_pages=12, preemption_mode="swap", swap_space=3 * page_bytes / 2**30)
    assert llm.swap.num_slots == 3
    with caplog.at_level(logging.INFO, logger="cascadeinfer.engine"):
        outs = llm.generate(prompts, SamplingParams(max_tokens=12, **GREEDY))
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(model, prompt, 12, device)
    stats = llm.stats
    assert stats.swap_fallbacks > 0 and stats.preemptions > stats.swapped_preemptions
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "swap space is full" in warnings[0].getMessage()
    assert "recomputed instead" in warnings[0].getMessage()
    _assert_no_leak(llm)


def test_swap_settings_are_checked(models):
    path, _ = models["llama"]
    with pytest.raises(ValueError, match="preemption_mode"):
        LLM(path, device="cpu", preemption_mode="often")
    with pytest.raises(ValueError, match="swap_space"):
        LLM(path, device="cpu", swap_space=-1)
    with pytest.raises(ValueError, match="tensor_parallel_size 1"):
        LLM(path, device="cpu", preemption_mode="swap", tensor_parallel_size=2)
    assert LLM(path, device="cpu", preemption_mode="recompute").swap is None


def test_bench_runs_a_memory_pressure_workload(tmp_path, torch_path):
    """``cascadeinfer bench --modes swap,recompute``: the same workload on a pool of half
    the pages it needs, preemptions swapped or recomputed, with what each cost."""
    import json  # noqa: PLC0415

    from cascadeinfer.engine.cli import main  # noqa: PLC0415

    out = tmp_path / "bench.json"
    assert main(["bench", "--preset", "tiny", "--device", "cpu", "--modes", "swap,recompute", "--requests", "6",
                 "--prefix", "21", "--suffix", "5", "--new-tokens", "12", "--page-size", "4", "--pressure", "0.4",
                 "--skip-check", "--json", str(out)]) == 0
    swap, recompute = json.loads(out.read_text())["rows"]
    assert swap["mode"] == "swap" and recompute["mode"] == "recompute"
    for row in (swap, recompute):
        assert row["output_tokens"] == 6 * 12 and row["tokens_per_s"] > 0 and row["preemptions"] > 0
    assert swap["swapped_preemptions"] == swap["preemptions"] and swap["swapped_out_gb"] > 0 and swap["swap_s"] > 0
    assert recompute["swapped_preemptions"] == 0 and recompute["swapped_out_gb"] == 0
    assert recompute["computed_tokens"] > swap["computed_tokens"]  # recompute computes preempted tokens again
