"""The decode engine end to end against Hugging Face transformers' generate.

Tiny random Llama and Qwen2 checkpoints are written with ``save_pretrained`` into a
temporary directory; the engine's greedy tokens must equal transformers' greedy tokens
for the same prompts — with and without a shared prefix, cascade forced on and off,
with prefix caching, chunked prefill, preemption forced by a tiny pool, and n > 1.

On a CPU most tests run the kernels' PyTorch path (``TRITON_INTERPRET`` switched off for
the test: the interpreter is too slow for whole models); ``test_triton_kernels_end_to_end``
runs the Triton kernels through the interpreter. On a GPU every test runs the Triton
kernels (and CUDA graphs for decode steps).
"""

from __future__ import annotations

import json
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from cascadeinfer.engine.llm import LLM  # noqa: E402
from cascadeinfer.engine.model_loader import ModelConfig, ModelLoadError  # noqa: E402
from cascadeinfer.engine.sampling import SamplingParams  # noqa: E402

VOCAB = 256


pytestmark = pytest.mark.usefixtures("one_torch_thread")


GREEDY = dict(temperature=0.0, ignore_eos=True)


def _tiny(arch: str, path, std: float = 0.2, **extra):
    """Write a tiny random checkpoint of ``arch`` to ``path``; return the HF model (fp32, eval)."""
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, eos_token_id=2)
    common.update(extra)
    if arch == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    gen = torch.Generator().manual_seed(1 if arch == "llama" else 2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            # Larger than HF's 0.02 init so that greedy choices are not near-ties.
            p.copy_(torch.randn(p.shape, generator=gen) * (std if p.dim() > 1 else 0.3))
            if "norm" in name:
                p.add_(1.0)
    model.eval()
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    return path, _tiny("llama", path)


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2")
    return path, _tiny("qwen2", path)


@pytest.fixture
def torch_path(monkeypatch, device):
    """Plain-CPU runs take the kernels' PyTorch path (GPU runs are unaffected)."""
    if device.type == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "0")


def hf_greedy(model, prompt: list[int], max_new: int, device) -> list[int]:
    model = model.to(device)
    out = model.generate(torch.tensor([prompt], device=device), attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=device),
                         max_new_tokens=max_new, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


PREFIX = [(7 * i + 3) % VOCAB for i in range(21)]  # 21 tokens: 5 full pages of 4 and one partial
SHARED = [PREFIX + [100 + i, 30 + 2 * i] for i in range(3)]  # 23 tokens: 5 shared full pages
UNSHARED = [[5, 6, 7], [200, 13, 14, 15, 16, 17, 18, 19, 20]]


def _llm(path, device, **kw):
    kw = {"page_size": 4, "num_pages": 96, "check_metadata": True, **kw}
    return LLM(path, device=device, dtype=torch.float32, **kw)


def _check(llm, model, prompts, max_new, device, params=None):
    outs = llm.generate(prompts, params or SamplingParams(max_tokens=max_new, **GREEDY))
    for prompt, out in zip(prompts, outs):
        ref = hf_greedy(model, prompt, max_new, device)
        for sample in out.outputs:
            assert sample.token_ids == ref, f"prompt {prompt}: engine {sample.token_ids} != transformers {ref}"
            assert sample.finish_reason == "length"
    return outs


def _assert_no_leak(llm):
    assert not llm.has_unfinished()
    assert llm.swap is None or llm.swap.num_held == 0
    assert llm.pool.num_free + llm.cache.num_cached == llm.pool.num_pages
    assert all(llm.pool.refcount(p) == 1 for p in range(llm.pool.num_pages) if llm.pool.refcount(p))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("use_cascade", [True, False])
def test_greedy_matches_transformers(arch, use_cascade, llama, qwen2, device, torch_path):
    path, model = llama if arch == "llama" else qwen2
    llm = _llm(path, device, use_cascade=use_cascade, record_steps=True)
    _check(llm, model, SHARED + UNSHARED, 10, device)
    decode_modes = {s.cascade for s in llm.step_stats if s.num_decode}
    assert decode_modes == {use_cascade}
    assert llm.cache.hits >= 2 * 5  # requests 1 and 2 reuse the 5 full prefix pages
    _assert_no_leak(llm)


