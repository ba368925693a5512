"""``cascadeinfer bench``: end-to-end throughput on a shared-prefix workload, against floors.

The workload: ``--requests`` prompts, each a ``--prefix``-token system prompt shared by all
followed by a ``--suffix``-token unique part, ``--new-tokens`` greedy tokens each (EOS
ignored), all submitted at once. The model is a random-weight model of a preset's shapes
(``--preset llama3-8b``; ``--preset tiny`` for a CPU), built in memory without any
checkpoint, or a local checkpoint (``--model``). A model whose weights and KV cache would
not fit the device's free memory is refused unless ``--force`` is given.

What runs, in order:

1. **Check** (unless ``--skip-check``): a small random fp32 Llama on the same device; the
   engine's greedy tokens with cascade forced on and with flat decode must equal
   transformers' generate on shared-prefix prompts, else the bench stops (exit 1).
2. **Ceilings**, measured on the device in this run: the copy bandwidth (a large
   ``torch.add(x, 0, out=y)``, bytes read + written per second) and the matmul rate (a
   square ``torch.mm`` in the engine's dtype, bf16 on a GPU), each the median of many
   timed calls (CUDA-graph replays on a GPU).
3. **Runs**, one per ``--modes`` entry, in the order given: ``cascade`` (the engine, decode
   attention forced to the cascade), ``flat`` (forced flat paged decode), ``auto`` (the
   planner chooses each step), ``beam`` (beam search, ``--beam-width`` beams), ``swap``
   and ``recompute`` (memory pressure: the engine with a KV pool of ``--pressure``
   times the pages the workload needs, its preempted sequences swapped to host memory or
   recomputed) and ``hf`` (transformers' own continuous batching,
   ``generate_batch`` with its paged attention, over the same requests). Each mode first
   runs, untimed, a workload of the same shapes with other tokens: every kernel is
   compiled and every CUDA-graph bucket the timed run uses is captured (the timed run is
   checked to capture none), and nothing it cached can serve the timed prompts. The
   engine's prefix cache is emptied before the timed run (``--hf-warmup-requests N``
   warms transformers up on the first N of those requests only, where one pass over all
   of them takes minutes; its row then says so; ``--hf-max-requests N`` is its
   ``max_requests_per_batch``). One engine serves all engine
   modes; it is freed before ``hf`` runs (and built again, the same, for engine modes
   after it), so the order of the modes changes no run's conditions.

Reported per run (table, and every number in ``--json PATH``):

* **end to end**: output tokens / wall time of the whole batch (prefill included), and
  the fraction of its floor: the prefill of the shared prompt once plus every suffix, then
  ``new_tokens - 1`` decode steps of the whole batch (``max_num_seqs`` at a time), each
  at the decode step floor below.
* **prefill**: the time of the steps that carry prompt tokens (the decode tokens of
  requests admitted earlier ride along), against the floor of computing the shared prompt
  once plus the suffixes: max(weight bytes per step of ``max_num_batched_tokens`` + KV
  bytes written, / copy bandwidth; 2 · matmul params · tokens + attention FLOPs, / matmul
  rate). Also the prompt tokens the engine computed against those submitted.
* **decode step**: the median over the steps that decode the full batch (host work
  included), against the median of those steps' floors: max((weight bytes + KV bytes
  read with the shared prefix once + KV bytes written) / copy bandwidth, (2 · matmul
  params · batch + attention FLOPs) / matmul rate). The KV bytes the mode's attention
  actually reads are reported beside it (flat re-reads the prefix for every request),
  and the host's own part of the step (its time less the wait for the previous step's
  tokens): a step whose host part is near its whole time is bound by the host. On a GPU
  also the GPU's time for the step's forward (CUDA events around it): a step whose GPU
  time is near its whole time is bound by the GPU.

Floors are lower bounds: they leave out what a perfect kernel could avoid or overlap
(activations, the prefill's reads of the prefix, norms, sampling). With
``--tensor-parallel-size N`` they are one device's share (1/N of the layers' weights,
heads and KV, the whole output projection) and leave out the all-reduces, whose time
per decode step is reported beside them: the step's 2 · layers all-reduces of
``[batch, hidden]``, timed alone on every rank (replayed from a CUDA graph on GPUs).
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
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import date

import torch

from cascadeinfer.engine.beam import BeamSearchParams
from cascadeinfer.engine.model_loader import PRESETS, ModelConfig, ModelLoadError, parse_dtype
from cascadeinfer.engine.sampling import SamplingParams
from cascadeinfer.kernels import hot_path

QUICK = dict(requests=64, prefix=1024, suffix=64, new_tokens=64)
MODES = ("cascade", "flat", "auto", "beam", "swap", "recompute", "hf")
_ENGINE_MODES = {"cascade": True, "flat": False, "auto": None}


def add_bench_args(b: argparse.ArgumentParser) -> None:
    src = b.add_mutually_exclusive_group()
    src.add_argument("--preset", default=None, choices=sorted(PRESETS), help="random weights of these shapes (default llama3-8b)")
    src.add_argument("--model", default=None, help="a local checkpoint directory instead of a preset")
    b.add_argument("--num-layers", type=int, default=None,
                   help="a preset with this many of its layers (e.g. a 70B model's shapes on fewer devices)")
    b.add_argument("--requests", type=int, default=256)
    b.add_argument("--prefix", type=int, default=4096, help="shared system-prompt tokens")
    b.add_argument("--suffix", type=int, default=128, help="unique tokens per request")
    b.add_argument("--new-tokens", type=int, default=256)
    b.add_argument("--modes", default="cascade,flat,hf",
                   help="comma list, run in this order, of cascade, flat, auto (the engine), beam (the engine's "
                        "beam search, --beam-width beams a prompt) and hf (transformers)")
    b.add_argument("--beam-width", type=int, default=4, help="beams per prompt in the beam mode")
    b.add_argument("--hf-warmup-requests", type=int, default=None, metavar="N",
                   help="warm transformers up on N requests of the workload's shapes (default: all of them)")
    b.add_argument("--hf-max-requests", type=int, default=None, metavar="N",
                   help="transformers' max_requests_per_batch: at most N requests in one of its forward passes "
                        "(default: its own choice)")
    b.add_argument("--pressure", type=float, default=0.5,
                   help="the swap and recompute modes' KV pool, as a fraction of the pages the workload needs")
    b.add_argument("--quick", action="store_true",
                   help=f"a smaller workload: {', '.join(f'{k}={v}' for k, v in QUICK.items())}")
    b.add_argument("--skip-check", action="store_true", help="skip the correctness check")
    b.add_argument("--force", action="store_true", help="run even when the model seems not to fit the device's memory")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--json", default=None, metavar="PATH", help="write the results here as JSON")


# ---- device ceilings ------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_seconds(fn: Callable[[], object], device: torch.device) -> float:
    """Median time of ``fn``: CUDA-graph replays on a GPU, timed calls on a CPU."""
    if device.type == "cuda":
        import triton  # noqa: PLC0415

        fn()
        _sync(device)
        return triton.testing.do_bench_cudagraph(fn, rep=200, return_mode="median") * 1e-3
    fn()
    times = []
    for _ in range(9):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(device: torch.device) -> float:
    """Bytes/s (read + written) of a large device copy: 1 GiB on a GPU, 64 MiB on a CPU."""
    nbytes = 2**30 if device.type == "cuda" else 2**26
    x = torch.randn(nbytes // 4, device=device)
    y = torch.empty_like(x)
    seconds = _median_seconds(lambda: torch.add(x, 0, out=y), device)
    if not torch.equal(x, y):
        raise RuntimeError("copy bandwidth: the copy is wrong")
    return 2 * nbytes / seconds


def matmul_rate(device: torch.device, dtype: torch.dtype) -> float:
    """FLOP/s of a square ``torch.mm`` in ``dtype``: 8192 on a GPU, 512 on a CPU."""
    n = 8192 if device.type == "cuda" else 512
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, generator=gen).to(dtype)
    b = torch.randn(n, n, device=device, generator=gen).to(dtype)
    c = torch.empty(n, n, device=device, dtype=dtype)
    seconds = _median_seconds(lambda: torch.mm(a, b, out=c), device)
    return 2 * n**3 / seconds


@dataclass(frozen=True, slots=True)
class Ceilings:
    """What the device reaches in this run: copy bytes/s (read + written), matmul FLOP/s."""

    copy_bytes_per_s: float
    matmul_flops_per_s: float

    def __post_init__(self) -> None:
        for name in ("copy_bytes_per_s", "matmul_flops_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: expected a positive rate, got {getattr(self, name)!r}")


# ---- model arithmetic and floors ------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ModelCosts:
    """Bytes and FLOPs of a model's steps.

    ``weight_bytes``: what every step reads (all weights but the embedding table, unless
    tied). ``body_params``: the matmul weights every token meets; ``head_params``: the
    output projection, met by the tokens whose logits are computed. An attention *pair*
    is one query and one key in every layer: QK and PV, ``4 · heads · head_dim`` FLOPs.
    """

    weight_bytes: int
    body_params: int
    head_params: int
    kv_bytes_per_token: int
    flops_per_pair: int

    @classmethod
    def of(cls, mc: ModelConfig, weight_bytes: int, elem_bytes: int, tensor_parallel_size: int = 1) -> ModelCosts:
        """One device's share: with tensor parallelism over ``n`` devices each holds 1/n of
        the layers' weights, heads and KV, and the whole output projection (every rank
        computes the logits)."""
        h, d, n = mc.hidden_size, mc.head_dim, tensor_parallel_size
        layer = h * (mc.num_qo_heads + 2 * mc.num_kv_heads) * d + mc.num_qo_heads * d * h + 3 * h * mc.intermediate_size
        head_bytes = mc.vocab_size * h * elem_bytes
        return cls(weight_bytes=(weight_bytes - head_bytes) // n + head_bytes, body_params=mc.num_layers * layer // n,
                   head_params=mc.vocab_size * h,
                   kv_bytes_per_token=2 * mc.num_layers * mc.num_kv_heads // n * d * elem_bytes,
                   flops_per_pair=4 * mc.num_layers * mc.num_qo_heads // n * d)

    def step_floor(self, ceil: Ceilings, *, tokens: int, logits: int, pairs: int, kv_read: int,
                   weight_reads: int = 1) -> float:
        """Seconds at least for ``tokens`` tokens (``logits`` of them with logits) that
        attend ``pairs`` (query, key) pairs, read ``kv_read`` tokens' K/V and write their
        own, reading the weights ``weight_reads`` times."""
        nbytes = weight_reads * self.weight_bytes + (kv_read + tokens) * self.kv_bytes_per_token
        flops = 2 * self.body_params * tokens + 2 * self.head_params * logits + self.flops_per_pair * pairs
        return max(nbytes / ceil.copy_bytes_per_s, flops / ceil.matmul_flops_per_s)


@dataclass(frozen=True, slots=True)
class Workload:
    """``requests`` prompts of a shared ``prefix`` and an own ``suffix``; ``new_tokens`` each."""

    requests: int
    prefix: int
    suffix: int
    new_tokens: int

    def __post_init__(self) -> None:
        for name in ("requests", "new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected a positive count, got {getattr(self, name)}")
        for name in ("prefix", "suffix"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: expected a count >= 0, got {getattr(self, name)}")
        if self.prefix + self.suffix < 1:
            raise ValueError("prefix, suffix: a prompt needs at least one token")

    def prompts(self, vocab: int, seed: int) -> list[list[int]]:
        gen = torch.Generator().manual_seed(seed)
        shared = torch.randint(3, vocab, (self.prefix,), generator=gen).tolist()
        return [shared + torch.randint(3, vocab, (self.suffix,), generator=gen).tolist() for _ in range(self.requests)]

    def prefill_floor(self, costs: ModelCosts, ceil: Ceilings, max_batched_tokens: int) -> float:
        """The shared prompt once, then every suffix; in steps of ``max_batched_tokens``."""
        p, s, r = self.prefix, self.suffix, self.requests
        tokens = p + r * s
        pairs = p * (p + 1) // 2 + r * (s * p + s * (s + 1) // 2)  # causal: position i sees i + 1 keys
        return costs.step_floor(ceil, tokens=tokens, logits=r, pairs=pairs, kv_read=0,
                                weight_reads=-(-tokens // max_batched_tokens))

    def decode_floors(self, costs: ModelCosts, ceil: Ceilings, max_batch: int) -> list[float]:
        """Floors of the decode steps after the prefill: ``new_tokens - 1`` per wave of at
        most ``max_batch`` requests, the prefix read once per step."""
        floors = []
        for first in range(0, self.requests, max_batch):
            batch = min(max_batch, self.requests - first)
            for k in range(1, self.new_tokens):
                keys = self.prefix + self.suffix + k  # the fed token included
                floors.append(costs.step_floor(ceil, tokens=batch, logits=batch, pairs=batch * keys,
                                               kv_read=self.prefix + batch * (keys - self.prefix)))
        return floors


def decode_step_floor(costs: ModelCosts, ceil: Ceilings, step) -> float:
    """Floor of one recorded decode step (a ``StepStats`` without prefill tokens)."""
    return costs.step_floor(ceil, tokens=step.num_decode, logits=step.num_decode, pairs=step.kv_tokens_attended,
                            kv_read=step.kv_tokens_shared_once)


def memory_needed(mc: ModelConfig, workload: Workload, elem_bytes: int, tensor_parallel_size: int = 1) -> int:
    """Bytes one device needs at least: its share of the weights (the embedding and output
    projection whole on every device) and of the workload's K/V, the shared prefix held once."""
    n = tensor_parallel_size
    kv = 2 * mc.num_layers * mc.num_kv_heads // n * mc.head_dim * elem_bytes
    tokens = workload.prefix + workload.requests * (workload.suffix + workload.new_tokens)
    whole = mc.vocab_size * mc.hidden_size * (1 if mc.tie_word_embeddings else 2)
    return ((mc.num_parameters() - whole) // n + whole) * elem_bytes + tokens * kv


def memory_available(device: torch.device) -> int:
    """Free bytes on ``device``: the GPU's free memory, or the host's available memory."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


# ---- transformers models, and the correctness check ------------------------------


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
    prompts = Workload(6, 3 * page_size + 5, 7, 12).prompts(mc.vocab_size, seed=2)
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


# ---- the runs -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Setting:
    """What every run of one bench shares."""

    workload: Workload
    prompts: list[list[int]]
    warmup_prompts: list[list[int]]  # the same shapes, other tokens
    costs: ModelCosts
    ceilings: Ceilings
    end_to_end_floor_s: float
    prefill_floor_s: float


def _end_to_end(row: dict, setting: Setting) -> dict:
    """Throughput, its floor and the fraction reached, from ``output_tokens`` and ``wall_s``."""
    floor_tps = row["output_tokens"] / setting.end_to_end_floor_s
    return {**row, "tokens_per_s": row["output_tokens"] / row["wall_s"], "floor_tokens_per_s": floor_tps,
            "fraction_of_floor": setting.end_to_end_floor_s / row["wall_s"]}


def _graphs_captured(llm) -> int:
    graphs = llm.runner.graphs
    return graphs.num_captured if graphs is not None else 0


def _timed(llm, run: Callable[[list[list[int]]], list], setting: Setting, device: torch.device):
    """``run(prompts)`` warmed up on the other-token workload, then timed on the real one
    (the prefix cache emptied before each, the step records cleared before the timed one).
    Returns its outputs, wall seconds, the engine's counters of the timed run and the CUDA
    graphs captured while timed."""
    if device.type == "cuda":
        hot_path.module()  # the launchers' C++ hot path built (once per machine) before anything is timed
    llm.reset_prefix_cache()
    run(setting.warmup_prompts)
    llm.reset_prefix_cache()
    llm.step_stats.clear()
    captured, before = _graphs_captured(llm), llm.stats
    gc.collect()
    _sync(device)
    t0 = time.perf_counter()
    outs = run(setting.prompts)
    _sync(device)
    wall = time.perf_counter() - t0
    return outs, wall, llm.stats - before, _graphs_captured(llm) - captured


def engine_run(llm, mode: str, setting: Setting, device: torch.device) -> dict:
    """Warm up on the other-token workload, then time the real one, in ``mode``."""
    params = SamplingParams(temperature=0.0, max_tokens=setting.workload.new_tokens, ignore_eos=True)
    llm.set_use_cascade(_ENGINE_MODES[mode])
    outs, wall, stats, captured = _timed(llm, lambda prompts: llm.generate(prompts, params), setting, device)
    ended = time.time()  # wall clock (e.g. to find the run in a power log), a moment after its end
    steps = llm.step_stats
    costs, ceil = setting.costs, setting.ceilings
    prefill = [s for s in steps if s.num_prefill_tokens]
    row = _end_to_end({
        "engine": f"cascadeinfer {mode}", "mode": mode, "requests": len(outs),
        "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs), "wall_s": wall,
        "prompt_tokens": stats.prompt_tokens, "prefill_tokens": stats.prefill_tokens,
        "cached_prompt_tokens": stats.cached_prompt_tokens, "preemptions": stats.preemptions, "steps": stats.steps,
        "prefill_s": sum(s.seconds for s in prefill), "prefill_floor_s": setting.prefill_floor_s,
        "prefill_steps": len(prefill), "graphs_captured_while_timed": captured, "ended_unix_s": ended,
    }, setting)
    row["fraction_of_prefill_floor"] = row["prefill_floor_s"] / row["prefill_s"] if row["prefill_s"] else None
    batch = min(len(outs), llm.config.max_num_seqs)
    full = [s for s in steps if s.num_prefill_tokens == 0 and s.num_decode == batch]
    if full:
        step = statistics.median(s.seconds for s in full)
        host = statistics.median(s.seconds - s.wait_seconds for s in full)
        gpu_each = [s.gpu_seconds() for s in full]
        gpu = statistics.median(gpu_each) if None not in gpu_each else None
        floor = statistics.median(decode_step_floor(costs, ceil, s) for s in full)
        kv_read = statistics.median(s.kv_tokens_read for s in full) * costs.kv_bytes_per_token
        row.update(decode_step_ms=step * 1e3, decode_step_host_ms=host * 1e3,
                   decode_step_gpu_ms=gpu * 1e3 if gpu is not None else None,
                   # every full step in order (JSON only): how the step grows with the rows' keys
                   decode_steps_ms=[round(s.seconds * 1e3, 4) for s in full],
                   decode_steps_gpu_ms=[round(t * 1e3, 4) for t in gpu_each] if gpu is not None else None,
                   decode_step_floor_ms=floor * 1e3, fraction_of_decode_floor=floor / step,
                   decode_steps=len(full), weights_gb=costs.weight_bytes / 1e9, kv_read_gb=kv_read / 1e9,
                   achieved_gb_s=(costs.weight_bytes + kv_read) / step / 1e9,
                   fraction_of_copy_bw=(costs.weight_bytes + kv_read) / step / ceil.copy_bytes_per_s,
                   cascade_steps=sum(bool(s.cascade) for s in full), graph_steps=sum(s.graph for s in full))
        all_reduce = llm.time_all_reduce(batch)
        if all_reduce is not None:  # tensor parallelism: the step's all-reduces, timed alone
            row.update(all_reduce_ms=all_reduce * 1e3, all_reduce_share_of_step=all_reduce / step)
    return row


def beam_run(llm, setting: Setting, width: int, device: torch.device) -> dict:
    """The engine's beam search over the same prompts (``width`` beams each, the planner
    choosing cascade or flat decode each step), warmed up on the other-token workload.
    Reported: the best sequences' tokens per second, the beams' tokens (all ``width`` of
    them, every step) per second, steps and preemptions. No floor: the floors above count
    one decode row per request, a beam search ``width``."""
    params = BeamSearchParams(beam_width=width, max_tokens=setting.workload.new_tokens, ignore_eos=True)
    llm.set_use_cascade(None)
    outs, wall, stats, _ = _timed(llm, lambda prompts: llm.beam_search(prompts, params), setting, device)
    best = sum(len(o.sequences[0].tokens) - len(p) for o, p in zip(outs, setting.prompts))
    return {"engine": f"cascadeinfer beam search ({width} beams)", "mode": "beam", "requests": len(outs),
            "beam_width": width, "output_tokens": best, "wall_s": wall, "tokens_per_s": best / wall,
            "beam_tokens": stats.output_tokens, "beam_tokens_per_s": stats.output_tokens / wall,
            "steps": stats.steps, "preemptions": stats.preemptions, "prefill_tokens": stats.prefill_tokens,
            "prompt_tokens": stats.prompt_tokens}


def pages_needed(workload: Workload, page_size: int) -> int:
    """KV pages of the whole workload at once: the shared prompt's full pages once, then
    each request's own (its part of the prompt's last page, its suffix, its new tokens)."""
    w = workload
    shared = w.prefix // page_size
    own = -(-(w.prefix + w.suffix + w.new_tokens) // page_size) - shared
    return shared + w.requests * own


def pressure_run(llm, mode: str, setting: Setting, device: torch.device) -> dict:
    """The engine on a KV pool too small for the batch (built by the caller), its
    preemptions swapped (``mode`` "swap") or recomputed ("recompute"), warmed up on the
    other-token workload. Reported: output tokens per second, the preemptions and how they
    were served, the bytes swapped each way and the time of those copies, the tokens
    computed (a recomputed sequence's again) against the tokens a roomy pool computes."""
    params = SamplingParams(temperature=0.0, max_tokens=setting.workload.new_tokens, ignore_eos=True)
    llm.set_use_cascade(None)
    outs, wall, stats, _ = _timed(llm, lambda prompts: llm.generate(prompts, params), setting, device)
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    w = setting.workload
    once = w.prefix + w.requests * (w.suffix + w.new_tokens - 1)  # the shared prompt once, the rest per request
    return {"engine": f"cascadeinfer {mode} preemption ({llm.pool.num_pages} KV pages)", "mode": mode,
            "requests": len(outs), "output_tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
            "kv_pages": llm.pool.num_pages, "preemptions": stats.preemptions,
            "swapped_preemptions": stats.swapped_preemptions, "swap_fallbacks": stats.swap_fallbacks,
            "swapped_out_gb": stats.swapped_out_bytes / 1e9, "swapped_in_gb": stats.swapped_in_bytes / 1e9,
            "swap_s": stats.swap_seconds, "computed_tokens": stats.computed_tokens, "computed_tokens_once": once,
            "prefill_tokens": stats.prefill_tokens, "prompt_tokens": stats.prompt_tokens, "steps": stats.steps}


def _hf_batch_config(setting: Setting, llm_kwargs: dict, device: torch.device, max_requests: int | None = None):
    """transformers' own sizing on a GPU; on a CPU (where it would size its cache from the
    host's memory) a cache just large enough for the workload. ``max_requests``: its
    ``max_requests_per_batch`` (None: its own choice on a GPU, the engine's
    ``max_num_seqs`` on a CPU)."""
    import transformers  # noqa: PLC0415

    cls = getattr(transformers, "ContinuousBatchingConfig", None)
    if cls is None:
        return None
    if device.type == "cuda":
        return None if max_requests is None else cls(max_requests_per_batch=max_requests)
    w, page = setting.workload, 16
    blocks = w.requests * -(-(w.prefix + w.suffix + w.new_tokens) // page) + 1
    return cls(page_size=page, num_blocks=blocks, max_batch_tokens=llm_kwargs["max_num_batched_tokens"],
               max_requests_per_batch=max_requests or llm_kwargs["max_num_seqs"])


def _hf_attention() -> str:
    """The attention transformers' continuous batching runs a model loaded with sdpa: it
    switches to FlashAttention-3, else -2, where that package is installed (and CUDA is
    there), as ``ContinuousBatchingManager`` does (its hub fallback is not tried here)."""
    from transformers.utils import import_utils  # noqa: PLC0415

    for version in (3, 2):
        available = getattr(import_utils, f"is_flash_attn_{version}_available", None)
        if available is not None and available():
            return f"flash_attention_{version}"
    return "sdpa"


def hf_run(mc: ModelConfig, dtype: torch.dtype, device: torch.device, setting: Setting, llm_kwargs: dict,
           warmup_requests: int | None = None, max_requests: int | None = None) -> dict:
    """transformers' continuous batching (``generate_batch``) over the same requests: a
    persistent manager warmed up on the other-token workload (its first
    ``warmup_requests`` requests; None: all), then the timed call. ``max_requests``: its
    ``max_requests_per_batch`` (None: its own choice)."""
    import importlib.util  # noqa: PLC0415
    import logging  # noqa: PLC0415

    warmup = setting.warmup_prompts[:warmup_requests] if warmup_requests else setting.warmup_prompts
    row = {"engine": "transformers generate_batch", "mode": "hf", "requests": len(setting.prompts),
           "warmup_requests": len(warmup), "max_requests_per_batch": max_requests}
    try:
        import transformers  # noqa: PLC0415
    except ImportError:
        return {**row, "error": "transformers is not installed"}
    if not hasattr(_hf_config(mc)[1], "generate_batch"):
        return {**row, "error": f"transformers {transformers.__version__} has no generate_batch (continuous batching)"}
    # It switches sdpa to flash attention for continuous batching when a flash package is installed.
    row["attn_implementation"] = _hf_attention()
    row["flash_attn_installed"] = any(importlib.util.find_spec(m) is not None
                                      for m in ("flash_attn", "flash_attn_interface"))
    new = setting.workload.new_tokens
    gen_config = transformers.GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=-1, pad_token_id=0)
    kwargs = {"generation_config": gen_config, "progress_bar": False, "persistent_manager": True}
    cb_config = _hf_batch_config(setting, llm_kwargs, device, max_requests)
    if cb_config is not None:
        kwargs["continuous_batching_config"] = cb_config
    log = logging.getLogger("ContinuousBatchingLogger")
    level = log.level
    log.setLevel(logging.ERROR)  # a warning per call about the persistent manager otherwise
    model = None
    try:
        # Out of inference mode (the command line runs in it): the manager runs the model on
        # a thread of its own, outside the caller's thread-local mode, and updates the
        # model's and its own tensors in place, which inference tensors forbid. Gradients
        # are off all the same.
        with torch.inference_mode(False), torch.no_grad():
            model = _hf_model(mc, dtype, device)
            t0 = time.perf_counter()
            model.generate_batch(warmup, **kwargs)  # sizes the manager, captures its graphs
            _sync(device)
            print(f"# transformers generate_batch: warm-up took {time.perf_counter() - t0:.1f} s", flush=True)
            t0 = time.perf_counter()
            out = model.generate_batch(setting.prompts, **kwargs)
            _sync(device)
        wall = time.perf_counter() - t0
    except torch.OutOfMemoryError as exc:
        return {**row, "error": f"out of memory ({str(exc).splitlines()[0][:80]})"}
    except Exception as exc:  # noqa: BLE001 - a failing peer must not lose the engine's rows
        return {**row, "error": f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:120]}"}
    finally:
        log.setLevel(level)
        if model is not None and hasattr(model, "destroy_cached_continuous_batching_manager"):
            model.destroy_cached_continuous_batching_manager()
        model = None
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    lengths = [len(o.generated_tokens) for o in out.values() if o.error is None]
    if len(lengths) != len(setting.prompts) or any(n != new for n in lengths):
        errors = [str(o.error) for o in out.values() if o.error is not None]
        why = f"; first error: {errors[0].splitlines()[0][:160]}" if errors else ""
        return {**row, "error": f"generate_batch: {len(lengths)} of {len(setting.prompts)} requests finished "
                                f"({len(out)} outputs), {sum(lengths)} tokens instead of "
                                f"{new * len(setting.prompts)}{why}"}
    return _end_to_end({**row, "output_tokens": sum(lengths), "wall_s": wall}, setting)


