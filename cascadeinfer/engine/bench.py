"""``cascadeinfer bench``: end-to-end throughput on a synthetic shared-prefix workload.

The workload: ``--requests`` prompts, each a ``--prefix``-token system prompt shared by all
followed by a ``--suffix``-token unique part, ``--new-tokens`` greedy tokens each (EOS
ignored). The model is a random-weight model of a preset's shapes (``--preset
llama3-8b``), built in memory without any checkpoint, or a local checkpoint (``--model``).

What runs, in order:

1. **Check** (unless ``--skip-check``): a small random fp32 Llama on the same device; the
   engine's greedy tokens with cascade forced on and with flat decode must equal
   transformers' generate on shared-prefix prompts, else the bench stops (exit 1).
2. **Copy bandwidth** (CUDA): a 1 GiB device-to-device copy (``torch.add(x, 0, out=y)``),
   timed as a CUDA-graph replay, median; bytes read + written per second.
3. **Engine runs**, one per ``--modes`` entry among ``cascade`` (decode attention forced
   to the cascade), ``flat`` (forced flat paged decode) and ``auto`` (the planner
   chooses each step): the same engine, warmed up (kernels compiled, graphs captured for
   a small batch) and with the prefix cache emptied before each run. Output tokens/s =
   requests × new tokens / wall time of ``generate`` (prefill included). For the decode
   steps at full batch: the median step time (host scheduling and sampling included) and
   the achieved bandwidth = (weight bytes + KV bytes the decode attention reads) / step
   time, against the copy bandwidth. KV bytes count the shared prefix once for cascade
   and once per request for flat (what each algorithm must read; flat may be served
   partly from L2).
4. **transformers generate** (``hf`` in ``--modes``, when transformers is installed): the
   same model shapes with random weights (sdpa attention), on ``--hf-requests`` of the
   prompts as one padded-free batch (all prompts have the same length), after the engine
   is freed. Out of memory is reported, not fatal.

A markdown table is printed at the end; ``--json PATH`` (and ``$OUT/bench_engine.json``
when ``OUT`` is set) receives every number.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import tempfile
import time
from dataclasses import replace
from datetime import date

import torch

from cascadeinfer.engine.model_loader import PRESETS, ModelConfig, parse_dtype
from cascadeinfer.engine.sampling import SamplingParams

QUICK = dict(requests=64, prefix=1024, suffix=64, new_tokens=64, hf_requests=16)


def add_bench_args(b: argparse.ArgumentParser) -> None:
    src = b.add_mutually_exclusive_group()
    src.add_argument("--preset", default=None, choices=sorted(PRESETS), help="random weights of these shapes (default llama3-8b)")
    src.add_argument("--model", default=None, help="a local checkpoint directory instead of a preset")
    b.add_argument("--requests", type=int, default=256)
    b.add_argument("--prefix", type=int, default=4096, help="shared system-prompt tokens")
    b.add_argument("--suffix", type=int, default=128, help="unique tokens per request")
    b.add_argument("--new-tokens", type=int, default=256)
    b.add_argument("--hf-requests", type=int, default=32, help="requests in transformers' batch (memory)")
    b.add_argument("--modes", default="cascade,flat,hf", help="comma list of cascade, flat, auto, hf")
    b.add_argument("--quick", action="store_true",
                   help=f"a smaller workload: {', '.join(f'{k}={v}' for k, v in QUICK.items())}")
    b.add_argument("--skip-check", action="store_true", help="skip the correctness check")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--json", default=None, help="write the results here as JSON")


# ---- measurements ---------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, nbytes: int = 2**30) -> float | None:
    """Bytes/s (read + write) of a large device copy, CUDA-graph replay median; None on CPU."""
    if device.type != "cuda":
        return None
    import triton  # noqa: PLC0415

    x = torch.randn(nbytes // 4, device=device)
    y = torch.empty_like(x)
    torch.add(x, 0, out=y)
    _sync(device)
    seconds = triton.testing.do_bench_cudagraph(lambda: torch.add(x, 0, out=y), rep=200, return_mode="median") * 1e-3
    if not torch.equal(x, y):
        raise RuntimeError("copy bandwidth: the copy is wrong")
    return 2 * nbytes / seconds


def _workload(vocab: int, requests: int, prefix: int, suffix: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, vocab, (prefix,), generator=gen).tolist()
    return [shared + torch.randint(3, vocab, (suffix,), generator=gen).tolist() for _ in range(requests)]


def _hf_config(mc: ModelConfig):
    """A transformers config of the same shapes (either transformers 4 or 5 spelling)."""
    import transformers  # noqa: PLC0415

    rope = {"rope_type": "default", "rope_theta": mc.rope_theta}
    if mc.rope_scaling is not None:
        s = mc.rope_scaling
        rope = {"rope_type": s.rope_type, "rope_theta": mc.rope_theta, "factor": s.factor,
                "low_freq_factor": s.low_freq_factor, "high_freq_factor": s.high_freq_factor,
                "original_max_position_embeddings": s.original_max_position_embeddings}
    common = dict(vocab_size=mc.vocab_size, hidden_size=mc.hidden_size, intermediate_size=mc.intermediate_size,
                  num_hidden_layers=mc.num_layers, num_attention_heads=mc.num_qo_heads,
                  num_key_value_heads=mc.num_kv_heads, head_dim=mc.head_dim, rms_norm_eps=mc.rms_norm_eps,
                  max_position_embeddings=mc.max_position_embeddings, tie_word_embeddings=mc.tie_word_embeddings,
                  eos_token_id=None, bos_token_id=None)
    if int(transformers.__version__.split(".")[0]) >= 5:
        common["rope_parameters"] = rope
    else:
        common["rope_theta"] = mc.rope_theta
        if mc.rope_scaling is not None:
            common["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    if mc.model_type == "qwen2":
        return transformers.Qwen2Config(**common), transformers.Qwen2ForCausalLM
    common.update(attention_bias=mc.qkv_bias, mlp_bias=mc.mlp_bias)
    return transformers.LlamaConfig(**common), transformers.LlamaForCausalLM


def _hf_model(mc: ModelConfig, dtype: torch.dtype, device: torch.device):
    cfg, cls = _hf_config(mc)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(cfg)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def _hf_generate(model, prompts: list[list[int]], new_tokens: int, device: torch.device) -> list[list[int]]:
    ids = torch.tensor(prompts, device=device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[:, ids.shape[1]:].tolist()


def correctness_check(device: torch.device, page_size: int) -> str:
    """Engine (cascade and flat) vs transformers greedy on a small random fp32 Llama."""
    try:
        import transformers  # noqa: F401, PLC0415
    except ImportError:
        return "skipped (transformers not installed)"
    from cascadeinfer.engine.llm import LLM  # noqa: PLC0415

    mc = ModelConfig(model_type="llama", vocab_size=1000, hidden_size=256, intermediate_size=512, num_layers=2,
                     num_qo_heads=8, num_kv_heads=2, head_dim=32 if device.type == "cpu" else 64,
                     max_position_embeddings=1024)
    mc = replace(mc, hidden_size=mc.num_qo_heads * mc.head_dim)
    model = _hf_model(mc, torch.float32, device)
    gen = torch.Generator(device="cpu").manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.1 if p.dim() > 1 else 0.2) + (1.0 if "norm" in name else 0.0))
    prompts = _workload(mc.vocab_size, 6, 3 * page_size + 5, 7, seed=2)
    prompts.append(prompts[0][:11])
    ref = [_hf_generate(model, [p], 12, device)[0] for p in prompts]
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        del model
        for use_cascade in (True, False):
            llm = LLM(tmp, dtype=torch.float32, device=device, page_size=page_size, num_pages=256,
                      use_cascade=use_cascade, max_num_seqs=8)
            outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
            got = [o.outputs[0].token_ids for o in outs]
            if got != ref:
                bad = next(i for i, (a, b) in enumerate(zip(got, ref)) if a != b)
                raise SystemExit(f"CHECK FAILED ({'cascade' if use_cascade else 'flat'}): prompt {bad}: "
                                 f"engine {got[bad]} != transformers {ref[bad]}")
            del llm
    return "ok (cascade and flat decode equal transformers greedy on 7 prompts, fp32)"


def _engine_run(llm, prompts, params, mode: str, device: torch.device, copy_bw: float | None) -> dict:
    llm.set_use_cascade({"cascade": True, "flat": False, "auto": None}[mode])
    llm.reset_prefix_cache()
    llm.step_stats.clear()
    _sync(device)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    _sync(device)
    wall = time.perf_counter() - t0
    new_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    full = [s for s in llm.step_stats if s.num_prefill_tokens == 0 and s.num_decode == len(prompts)]
    row = {"engine": f"cascadeinfer {mode}", "requests": len(prompts), "output_tokens": new_tokens,
           "wall_s": wall, "tokens_per_s": new_tokens / wall, "preemptions": llm.num_preemptions}
    if full:
        step = statistics.median(s.seconds for s in full)
        mc = llm.model_config
        kv_bytes_per_token = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * llm.pool.cache.element_size()
        kv = statistics.median(s.kv_tokens_read for s in full) * kv_bytes_per_token
        weights = llm.model.weight_bytes()
        row.update(decode_step_ms=step * 1e3, decode_steps=len(full), weights_gb=weights / 1e9, kv_gb=kv / 1e9,
                   achieved_gb_s=(weights + kv) / step / 1e9,
                   cascade_steps=sum(bool(s.cascade) for s in full), graph_steps=sum(s.graph for s in full))
        if copy_bw:
            row["fraction_of_copy_bw"] = (weights + kv) / step / copy_bw
    return row


def _table(rows: list[dict]) -> str:
    cols = [("engine", "engine"), ("requests", "requests"), ("output_tokens", "output tokens"), ("wall_s", "wall s"),
            ("tokens_per_s", "output tok/s"), ("decode_step_ms", "decode step ms"), ("weights_gb", "weights GB"),
            ("kv_gb", "KV GB/step"), ("achieved_gb_s", "achieved GB/s"), ("fraction_of_copy_bw", "of copy BW")]

    def fmt(x) -> str:
        if x is None:
            return "—"
        if isinstance(x, float):
            return f"{x:.3g}" if abs(x) < 1000 else f"{x:.0f}"
        return str(x)

    lines = ["| " + " | ".join(c for _, c in cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r.get(k)) for k, _ in cols) + " |" for r in rows]
    return "\n".join(lines)


def _environment(device: torch.device) -> dict:
    import triton  # noqa: PLC0415

    try:
        import transformers  # noqa: PLC0415

        hf = transformers.__version__
    except ImportError:
        hf = None
    return {"date": date.today().isoformat(),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
            "python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
            "transformers": hf}


def cmd_bench(args: argparse.Namespace) -> int:
    from cascadeinfer.engine.cli import _engine_kwargs  # noqa: PLC0415
    from cascadeinfer.engine.llm import LLM  # noqa: PLC0415
    from cascadeinfer.engine.model_loader import preset  # noqa: PLC0415

    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = set(modes) - {"cascade", "flat", "auto", "hf"}
    if unknown or not modes:
        raise SystemExit(f"--modes: expected a comma list of cascade, flat, auto, hf; got {args.modes!r}")
    for name in ("requests", "prefix", "suffix", "new_tokens", "hf_requests"):
        if getattr(args, name) < (0 if name in ("prefix", "suffix") else 1):
            raise SystemExit(f"--{name.replace('_', '-')}: got {getattr(args, name)}")
    if args.prefix + args.suffix < 1:
        raise SystemExit("--prefix, --suffix: a prompt needs at least one token")
    kwargs = _engine_kwargs(args)
    device = torch.device(kwargs.pop("device") or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = kwargs.pop("dtype")
    dtype = parse_dtype(dtype if dtype != "auto" else ("bfloat16" if device.type == "cuda" else "float32"))
    kwargs["max_model_len"] = kwargs["max_model_len"] or args.prefix + args.suffix + args.new_tokens
    kwargs.pop("use_cascade")
    env = _environment(device)
    workload = {"requests": args.requests, "prefix": args.prefix, "suffix": args.suffix,
                "new_tokens": args.new_tokens, "model": args.model or args.preset or "llama3-8b", "dtype": str(dtype)}
    print("# " + ", ".join(f"{k} {v}" for k, v in env.items()), flush=True)
    print("# workload: " + ", ".join(f"{k} {v}" for k, v in workload.items()), flush=True)

    check = "skipped" if args.skip_check else correctness_check(device, args.page_size)
    print(f"# check: {check}", flush=True)
    gc.collect()
    copy_bw = copy_bandwidth(device)
    if copy_bw:
        print(f"# measured copy bandwidth: {copy_bw / 1e9:.0f} GB/s (1 GiB torch copy, read + write)", flush=True)

    engine_modes = [m for m in modes if m != "hf"]
    rows: list[dict] = []
    if args.model:
        llm = LLM(args.model, device=device, dtype=dtype, tokenizer=False, record_steps=True, **kwargs)
        mc = llm.model_config
    else:
        mc = preset(args.preset or "llama3-8b")
        llm = LLM.from_config(mc, device=device, dtype=dtype, seed=args.seed, record_steps=True, **kwargs) \
            if engine_modes else None
    prompts = _workload(mc.vocab_size, args.requests, args.prefix, args.suffix, args.seed)
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    if llm is not None:
        print(f"# engine: {llm.pool.num_pages} KV pages of {llm.config.page_size} tokens, "
              f"{llm.model.weight_bytes() / 1e9:.1f} GB of weights", flush=True)
        # Warm up on the timed workload itself (a few tokens): every kernel specialisation
        # compiles and the decode graph of the timed batch size is captured before timing.
        for mode in engine_modes:
            llm.set_use_cascade({"cascade": True, "flat": False, "auto": None}[mode])
            llm.reset_prefix_cache()
            llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        for mode in engine_modes:
            row = _engine_run(llm, prompts, params, mode, device, copy_bw)
            rows.append(row)
            print(f"# {row['engine']}: {row['tokens_per_s']:.0f} output tok/s", flush=True)
        del llm
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()

    if "hf" in modes:
        rows.append(_hf_run(mc, dtype, device, prompts[:args.hf_requests], args.new_tokens))
        hf = rows[-1]
        print(f"# {hf['engine']}: " + (f"{hf['tokens_per_s']:.0f} output tok/s" if "tokens_per_s" in hf else hf["error"]),
              flush=True)

    print()
    print(_table(rows))
    by = {r["engine"]: r.get("tokens_per_s") for r in rows}
    notes = []
    if by.get("cascadeinfer cascade") and by.get("cascadeinfer flat"):
        notes.append(f"cascade / flat: {by['cascadeinfer cascade'] / by['cascadeinfer flat']:.2f}x")
    hf_tps = next((r.get("tokens_per_s") for r in rows if r["engine"].startswith("transformers")), None)
    if hf_tps and by.get("cascadeinfer cascade"):
        notes.append(f"cascade / transformers: {by['cascadeinfer cascade'] / hf_tps:.2f}x")
    if notes:
        print("\n" + "; ".join(notes))
    payload = {"environment": env, "workload": workload, "check": check,
               "copy_bandwidth_gb_s": copy_bw / 1e9 if copy_bw else None, "rows": rows}
    for path in [args.json] + ([os.path.join(os.environ["OUT"], "bench_engine.json")] if os.environ.get("OUT") else []):
        if path:
            with open(path, "w") as f:
                json.dump(payload, f, indent=1)
    return 0


def _hf_run(mc: ModelConfig, dtype: torch.dtype, device: torch.device, prompts: list[list[int]], new_tokens: int) -> dict:
    row = {"engine": "transformers generate (sdpa)", "requests": len(prompts)}
    try:
        import transformers  # noqa: F401, PLC0415
    except ImportError:
        return {**row, "error": "transformers not installed"}
    try:
        model = _hf_model(mc, dtype, device)
        _hf_generate(model, prompts[:2], 2, device)  # warm up
        _sync(device)
        t0 = time.perf_counter()
        out = _hf_generate(model, prompts, new_tokens, device)
        _sync(device)
        wall = time.perf_counter() - t0
    except torch.OutOfMemoryError as exc:
        return {**row, "error": f"out of memory ({str(exc).splitlines()[0][:80]})"}
    finally:
        model = None
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    tokens = sum(len(o) for o in out)
    return {**row, "output_tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall}