def test_prefix_cache_across_calls_and_chunked_prefill(llama, device, torch_path):
    path, model = llama
    llm = _llm(path, device, max_num_batched_tokens=6)  # prompts are prefilled in chunks
    _check(llm, model, SHARED[:1], 6, device)
    hits = llm.cache.hits
    _check(llm, model, SHARED[1:] + UNSHARED, 6, device)  # the prefix comes from the cache now
    assert llm.cache.hits - hits == 2 * 5
    llm.reset_prefix_cache()
    assert llm.pool.num_free == llm.pool.num_pages
    _assert_no_leak(llm)


def _ideal_prefill(prompts, page_size):
    """Prompt tokens to compute when every full page is computed once: each prompt's
    tokens past the full pages an earlier prompt has (its last token always computed)."""
    seen, total = set(), 0
    for p in prompts:
        hits = 0
        while hits < (len(p) - 1) // page_size and tuple(p[:(hits + 1) * page_size]) in seen:
            hits += 1
        total += len(p) - hits * page_size
        seen.update(tuple(p[:(k + 1) * page_size]) for k in range(len(p) // page_size))
    return total


LONG = [(11 * i + 5) % VOCAB for i in range(37)]  # 9 full pages of 4 and one token
OTHER = [(13 * i + 1) % VOCAB for i in range(26)]  # 6 full pages and two tokens
WORKLOADS = {
    "one prompt": [LONG + [60 + i] for i in range(6)],
    "identical": [LONG[:36]] * 4,  # a page-aligned prompt: its last page is computed by all
    "two groups": [(OTHER if i < 3 else LONG) + [60 + i, 90 + i] for i in range(6)],
    "part of a page": [LONG[:10] + [60 + i, 61, 62, 63] for i in range(4)],  # 2 full pages and 2 tokens shared
}


@pytest.mark.parametrize("budget", [8192, 12], ids=["one-step", "chunked"])
@pytest.mark.parametrize("workload", list(WORKLOADS))
def test_shared_prompt_is_prefilled_once(workload, budget, llama, device, torch_path):
    path, model = llama
    prompts = WORKLOADS[workload]
    params = SamplingParams(max_tokens=4, **GREEDY)
    llm = _llm(path, device, max_num_batched_tokens=budget, record_steps=True)
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    stats = llm.stats
    assert stats.preemptions == 0 and stats.requests == len(prompts)
    assert stats.prompt_tokens == sum(map(len, prompts))
    assert stats.prefill_tokens == _ideal_prefill(prompts, 4) < stats.prompt_tokens
    assert stats.prefill_tokens + stats.cached_prompt_tokens == stats.prompt_tokens
    assert stats.output_tokens == 4 * len(prompts) and stats.steps == len(llm.step_stats)
    assert stats.computed_tokens == stats.prefill_tokens + 3 * len(prompts)  # the last sampled token is not fed back
    if workload == "two groups" and budget == 8192:  # the second group does not wait behind the first
        assert llm.step_stats[0].num_prefill_tokens == len(prompts[0]) + len(prompts[3])
    _assert_no_leak(llm)
    alone = []
    for prompt in prompts:  # one by one, nothing cached: the same tokens
        llm.reset_prefix_cache()
        alone.append(llm.generate([prompt], params)[0].outputs[0].token_ids)
    assert together == alone
    assert together[0] == hf_greedy(model, prompts[0], 4, device)
    assert (llm.stats - stats).prefill_tokens == sum(map(len, prompts))


def test_preemption_gives_the_same_outputs(qwen2, device, torch_path):
    path, model = qwen2
    prompts = SHARED + UNSHARED
    # 12 pages of 4 tokens: 5 sequences of up to 36 tokens cannot all run at once.
    llm = _llm(path, device, num_pages=12, use_cascade=True, preemption_mode="recompute")
    outs = _check(llm, model, prompts, 12, device)
    assert llm.num_preemptions > 0
    stats = llm.stats  # a preempted prompt is computed (or found in the cache) again
    assert stats.prefill_tokens + stats.cached_prompt_tokens > stats.prompt_tokens
    assert stats.computed_tokens > stats.prefill_tokens + 11 * len(prompts)
    _assert_no_leak(llm)
    sampled = SamplingParams(temperature=0.9, top_k=50, top_p=0.9, max_tokens=12, seed=3, ignore_eos=True)
    small = [o.outputs[0].token_ids for o in llm.generate(prompts, sampled)]
    big = [o.outputs[0].token_ids for o in _llm(path, device).generate(prompts, sampled)]
    assert small == big  # seeded sampling is independent of preemption too
    assert [o.outputs[0].token_ids for o in outs] != small


def test_n_samples_share_the_prompt(llama, device, torch_path):
    path, model = llama
    llm = _llm(path, device)
    outs = _check(llm, model, SHARED[:2], 8, device, SamplingParams(n=3, max_tokens=8, **GREEDY))
    assert [len(o.outputs) for o in outs] == [3, 3]
    assert llm.cache.copies >= 2 * 2  # the shared, partly filled last prompt page was copied
    _assert_no_leak(llm)
    sampled = llm.generate(SHARED[0], SamplingParams(n=4, temperature=1.0, max_tokens=8, seed=11, ignore_eos=True))
    tokens = [s.token_ids for s in sampled[0].outputs]
    assert len({tuple(t) for t in tokens}) > 1  # independent streams per sample
    again = llm.generate(SHARED[0], SamplingParams(n=4, temperature=1.0, max_tokens=8, seed=11, ignore_eos=True))
    assert [s.token_ids for s in again[0].outputs] == tokens


def test_new_requests_join_between_steps_and_bad_ones_are_rejected(llama, device, torch_path):
    path, model = llama
    llm = _llm(path, device)
    params = SamplingParams(max_tokens=10, **GREEDY)
    done = {}
    first = llm.add_request(SHARED[0], params)
    for _ in range(3):
        for out in llm.step():
            done[out.request_id] = out
    second = llm.add_request(UNSHARED[1], params)
    bad = [
        ([], params, ValueError, "empty"),
        ([1] * 129, params, ValueError, "max_model_len"),
        ([VOCAB + 3], params, ValueError, "vocabulary"),
        ([5, -1], params, ValueError, "token id -1 is outside the vocabulary"),
        ("text", params, ValueError, "tokenizer"),
        ([1, 2.5], params, TypeError, "token 1"),
        ([1, 2], SamplingParams(max_tokens=4, stop_token_ids=[VOCAB]), ValueError, "stop_token_ids"),
        ([1, 2], "greedy", TypeError, "sampling_params"),
    ]
    for prompt, p, exc, words in bad:
        with pytest.raises(exc, match=words):
            llm.add_request(prompt, p)
    with pytest.raises(ValueError, match="prompts\\[1\\]"):
        llm.generate([[1, 2], []], params)  # validated before anything is queued
    while llm.has_unfinished():
        for out in llm.step():
            done[out.request_id] = out
    assert set(done) == {first, second}
    assert done[first].outputs[0].token_ids == hf_greedy(model, SHARED[0], 10, device)
    assert done[second].outputs[0].token_ids == hf_greedy(model, UNSHARED[1], 10, device)
    _assert_no_leak(llm)


@pytest.mark.parametrize("kwargs, words", [
    (dict(temperature=-0.1), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"), (dict(max_tokens=0), "max_tokens"), (dict(n=0), "n"),
    (dict(seed=-1), "seed"), (dict(temperature=math.nan), "temperature"), (dict(n=1.5), "n"),
    (dict(stop_token_ids="ab"), "stop_token_ids"), (dict(ignore_eos=1), "ignore_eos"),
])
def test_invalid_sampling_params(kwargs, words):
    with pytest.raises((ValueError, TypeError), match=words):
        SamplingParams(**kwargs)


def test_stop_tokens_and_context_limit(llama, device, torch_path):
    path, model = llama
    llm = _llm(path, device, max_model_len=30)
    ref = hf_greedy(model, UNSHARED[0], 8, device)
    stop = ref[3]
    out = llm.generate(UNSHARED[0], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop]))[0].outputs[0]
    assert out.token_ids == ref[:ref.index(stop) + 1] and out.finish_reason == "stop"
    # eos (id 2 in the config) stops too unless ignored; the context limit ends with "length"
    out = llm.generate(SHARED[0], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))[0].outputs[0]
    assert len(SHARED[0]) + len(out.token_ids) == 30 and out.finish_reason == "length"