# ---- report ---------------------------------------------------------------------------


_COLUMNS = [("engine", "engine"), ("output_tokens", "output tokens"), ("wall_s", "wall s"),
            ("tokens_per_s", "output tok/s"), ("fraction_of_floor", "of floor"), ("prefill_s", "prefill s"),
            ("prefill_floor_s", "prefill floor s"), ("decode_step_ms", "decode step ms"),
            ("decode_step_floor_ms", "step floor ms"), ("decode_step_host_ms", "step host ms"),
            ("decode_step_gpu_ms", "step GPU ms"),
            ("prefill_tokens", "prompt tok computed"),
            ("prompt_tokens", "prompt tok submitted"), ("kv_read_gb", "KV GB/step"), ("achieved_gb_s", "achieved GB/s"),
            ("all_reduce_ms", "all-reduce ms/step")]


def _fmt(x) -> str:
    if x is None:
        return "—"
    if isinstance(x, float):
        return f"{x:.3g}" if abs(x) < 1000 else f"{x:.0f}"
    return str(x)


# The memory-pressure runs' own table (swap and recompute modes).
_PRESSURE_COLUMNS = [("engine", "engine"), ("tokens_per_s", "output tok/s"), ("wall_s", "wall s"),
                     ("preemptions", "preemptions"), ("swapped_preemptions", "swapped"),
                     ("swap_fallbacks", "fallbacks"), ("swapped_out_gb", "GB out"), ("swapped_in_gb", "GB in"),
                     ("swap_s", "copy s"), ("computed_tokens", "tokens computed"),
                     ("computed_tokens_once", "without preemption")]


