"""Beam search in the engine against transformers' ``generate(num_beams=k)``: the same k
sequences, best first, with the same scores, for prompts in one batch that share a
prefix; the beams share pages (fork, copy-on-write) and every page is free at the end."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_engine import SHARED, UNSHARED, _tiny  # noqa: E402
from test_smollm2 import smollm2_dir  # noqa: E402, F401 - the converted SmolLM2-135M, a fixture

from cascadeinfer.engine import LLM, BeamSearchParams, SamplingParams  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def torch_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def hf_beams(model, prompt: list[int], p: BeamSearchParams, eos: int | None):
    """transformers' k best sequences (prompt included, cut after a stop token) and scores."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             num_beams=p.beam_width, num_return_sequences=p.beam_width, do_sample=False,
                             max_new_tokens=p.max_tokens, length_penalty=p.length_penalty,
                             early_stopping=p.early_stopping, eos_token_id=eos, pad_token_id=0,
                             output_scores=True, return_dict_in_generate=True)
    scores = out.sequences_scores.tolist() if p.beam_width > 1 else None  # k = 1 is greedy search there
    seqs = []
    for row in out.sequences.tolist():
        gen = row[len(prompt):]
        if eos is not None and eos in gen:
            gen = gen[:gen.index(eos) + 1]
        seqs.append(prompt + gen)
    return seqs, scores


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("k, length_penalty, early_stopping", [(1, 1.0, False), (2, 1.0, False), (4, 0.5, True),
                                                               (4, 1.5, "never")])
def test_beam_search_equals_transformers(arch, k, length_penalty, early_stopping, tmp_path, torch_path):
    model = _tiny(arch, tmp_path, eos_token_id=3)
    llm = LLM(tmp_path, device="cpu", dtype=torch.float32, page_size=4, num_pages=160)
    prompts = SHARED + UNSHARED[:1]
    params = BeamSearchParams(beam_width=k, max_tokens=7, length_penalty=length_penalty,
                              early_stopping=early_stopping)
    outs = llm.beam_search(prompts, params)
    for prompt, out in zip(prompts, outs):
        seqs, scores = hf_beams(model, prompt, params, eos=3)
        assert [s.tokens for s in out.sequences] == seqs
        if scores is not None:
            assert [s.score for s in out.sequences] == pytest.approx(scores, abs=1e-4)
    # No page leaked: every page is free or held by the prefix cache alone.
    assert llm.pool.num_free + llm.cache.num_cached == llm.pool.num_pages
    assert llm.cache.copies > 0 or k == 1  # beams sharing a partial page copied it before writing


def test_beam_search_under_memory_pressure(tmp_path, torch_path):
    """A pool too small for every beam at once: beams are preempted and recomputed, steps
    run only some beams of a request, and the results equal an unconstrained run's."""
    _tiny("llama", tmp_path, eos_token_id=3)
    prompts = SHARED + UNSHARED
    params = BeamSearchParams(beam_width=4, max_tokens=7)
    roomy = LLM(tmp_path, device="cpu", dtype=torch.float32, page_size=4, num_pages=200)
    tight = LLM(tmp_path, device="cpu", dtype=torch.float32, page_size=4, num_pages=22, max_num_batched_tokens=24)
    expected = roomy.beam_search(prompts, params)
    got = tight.beam_search(prompts, params)
    assert tight.scheduler.num_preemptions > 0
    for a, b in zip(got, expected):
        assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
        assert [s.score for s in a.sequences] == pytest.approx([s.score for s in b.sequences], abs=1e-5)
    assert tight.pool.num_free + tight.cache.num_cached == tight.pool.num_pages