@pytest.fixture
def few_decode_splits(monkeypatch, device):
    """On a CPU the kernels plan their KV splits for 132 SMs: hundreds of programs,
    seconds per call in the interpreter. Plan for 4 there (split-KV itself is the
    kernels' own tests' business)."""
    if device.type == "cpu":
        from cascadeinfer.kernels import policy  # noqa: PLC0415

        monkeypatch.setattr(policy, "planning_sms", lambda *args: 4)


@pytest.mark.parametrize("mode", ["cascade", "flat", "padded-graph-path"])
def test_triton_kernels_end_to_end(mode, tmp_path, device, few_decode_splits, monkeypatch):
    """The real kernels (the interpreter on a CPU): RoPE fused with the K/V append, ragged
    and paged prefill, cascade (prefix + decode + merge) and flat decode, prefix hits and
    copy-on-write, and the CUDA-graph path's padded buffers (without capture)."""
    from cascadeinfer.engine import model_runner  # noqa: PLC0415
    from cascadeinfer.engine.model_runner import DecodeGraphs  # noqa: PLC0415

    calls = {"append_paged_kv_cache": 0, "append_paged_kv_cache_rope": 0}
    for name in calls:
        def counted(*args, _fn=getattr(model_runner, name), _name=name, **kwargs):
            calls[_name] += 1
            return _fn(*args, **kwargs)
        monkeypatch.setattr(model_runner, name, counted)
    model = _tiny("llama", tmp_path, num_hidden_layers=1)
    prompts = [PREFIX[:9] + [40 + i] for i in range(2)]  # 2 full shared pages + own page
    llm = _llm(tmp_path, device, use_cascade=mode != "flat", record_steps=True, max_graph_batch=4)
    if mode == "padded-graph-path":
        llm.runner.graphs = DecodeGraphs(llm.runner, capture=False)
    _check(llm, model, prompts, 3, device, SamplingParams(n=2 if mode == "cascade" else 1, max_tokens=3, **GREEDY))
    assert {s.cascade for s in llm.step_stats if s.num_decode} == {mode != "flat"}
    # On a GPU the engine captures decode graphs by default; on a CPU only the forced path uses them.
    assert any(s.graph for s in llm.step_stats) == (mode == "padded-graph-path" or device.type == "cuda")
    assert llm.cache.hits == 2
    # The fused layers leave the rotation to the step's attention: one launch per layer
    # rotates and appends, eager steps and graph steps alike.
    assert calls["append_paged_kv_cache_rope"] > 0 and calls["append_paged_kv_cache"] == 0


