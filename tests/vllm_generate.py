"""Run one vLLM (CPU build) engine over the shared-prompt scenarios and write the tokens
and the attention implementation that ran as JSON: ``python tests/vllm_generate.py
MODEL_DIR OUT_JSON`` (with our backend, each step's plan too). With
``CASCADEINFER_VLLM_REPLACE=CPU_ATTN`` in the environment our backend runs in place of
vLLM's own (the plugin's entry point reads it); without, vLLM's runs. Called by
tests/test_vllm_plugin.py, one process per engine.
"""

import json
import os
import sys

if os.environ.get("TRITON_INTERPRET") == "1":  # our kernels through Triton's interpreter, patched as in the tests
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import conftest  # noqa: F401

from vllm import LLM, SamplingParams


def scenarios(vocab: int) -> list[tuple[list[int], dict]]:
    """(prompt, sampling) pairs: two system prompts shared by groups of requests, n > 1
    (seeded sampling: vLLM has no greedy n > 1), requests finishing at different times,
    one unshared prompt; greedy elsewhere."""
    system_a = [(13 * i + 5) % vocab for i in range(100)]  # 3 full blocks of 32 and a part
    system_b = [(7 * i + 11) % vocab for i in range(70)]
    out = []
    for i in range(5):
        out.append((system_a + [(31 * i + 3) % vocab, (17 * i + 1) % vocab], dict(max_tokens=4 + 2 * i)))
    for i in range(3):
        out.append((system_b + [(29 * i + 2) % vocab], dict(max_tokens=7)))
    out.append((system_a + [9, 8, 7], dict(max_tokens=6, n=2, temperature=0.8, seed=1234)))  # seeded sampling
    out.append(([3, 1, 4, 1, 5, 9, 2, 6], dict(max_tokens=9)))
    return out


def record_steps() -> list[list]:
    """With our backend: every step's plan as (decode rows, prefill rows?, cascade?),
    recorded in this process (vLLM runs its engine here: no worker processes)."""
    steps: list[list] = []
    if not os.environ.get("CASCADEINFER_VLLM_REPLACE"):
        return steps
    from cascadeinfer.integrations.vllm import backend  # noqa: PLC0415

    plan_step = backend.plan_step

    def recorded(*args, **kwargs):
        plan = plan_step(*args, **kwargs)
        steps.append([plan.num_decodes, plan.prefill is not None, plan.use_cascade])
        return plan

    backend.plan_step = recorded
    return steps


def main() -> None:
    model, out_path = sys.argv[1], sys.argv[2]
    steps = record_steps()
    llm = LLM(model=model, skip_tokenizer_init=True, enforce_eager=True, dtype="float32", block_size=32,
              max_model_len=256, max_num_seqs=8, max_num_batched_tokens=96, seed=0, kv_cache_memory_bytes=64 << 20,
              enable_prefix_caching=True)
    vocab = llm.llm_engine.model_config.get_vocab_size()
    work = scenarios(vocab)
    prompts = [{"prompt_token_ids": p} for p, _ in work]
    params = [SamplingParams(ignore_eos=True, **{"temperature": 0.0, **kw}) for _, kw in work]
    runs = []
    for _ in range(2):  # the second time the prompts' full blocks come from the prefix cache
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs.append([[list(c.token_ids) for c in o.outputs] for o in outs])
    impls = llm.apply_model(lambda model: sorted({type(m.impl).__name__ for m in model.modules() if hasattr(m, "impl")}))
    with open(out_path, "w") as f:
        json.dump({"runs": runs, "attention": impls[0], "steps": steps}, f)


if __name__ == "__main__":
    main()
