"""The host's part of a full-batch decode step, with the model's GPU work taken away.

    python -m benchmarks.tools.probe_engine_host --requests 256 --prefix 4096 --suffix 128 --json PATH

Builds an engine over a small random model (``--preset tiny``) whose forward pass is
replaced by a stub that returns the logits buffer untouched, so a step costs only what
the engine does around the model: scheduling, grouping the rows into levels, planning the
cascade, filling the step's inputs, sampling, reading the previous step's tokens and
advancing the sequences. Decode steps take the graph path's buffers (not captured on a
CPU). ``--requests`` requests of ``--prefix`` shared and ``--suffix`` own tokens are run
until the whole batch decodes; then ``--steps`` steps are timed bare, and as many again
with each part's own time summed (each part wrapped in a timer, which adds about 1 µs a
call). Printed: ms per step, bare and by part. Runs on the CPU by default; on a GPU
(``--device cuda``) the parts include their CUDA calls (copies, events, the argmax).
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import time

import torch

from benchmarks._common import environment, markdown_table, write_json
from benchmarks.tools.profile_engine_step import step_until_full_batch


def build(args) -> object:
    """The engine with its model stubbed, stepped until the whole batch decodes."""
    from cascadeinfer.engine.bench import Workload  # noqa: PLC0415
    from cascadeinfer.engine.llm import LLM  # noqa: PLC0415
    from cascadeinfer.engine.model_loader import preset  # noqa: PLC0415
    from cascadeinfer.engine.sampling import SamplingParams  # noqa: PLC0415

    length = args.prefix + args.suffix + args.steps * 2 + 8
    mc = preset(args.preset, max_position_embeddings=length)
    pages = args.requests * (-(-(args.suffix + args.steps * 2 + 8) // args.page_size) + 1) + length // args.page_size
    llm = LLM.from_config(mc, device=args.device, dtype=torch.float32, record_steps=True, page_size=args.page_size,
                          max_num_seqs=args.requests, decode_graph_path=True, max_model_len=length,
                          num_pages=pages + 16)

    def stub(input_ids, positions, attention, sample_index=None, *_, out=None, **__):
        rows = input_ids.shape[0] if sample_index is None else sample_index.shape[0]
        return out if out is not None else torch.zeros(rows, mc.vocab_size, device=input_ids.device)

    llm.runner.model.forward = stub
    params = SamplingParams(temperature=0.0, max_tokens=args.steps * 2 + 8, ignore_eos=True)
    for prompt in Workload(args.requests, args.prefix, args.suffix, args.steps * 2 + 8).prompts(mc.vocab_size, 0):
        llm.add_request(prompt, params)
    step_until_full_batch(llm, args.requests)
    return llm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prefix", type=int, default=4096)
    ap.add_argument("--suffix", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--steps", type=int, default=40, help="steps timed, bare and by part")
    ap.add_argument("--updates", action="store_true", help="an output for every request each step, as step() gives")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", metavar="PATH", help="write the results and the environment here as JSON")
    args = ap.parse_args()
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "0"  # the prefill's kernels take their PyTorch path
        torch.set_num_threads(1)
    llm = build(args)

    def step() -> None:
        with torch.inference_mode():
            llm._step(updates=args.updates)

    first = len(llm.step_stats)
    for _ in range(args.steps):
        step()
    bare = statistics.median(s.seconds for s in llm.step_stats[first:]) * 1e3

    import cascadeinfer.engine.llm as llm_module  # noqa: PLC0415
    import cascadeinfer.engine.model_runner as runner_module  # noqa: PLC0415

    spent: dict[str, float] = collections.defaultdict(float)

    def timed(owner, name: str, part: str) -> None:
        inner = getattr(owner, name)

        def call(*a, **k):
            t0 = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                spent[part] += time.perf_counter() - t0

        setattr(owner, name, call)

    graphs = llm.runner.graphs
    parts = [(llm.scheduler, "schedule", "schedule"), (llm.runner, "execute", "execute"),
             (runner_module, "group_levels", "execute: group_levels"),
             (runner_module, "choose_cascade", "execute: choose_cascade"),
             (graphs, "run", "execute: plan, fill, replay"), (graphs, "_fill", "execute: fill the inputs"),
             (llm_module, "sample", "sample"), (llm, "_resolve", "read the previous tokens"),
             (llm.scheduler, "advance", "advance")]
    for owner, name, part in parts:
        timed(owner, name, part)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    total = (time.perf_counter() - t0) / args.steps * 1e3
    rows = [{"part": "a step, bare", "ms": round(bare, 3)}, {"part": "a step, parts timed", "ms": round(total, 3)}]
    rows += [{"part": part, "ms": round(spent[part] / args.steps * 1e3, 3)} for _, _, part in parts]
    print(f"# {args.requests} requests, prefix {args.prefix}, suffix {args.suffix}, page {args.page_size}, "
          f"{args.device}; ms per full-batch decode step (the model stubbed)")
    print(markdown_table(rows, ["part", "ms"]))
    write_json(args.json, {"environment": environment(), "workload": {k: v for k, v in vars(args).items() if k != "json"},
                           "parts": rows})


if __name__ == "__main__":
    main()