# ---- checkpoints ---------------------------------------------------------------------


def test_sharded_bf16_tied_checkpoint(tmp_path, device, torch_path):
    model = _tiny("llama", tmp_path / "src", tie_word_embeddings=True).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    llm = _llm(tmp_path / "sharded", device)
    assert llm.model.lm_head is None
    _check(llm, model.float(), UNSHARED, 6, device)


def test_llama3_rope_scaling(tmp_path, device, torch_path):
    rope = {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    model = _tiny("llama", tmp_path, rope_parameters=rope)
    llm = _llm(tmp_path, device)
    assert llm.model_config.rope_scaling.rope_type == "llama3"
    _check(llm, model, SHARED[:1], 8, device)


def test_config_parsing():
    old_style = {"model_type": "mistral", "vocab_size": 100, "hidden_size": 32, "intermediate_size": 64,
                 "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 1,
                 "rope_theta": 1e6, "rope_scaling": {"type": "linear", "factor": 2.0},
                 "sliding_window": 64, "max_position_embeddings": 1024, "eos_token_id": [2, 3]}
    cfg = ModelConfig.from_dict(old_style, {"eos_token_id": 7})
    assert (cfg.rope_theta, cfg.rope_scaling.rope_type, cfg.rope_scaling.factor) == (1e6, "linear", 2.0)
    assert cfg.context_length == 64 and cfg.head_dim == 8 and cfg.eos_token_ids == (2, 3, 7)
    bad = [
        ({**old_style, "model_type": "gpt2"}, "model_type"),
        ({**old_style, "hidden_act": "gelu"}, "hidden_act"),
        ({k: v for k, v in old_style.items() if k != "vocab_size"}, "vocab_size"),
        ({**old_style, "num_key_value_heads": 3}, "num_key_value_heads"),
        ({**old_style, "rope_scaling": {"type": "yarn", "factor": 4.0}}, "yarn"),
        ({**old_style, "eos_token_id": "x"}, "eos_token_id"),
    ]
    for cfg_dict, words in bad:
        with pytest.raises(ModelLoadError, match=words):
            ModelConfig.from_dict(cfg_dict)


def test_missing_or_malformed_files(tmp_path, llama):
    path, _ = llama
    with pytest.raises(ModelLoadError, match="not a directory"):
        LLM(tmp_path / "nowhere")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelLoadError, match="config.json"):
        LLM(empty)
    (empty / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="malformed JSON"):
        LLM(empty)
    (empty / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(ModelLoadError, match="safetensors"):
        LLM(empty, device="cpu")
    (empty / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage")
    with pytest.raises(ModelLoadError, match="malformed safetensors"):
        LLM(empty, device="cpu")
    from safetensors.torch import load_file, save_file  # noqa: PLC0415

    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, str(empty / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="lacks 1 tensors.*down_proj"):
        LLM(empty, device="cpu")
    tensors["model.layers.1.mlp.down_proj.weight"] = torch.zeros(3, 3)
    save_file(tensors, str(empty / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="down_proj.weight.*shape"):
        LLM(empty, device="cpu")


def test_text_prompts_with_tokenizer(tmp_path, device, torch_path):
    tokenizers = pytest.importorskip("tokenizers")
    model = _tiny("llama", tmp_path)
    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(VOCAB - 3)]
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.decoder = tokenizers.decoders.WordPiece()  # joins words with spaces
    tok.save(str(tmp_path / "tokenizer.json"))
    llm = _llm(tmp_path, device)
    text = "w10 w20 w30 w40"
    ids = [13, 23, 33, 43]
    out = llm.generate([text], SamplingParams(max_tokens=5, **GREEDY))[0]
    ref = hf_greedy(model, ids, 5, device)
    assert out.prompt_token_ids == ids and out.outputs[0].token_ids == ref
    assert out.outputs[0].text == " ".join(words[t] for t in ref)


def test_engine_options_are_checked(llama):
    path, _ = llama
    with pytest.raises(TypeError, match="unexpected keyword"):
        LLM(path, device="cpu", pages=3)
    with pytest.raises(ValueError, match="page_size"):
        LLM(path, device="cpu", page_size=0)
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(path, device="cpu", max_model_len=10**6)
    with pytest.raises(ValueError, match="need 6 pages"):
        LLM(path, device="cpu", num_pages=2, page_size=4).generate([1, 2, 3], SamplingParams(max_tokens=20))
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["model_type"] == "llama"


@pytest.mark.parametrize("use_cascade,levels", [(True, 2), (False, 2), (True, 3)])
def test_padded_graph_path_without_capture(use_cascade, levels, qwen2, device, torch_path):
    """The CUDA-graph decode path's fixed buffers and padding, run without capture; with 3
    levels two of the shared-prompt requests share 2 more pages."""
    from cascadeinfer.engine.model_runner import DecodeGraphs  # noqa: PLC0415

    path, model = qwen2
    llm = _llm(path, device, use_cascade=use_cascade, max_graph_batch=6, record_steps=True, cascade_levels=levels)
    llm.runner.graphs = DecodeGraphs(llm.runner, capture=False)
    prompts = SHARED + UNSHARED if levels == 2 else SHARED[:1] + [PREFIX + [9] * 8 + [i] for i in range(2)] + UNSHARED
    params = [SamplingParams(max_tokens=4 + 2 * i, **GREEDY) for i in range(len(prompts))]
    outs = llm.generate(prompts, params)
    for prompt, p, out in zip(prompts, params, outs):
        assert out.outputs[0].token_ids == hf_greedy(model, prompt, p.max_tokens, device)
    padded = {s.num_decode for s in llm.step_stats if s.graph}
    assert {5, 3} <= padded  # batches of 5 (bucket 6) and 3 (bucket 4) went through it
    if use_cascade:  # (batch bucket, cascade, a group bucket per shared level)
        assert any(len(key[2]) == levels - 1 for key in llm.runner.graphs.steps)
    _assert_no_leak(llm)


def test_stream_ends_with_the_final_output_and_its_reason(llama, device, torch_path):
    path, model = llama
    updates = list(_llm(path, device).stream([UNSHARED[0]], SamplingParams(max_tokens=3, **GREEDY)))
    assert [out.finished for _, out in updates] == [False, False, True]
    assert [out.outputs[0].finish_reason for _, out in updates] == [None, None, "length"]
    assert updates[-1][1].outputs[0].token_ids == hf_greedy(model, UNSHARED[0], 3, device)


def test_cli_generate_streams_and_batches(llama, tmp_path, device, torch_path, capsys):
    from cascadeinfer.engine.cli import main  # noqa: PLC0415

    path, model = llama
    common = ["--model", str(path), "--max-tokens", "5", "--ignore-eos", "--device", device.type,
              "--dtype", "float32", "--page-size", "4", "--num-pages", "64"]
    assert main(["generate", "--prompt", json.dumps(UNSHARED[1])] + common) == 0
    streamed = capsys.readouterr().out.split()
    assert [int(t) for t in streamed] == hf_greedy(model, UNSHARED[1], 5, device)
    prompts_file = tmp_path / "prompts.txt"
    prompts_file.write_text("\n".join(json.dumps(p) for p in SHARED) + "\n")
    assert main(["generate", "--prompts-file", str(prompts_file), "--no-progress"] + common) == 0
    out = capsys.readouterr().out
    for i, prompt in enumerate(SHARED):
        assert f"=== prompt {i} ===\n{json.dumps(hf_greedy(model, prompt, 5, device))}  (5 tokens, length)" in out
    with pytest.raises(SystemExit, match="temperature"):
        main(["generate", "--prompt", "[1]", "--temperature", "-1"] + common)
    with pytest.raises(SystemExit, match="tokenizer"):
        main(["generate", "--prompt", "no tokenizer here"] + common)
    with pytest.raises(SystemExit, match="not a directory"):
        main(["generate", "--prompt", "[1]", "--model", str(tmp_path / "missing")])


_BENCH = ["bench", "--preset", "tiny", "--requests", "5", "--prefix", "21", "--suffix", "3", "--new-tokens", "4",
          "--page-size", "4"]
_ENGINE_FIELDS = ["output_tokens", "wall_s", "tokens_per_s", "floor_tokens_per_s", "fraction_of_floor", "prefill_s",
                  "prefill_floor_s", "decode_step_ms", "decode_step_floor_ms", "decode_step_host_ms", "prompt_tokens",
                  "prefill_tokens", "kv_read_gb", "achieved_gb_s", "decode_steps", "graphs_captured_while_timed"]


@pytest.mark.parametrize("order", ["cascade,flat,hf", "hf,flat,cascade"])
def test_cli_bench_in_either_order(order, device, torch_path, capsys, tmp_path):
    from cascadeinfer.engine.cli import main  # noqa: PLC0415

    out_json = tmp_path / "runs" / "bench.json"
    out_json.parent.mkdir()
    # the check runs once; transformers warms up on all requests in one order, on two in the
    # other, where it also takes at most two requests per forward pass
    check = [] if order.startswith("cascade") else ["--skip-check", "--hf-warmup-requests", "2",
                                                    "--hf-max-requests", "2"]
    assert main(_BENCH + ["--device", device.type, "--modes", order, "--json", str(out_json)] + check) == 0
    out = capsys.readouterr().out
    assert ("# check: ok" if not check else "# check: skipped") in out
    assert "| cascadeinfer cascade | 20 |" in out and "| cascadeinfer flat | 20 |" in out
    assert "| transformers generate_batch |" in out and "cascade / flat tokens/s" in out
    result = json.loads(out_json.read_text())
    assert [r["mode"] for r in result["rows"]] == order.split(",")
    assert result["ceilings"]["copy_bandwidth_gb_s"] > 0 and result["ceilings"]["matmul_tflops"] > 0
    assert all(result["floors"][k] > 0 for k in ("prefill_s", "decode_step_first_ms", "end_to_end_s"))
    rows = {r["mode"]: r for r in result["rows"]}
    for mode in ("cascade", "flat"):
        row = rows[mode]
        assert all(row[k] is not None for k in _ENGINE_FIELDS), row
        assert row["output_tokens"] == 20 and row["graphs_captured_while_timed"] == 0
        assert 0 < row["decode_step_host_ms"] <= row["decode_step_ms"]
        # the GPU's time for the step's forward, from CUDA events: on a GPU only
        assert (row["decode_step_gpu_ms"] is None) == (device.type != "cuda")
        assert device.type != "cuda" or 0 < row["decode_step_gpu_ms"] < 10 * row["decode_step_ms"]
        assert 0 < row["prefill_floor_s"] and 0 < row["decode_step_floor_ms"] and 0 < row["fraction_of_floor"] < 1
        assert row["prompt_tokens"] == 5 * 24 and row["prefill_tokens"] == 24 + 4 * 4  # the 5 shared pages once
        assert row["decode_steps"] == 2 and row["preemptions"] == 0  # request 0 is a step ahead
    assert rows["cascade"]["cascade_steps"] == rows["cascade"]["decode_steps"] and rows["flat"]["cascade_steps"] == 0
    assert rows["cascade"]["kv_read_gb"] < rows["flat"]["kv_read_gb"]
    hf = rows["hf"]  # transformers' continuous batching, where the installed version has it
    if hasattr(transformers.LlamaForCausalLM, "generate_batch"):
        assert "error" not in hf, hf["error"]
        assert hf["warmup_requests"] == (5 if not check else 2)
        assert ("warmed up on 2 of its 5 requests" in out) == bool(check)
        assert hf["max_requests_per_batch"] == (2 if check else None)
        # sdpa, or the flash attention transformers switches to where a flash package and CUDA are there
        assert hf["attn_implementation"] in ("sdpa", "flash_attention_2", "flash_attention_3")
        assert f"; attention {hf['attn_implementation']}" in out
        assert hf["attn_implementation"] == "sdpa" or device.type == "cuda"
        assert ("at most 2 requests per forward pass" in out) == bool(check)
        assert hf["output_tokens"] == 20 and hf["fraction_of_floor"] > 0
    else:
        assert "has no generate_batch" in hf["error"]
    assert set(result["ratios"]) >= {"cascade / flat tokens/s", "flat / cascade decode step"}


def test_cli_bench_refuses_what_cannot_run(monkeypatch, tmp_path):
    from cascadeinfer.engine import bench  # noqa: PLC0415
    from cascadeinfer.engine.cli import main  # noqa: PLC0415

    monkeypatch.setattr(bench, "memory_available", lambda device: 8 * 10**9)
    with pytest.raises(SystemExit, match=r"--preset llama3-8b: .* need 29.5 GB per device in bfloat16 \(tensor parallel size 1\), but cpu has 8.0 GB.*--force"):
        main(["bench", "--preset", "llama3-8b", "--device", "cpu", "--dtype", "bfloat16"])
    with pytest.raises(SystemExit, match="--modes"):
        main(_BENCH + ["--device", "cpu", "--modes", "cascade,warp"])
    with pytest.raises(SystemExit, match="--modes"):
        main(_BENCH + ["--device", "cpu", "--modes", "flat,flat"])
    with pytest.raises(SystemExit, match="--json: the directory"):
        main(_BENCH + ["--device", "cpu", "--json", str(tmp_path / "missing" / "b.json")])
    with pytest.raises(SystemExit, match="--new-tokens"):
        main(_BENCH + ["--device", "cpu", "--new-tokens", "0"])
    with pytest.raises(SystemExit, match="--hf-warmup-requests: expected >= 1, got 0"):
        main(_BENCH + ["--device", "cpu", "--hf-warmup-requests", "0"])
    with pytest.raises(SystemExit, match="--hf-max-requests: expected >= 1, got -3"):
        main(_BENCH + ["--device", "cpu", "--hf-max-requests", "-3"])


@pytest.mark.gpu
def test_cuda_graphs_match_eager(llama, device):
    path, model = llama
    prompts = SHARED + UNSHARED
    graphs = _llm(path, device, use_cascade=True, record_steps=True, check_metadata=False)
    eager = _llm(path, device, use_cascade=True, enforce_eager=True)
    a = _check(graphs, model, prompts, 12, device)
    b = _check(eager, model, prompts, 12, device)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    assert any(s.graph and s.cascade for s in graphs.step_stats)
    flat = _llm(path, device, use_cascade=False, record_steps=True, check_metadata=False)
    _check(flat, model, prompts, 12, device)
    assert any(s.graph and s.cascade is False for s in flat.step_stats)


@pytest.mark.gpu
def test_realistic_head_dim_on_gpu(tmp_path, device):
    """head_dim 128, pages of 16, GQA 4, a 600-token shared prefix: the kernels' GPU tiles."""
    model = _tiny("llama", tmp_path, std=0.05, vocab_size=2000, hidden_size=1024, intermediate_size=2048,
                  num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024)
    gen = torch.Generator().manual_seed(5)
    prefix = torch.randint(0, 2000, (600,), generator=gen).tolist()
    prompts = [prefix + torch.randint(0, 2000, (5 + i,), generator=gen).tolist() for i in range(8)]
    for use_cascade in (True, False):
        llm = LLM(tmp_path, device=device, dtype=torch.float32, page_size=16, num_pages=512,
                  use_cascade=use_cascade, record_steps=True)
        _check(llm, model, prompts, 8, device)
        assert any(s.graph for s in llm.step_stats)


@pytest.mark.parametrize("num_pages", [96, 14])
def test_overlapped_steps_stop_preempt_and_fork(num_pages, llama, device, torch_path):
    """Decode steps of the graph path read their input tokens from the previous step's
    samples on the device while the host reads those samples a step late: requests that
    sample a stop token mid-batch (one exactly at its length limit), n > 1 samples, and a
    pool small enough to preempt still give transformers' tokens, and nothing leaks."""
    from cascadeinfer.engine.model_runner import DecodeGraphs  # noqa: PLC0415

    path, model = llama
    prompts = SHARED + UNSHARED
    refs = [hf_greedy(model, p, 8, device) for p in prompts]
    # Stop tokens taken from each reference: request i stops at its token i + 2, except
    # request 2, whose limit of 4 tokens is reached at its stop token; request 4 never stops.
    at = [2, 3, 3, 5]
    params = []
    for i, ref in enumerate(refs):
        stop = [ref[at[i]]] if i < 4 else []
        params.append(SamplingParams(max_tokens=4 if i == 2 else 8, stop_token_ids=stop, n=2 if i == 1 else 1,
                                     **GREEDY))
    llm = _llm(path, device, use_cascade=True, max_graph_batch=8, record_steps=True, num_pages=num_pages)
    llm.runner.graphs = DecodeGraphs(llm.runner, capture=False)
    outs = llm.generate(prompts, params)
    for i, (ref, out) in enumerate(zip(refs, outs)):
        for sample in out.outputs:
            if i < 4:
                end = ref.index(ref[at[i]]) + 1  # the first occurrence of the stop token ends it
                assert sample.token_ids == ref[:end] and sample.finish_reason == "stop", i
            else:
                assert sample.token_ids == ref and sample.finish_reason == "length"
    assert any(s.graph for s in llm.step_stats)
    if num_pages == 14:
        assert llm.num_preemptions > 0
    _assert_no_leak(llm)
    # Seeded sampling (n > 1 included) reads a step late as it reads at once: the same
    # tokens as the eager engine, whose steps each wait for their samples.
    sampled = [SamplingParams(temperature=0.9, top_k=50, top_p=0.9, max_tokens=8, seed=3 + i, n=1 + (i == 1),
                              stop_token_ids=params[i].stop_token_ids, ignore_eos=True) for i in range(len(prompts))]
    late = [[s.token_ids for s in o.outputs] for o in llm.generate(prompts, sampled)]
    eager = [[s.token_ids for s in o.outputs] for o in _llm(path, device, num_pages=num_pages).generate(prompts, sampled)]
    assert late == eager
    _assert_no_leak(llm)
