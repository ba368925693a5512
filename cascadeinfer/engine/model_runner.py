"""One engine step on the device: per-step metadata, the model forward, the logits.

A step's tokens are laid out flat: every prefill chunk first, then one token per decode
sequence. Per layer, the attention callable of the step

1. appends the step's K/V to the paged pool (``append_paged_kv_cache``, one call for all
   tokens, through one CSR page table with a row per sequence);
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
(batch bucket, attention mode, level-0 group bucket) over fixed-capacity metadata buffers
that each step refills (see :class:`DecodeGraphs`).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import torch

from cascadeinfer._checks import next_power_of_2
from cascadeinfer.cascade.multi_level import MultiLevelCascadeAttention
from cascadeinfer.cascade.grouping import group_levels
from cascadeinfer.cascade.plan import HostLevel, choose_cascade
from cascadeinfer.engine.config import EngineConfig
from cascadeinfer.engine.llama import LlamaForCausalLM
from cascadeinfer.engine.scheduler import ScheduledBatch
from cascadeinfer.engine.sequence import Sequence
from cascadeinfer.kernels.append import append_paged_kv_cache
from cascadeinfer.kernels.decode import batch_decode_paged
from cascadeinfer.kernels.merge import merge_state
from cascadeinfer.kernels.prefill import batch_prefill_paged, batch_prefill_ragged
from cascadeinfer.layouts.pool import PagedKVPool


# ---- the attention of one step --------------------------------------------------------


def _host_tensor(values: list[int], dtype: torch.dtype) -> torch.Tensor:
    """A CPU int32/int64 tensor from a list (via ``array``: ~3x faster than torch.tensor)."""
    if not values:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(array("i" if dtype == torch.int32 else "q", values), dtype=dtype)


def _i32(values: list[int], device: torch.device) -> torch.Tensor:
    return _host_tensor(values, torch.int32).to(device)


class StepAttention:
    """The per-layer attention callable of one eager step (see the module docstring)."""

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

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cache = self.pool.layer(layer)
        append_paged_kv_cache(k, v, self.append_rows, self.append_positions, cache, self.kv_indices,
                              self.kv_indptr, self.kv_last_page_len, kv_layout=self.kv_layout,
                              validate=self.validate)
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
    # Both counts, whichever mode ran (for floors): every row its whole sequence, and the
    # levels' pages once each (the shared prefix once).
    kv_tokens_attended: int = 0
    kv_tokens_shared_once: int = 0


class ModelRunner:
    """Runs the model for a :class:`ScheduledBatch` and returns the logits to sample."""

    def __init__(self, model: LlamaForCausalLM, pool: PagedKVPool, config: EngineConfig):
        self.model = model
        self.pool = pool
        self.config = config
        mc = model.config
        self.sm_scale = mc.head_dim ** -0.5
        self.page_size = pool.page_size
        self.graphs = DecodeGraphs(self) if config.use_graphs else None

    def _plan_decode(self, levels: list[HostLevel]) -> MultiLevelCascadeAttention:
        mc = self.model.config
        attn = MultiLevelCascadeAttention(len(levels), kv_layout=self.config.kv_layout, device=self.config.device)
        tables = [[getattr(lv, name) for lv in levels] for name in ("qo_indptr", "kv_indptr", "kv_indices",
                                                                   "kv_last_page_len")]
        attn.plan(*tables,
                  mc.num_qo_heads, mc.num_kv_heads, mc.head_dim, self.page_size, causal=False,
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
            num_qo_heads=mc.num_qo_heads, num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim,
            elem_bytes=self.pool.cache.element_size(), device=self.config.device)
        return cascade

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> tuple[list[Sequence], torch.Tensor, StepStats]:
        """Run one step. Returns the sequences that sample, in the order of the rows of the
        float32 logits ``[rows, vocab]``, and the step's statistics. Reads nothing back."""
        ps = self.page_size
        device = self.config.device
        decode_levels: list[HostLevel] = []
        decode = batch.decode
        if decode:
            order, decode_levels = group_levels(
                [s.pages for s in decode], [s.num_tokens - (len(s.pages) - 1) * ps for s in decode],
                self.config.cascade_levels, ps)
            decode = [decode[r] for r in order]

        if not batch.prefill and self.graphs is not None and len(decode) <= self.config.max_graph_batch:
            cascade = self.choose_cascade(decode_levels)
            logits = self.graphs.run(decode, decode_levels, cascade)
            return decode, logits, self._stats(0, decode_levels, cascade, True)

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
            _host_tensor(input_ids, torch.int64).to(device),
            _host_tensor(positions, torch.int64).to(device),
            attention,
            _host_tensor(sample_index, torch.int64).to(device),
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


