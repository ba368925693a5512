"""One engine step on the device: per-step metadata, the model forward, the logits.

A step's tokens are laid out flat: every prefill chunk first, then one token per decode
sequence. Per layer, the attention callable of the step

1. appends the step's K/V to the paged pool (``append_paged_kv_cache``, one call for all
   tokens, through one CSR page table with a row per sequence). With the model's fused
   kernels on, the layer leaves RoPE to it too, and one launch
   (``append_paged_kv_cache_rope``) rotates q and k in place and appends the rotated K/V;
2. runs prefill attention for the chunks: ``batch_prefill_ragged`` over the step's own
   K/V when no chunk has earlier tokens in the cache, else ``batch_prefill_paged`` over
   each sequence's pages (causal, the last query aligned with the last key);
3. runs decode attention as a multi-level cascade. The decode sequences are ordered so
   that sequences sharing pages are neighbours, and grouped: a level-0 group per set of
   sequences with a common page prefix (their longest common run of shared pages), more
   levels inside those where configured, and a last level holding each sequence's own
   pages. ``MultiLevelCascadeAttention`` is planned once per step — its cost model picks
   cascade or flat decode — and run once per layer.

Pure decode steps on a GPU replay a CUDA graph of the whole forward, captured lazily per
(batch bucket, attention mode, group bucket of each shared level), its attention the
cascade's graph mode over fixed-capacity buffers that each step's plan refills (see
:class:`DecodeGraphs`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cascadeinfer._device import next_power_of_2
from cascadeinfer._host import host_tensor
from cascadeinfer.cascade.grouping import group_levels
from cascadeinfer.cascade.multi_level import MultiLevelCascadeAttention
from cascadeinfer.cascade.plan import HostLevel, choose_cascade
from cascadeinfer.engine.config import EngineConfig
from cascadeinfer.engine.llama import LlamaForCausalLM
from cascadeinfer.engine.scheduler import ScheduledBatch
from cascadeinfer.engine.sequence import Sequence
from cascadeinfer.kernels import batch_prefill_paged, batch_prefill_ragged
from cascadeinfer.kernels.append import append_paged_kv_cache
from cascadeinfer.kernels.rope_append import append_paged_kv_cache_rope
from cascadeinfer.layouts.pool import PagedKVPool

# ---- the attention of one step --------------------------------------------------------


def _i32(values: list[int], device: torch.device) -> torch.Tensor:
    return host_tensor(values, torch.int32).to(device)


class StepAttention:
    """The per-layer attention callable of one eager step (see the module docstring)."""

    # A fused layer hands over q and k unrotated, with the positions and the cos/sin table.
    applies_rope = True

    def __init__(self, runner: ModelRunner, *, append_rows, append_positions, kv_indptr, kv_indices,
                 kv_last_page_len, num_prefill_rows: int, num_prefill_pages: int, num_prefill_tokens: int,
                 prefill_qo_indptr, prefill_ragged: bool, decode: MultiLevelCascadeAttention | None):
        self.pool = runner.pool
        self.kv_layout = runner.config.kv_layout
        self.sm_scale = runner.sm_scale
        self.validate = runner.config.check_metadata
        self.append_rows, self.append_positions = append_rows, append_positions
        self.kv_indptr, self.kv_indices, self.kv_last_page_len = kv_indptr, kv_indices, kv_last_page_len
        self.num_prefill_rows, self.num_prefill_tokens = num_prefill_rows, num_prefill_tokens
        self.num_prefill_pages = num_prefill_pages
        self.prefill_qo_indptr, self.prefill_ragged = prefill_qo_indptr, prefill_ragged
        self.decode = decode

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 positions: torch.Tensor | None = None, cos_sin: torch.Tensor | None = None) -> torch.Tensor:
        """``o [T, Hq, D]``. With ``positions`` and ``cos_sin`` (a fused layer), q and k are
        rotated here, in place, by the launch that appends K/V; without, they come rotated."""
        cache = self.pool.layer(layer)
        if positions is None:
            append_paged_kv_cache(k, v, self.append_rows, self.append_positions, cache, self.kv_indices,
                                  self.kv_indptr, self.kv_last_page_len, kv_layout=self.kv_layout,
                                  validate=self.validate)
        else:
            append_paged_kv_cache_rope(q, k, v, self.append_rows, self.append_positions, cache, self.kv_indices,
                                       self.kv_indptr, self.kv_last_page_len, positions, cos_sin,
                                       kv_layout=self.kv_layout, validate=self.validate)
        out = torch.empty_like(q)
        p, rows = self.num_prefill_tokens, self.num_prefill_rows
        if p and self.prefill_ragged:
            batch_prefill_ragged(q[:p], self.prefill_qo_indptr, k[:p], v[:p], self.prefill_qo_indptr, causal=True,
                                 sm_scale=self.sm_scale, out=out[:p], validate=self.validate)
        elif p:
            batch_prefill_paged(q[:p], self.prefill_qo_indptr, cache, self.kv_indptr[:rows + 1],
                                self.kv_indices[:self.num_prefill_pages], self.kv_last_page_len[:rows], causal=True,
                                kv_layout=self.kv_layout, sm_scale=self.sm_scale, out=out[:p], validate=self.validate)
        if self.decode is not None:
            self.decode.run(q[p:], cache, out=out[p:], sm_scale=self.sm_scale)
        return out


@dataclass(frozen=True, slots=True)
class StepStats:
    """What one step did (``LLM.step_stats`` when ``record_steps``)."""

    num_prefill_tokens: int
    num_decode: int
    cascade: bool | None  # decode attention mode; None without decode tokens
    graph: bool
    kv_tokens_read: int  # keys the decode attention reads (shared levels counted once)
    seconds: float = 0.0
    # Of ``seconds``, the wait for the previous step's tokens: the host's own work is the
    # rest, and a step whose wait is near 0 is bound by the host, not the GPU.
    wait_seconds: float = 0.0
    # Both counts, whichever mode ran (for floors): every row its whole sequence, and the
    # levels' pages once each (the shared prefix once).
    kv_tokens_attended: int = 0
    kv_tokens_shared_once: int = 0
    # On a GPU: CUDA events recorded before and after the step's forward was enqueued, so
    # their interval is the GPU's time for the forward (see :meth:`gpu_seconds`).
    gpu_events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None

    def gpu_seconds(self) -> float | None:
        """The GPU's time from the step's first event to its second: the forward's kernels,
        and any time the GPU waited in between for the host to enqueue them (none for a
        captured step, enqueued at once). Waits for the second event. None on a CPU."""
        if self.gpu_events is None:
            return None
        start, end = self.gpu_events
        end.synchronize()
        return start.elapsed_time(end) * 1e-3


class ModelRunner:
    """Runs the model for a :class:`ScheduledBatch` and returns the logits to sample."""

    def __init__(self, model: LlamaForCausalLM, pool: PagedKVPool, config: EngineConfig):
        self.model = model
        self.pool = pool
        self.config = config
        mc = model.config
        self.sm_scale = mc.head_dim ** -0.5
        self.page_size = pool.page_size
        path = config.use_graphs if config.decode_graph_path is None else config.decode_graph_path
        self.graphs = DecodeGraphs(self, capture=config.use_graphs) if path else None

    def _plan_decode(self, levels: list[HostLevel]) -> MultiLevelCascadeAttention:
        mc = self.model.config
        attn = MultiLevelCascadeAttention(len(levels), kv_layout=self.config.kv_layout, device=self.config.device)
        tables = [[getattr(lv, name) for lv in levels] for name in ("qo_indptr", "kv_indptr", "kv_indices",
                                                                   "kv_last_page_len")]
        attn.plan(*tables,
                  self.model.num_qo_heads, self.model.num_kv_heads, mc.head_dim, self.page_size, causal=False,
                  sm_scale=self.sm_scale, num_pages=self.pool.num_pages, dtype=self.pool.dtype,
                  use_cascade=self.config.use_cascade if len(levels) > 1 else None)
        return attn

    def choose_cascade(self, levels: list[HostLevel]) -> bool:
        """The planner's choice for these levels (the config's override, if any, wins)."""
        if len(levels) == 1:
            return False
        if self.config.use_cascade is not None:
            return self.config.use_cascade
        mc = self.model.config
        # Flat decode is always possible here (levels above the last hold full pages only).
        cascade, _, _, _ = choose_cascade(
            levels, page_size=self.page_size,
            num_qo_heads=self.model.num_qo_heads, num_kv_heads=self.model.num_kv_heads, head_dim=mc.head_dim,
            elem_bytes=self.pool.cache.element_size(), device=self.config.device)
        return cascade

    def overlappable(self, batch: ScheduledBatch) -> bool:
        """Whether :meth:`execute` can take ``batch``'s input tokens from the previous
        step's samples on the device (a decode step of the captured-graph path)."""
        return (not batch.prefill and bool(batch.decode) and self.graphs is not None
                and len(batch.decode) <= self.config.max_graph_batch)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, previous: tuple[torch.Tensor, dict[int, int]] | None = None
                ) -> tuple[list[Sequence], torch.Tensor, StepStats]:
        """Run one step. Returns the sequences that sample, in the order of the rows of the
        logits ``[rows, vocab]`` (float32, or the model's dtype from a captured decode step:
        :func:`cascadeinfer.engine.sampling.sample` takes either), and the step's
        statistics. Reads nothing back.

        ``previous``: the last step's samples on the device and each sequence's index in
        them (by ``seq_id``), for sequences whose last token the host has not read yet;
        only for an :meth:`overlappable` batch.
        """
        ps = self.page_size
        device = self.config.device
        decode_levels: list[HostLevel] = []
        decode = batch.decode
        if decode:
            order, decode_levels = group_levels(
                [s.pages for s in decode], [s.num_tokens - (len(s.pages) - 1) * ps for s in decode],
                self.config.cascade_levels, ps)
            decode = [decode[r] for r in order]

        if self.overlappable(batch):
            cascade = self.choose_cascade(decode_levels)
            logits = self.graphs.run(decode, decode_levels, cascade, previous)
            return decode, logits, self._stats(0, decode_levels, cascade, True)

        if previous is not None:
            raise ValueError("previous: only a decode step of the captured-graph path reads tokens on the device")
        rows = [(s, n) for s, n in batch.prefill] + [(s, 1) for s in decode]
        input_ids, positions, append_rows, kv_indptr, kv_indices, kv_last = [], [], [], [0], [], []
        sample_seqs, sample_index = [], []
        for row, (seq, n) in enumerate(rows):
            start, end = seq.num_computed, seq.num_computed + n
            input_ids += seq.tokens[start:end]
            positions += range(start, end)
            append_rows += [row] * n
            num_pages = -(-end // ps)
            if len(seq.pages) != num_pages:
                raise RuntimeError(f"{seq!r}: holds {len(seq.pages)} pages but {end} tokens need {num_pages}")
            kv_indices += seq.pages
            kv_indptr.append(len(kv_indices))
            kv_last.append(end - (num_pages - 1) * ps)
            if end == seq.num_tokens:
                sample_seqs.append(seq)
                sample_index.append(len(input_ids) - 1)
        num_prefill_rows = len(batch.prefill)
        num_prefill_tokens = sum(n for _, n in batch.prefill)
        qo = [0]
        for _, n in batch.prefill:
            qo.append(qo[-1] + n)
        decode_attn = self._plan_decode(decode_levels) if decode else None
        attention = StepAttention(
            self, append_rows=_i32(append_rows, device), append_positions=_i32(positions, device),
            kv_indptr=_i32(kv_indptr, device), kv_indices=_i32(kv_indices, device),
            kv_last_page_len=_i32(kv_last, device), num_prefill_rows=num_prefill_rows,
            num_prefill_pages=kv_indptr[num_prefill_rows],
            num_prefill_tokens=num_prefill_tokens, prefill_qo_indptr=_i32(qo, device),
            prefill_ragged=all(s.num_computed == 0 for s, _ in batch.prefill), decode=decode_attn)
        logits = self.model(
            host_tensor(input_ids, torch.int64).to(device),
            host_tensor(positions, torch.int64).to(device),
            attention,
            host_tensor(sample_index, torch.int64).to(device),
        )
        cascade = decode_attn.use_cascade if decode_attn is not None else None
        return sample_seqs, logits, self._stats(num_prefill_tokens, decode_levels, cascade, False)

    def _stats(self, num_prefill_tokens: int, levels: list[HostLevel], cascade: bool | None,
               graph: bool) -> StepStats:
        if not levels:
            return StepStats(num_prefill_tokens, 0, None, graph, 0)
        ps = self.page_size
        num_decode = levels[-1].num_groups
        once, attended = sum(lv.kv_tokens(ps) for lv in levels), _flat_kv_tokens(levels, ps)
        return StepStats(num_prefill_tokens, num_decode, cascade, graph, once if cascade else attended,
                         kv_tokens_attended=attended, kv_tokens_shared_once=once)


def _flat_kv_tokens(levels: list[HostLevel], page_size: int) -> int:
    """Keys flat decode reads: every row its whole sequence (shared pages once per row)."""
    total = levels[-1].kv_tokens(page_size)
    for lv in levels[:-1]:  # full pages only above the last level
        queries = lv.qo_indptr[1:] - lv.qo_indptr[:-1]
        pages = (lv.kv_indptr[1:] - lv.kv_indptr[:-1]).long()
        total += int((queries * pages).sum()) * page_size
    return total


# ---- CUDA graphs of the decode step --------------------------------------------------


def _buckets(max_batch: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_batch + 1, 16))
    return sorted({s for s in sizes if s <= max_batch} | {max_batch})