def table(rows: list[dict], columns: list[tuple[str, str]] | None = None) -> str:
    columns = columns or _COLUMNS
    lines = ["| " + " | ".join(c for _, c in columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        cells = [_fmt(r.get(k)) for k, _ in columns]
        if "error" in r:
            cells[1] = r["error"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def ratios(rows: list[dict]) -> dict[str, float]:
    """Throughput and decode-step ratios between the runs that have them."""
    by = {r["mode"]: r for r in rows if "tokens_per_s" in r}
    out = {}
    for a, b in (("cascade", "flat"), ("cascade", "hf"), ("auto", "flat"), ("flat", "hf")):
        if a in by and b in by:
            out[f"{a} / {b} tokens/s"] = by[a]["tokens_per_s"] / by[b]["tokens_per_s"]
            if "decode_step_ms" in by[a] and "decode_step_ms" in by[b]:
                out[f"{b} / {a} decode step"] = by[b]["decode_step_ms"] / by[a]["decode_step_ms"]
    return out


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


# ---- the command ----------------------------------------------------------------------


def _parse_modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    if not modes or set(modes) - set(MODES) or len(set(modes)) != len(modes):
        raise SystemExit(f"--modes: expected a comma list of distinct {', '.join(MODES)}; got {text!r}")
    return modes


def cmd_bench(args: argparse.Namespace) -> int:
    from cascadeinfer.engine.cli import engine_kwargs  # noqa: PLC0415
    from cascadeinfer.engine.llm import LLM  # noqa: PLC0415
    from cascadeinfer.engine.model_loader import preset  # noqa: PLC0415

    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    modes = _parse_modes(args.modes)
    try:
        workload = Workload(args.requests, args.prefix, args.suffix, args.new_tokens)
    except ValueError as exc:
        raise SystemExit(f"--{str(exc).replace('_', '-')}") from None
    for flag, value in (("--hf-warmup-requests", args.hf_warmup_requests), ("--hf-max-requests", args.hf_max_requests)):
        if value is not None and value < 1:
            raise SystemExit(f"{flag}: expected >= 1, got {value}")
    if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        raise SystemExit(f"--json: the directory of {args.json!r} does not exist")
    kwargs = engine_kwargs(args)
    device = torch.device(kwargs.pop("device") or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = kwargs.pop("dtype")
    dtype = parse_dtype(dtype if dtype != "auto" else ("bfloat16" if device.type == "cuda" else "float32"))
    elem = torch.empty((), dtype=dtype).element_size()
    kwargs.pop("use_cascade")
    kwargs["max_model_len"] = kwargs["max_model_len"] or args.prefix + args.suffix + args.new_tokens
    if device.type != "cuda" and kwargs["num_pages"] is None:  # every sequence's pages, no preemption
        kwargs["num_pages"] = args.requests * -(-kwargs["max_model_len"] // kwargs["page_size"]) + 1
    name = args.model or args.preset or "llama3-8b"
    try:
        mc = ModelConfig.from_dir(args.model) if args.model else preset(name)
    except ModelLoadError as exc:
        raise SystemExit(f"--model: {exc}") from None
    if args.num_layers is not None:
        if args.model or not 1 <= args.num_layers:
            raise SystemExit("--num-layers: a positive count, with a preset (not --model)")
        mc = replace(mc, num_layers=args.num_layers)
    tp = kwargs["tensor_parallel_size"]
    if "swap" in modes and tp > 1:
        raise SystemExit("--modes swap: needs --tensor-parallel-size 1 (the workers' pools are not swapped)")
    need, free = memory_needed(mc, workload, elem, tp), memory_available(device)
    if need > free and not args.force:
        raise SystemExit(f"{'--model' if args.model else '--preset'} {name}: its weights and this workload's KV cache "
                         f"need {need / 1e9:.1f} GB per device in {str(dtype).removeprefix('torch.')} "
                         f"(tensor parallel size {tp}), but {device.type} has "
                         f"{free / 1e9:.1f} GB free; use a smaller model (e.g. --preset tiny on a CPU) or a smaller "
                         "workload, or pass --force to try anyway")

    env = _environment(device)
    info = {"requests": args.requests, "prefix": args.prefix, "suffix": args.suffix, "new_tokens": args.new_tokens,
            "model": name, "num_layers": mc.num_layers, "tensor_parallel_size": tp,
            "dtype": str(dtype).removeprefix("torch."), "modes": modes, "page_size": kwargs["page_size"],
            "max_num_batched_tokens": kwargs["max_num_batched_tokens"], "max_num_seqs": kwargs["max_num_seqs"]}
    print("# " + ", ".join(f"{k} {v}" for k, v in env.items()), flush=True)
    print("# workload: " + ", ".join(f"{k} {v}" for k, v in info.items()), flush=True)
    check = "skipped" if args.skip_check else correctness_check(device, args.page_size)
    print(f"# check: {check}", flush=True)

    gc.collect()
    ceil = Ceilings(copy_bandwidth(device), matmul_rate(device, dtype))
    print(f"# ceilings measured: copy {ceil.copy_bytes_per_s / 1e9:.0f} GB/s (read + written), "
          f"{str(dtype).removeprefix('torch.')} matmul {ceil.matmul_flops_per_s / 1e12:.1f} TFLOP/s", flush=True)

    # What every step reads: all weights but the embedding table (unless tied), as the engine counts them.
    weight_bytes = (mc.num_parameters() - (0 if mc.tie_word_embeddings else mc.vocab_size * mc.hidden_size)) * elem
    costs = ModelCosts.of(mc, weight_bytes, elem, kwargs["tensor_parallel_size"])  # one device's share
    prefill_floor = workload.prefill_floor(costs, ceil, kwargs["max_num_batched_tokens"])
    decode_floors = workload.decode_floors(costs, ceil, kwargs["max_num_seqs"])
    prompts = workload.prompts(mc.vocab_size, args.seed)
    warmup_prompts = workload.prompts(mc.vocab_size, args.seed + 1)
    setting = Setting(workload, prompts, warmup_prompts, costs, ceil, prefill_floor + sum(decode_floors), prefill_floor)
    floors = {"prefill_s": prefill_floor, "decode_steps": len(decode_floors),
              "decode_step_first_ms": decode_floors[0] * 1e3 if decode_floors else None,
              "decode_step_last_ms": decode_floors[-1] * 1e3 if decode_floors else None,
              "end_to_end_s": setting.end_to_end_floor_s,
              "end_to_end_tokens_per_s": workload.requests * workload.new_tokens / setting.end_to_end_floor_s}
    print(f"# floors: prefill {prefill_floor:.3g} s, {len(decode_floors)} decode steps of "
          f"{_fmt(floors['decode_step_first_ms'])}..{_fmt(floors['decode_step_last_ms'])} ms, end to end "
          f"{setting.end_to_end_floor_s:.3g} s ({floors['end_to_end_tokens_per_s']:.0f} output tok/s)", flush=True)

    def build(**changes) -> LLM:
        kw = {**kwargs, **changes}
        if args.model:
            llm = LLM(args.model, device=device, dtype=dtype, tokenizer=False, record_steps=True, **kw)
        else:
            llm = LLM.from_config(mc, device=device, dtype=dtype, seed=args.seed, record_steps=True, **kw)
        print(f"# engine: {llm.pool.num_pages} KV pages of {llm.config.page_size} tokens, "
              f"{llm.model.weight_bytes() / 1e9:.2f} GB of weights", flush=True)
        return llm

    def free_memory() -> None:
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()

    def write_json(rows: list[dict], rel: dict) -> None:
        if not args.json:
            return
        payload = {"environment": env, "workload": info, "check": check,
                   "ceilings": {"copy_bandwidth_gb_s": ceil.copy_bytes_per_s / 1e9,
                                "matmul_tflops": ceil.matmul_flops_per_s / 1e12,
                                "matmul_dtype": str(dtype).removeprefix("torch.")},
                   "floors": floors, "rows": rows, "ratios": rel}
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=1)

    rows: list[dict] = []
    llm = None
    for mode in modes:
        if mode == "hf":
            llm = None  # the engine's memory goes back before transformers loads its copy
            free_memory()
            row = hf_run(mc, dtype, device, setting, kwargs, args.hf_warmup_requests, args.hf_max_requests)
        elif mode == "beam":
            llm = llm if llm is not None else build()
            row = beam_run(llm, setting, args.beam_width, device)
        elif mode in ("swap", "recompute"):
            llm = None  # an engine of its own, with a small pool (the next engine mode builds the usual one)
            free_memory()
            pages = max(int(args.pressure * pages_needed(workload, kwargs["page_size"])),
                        -(-kwargs["max_model_len"] // kwargs["page_size"]) + 1)
            small = build(num_pages=pages, preemption_mode=mode)
            row = pressure_run(small, mode, setting, device)
            small.close()
            del small
            free_memory()
        else:
            llm = llm if llm is not None else build()
            row = engine_run(llm, mode, setting, device)
        rows.append(row)
        write_json(rows, ratios(rows))  # each finished mode is kept, should a later one not finish
        if "error" in row:
            print(f"# {row['engine']}: {row['error']}", flush=True)
            continue
        line = f"# {row['engine']}: {row['tokens_per_s']:.0f} output tok/s"
        if "fraction_of_floor" in row:
            line += f", {row['fraction_of_floor']:.2f} of the floor's {row['floor_tokens_per_s']:.0f}"
        if "swapped_preemptions" in row:
            line += (f"; {row['preemptions']} preemptions ({row['swapped_preemptions']} swapped, "
                     f"{row['swap_fallbacks']} fallbacks), {row['swapped_out_gb']:.3f} GB out and "
                     f"{row['swapped_in_gb']:.3f} GB in in {row['swap_s'] * 1e3:.1f} ms, "
                     f"{row['computed_tokens']} tokens computed ({row['computed_tokens_once']} without preemption)")
        if "beam_tokens_per_s" in row:
            line += (f" (the best beam's); all {row['beam_width']} beams {row['beam_tokens_per_s']:.0f} tok/s, "
                     f"{row['preemptions']} preemptions")
        if "prefill_tokens" in row:
            line += f"; prompt tokens computed {row['prefill_tokens']} of {row['prompt_tokens']} submitted"
        if row.get("warmup_requests", row.get("requests")) != row.get("requests"):
            line += f"; warmed up on {row['warmup_requests']} of its {row['requests']} requests"
        if row.get("attn_implementation"):
            line += f"; attention {row['attn_implementation']}"
        if row.get("max_requests_per_batch"):
            line += f"; at most {row['max_requests_per_batch']} requests per forward pass"
        if row.get("graphs_captured_while_timed"):
            line += f"; WARNING: {row['graphs_captured_while_timed']} CUDA graphs were captured while timed"
        print(line, flush=True)

    print()
    print(table(rows), flush=True)
    pressure = [r for r in rows if "swapped_preemptions" in r]
    if pressure:
        print("\n" + table(pressure, _PRESSURE_COLUMNS), flush=True)
    rel = ratios(rows)
    if rel:
        print("\n" + "; ".join(f"{k}: {v:.2f}x" for k, v in rel.items()))
    write_json(rows, rel)
    if llm is not None:  # the results are out first: stopping workers is the last thing
        llm.close()
    return 0
