"""The user-facing engine: ``LLM(model_dir).generate(prompts, SamplingParams(...))``.

``LLM`` owns the model, the paged KV pool, the prefix cache, the scheduler and the model
runner, and runs the loop: schedule a step, run it, sample, update. Requests can also be
fed one at a time (:meth:`LLM.add_request`, :meth:`LLM.step`) for continuous batching with
new arrivals between steps; :meth:`LLM.stream` yields partial outputs as they grow.
"""

from __future__ import annotations

import os
import time
import weakref
from collections.abc import Iterator, Sequence as Seq
from dataclasses import dataclass, field, replace

import numpy as np
import torch
import torch.distributed as dist

from cascadeinfer.engine.beam import BeamSearchOutput, BeamSearchParams, BeamSearchSequence, BeamState
from cascadeinfer.engine.chat import ChatTemplate, load_chat_template
from cascadeinfer.engine.config import EngineConfig
from cascadeinfer.engine.detokenize import IncrementalText
from cascadeinfer.engine.llama import LlamaForCausalLM, TensorParallel
from cascadeinfer.engine.model_loader import ModelConfig, load_tokenizer, parse_dtype
from cascadeinfer.engine.model_runner import ModelRunner, StepStats
from cascadeinfer.engine.parallel import Workers, launched_group, serve
from cascadeinfer.engine.prefix_cache import PrefixCache
from cascadeinfer.engine.sampling import SamplingParams, sample, sample_seed
from cascadeinfer.engine.scheduler import ScheduledBatch, Scheduler
from cascadeinfer.engine.sequence import Sequence
from cascadeinfer.engine.swap import SwapPolicy, SwapSpace
from cascadeinfer.kernels.copy_pages import copy_pages_unchecked
from cascadeinfer.layouts.pool import PagedKVPool

Prompt = str | Seq[int]


@dataclass(slots=True)
class CompletionOutput:
    """One sample: its generated tokens (a stop token included), text, and why it ended."""

    index: int
    token_ids: list[int]
    text: str | None
    finish_reason: str | None  # None while running, else "stop" or "length"
    cumulative_logprob: float | None = None  # beam search: the sum of the tokens' log-probabilities
    score: float | None = None  # beam search: the length-penalised score that ranks the beams


@dataclass(slots=True)
class RequestOutput:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool


@dataclass(frozen=True, slots=True)
class EngineStats:
    """Counters of an engine since it was built (:attr:`LLM.stats`).

    ``later - earlier`` gives the counts of the work between two snapshots. Without
    preemptions ``prefill_tokens + cached_prompt_tokens == prompt_tokens``: every prompt
    token is either computed or served from the prefix cache; a prompt shared by many
    requests is computed once when ``prefill_tokens`` is its length plus the others' own
    parts (whole pages are shared, so a shared part that ends inside a page is computed
    again from that page's start).
    """

    requests: int = 0  # requests submitted
    prompt_tokens: int = 0  # their prompt tokens (once per request: its n samples share them)
    prefill_tokens: int = 0  # prompt tokens whose K/V a step computed (again after a preemption)
    cached_prompt_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache
    computed_tokens: int = 0  # every token a step computed: prefill and decode
    output_tokens: int = 0  # tokens sampled (a beam search's: the tokens its running beams took)
    steps: int = 0
    preemptions: int = 0
    swapped_preemptions: int = 0  # preemptions that swapped the pages out (the others recompute)
    swap_fallbacks: int = 0  # swaps the policy chose that the full swap space turned into recomputes
    swapped_out_bytes: int = 0  # host copies made (a page shared by several sequences once)
    swapped_in_bytes: int = 0
    swap_seconds: float = 0.0  # time of those copies (GPU time on a GPU)
    cache_hit_pages: int = 0
    copied_pages: int = 0  # shared pages copied before a write (n > 1 samples)

    def __sub__(self, other: EngineStats) -> EngineStats:
        if not isinstance(other, EngineStats):
            return NotImplemented
        return EngineStats(*(getattr(self, f) - getattr(other, f) for f in self.__dataclass_fields__))


@dataclass(slots=True)
class _Request:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    stop_ids: frozenset[int]
    beam: BeamState | None = None  # beam search: the search's state, seqs its running beams in order
    result: list[BeamSearchSequence] | None = None
    # The rows in so far of this search step, by seq_id: each beam's best log-probs and their tokens.
    beam_rows: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)