def test_beam_search_with_sampling_in_one_batch(tmp_path, torch_path):
    """Beam requests and sampled ones step together; each gets what it gets alone."""
    _tiny("llama", tmp_path, eos_token_id=3)
    llm = LLM(tmp_path, device="cpu", dtype=torch.float32, page_size=4, num_pages=200, record_steps=True)
    beams = BeamSearchParams(beam_width=2, max_tokens=5)
    seeded = SamplingParams(temperature=0.9, seed=7, max_tokens=6)
    alone_beams = llm.beam_search(SHARED[:2], beams)
    alone_sampled = llm.generate(SHARED[2:], seeded)
    llm.reset_prefix_cache()
    ids = [llm.add_beam_request(SHARED[0], beams), llm.add_request(SHARED[2], seeded),
           llm.add_beam_request(SHARED[1], beams)]
    final = {}
    while llm.has_unfinished():
        final.update((o.request_id, o) for o in llm.step() if o.finished)
    for rid, alone in zip(ids[::2], alone_beams):
        assert [SHARED[ids.index(rid) // 2] + c.token_ids for c in final[rid].outputs] == \
            [s.tokens for s in alone.sequences]
        assert [c.score for c in final[rid].outputs] == pytest.approx([s.score for s in alone.sequences])
    assert final[ids[1]].outputs[0].token_ids == alone_sampled[0].outputs[0].token_ids


def test_beam_search_params_are_checked(tmp_path, torch_path):
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0)
    with pytest.raises(ValueError, match="early_stopping"):
        BeamSearchParams(beam_width=2, early_stopping="sometimes")
    _tiny("llama", tmp_path)
    llm = LLM(tmp_path, device="cpu", dtype=torch.float32, page_size=4, num_pages=64, max_model_len=32)
    with pytest.raises(TypeError, match="params"):
        llm.beam_search([[1, 2]], SamplingParams())
    with pytest.raises(ValueError, match="max_model_len"):
        llm.beam_search([[1, 2]], BeamSearchParams(beam_width=2, max_tokens=31))


@pytest.mark.parametrize("k", [2, 4])
def test_beam_search_on_smollm2_equals_transformers(k, smollm2_dir, torch_path):  # noqa: F811
    """The real model (SmolLM2-135M, fp32): prompts sharing a prefix, its end-of-text token."""
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir).float().eval()
    tok = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    llm = LLM(smollm2_dir, device="cpu", dtype=torch.float32, page_size=16, num_pages=128)
    shared = "The history of the city begins with"
    prompts = [tok.encode(shared + end) for end in (" a small", " the river", " its first")]
    params = BeamSearchParams(beam_width=k, max_tokens=6, length_penalty=1.0, early_stopping=False)
    eos = llm.model_config.eos_token_ids[0]
    for prompt, out in zip(prompts, llm.beam_search(prompts, params)):
        seqs, scores = hf_beams(model, prompt, params, eos=eos)
        assert [s.tokens for s in out.sequences] == seqs
        assert [s.score for s in out.sequences] == pytest.approx(scores, abs=1e-4)
    assert llm.pool.num_free + llm.cache.num_cached == llm.pool.num_pages


def test_bench_runs_a_beam_search_workload(tmp_path, torch_path):
    """``cascadeinfer bench --modes beam``: the beams' throughput and, in a pool too small
    for all beams at once, the preemptions they cost."""
    import json  # noqa: PLC0415

    from cascadeinfer.engine.cli import main  # noqa: PLC0415

    out = tmp_path / "bench.json"
    assert main(["bench", "--preset", "tiny", "--device", "cpu", "--modes", "beam", "--beam-width", "4",
                 "--requests", "5", "--prefix", "21", "--suffix", "3", "--new-tokens", "6", "--page-size", "4",
                 "--num-pages", "26", "--max-num-batched-tokens", "24", "--skip-check", "--json", str(out)]) == 0
    row = json.loads(out.read_text())["rows"][0]
    assert row["mode"] == "beam" and row["beam_width"] == 4 and row["output_tokens"] == 5 * 6
    assert row["beam_tokens"] == 5 * 4 * (6 - 1) and row["beam_tokens_per_s"] > row["tokens_per_s"] > 0
    assert row["preemptions"] > 0