class DecodeGraphs:
    """Captured decode steps over fixed-capacity metadata buffers.

    A graph replays the same kernel launches, so every tensor it reads has a fixed address
    and a fixed shape per key ``(batch bucket, cascade?, level-0 group bucket)``: the
    batch is padded to the bucket (padding rows append nothing, have no pages and attend to
    nothing), the level-0 group count to a power of two (empty groups), and the page lists
    sit in buffers of the largest possible size (kernels read only up to ``kv_indptr``).
    Only two-level cascades (or flat decode) are captured. Graphs share one memory pool
    and are captured on first use; each step refills the buffers and replays.

    ``capture=False`` runs the same padded forward without a graph (any device): the
    tests check the padding and buffer logic that way on a CPU.
    """

    def __init__(self, runner: ModelRunner, *, capture: bool = True):
        # The runner's parts, not the runner: the runner holds this object (no cycle).
        self.model, self.pool, self.sm_scale, self.page_size = runner.model, runner.pool, runner.sm_scale, runner.page_size
        self.kv_layout = runner.config.kv_layout
        self.capture = capture
        cfg = runner.config
        dev = cfg.device
        self.max_batch = cfg.max_graph_batch
        self.buckets = _buckets(self.max_batch)
        pages_per_seq = -(-cfg.max_model_len // runner.page_size)
        cap = self.max_batch * pages_per_seq
        b = self.max_batch
        i32 = dict(dtype=torch.int32, device=dev)
        self.input_ids = torch.zeros(b, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(b, dtype=torch.int64, device=dev)
        self.append_rows = torch.zeros(b, **i32)
        self.append_positions = torch.zeros(b, **i32)
        # flat table (every row's pages): the append, and flat decode
        self.flat_indptr, self.flat_indices, self.flat_last = (torch.zeros(b + 1, **i32), torch.zeros(cap, **i32),
                                                               torch.zeros(b, **i32))
        # level 0 (shared prefixes) and level 1 (each row's own pages) of the cascade
        self.l0_qo, self.l0_indptr = torch.zeros(b + 1, **i32), torch.zeros(b + 1, **i32)
        self.l0_indices, self.l0_last = torch.zeros(cap, **i32), torch.zeros(b, **i32)
        self.l1_indptr, self.l1_indices, self.l1_last = (torch.zeros(b + 1, **i32), torch.zeros(cap, **i32),
                                                         torch.zeros(b, **i32))
        # Every graph writes its logits here (one buffer, not one per graph: [batch, vocab] fp32 is big).
        self.logits = torch.empty(b, runner.model.config.vocab_size, dtype=torch.float32, device=dev)
        self.graphs: dict[tuple[int, bool, int], torch.cuda.CUDAGraph] = {}
        self.mempool = torch.cuda.graph_pool_handle() if capture else None

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def _fill(self, batch: int, seqs: list[Sequence], levels: list[HostLevel], groups: int) -> None:
        """Write the step's metadata into the buffers, padded to ``batch`` rows and ``groups``.

        Flat mode (``levels`` empty) fills the flat table (every row's pages). Cascade mode
        fills the two levels; the new token is appended through the last level's table
        (its page is always the row's last), so positions there are relative to the row's
        first page in that level.
        """
        ps = self.page_size
        n = len(seqs)
        pad = batch - n

        def put(buf: torch.Tensor, values: list[int]) -> None:
            if values:
                buf[:len(values)].copy_(_host_tensor(values, buf.dtype), non_blocking=True)

        put(self.input_ids, [s.tokens[-1] for s in seqs] + [0] * pad)
        positions = [s.num_tokens - 1 for s in seqs]
        put(self.positions, positions + [0] * pad)
        put(self.append_rows, list(range(n)) + [-1] * pad)
        if not levels:
            indptr, indices, last = [0], [], []
            for s in seqs:
                indices += s.pages
                indptr.append(len(indices))
                last.append(s.num_tokens - (len(s.pages) - 1) * ps)
            put(self.append_positions, positions + [0] * pad)
            put(self.flat_indptr, indptr + [indptr[-1]] * pad)
            put(self.flat_indices, indices)
            put(self.flat_last, last + [0] * pad)
            return
        top, own = levels
        qo, kv, last = top.qo_indptr.tolist(), top.kv_indptr.tolist(), top.kv_last_page_len.tolist()
        if pad:  # one more group: the padding rows, without pages
            qo.append(batch)
            kv.append(kv[-1])
            last.append(0)
        empty = groups + 1 - len(qo)
        put(self.l0_qo, qo + [batch] * empty)
        put(self.l0_indptr, kv + [kv[-1]] * empty)
        put(self.l0_indices, top.kv_indices.tolist())
        put(self.l0_last, last + [0] * empty)
        own_indptr = own.kv_indptr.tolist()
        own_pages = [b - a for a, b in zip(own_indptr[:-1], own_indptr[1:])]
        put(self.append_positions, [pos - (len(s.pages) - k) * ps for pos, s, k in zip(positions, seqs, own_pages)]
            + [0] * pad)
        put(self.l1_indptr, own_indptr + [own_indptr[-1]] * pad)
        put(self.l1_indices, own.kv_indices.tolist())
        put(self.l1_last, own.kv_last_page_len.tolist() + [0] * pad)

    def _attention(self, batch: int, cascade: bool, groups: int):
        pool, layout, scale = self.pool, self.kv_layout, self.sm_scale
        rows, positions = self.append_rows[:batch], self.append_positions[:batch]
        flat = (self.flat_indptr[:batch + 1], self.flat_indices, self.flat_last[:batch])
        l0 = (self.l0_qo[:groups + 1], self.l0_indptr[:groups + 1], self.l0_indices, self.l0_last[:groups])
        l1 = (self.l1_indptr[:batch + 1], self.l1_indices, self.l1_last[:batch])
        table = l1 if cascade else flat  # where the new token's page is found

        def attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            cache = pool.layer(layer)
            append_paged_kv_cache(k, v, rows, positions, cache, table[1], table[0], table[2], kv_layout=layout,
                                  validate=False)
            if not cascade:
                return batch_decode_paged(q, cache, *flat, kv_layout=layout, sm_scale=scale, validate=False)[0]
            qo0, kv0, idx0, last0 = l0
            o0, s0 = batch_prefill_paged(q, qo0, cache, kv0, idx0, last0, causal=False, kv_layout=layout,
                                         sm_scale=scale, validate=False)
            o1, s1 = batch_decode_paged(q, cache, *l1, kv_layout=layout, sm_scale=scale, validate=False)
            return merge_state(o0, s0, o1, s1)[0]

        return attention

    def _forward(self, batch: int, cascade: bool, groups: int) -> torch.Tensor:
        attention = self._attention(batch, cascade, groups)
        return self.model(self.input_ids[:batch], self.positions[:batch], attention, None)

    def _capture(self, batch: int, cascade: bool, groups: int) -> torch.cuda.CUDAGraph:
        empty = HostLevel.from_lists([0], [0], [], [], self.page_size)
        self._fill(batch, [], [empty, empty] if cascade else [], groups)

        def forward() -> None:
            self.logits[:batch].copy_(self._forward(batch, cascade, groups))

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            forward()  # compiles the kernels outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.mempool):
            forward()
        return graph

    def run(self, seqs: list[Sequence], levels: list[HostLevel], cascade: bool) -> torch.Tensor:
        """Replay (capturing first if new) the step for ``seqs``; float32 logits ``[n, vocab]``."""
        batch = self.bucket(len(seqs))
        groups = 1  # level-0 groups, padding rows' group included, rounded up to a power of 2
        if cascade:
            groups = min(batch, next_power_of_2(levels[0].num_groups + (batch > len(seqs))))
        if not self.capture:
            self._fill(batch, seqs, levels if cascade else [], groups)
            return self._forward(batch, cascade, groups)[:len(seqs)]
        key = (batch, cascade, groups)
        if key not in self.graphs:
            self.graphs[key] = self._capture(batch, cascade, groups)
        self._fill(batch, seqs, levels if cascade else [], groups)
        self.graphs[key].replay()
        return self.logits[:len(seqs)]