def _default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class LLM:
    """A Llama-family model served from a local Hugging Face directory.

    Args:
        model_dir: directory with ``config.json``, ``*.safetensors`` and optionally
            ``tokenizer.json`` (never downloaded).
        dtype: ``"auto"`` (the checkpoint's dtype on GPU, float32 on CPU) or a float dtype
            name / ``torch.dtype``.
        device: default CUDA when available, else CPU.
        tokenizer: load ``tokenizer.json`` when present (False: token ids only).
        **engine: the fields of :class:`~cascadeinfer.engine.config.EngineConfig` other than
            device and dtype (``max_model_len`` defaults to the model's context length).

    Text prompts need the tokenizer; token-id prompts always work. Outputs carry the
    generated token ids and, with a tokenizer, their text.
    """

    def __init__(self, model_dir: str | os.PathLike, *, dtype: str | torch.dtype = "auto",
                 device: str | torch.device | None = None, tokenizer: bool = True, **engine) -> None:
        config = ModelConfig.from_dir(model_dir)
        self._setup(config, dtype, device, engine)
        self.model.load_checkpoint(model_dir)
        self._weights = {"model_dir": str(model_dir)}
        self.tokenizer = load_tokenizer(model_dir) if tokenizer else None
        self.chat_template: ChatTemplate | None = load_chat_template(model_dir) if tokenizer else None
        self._build_engine()

    @classmethod
    def from_config(cls, config: ModelConfig, *, dtype: str | torch.dtype = "auto",
                    device: str | torch.device | None = None, seed: int = 0, std: float = 0.02,
                    **engine) -> LLM:
        """An engine over a model of ``config``'s shapes with random weights (benchmarks)."""
        self = cls.__new__(cls)
        self._setup(config, dtype, device, engine)
        self.model.init_random_(seed, std)
        self._weights = {"random": (seed, std)}  # each shard its own random weights
        self.tokenizer = None
        self.chat_template = None
        self._build_engine()
        return self

    # ---- construction ------------------------------------------------------------------

    def _setup(self, config: ModelConfig, dtype, device, engine: dict) -> None:
        device = torch.device(device) if device is not None else _default_device()
        if device.type == "cuda" and device.index is None:  # tensors report "cuda:0", never "cuda"
            device = torch.device("cuda", torch.cuda.current_device())
        if dtype == "auto":
            dtype = (config.torch_dtype or torch.bfloat16) if device.type == "cuda" else torch.float32
        dtype = parse_dtype(dtype)
        max_len = engine.pop("max_model_len", None) or config.context_length
        if max_len > config.context_length:
            raise ValueError(f"max_model_len: {max_len} exceeds the model's context length {config.context_length}")
        unknown = set(engine) - set(EngineConfig.__dataclass_fields__)
        if unknown:
            raise TypeError(f"LLM: unexpected keyword arguments {sorted(unknown)}")
        size = engine.get("tensor_parallel_size", 1)
        TensorParallel(0, size).check(config)  # before any process starts
        # Under torchrun every rank runs this: its rank and device come from the launcher.
        self._launched = launched_group(size, device) if isinstance(size, int) and size > 1 else None
        rank = 0
        if self._launched is not None:
            rank, device, _ = self._launched
        elif size > 1 and device.type == "cuda" and torch.cuda.device_count() < (device.index or 0) + size:
            raise ValueError(f"tensor_parallel_size: {size} devices from {device} needed, "
                             f"{torch.cuda.device_count()} visible")
        self.config = EngineConfig(device=device, dtype=dtype, max_model_len=max_len, **engine)
        self.model_config = config
        tp = TensorParallel(rank, self.config.tensor_parallel_size)  # the default process group
        self.model = LlamaForCausalLM(config, dtype=dtype, device=device, max_positions=max_len, tp=tp)

    def _build_engine(self) -> None:
        cfg, mc = self.config, self.model_config
        num_pages = self._num_pages()
        self._workers = None
        if cfg.tensor_parallel_size > 1:
            if self._launched is not None:  # every rank must size its pool alike: rank 0's count
                box = [num_pages]
                dist.broadcast_object_list(box, src=0)
                num_pages = box[0]
            build = dict(engine_config=cfg, model_config=mc, num_pages=num_pages, **self._weights)
            if self._launched is not None and self._launched[0] > 0:
                # A launched worker rank: serve rank 0's steps with the shard loaded above, then end.
                serve(self._launched[0], cfg.tensor_parallel_size, cfg.device, build, model=self.model)
                if self._launched[2]:
                    dist.destroy_process_group()
                raise SystemExit(0)
            self._workers = Workers(cfg.tensor_parallel_size, cfg.device, build, launched=self._launched)
        self.pool = PagedKVPool(mc.num_layers, num_pages, cfg.page_size, mc.num_kv_heads // cfg.tensor_parallel_size,
                                mc.head_dim, dtype=cfg.dtype, device=cfg.device, kv_layout=cfg.kv_layout,
                                copy_pages=copy_pages_unchecked)
        if self._workers is not None:
            self.pool.copy_log = []
        self.cache = PrefixCache(self.pool, enabled=cfg.enable_prefix_caching)
        self.swap, policy = None, None
        if cfg.preemption_mode != "recompute" and cfg.tensor_parallel_size == 1:
            self.swap = SwapSpace(self.cache, int(cfg.swap_space * 2**30))
            policy = SwapPolicy(cfg.preemption_mode, page_bytes=self.swap.page_bytes,
                                flops_per_token=2 * self.model.weight_bytes() / self.pool.cache.element_size(),
                                device=cfg.device, dtype=cfg.dtype)
        self.scheduler = Scheduler(self.cache, max_num_seqs=cfg.max_num_seqs,
                                   max_num_batched_tokens=cfg.max_num_batched_tokens, swap=self.swap, policy=policy)
        self.runner = ModelRunner(self.model, self.pool, cfg)
        if self._workers is not None:
            weakref.finalize(self, _stop_workers, self._workers, self.runner)
        self._requests: dict[int, _Request] = {}
        self._next_request = 0
        self._next_seq = 0
        self.step_stats: list[StepStats] = []
        self._num_requests = self._num_prompt_tokens = self._num_output_tokens = self._num_steps = 0
        self._pending: _Pending | None = None  # the last step's tokens, not yet read

    def _page_bytes(self) -> int:
        mc, cfg = self.model_config, self.config
        elem = torch.empty((), dtype=cfg.dtype).element_size()
        return mc.num_layers * 2 * cfg.page_size * mc.num_kv_heads // cfg.tensor_parallel_size * mc.head_dim * elem

    def _num_pages(self) -> int:
        cfg, mc = self.config, self.model_config
        if cfg.num_pages is not None:
            return cfg.num_pages
        if cfg.device.type != "cuda":  # a few sequences of full length, at most 1 GiB
            want = 4 * -(-cfg.max_model_len // cfg.page_size)
            return max(1, min(want, 2**30 // self._page_bytes()))
        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info(cfg.device)
        elem = torch.empty((), dtype=cfg.dtype).element_size()
        # Activations of the largest step: a few hidden-size and MLP-size buffers per token,
        # plus float32 logits and sampling buffers for every running sequence.
        per_token = (8 * mc.hidden_size + 4 * mc.intermediate_size + 2 * (mc.num_qo_heads + 2 * mc.num_kv_heads) * mc.head_dim) * elem
        reserve = cfg.max_num_batched_tokens * per_token + 4 * cfg.max_num_seqs * mc.vocab_size * 4 + 2**30
        budget = int(free * cfg.gpu_memory_utilization) - reserve
        pages = budget // self._page_bytes()
        if pages < 1:
            raise RuntimeError(
                f"num_pages: no GPU memory left for the KV pool ({free / 2**30:.1f} GiB free, "
                f"{reserve / 2**30:.1f} GiB reserved for activations); pass num_pages or lower max_num_batched_tokens")
        return int(pages)

    # ---- requests ----------------------------------------------------------------------

    def _prompt_ids(self, prompt: object, i: int) -> tuple[str | None, list[int]]:
        what = f"prompts[{i}]"
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{what}: a text prompt needs the model's tokenizer.json; pass token ids instead")
            if not prompt:
                raise ValueError(f"{what}: the prompt is empty")
            return prompt, list(self.tokenizer.encode(prompt).ids)
        if isinstance(prompt, torch.Tensor):
            if prompt.dim() != 1 or prompt.dtype.is_floating_point or prompt.dtype == torch.bool:
                raise TypeError(f"{what}: expected a 1-D integer tensor of token ids, got {prompt.dtype} {list(prompt.shape)}")
            prompt = prompt.tolist()
        if not isinstance(prompt, (list, tuple)):
            raise TypeError(f"{what}: expected a string or a sequence of token ids, got {type(prompt).__name__}")
        ids = []
        for j, t in enumerate(prompt):
            if isinstance(t, bool) or not isinstance(t, int):
                raise TypeError(f"{what}: token {j} is {type(t).__name__} {t!r}, expected an int")
            ids.append(int(t))
        return None, ids

    def _check_request(self, ids: list[int], params: SamplingParams, i: int) -> None:
        what = f"prompts[{i}]"
        vocab, max_len, ps = self.model_config.vocab_size, self.config.max_model_len, self.config.page_size
        if not ids:
            raise ValueError(f"{what}: the prompt is empty (it needs at least one token)")
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"{what}: token id {bad} is outside the vocabulary [0, {vocab})")
        if len(ids) > max_len:
            raise ValueError(f"{what}: the prompt has {len(ids)} tokens, more than max_model_len={max_len}")
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params: expected SamplingParams, got {type(params).__name__}")
        bad = next((t for t in params.stop_token_ids if t >= vocab), None)
        if bad is not None:
            raise ValueError(f"stop_token_ids: token id {bad} is outside the vocabulary [0, {vocab})")
        pages = -(-min(len(ids) + params.max_tokens, max_len) // ps)
        if pages > self.pool.num_pages:
            raise ValueError(f"{what}: prompt + max_tokens need {pages} pages but the KV pool has only "
                             f"{self.pool.num_pages}; lower max_tokens or give the pool more pages")

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None) -> int:
        """Queue one request; it joins the running batch at the next step. Returns its id.

        Raises ``ValueError``/``TypeError`` (and changes nothing) for an empty prompt, a
        token outside the vocabulary, a prompt longer than ``max_model_len``, a request that
        could never fit the KV pool, or bad sampling parameters.
        """
        params = SamplingParams() if params is None else params
        text, ids = self._prompt_ids(prompt, 0)
        self._check_request(ids, params, 0)
        return self._add(text, ids, params)

    def _add_beam(self, text: str | None, ids: list[int], params: BeamSearchParams) -> int:
        """Queue a beam-search request: one sequence until its first step forks the beams."""
        rid = self._next_request
        self._next_request += 1
        stop = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.model_config.eos_token_ids))
        seq_params = _beam_sequence_params(params)
        seq = Sequence(self._next_seq, rid, 0, ids, seq_params, None)
        self._next_seq += 1
        self._requests[rid] = _Request(rid, text, ids, seq_params, [seq], frozenset(stop),
                                       beam=BeamState(len(ids), params, frozenset(stop)))
        self._num_requests += 1
        self._num_prompt_tokens += len(ids)
        self.scheduler.add(seq)
        return rid

    def add_beam_request(self, prompt: Prompt, params: BeamSearchParams) -> int:
        """Queue one beam-search request beside the others (see :meth:`beam_search`); its
        final :class:`RequestOutput` from :meth:`step` lists the best sequences' generated
        tokens, best first, with ``cumulative_logprob`` and ``score``. Returns its id."""
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params: expected BeamSearchParams, got {type(params).__name__}")
        text, ids = self._prompt_ids(prompt, 0)
        self._check_beam_request(ids, params, 0)
        return self._add_beam(text, ids, params)

    def _check_beam_request(self, ids: list[int], params: BeamSearchParams, i: int) -> None:
        self._check_request(ids, _beam_sequence_params(params), i)
        if len(ids) + params.max_tokens > self.config.max_model_len:
            raise ValueError(f"prompts[{i}]: {len(ids)} prompt tokens + max_tokens {params.max_tokens} exceed "
                             f"max_model_len={self.config.max_model_len}")

    def beam_search(self, prompts, params: BeamSearchParams | Seq[BeamSearchParams]) -> list[BeamSearchOutput]:
        """Beam search for one prompt or a list (texts or token-id lists); outputs in order.

        ``params``: one :class:`~cascadeinfer.engine.beam.BeamSearchParams` for all prompts
        or one per prompt. Each output holds the ``beam_width`` best sequences (prompt and
        generated tokens), best first, with their cumulative log-probabilities and
        length-penalised scores, as transformers' ``generate(num_beams=k,
        num_return_sequences=k, do_sample=False)`` ranks them. The beams of a prompt share
        its pages and their common generated pages (fork, copy-on-write) and run in the
        same steps as any other requests; a pruned beam frees its pages.
        """
        prompts = _prompt_list(prompts)
        each = [params] * len(prompts) if isinstance(params, BeamSearchParams) else (
            list(params) if isinstance(params, (list, tuple)) else [])
        if len(each) != len(prompts) or not all(isinstance(p, BeamSearchParams) for p in each):
            raise TypeError(f"params: expected a BeamSearchParams or one per prompt ({len(prompts)})")
        request_ids = [self._add_beam(text, ids, p) for text, ids, p in self._checked(prompts, each,
                                                                                   self._check_beam_request)]
        done: dict[int, RequestOutput] = {}
        for i, out in self._run(request_ids, updates=False):
            if out.finished:
                done[i] = out
        return [BeamSearchOutput([BeamSearchSequence(done[i].prompt_token_ids + c.token_ids, c.cumulative_logprob,
                                                     c.score, c.text) for c in done[i].outputs])
                for i in range(len(request_ids))]

    def _add(self, text: str | None, ids: list[int], params: SamplingParams) -> int:
        rid = self._next_request
        self._next_request += 1
        seed = params.seed if params.seed is not None else sample_seed(self.config.seed, rid + 1)
        seqs = []
        for k in range(params.n):
            own_seed = None if params.greedy else sample_seed(seed, k)
            seqs.append(Sequence(self._next_seq + k, rid, k, ids, params, own_seed))
        self._next_seq += params.n
        seqs[0].forks = seqs[1:]
        stop = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop |= set(self.model_config.eos_token_ids)
        self._requests[rid] = _Request(rid, text, ids, params, seqs, frozenset(stop))
        self._num_requests += 1
        self._num_prompt_tokens += len(ids)
        self.scheduler.add(seqs[0])
        return rid

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._pending is not None

    # ---- the loop ----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step; returns the outputs of the requests that gained tokens in the
        step before it (see :meth:`_step`; the last call returns the last tokens)."""
        if not self.has_unfinished():
            return []
        with torch.inference_mode():
            return self._step(updates=True)

    def _step(self, *, updates: bool) -> list[RequestOutput]:
        """Schedule and enqueue a step, then take in the tokens of the step before it.

        The host never waits for the step it just enqueued: each step's tokens are copied
        back asynchronously and read at the next step, after that step is on the GPU, so
        the host's work for step ``n + 1`` (scheduling, grouping, planning, the metadata
        upload) runs while the GPU computes step ``n``. The scheduler needs only token
        counts, so a sampled token is a placeholder until it is read; a decode step of the
        captured-graph path takes its input tokens from the previous step's samples on the
        device. A step that needs the values on the host (prefill chunks, the eager path)
        reads the previous tokens first. A sequence that turns out to have sampled a stop
        token was given a row of the step in flight for nothing; that row's sample is
        dropped. Outputs therefore trail the GPU by one step. ``updates``: an output for
        every request that gained tokens; else only for those that finished (a caller that
        waits for the end needs no text decoded at every step).
        """
        t0 = time.perf_counter()
        pending, self._pending = self._pending, None
        batch = None
        if self.scheduler.has_unfinished():
            batch = self.scheduler.schedule()
            if not batch:
                raise RuntimeError("scheduler: no sequence could be scheduled (the KV pool is too small)")
        outputs: list[RequestOutput] = []
        waited = 0.0
        if pending is not None and not (batch and self.runner.overlappable(batch)):
            outputs = self._resolve(pending, updates)
            waited, pending = pending.wait_seconds, None
            batch = _without_finished(batch) if batch else None
        if self.swap is not None:
            self.swap.flush()  # the step's swap copies, before its kernels reuse the pages
        if not batch:  # nothing left to run, or every scheduled sequence just stopped
            return outputs
        if self._workers is not None:
            copies, self.pool.copy_log = self.pool.copy_log, []
            self._workers.send_step(batch, copies, from_previous=pending is not None)
        events = None
        if self.config.record_steps and self.config.device.type == "cuda":
            events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            events[0].record()
        sample_seqs, logits, stats = self.runner.execute(batch, pending.tokens_of() if pending else None)
        if events is not None:
            events[1].record()
        if pending is not None:
            outputs = self._resolve(pending, updates)  # waits for the previous step's copy only
            waited = pending.wait_seconds
        self.scheduler.advance(_without_finished(batch))
        targets: list[tuple[Sequence, int]] = []
        beam_rows: dict[int, list[tuple[Sequence, int]]] = {}
        for row, seq in enumerate(sample_seqs):
            if seq.finished:  # sampled a stop token in the previous step: this row was for nothing
                continue
            if self._requests[seq.request_id].beam is not None:
                beam_rows.setdefault(seq.request_id, []).append((seq, row))
                continue
            targets.append((seq, row))
            if seq.forks:
                targets += [(child, row) for child in self.scheduler.fork(seq)]
        if beam_rows:
            outputs += self._beam_step(beam_rows, logits)
        if [r for _, r in targets] != list(range(len(sample_seqs))):
            logits = logits.index_select(0, torch.tensor([r for _, r in targets], dtype=torch.long,
                                                         device=logits.device))
        rows = [s for s, _ in targets]
        step = _Pending(targets, sample(logits, [s.params for s in rows], [s.seed for s in rows],
                                        [s.num_tokens - s.prompt_len for s in rows]))
        if self._workers is not None and self.runner.graphs is not None and rows:
            # The workers' next step may take its tokens from these, before rank 0 reads them.
            self._workers.send_samples(step.device_tokens, [s.seq_id for s in rows])
        max_model_len = self.config.max_model_len
        for seq in rows:
            tokens = seq.tokens
            tokens.append(_PLACEHOLDER)
            # A length limit needs no token value: finish now, so the next step has no row for it.
            if len(tokens) - seq.prompt_len >= seq.params.max_tokens or len(tokens) >= max_model_len:
                self.scheduler.finish(seq, "length")
        self._pending = step if rows else None  # a step of beams only: nothing left to read
        self._num_steps += 1
        self._num_output_tokens += len(rows)
        if self.config.record_steps:
            self.step_stats.append(replace(stats, seconds=time.perf_counter() - t0, wait_seconds=waited,
                                           gpu_events=events))
        return outputs

    def _beam_step(self, beam_rows: dict[int, list[tuple[Sequence, int]]], logits: torch.Tensor
                   ) -> list[RequestOutput]:
        """Advance every beam request of the step (a host read of each row's best
        candidates): the beams that run on take their tokens now (forked where one beam has
        several continuations, sharing its pages), pruned beams free their pages, and a
        finished search ends its request. Returns the outputs of the requests that ended."""
        rows = [r for pairs in beam_rows.values() for _, r in pairs]
        log_probs = torch.log_softmax(logits[torch.tensor(rows, device=logits.device)].float(), dim=-1)
        # Each row's best candidates are all a search needs (BeamState.step): the top
        # `keep` of the row, found on the device, not the whole vocabulary copied over.
        keep = max(self._requests[rid].beam.keep for rid in beam_rows)
        values, token_ids = (t.cpu().numpy() for t in torch.topk(log_probs, k=min(keep, log_probs.shape[1]), dim=-1))
        at = {r: i for i, r in enumerate(rows)}
        ended = []
        for rid, pairs in beam_rows.items():
            req = self._requests[rid]
            beams = req.seqs
            # A step may run only some beams (its token budget, a preempted beam being
            # recomputed): the others' rows come in later steps, and the search moves on
            # once every beam's are in (a beam waiting for that has nothing to compute).
            req.beam_rows.update((seq.seq_id, (values[at[r]], token_ids[at[r]])) for seq, r in pairs)
            if any(seq.seq_id not in req.beam_rows for seq in beams):
                for seq, _ in pairs:
                    seq.awaiting = True
                continue
            got = [req.beam_rows.pop(seq.seq_id) for seq in beams]
            # The first step: the other beams are copies of the prompt's.
            got += got[:1] * (req.beam.k - len(beams))
            for seq in beams:
                seq.awaiting = False
            tokens = [s.tokens for s in beams] + [beams[0].tokens] * (req.beam.k - len(beams))
            chosen = req.beam.step(np.stack([v for v, _ in got]), np.stack([t for _, t in got]), tokens)
            if req.beam.done:
                req.result = req.beam.result()
                for seq in beams:
                    self.scheduler.finish(seq, "stop")
                ended.append(rid)
                continue
            # The beams that run on: a parent's first continuation is the parent itself, the
            # others its forks (made before any of them takes its token).
            taken: dict[int, int] = {}
            children: list[tuple[Sequence, int]] = []
            for parent_index, token, _ in chosen:
                parent = beams[min(parent_index, len(beams) - 1)]
                if taken.get(parent.seq_id, 0):
                    child = Sequence(self._next_seq, rid, len(children), req.prompt_token_ids, parent.params, None)
                    self._next_seq += 1
                    child.tokens = list(parent.tokens)
                    parent.forks = [child]
                    self.scheduler.fork(parent)
                else:
                    child = parent
                taken[parent.seq_id] = taken.get(parent.seq_id, 0) + 1
                children.append((child, token))
            for seq in beams:
                if not taken.get(seq.seq_id):
                    self.scheduler.finish(seq, "pruned")
            for child, token in children:
                child.tokens.append(token)
            req.seqs = [child for child, _ in children]
            self._num_output_tokens += len(children)
        outputs = []
        for rid in ended:
            outputs.append(self._output(self._requests[rid]))
            del self._requests[rid]
        return outputs

    def _resolve(self, pending: _Pending, updates: bool) -> list[RequestOutput]:
        """Read a step's tokens (waiting for their copy), put them in place of the
        placeholders, finish the sequences that sampled a stop token; the outputs of the
        requests that gained tokens (``updates``), or of those that finished."""
        touched: dict[int, None] = {}
        ended: set[int] = set()  # requests with a sequence that has finished: maybe all of them
        for (seq, _), token in zip(pending.targets, pending.values()):
            req = self._requests[seq.request_id]
            seq.tokens[-1] = token
            if token in req.stop_ids:
                if seq.finished:  # finished by its length at this very token: the stop token wins
                    seq.finish_reason = "stop"
                else:
                    self.scheduler.finish(seq, "stop")
            touched[seq.request_id] = None
            if seq.finished:
                ended.add(seq.request_id)
        outputs = [self._output(self._requests[rid]) for rid in touched
                   if updates or (rid in ended and all(seq.finished for seq in self._requests[rid].seqs))]
        for out in outputs:
            if out.finished:
                del self._requests[out.request_id]
        return outputs

    def _output(self, req: _Request) -> RequestOutput:
        if req.beam is not None:  # ended: its hypotheses, best first
            outs = [CompletionOutput(i, h.tokens[len(req.prompt_token_ids):],
                                     self._decode(h.tokens[len(req.prompt_token_ids):], req.stop_ids), "stop",
                                     h.cum_logprob, h.score) for i, h in enumerate(req.result)]
            return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outs, True)
        outs = []
        for seq in req.seqs:
            ids = seq.output_token_ids
            text = self._decode(ids, req.stop_ids) if seq.finished else self._partial_text(seq, ids)
            outs.append(CompletionOutput(seq.sample_index, ids, text, seq.finish_reason))
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outs,
                             all(s.finished for s in req.seqs))

    def _partial_text(self, seq: Sequence, ids: list[int]) -> str | None:
        """The text of a running sample's update, decoded incrementally (a running
        sample's ids end in no stop token: it would have finished)."""
        if self.tokenizer is None:
            return None
        if seq.text is None:
            seq.text = IncrementalText()
        return seq.text.update(self.tokenizer, ids)

    def _decode(self, ids: list[int], stop_ids: frozenset[int]) -> str | None:
        if self.tokenizer is None:
            return None
        if ids and ids[-1] in stop_ids:
            ids = ids[:-1]
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _add_all(self, prompts, sampling_params) -> list[int]:
        """Validate every prompt first, then queue them all (nothing queued on an error)."""
        prompts = _prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"sampling_params: got {len(params)} for {len(prompts)} prompts")
        return [self._add(text, ids, p) for text, ids, p in self._checked(prompts, params, self._check_request)]

    def _checked(self, prompts: list, params: list, check) -> list[tuple[str | None, list[int], object]]:
        """``(text, token ids, params)`` per prompt, every one checked (``check(ids, params,
        index)``) before any is queued, so that a bad prompt queues nothing."""
        checked = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            text, ids = self._prompt_ids(prompt, i)
            check(ids, p, i)
            checked.append((text, ids, p))
        return checked

    def _run(self, request_ids: list[int], *, updates: bool = True) -> Iterator[tuple[int, RequestOutput]]:
        index = {rid: i for i, rid in enumerate(request_ids)}
        remaining = set(request_ids)
        while remaining:
            if not self.has_unfinished():  # never expected: every request ends with a final output
                raise RuntimeError(f"requests {sorted(remaining)} ended without their final output")
            with torch.inference_mode():
                outputs = self._step(updates=updates)
            for out in outputs:
                if out.request_id in remaining:
                    if out.finished:
                        remaining.discard(out.request_id)
                    yield index[out.request_id], out

    def stream(self, prompts, sampling_params: SamplingParams | Seq[SamplingParams] | None = None
               ) -> Iterator[tuple[int, RequestOutput]]:
        """Queue ``prompts`` (validated first, as in :meth:`generate`) and return an iterator
        that runs them to completion, yielding ``(prompt index, output)`` whenever a request
        gains tokens; ``output.finished`` marks its last update."""
        return self._run(self._add_all(prompts, sampling_params))

    def generate(self, prompts, sampling_params: SamplingParams | Seq[SamplingParams] | None = None, *,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate for one prompt or a list (texts or token-id lists); outputs in order.

        ``sampling_params``: one for all prompts or one per prompt (default: SamplingParams()).
        Every prompt is validated before any is queued, so a bad one raises with nothing
        started.
        """
        request_ids = self._add_all(prompts, sampling_params)
        bar = _progress(len(request_ids)) if use_tqdm else None
        results: dict[int, RequestOutput] = {}
        try:
            for i, out in self._run(request_ids, updates=False):
                if out.finished:
                    results[i] = out
                    if bar is not None:
                        bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        return [results[i] for i in range(len(request_ids))]

    def chat_prompt(self, messages: list[dict], *, add_generation_prompt: bool = True) -> list[int]:
        """The token ids of a conversation rendered by the model's chat template.

        ``messages``: ``[{"role": "user", "content": "Hi"}, ...]``. The rendered text is
        encoded without the tokenizer's special-token additions: the template writes every
        special token itself (see :mod:`cascadeinfer.engine.chat`).
        """
        if self.tokenizer is None or self.chat_template is None:
            raise ValueError("messages: chat needs the model's tokenizer.json and a chat template "
                             "(chat_template.jinja or tokenizer_config.json's 'chat_template')")
        text = self.chat_template.render(messages, add_generation_prompt=add_generation_prompt)
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def chat(self, conversations, sampling_params: SamplingParams | Seq[SamplingParams] | None = None, *,
             use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate the assistant's next turn for one conversation (a list of message
        dicts) or a list of conversations; outputs in order, as :meth:`generate` gives them
        (their ``prompt`` is None: the prompt is the rendered conversation's token ids)."""
        if isinstance(conversations, (list, tuple)) and conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        if not isinstance(conversations, (list, tuple)) or not conversations:
            raise ValueError("conversations: expected a list of messages or a non-empty list of conversations")
        prompts = [self.chat_prompt(messages) for messages in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    # ---- maintenance -------------------------------------------------------------------

    def close(self) -> None:
        """Stop the tensor-parallel workers (if any) and end their process group. The
        engine is unusable afterwards; it also happens when the engine is collected."""
        if getattr(self, "_workers", None) is not None:
            _stop_workers(self._workers, self.runner)
            self._workers = None

    def time_all_reduce(self, tokens: int) -> float | None:
        """Seconds the all-reduces of one forward over ``tokens`` rows take alone (two per
        layer, ``[tokens, hidden]`` in the engine's dtype; on GPUs replayed from a CUDA
        graph), the slowest rank's; None without tensor parallelism. Every rank takes part."""
        if self._workers is None:
            return None
        shape = (tokens, self.model_config.hidden_size)
        return self._workers.time_all_reduce(shape, self.config.dtype, 2 * self.model_config.num_layers,
                                             self.config.device)

    def set_use_cascade(self, use_cascade: bool | None) -> None:
        """Switch the decode attention mode: cascade (True), flat (False), planner (None)."""
        self.config = replace(self.config, use_cascade=use_cascade)
        self.runner.config = self.config

    def reset_prefix_cache(self) -> None:
        """Drop every cached page no running sequence holds."""
        self.cache.reset()

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    @property
    def stats(self) -> EngineStats:
        """A snapshot of the engine's counters (see :class:`EngineStats`)."""
        sched = self.scheduler
        return EngineStats(
            requests=self._num_requests, prompt_tokens=self._num_prompt_tokens,
            prefill_tokens=sched.num_computed_prompt_tokens, cached_prompt_tokens=sched.num_cached_prompt_tokens,
            computed_tokens=sched.num_computed_tokens, output_tokens=self._num_output_tokens, steps=self._num_steps,
            preemptions=sched.num_preemptions, swapped_preemptions=sched.num_swapped_out,
            swap_fallbacks=sched.num_swap_fallbacks,
            swapped_out_bytes=self.swap.bytes_out if self.swap else 0,
            swapped_in_bytes=self.swap.bytes_in if self.swap else 0,
            swap_seconds=self.swap.seconds() if self.swap else 0.0,
            cache_hit_pages=self.cache.hits, copied_pages=self.cache.copies)


_PLACEHOLDER = -1  # a sampled token whose value is still on its way from the device


class _Pending:
    """A step's sampled tokens on their way to the host: ``targets`` pairs each sequence
    with its row of ``tokens`` (int64 ``[rows]`` on the device); the copy into pinned
    memory starts at once and is read by :meth:`values`."""

    def __init__(self, targets: list[tuple[Sequence, int]], tokens: torch.Tensor) -> None:
        self.targets = targets
        self.device_tokens = tokens
        self.row_of = {seq.seq_id: index for index, (seq, _) in enumerate(targets)}
        if tokens.is_cuda:
            self.host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self.host.copy_(tokens, non_blocking=True)
            self.copied = torch.cuda.Event()
            self.copied.record()
        else:
            self.host, self.copied = tokens, None
        self.wait_seconds = 0.0  # how long values() waited for the copy

    def values(self) -> list[int]:
        if self.copied is not None:
            t0 = time.perf_counter()
            self.copied.synchronize()
            self.wait_seconds = time.perf_counter() - t0
        return self.host.tolist()

    def tokens_of(self) -> tuple[torch.Tensor, dict[int, int]]:
        """The samples on the device and each sequence's index in them, by ``seq_id``."""
        return self.device_tokens, self.row_of


def _stop_workers(workers: Workers, runner: ModelRunner) -> None:
    """Stop the tensor-parallel workers, the captured steps freed first (see
    :meth:`~cascadeinfer.engine.model_runner.DecodeGraphs.release`)."""
    if runner.graphs is not None:
        runner.graphs.release()
    workers.close()


def _prompt_list(prompts) -> list:
    """One prompt (a text, a tensor or a list of token ids) or a non-empty list of them, as a list."""
    if isinstance(prompts, (str, torch.Tensor)) or (
            isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) and not isinstance(t, bool)
                                                                   for t in prompts)):
        return [prompts]
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts: expected a prompt or a non-empty list of prompts")
    return list(prompts)


def _beam_sequence_params(params: BeamSearchParams) -> SamplingParams:
    """What the scheduler and the checks read of a beam's sequence: its token budget (the
    beam search itself decides its tokens and when it ends)."""
    return SamplingParams(max_tokens=params.max_tokens, temperature=0.0, ignore_eos=True)


def _without_finished(batch: ScheduledBatch) -> ScheduledBatch:
    """``batch`` without the sequences that finished after it was scheduled."""
    return ScheduledBatch([(s, n) for s, n in batch.prefill if not s.finished],
                          [s for s in batch.decode if not s.finished], batch.preempted)


def _progress(total: int):
    try:
        from tqdm import tqdm  # noqa: PLC0415
    except ImportError:
        return None
    return tqdm(total=total, desc="requests", unit="req")