class _Captured:
    """One captured decode step: its cascade (graph mode: fixed buffers, fixed launch
    choices) and its graph (None until captured, and without capture)."""

    __slots__ = ("attn", "graph")

    def __init__(self, attn: MultiLevelCascadeAttention) -> None:
        self.attn = attn
        self.graph: torch.cuda.CUDAGraph | None = None


class DecodeGraphs:
    """Captured decode steps: the whole forward, attention through the cascade's graph mode.

    A graph replays the same kernel launches, so every tensor it reads has a fixed address
    and a fixed shape per key ``(batch bucket, cascade?, group bucket of each level above
    the last)``: the batch is padded to the bucket (padding rows append nothing, have no
    pages and attend to nothing), each upper level's group count to a power of two (empty
    groups), and each key owns a :class:`MultiLevelCascadeAttention` built with
    ``use_cuda_graph=True``, whose page lists sit in buffers of the largest possible size.
    Each step plans that cascade (its tables rewritten in place), refills the input
    buffers and replays; the captured cascade keeps its side stream and its prefix split
    sized for the decode beside it, for any number of levels. Flat decode is a one-level
    plan of every row's pages. The new token's K/V is appended through the last level's
    table (its page is always the row's last). Graphs share one memory pool and are
    captured on a key's first use, after a forward that compiles and records outside the
    capture.

    ``capture=False`` runs the same padded forward without a graph (any device): the
    tests check the padding and buffer logic that way on a CPU.
    """

    def __init__(self, runner: ModelRunner, *, capture: bool = True):
        # The runner's parts, not the runner: the runner holds this object (no cycle).
        self.model, self.pool, self.sm_scale, self.page_size = runner.model, runner.pool, runner.sm_scale, runner.page_size
        self.kv_layout = runner.config.kv_layout
        self.capture = capture
        cfg = runner.config
        self.device = dev = cfg.device
        self.max_batch = cfg.max_graph_batch
        self.buckets = _buckets(self.max_batch)
        self.pages_per_seq = -(-cfg.max_model_len // runner.page_size)
        b = self.max_batch
        self.input_ids = torch.zeros(b, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(b, dtype=torch.int64, device=dev)
        self.append_rows = torch.zeros(b, dtype=torch.int32, device=dev)
        self.append_positions = torch.zeros(b, dtype=torch.int32, device=dev)
        # Every graph writes its logits here (one buffer, not one per graph: [batch, vocab] is
        # big), in the model's dtype: greedy rows take their argmax from it directly, and a
        # float32 copy would cost a write and a read of the whole buffer per step.
        self.logits = torch.empty(b, runner.model.config.vocab_size, dtype=runner.model.embed_tokens.dtype,
                                  device=dev)
        self.steps: dict[tuple, _Captured] = {}
        self.mempool = torch.cuda.graph_pool_handle() if capture else None

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def release(self) -> None:
        """Free every captured step (a later step captures again). Under tensor parallelism
        this comes before the NCCL group ends: NCCL's teardown waits until every CUDA graph
        that captured its collectives is gone, so ending it first never returns."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.steps.clear()

    @property
    def num_captured(self) -> int:
        return sum(step.graph is not None for step in self.steps.values())

    def run(self, seqs: list[Sequence], levels: list[HostLevel], cascade: bool,
            previous: tuple[torch.Tensor, dict[int, int]] | None = None) -> torch.Tensor:
        """Replay (capturing first if new) the step for ``seqs``; logits ``[n, vocab]`` in the model's dtype.
        ``previous``: see :meth:`ModelRunner.execute`."""
        n = len(seqs)
        batch = self.bucket(n)
        if cascade:
            tables = [_padded(lv, batch, n, last=i == len(levels) - 1) for i, lv in enumerate(levels)]
        else:
            tables = [_padded(_flat_level(seqs, self.page_size), batch, n, last=True)]
        key = (batch, cascade, tuple(t[0].numel() - 1 for t in tables[:-1]))
        step = self.steps.get(key)
        if step is None:
            step = self.steps[key] = _Captured(MultiLevelCascadeAttention(
                len(tables), kv_layout=self.kv_layout, device=self.device, use_cuda_graph=True,
                max_pages=batch * self.pages_per_seq))
        mc = self.model.config
        step.attn.plan(*zip(*tables), self.model.num_qo_heads, self.model.num_kv_heads, mc.head_dim, self.page_size,
                       sm_scale=self.sm_scale, num_pages=self.pool.num_pages, dtype=self.pool.dtype)
        self._fill(batch, seqs, tables[-1][1], previous)
        if not self.capture:
            return self._forward(batch, step.attn)[:n]
        if step.graph is None:
            step.graph = self._capture(batch, step.attn)
        step.graph.replay()
        return self.logits[:n]

    def _fill(self, batch: int, seqs: list[Sequence], own_indptr: torch.Tensor,
              previous: tuple[torch.Tensor, dict[int, int]] | None) -> None:
        """The step's token ids, positions and append slots, padded to ``batch`` rows. The
        new token goes through the last level's table (``own_indptr``: each row's pages
        there), so its slot is counted from the row's first page in that table. A row
        whose last token is still in ``previous`` (its value unread) takes it from there,
        by a gather on the device."""
        ps = self.page_size
        n = len(seqs)
        pad = [0] * (batch - n)

        def put(buf: torch.Tensor, values: list[int]) -> None:
            buf[:batch].copy_(host_tensor(values, buf.dtype), non_blocking=True)

        own = own_indptr.tolist()
        ids, positions, slots = [], [], []
        for s, a, b in zip(seqs, own, own[1:]):  # one pass: this runs for every row at every step
            pos = len(s.tokens) - 1
            ids.append(max(s.tokens[-1], 0))
            positions.append(pos)
            slots.append(pos - (len(s.pages) - (b - a)) * ps)
        put(self.input_ids, ids + pad)
        if previous is not None:
            tokens, row_of = previous
            rows = [(i, row_of[s.seq_id]) for i, s in enumerate(seqs) if s.seq_id in row_of]
            if rows:
                index = host_tensor([i for i, _ in rows] + [r for _, r in rows], torch.int64)
                index = index.to(self.device, non_blocking=True)
                self.input_ids.index_copy_(0, index[:len(rows)], tokens.index_select(0, index[len(rows):]))
        put(self.positions, positions + pad)
        put(self.append_rows, list(range(n)) + [-1] * (batch - n))
        put(self.append_positions, slots + pad)

    def _forward(self, batch: int, attn: MultiLevelCascadeAttention) -> torch.Tensor:
        pool, layout, scale = self.pool, self.kv_layout, self.sm_scale
        rows, positions = self.append_rows[:batch], self.append_positions[:batch]
        table = attn.level_table(-1)  # where the new token's page is found

        def attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      rope_positions: torch.Tensor | None = None, cos_sin: torch.Tensor | None = None) -> torch.Tensor:
            cache = pool.layer(layer)
            if rope_positions is None:  # an unfused layer: q and k come rotated
                append_paged_kv_cache(k, v, rows, positions, cache, table.kv_indices, table.kv_indptr,
                                      table.kv_last_page_len, kv_layout=layout, validate=False)
            else:  # the token's own position rotates it; ``positions`` place it in the last level's table
                append_paged_kv_cache_rope(q, k, v, rows, positions, cache, table.kv_indices, table.kv_indptr,
                                           table.kv_last_page_len, rope_positions, cos_sin, kv_layout=layout,
                                           validate=False)
            return attn.run(q, cache, sm_scale=scale)

        attention.applies_rope = True  # see StepAttention
        return self.model(self.input_ids[:batch], self.positions[:batch], attention, None, out=self.logits[:batch])

    def _capture(self, batch: int, attn: MultiLevelCascadeAttention) -> torch.cuda.CUDAGraph:
        def forward() -> None:
            self._forward(batch, attn)

        # The step itself, once outside the capture: compiles the kernels and records the
        # cascade's launches (its K/V appends are written again, the same, by the replay).
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            forward()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.mempool):
            forward()
        return graph


def _flat_level(seqs: list[Sequence], page_size: int) -> HostLevel:
    """One level of every row's whole page list (flat decode)."""
    indptr, indices, last = [0], [], []
    for s in seqs:
        indices += s.pages
        indptr.append(len(indices))
        last.append(s.num_tokens - (len(s.pages) - 1) * page_size)
    return HostLevel.from_lists(list(range(len(seqs) + 1)), indptr, indices, last, page_size)


def _padded(level: HostLevel, batch: int, n: int, *, last: bool) -> tuple[torch.Tensor, ...]:
    """``level``'s host tables for a batch of ``n`` rows padded to ``batch``: the last level
    gets a row without pages per padding row; a level above it one group without pages
    holding the padding rows, then empty groups up to a power of two (capped at ``batch``)."""
    qo, kv, idx, lens = level.tensors()
    qo = qo.to(torch.int32)
    extra = batch - n if last else 0
    if not last:
        groups = level.num_groups + (batch > n)
        extra = min(batch, next_power_of_2(groups)) - level.num_groups
    if not extra:
        return qo, kv, idx, lens
    qo = torch.cat([qo, (torch.arange(1, extra + 1, dtype=torch.int32) + n) if last
                    else torch.full((extra,), batch, dtype=torch.int32)])
    return qo, torch.cat([kv, kv[-1:].expand(extra)]), idx, torch.cat([lens, torch.zeros(extra, dtype=torch.int32)])
