"""Tensor parallelism for the engine: one process per shard, one scheduler.

``LLM(..., tensor_parallel_size=N)`` keeps the scheduler, the prefix cache and sampling in
the caller's process (rank 0) and starts ``N - 1`` worker processes
(``torch.multiprocessing``, spawn). Every rank holds a shard of the model
(:class:`~cascadeinfer.engine.llama.TensorParallel`: its query and KV heads and its part
of the MLP) and a KV pool of its own KV heads, with the same pages as every other rank.
Each step rank 0 broadcasts what the step runs — the rows' token ids, positions and page
lists (:class:`RowView`) and the page copies its prefix cache made (copy-on-write) — and
every rank runs the same forward; the row-parallel projections' all-reduces keep them in
step, and every rank computes the same logits, of which rank 0 samples.

The process group is ``torch.distributed``'s (gloo on CPUs, NCCL on GPUs, one device per
rank; the step messages go through a gloo group on GPUs too), started with a timeout: a worker that dies or hangs ends the run with an error on
the other ranks instead of a silent wait.
"""

from __future__ import annotations

import datetime
import os
import tempfile
import traceback
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cascadeinfer.distributed.timing import median_seconds


def _timeout() -> datetime.timedelta:
    """How long a rank waits in a collective for the others before it raises (seconds in
    ``CASCADEINFER_TP_TIMEOUT_S``, default 120: the first steps compile kernels)."""
    return datetime.timedelta(seconds=float(os.environ.get("CASCADEINFER_TP_TIMEOUT_S", "120")))


class _TailTokens:
    """A sequence's tokens from ``start`` on (the only ones a step reads), indexable like
    the whole list for those positions."""

    __slots__ = ("start", "tail")

    def __init__(self, start: int, tail: list[int]) -> None:
        self.start, self.tail = start, tail

    def __len__(self) -> int:
        return self.start + len(self.tail)

    def __getitem__(self, index):
        if isinstance(index, slice):
            lo, hi, step = index.indices(len(self))
            if lo < self.start or step != 1:
                raise IndexError(f"tokens before {self.start} are not sent to the workers")
            return self.tail[lo - self.start:hi - self.start]
        index = index + len(self) if index < 0 else index
        if index < self.start:
            raise IndexError(f"token {index} is not sent to the workers")
        return self.tail[index - self.start]


@dataclass(slots=True)
class RowView:
    """What a worker's model runner reads of a sequence in one step."""

    seq_id: int
    pages: list[int]
    num_computed: int
    tokens: _TailTokens

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)


@dataclass(slots=True)
class StepMessage:
    """One step for the workers: its rows (as :class:`RowSender` encodes them) and the page
    copies made before it; or, with ``probe``, the arguments of :func:`all_reduce_seconds`
    for every rank to time."""

    prefill: list[tuple[tuple, int]] = field(default_factory=list)
    decode: list[tuple] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    stop: bool = False
    probe: tuple | None = None
    # The seq_ids of the rows of rank 0's last samples, broadcast right after this message
    # (on the default group: NCCL on GPUs): the worker posts the matching broadcast first.
    # With ``from_previous`` the step takes its rows' last tokens from them (rank 0 has
    # not read them: it is a step ahead).
    samples: list[int] | None = None
    from_previous: bool = False


class RowSender:
    """Rank 0's side of the rows each step sends, as little as the workers need.

    A row is ``(seq_id, num_computed, tokens from num_computed on, start, pages[start:])``.
    A sequence's page list goes whole (``start`` 0) the first time it is sent and whenever
    its list was replaced (admission, preemption, fork); while the sequence runs step
    after step the list only grows at its end and copy-on-write replaces only its last
    page, so from then on it is sent from the last page sent before. A sequence missing
    from a step is forgotten by both sides and sent whole when it comes back.
    """

    def __init__(self) -> None:
        self._sent: dict[int, tuple[list[int], int]] = {}  # seq_id -> (its list, length sent)

    def message(self, batch, copies: list[tuple[int, int]], from_previous: bool = False) -> StepMessage:
        sent, self._sent = self._sent, {}
        return StepMessage([(self._row(s, sent), n) for s, n in batch.prefill],
                           [self._row(s, sent) for s in batch.decode], copies, from_previous=from_previous)

    def _row(self, seq, sent: dict) -> tuple:
        pages = seq.pages
        before = sent.get(seq.seq_id)
        start = 0
        if before is not None and before[0] is pages and before[1] <= len(pages):
            start = max(before[1] - 1, 0)
        self._sent[seq.seq_id] = (pages, len(pages))
        done = seq.num_computed
        return seq.seq_id, done, seq.tokens[done:], start, pages[start:]


class RowReceiver:
    """A worker's side: the rows of each step as :class:`RowView` s, page lists rebuilt."""

    def __init__(self) -> None:
        self._pages: dict[int, list[int]] = {}

    def batch(self, message: StepMessage):
        from cascadeinfer.engine.scheduler import ScheduledBatch  # noqa: PLC0415

        known, self._pages = self._pages, {}
        return ScheduledBatch([(self._view(r, known), n) for r, n in message.prefill],
                              [self._view(r, known) for r in message.decode])

    def _view(self, row: tuple, known: dict) -> RowView:
        seq_id, done, tail, start, pages_tail = row
        pages = known[seq_id] if start else []
        pages[start:] = pages_tail
        self._pages[seq_id] = pages
        return RowView(seq_id, pages, done, _TailTokens(done, tail))


def backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def control_group(device: torch.device):
    """The group the step messages go through: on GPUs a gloo group beside the NCCL one, so
    that a message is pickled and sent by the CPUs without a copy to or from a device or a
    wait on its stream; on CPUs the default group. Every rank makes it, in the same order."""
    if device.type != "cuda":
        return dist.group.WORLD
    return dist.new_group(backend="gloo", timeout=_timeout())


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank ``rank``'s device: the ``rank``-th GPU counted from ``device``'s, or the CPU."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


class Workers:
    """The worker processes of one engine, started and stopped from rank 0."""

    def __init__(self, size: int, device: torch.device, build: dict, *, launched: tuple | None = None) -> None:
        """Spawn ``size - 1`` workers and start the group; with ``launched`` (torchrun:
        :func:`launched_group`'s answer) the group and the other ranks exist already."""
        self.size = size
        self._closed = False
        self._owns_group = launched is None or launched[2]
        self._nccl = device.type == "cuda"
        self._rows = RowSender()
        self._samples: list[int] | None = None
        if launched is not None:
            self._dir, self._procs = None, []
            self.group = dist.group.WORLD
            self.control = control_group(device)
            return
        self._dir = tempfile.TemporaryDirectory(prefix="cascadeinfer-tp-")
        init = f"file://{os.path.join(self._dir.name, 'init')}"
        ctx = mp.get_context("spawn")
        self._procs = [ctx.Process(target=_worker_main, args=(rank, size, init, device, build), daemon=True)
                       for rank in range(1, size)]
        for p in self._procs:
            p.start()
        if device.type == "cuda":
            torch.cuda.set_device(rank_device(device, 0))
        dist.init_process_group(backend(device), init_method=init, rank=0, world_size=size, timeout=_timeout())
        self.group = dist.group.WORLD
        self.control = control_group(device)

    def send_step(self, batch, copies: list[tuple[int, int]], from_previous: bool = False) -> None:
        """Broadcast what ``batch`` (a :class:`~cascadeinfer.engine.scheduler.ScheduledBatch`)
        runs and the page copies made before it; ``from_previous``: its input tokens are
        the samples of :meth:`send_samples`, not the rows' (placeholders)."""
        self.send(self._rows.message(batch, copies, from_previous))

    def send_samples(self, tokens: torch.Tensor, seq_ids: list[int]) -> None:
        """A step's samples (int64 ``[rows]``, on the device, unread) go to the workers'
        devices with the next message, for a next step that runs before rank 0 reads them:
        that message names the rows' seq_ids, then the tokens are broadcast (enqueued on
        the stream, no wait), where every worker posts the same broadcast after reading it."""
        if tokens.dtype != torch.int64 or tokens.shape != (len(seq_ids),):
            raise ValueError(f"tokens: expected int64 [{len(seq_ids)}], got {tokens.dtype} {tuple(tokens.shape)}")
        self._samples = (tokens, seq_ids)

    def send(self, message: StepMessage) -> None:
        """Broadcast one message; a dead worker raises here (or in the step's collectives)."""
        self.check_alive()
        samples, self._samples = self._samples, None
        message.samples = samples[1] if samples is not None else None
        try:
            dist.broadcast_object_list([message], src=0, group=self.control)
            if samples is not None:
                dist.broadcast(samples[0], src=0, group=self.group)
        except Exception as exc:  # a worker died or hung: the collective failed or timed out
            raise RuntimeError(f"tensor parallelism: a worker stopped answering ({exc})") from exc

    def time_all_reduce(self, shape: tuple[int, ...], dtype: torch.dtype, count: int, device: torch.device) -> float:
        """:func:`all_reduce_seconds` on every rank at once (the workers between steps)."""
        self.send(StepMessage(probe=(shape, dtype, count)))
        return all_reduce_seconds(shape, dtype, count, device, self.group)

    def check_alive(self) -> None:
        dead = [(i + 1, p.exitcode) for i, p in enumerate(self._procs) if not p.is_alive()]
        if dead:
            raise RuntimeError("tensor parallelism: worker(s) " + ", ".join(
                f"rank {r} (exit code {code})" for r, code in dead) + " exited; the engine cannot go on")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        alive = all(p.is_alive() for p in self._procs)  # (a launcher's ranks: assumed alive)
        try:
            if alive:
                self.send(StepMessage(stop=True))
        except Exception:  # noqa: BLE001 - closing after a failure: the workers are gone already
            alive = False
        # The workers end their group as they stop; NCCL's teardown waits for every rank's,
        # so rank 0 ends its own at the same time, before waiting for them to exit. With a
        # rank gone NCCL's would never return: the group is left to the process's exit.
        if self._owns_group and dist.is_initialized() and (alive or not self._nccl):
            dist.destroy_process_group()
        for p in self._procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        if self._dir is not None:
            self._dir.cleanup()


def _worker_main(rank: int, size: int, init: str, device: torch.device, build: dict) -> None:
    """A spawned worker: join the group, then serve rank 0's steps."""
    device = rank_device(device, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend(device), init_method=init, rank=rank, world_size=size, timeout=_timeout())
    try:
        serve(rank, size, device, build)
    except Exception:  # noqa: BLE001 - say why, then end the process (rank 0 sees it exit)
        traceback.print_exc()
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def serve(rank: int, size: int, device: torch.device, build: dict, model=None) -> None:
    """Rank ``rank``'s shard of the model (``model``, or built and loaded here) and of the
    pool, then one forward per step message of rank 0, until it says stop."""
    from cascadeinfer.engine.config import EngineConfig  # noqa: PLC0415
    from cascadeinfer.engine.llama import LlamaForCausalLM, TensorParallel  # noqa: PLC0415
    from cascadeinfer.engine.model_runner import ModelRunner  # noqa: PLC0415
    from cascadeinfer.kernels.copy_pages import copy_pages_unchecked  # noqa: PLC0415
    from cascadeinfer.layouts.pool import PagedKVPool  # noqa: PLC0415

    control = control_group(device)  # first: rank 0 makes it as it starts the workers
    config = build["engine_config"]
    config = EngineConfig(**{**{f: getattr(config, f) for f in EngineConfig.__dataclass_fields__}, "device": device})
    mc = build["model_config"]
    if model is None:
        model = LlamaForCausalLM(mc, dtype=config.dtype, device=device, max_positions=config.max_model_len,
                                 tp=TensorParallel(rank, size, dist.group.WORLD))
        if build.get("model_dir") is not None:
            model.load_checkpoint(build["model_dir"])
        else:
            model.init_random_(*build["random"])
    pool = PagedKVPool(mc.num_layers, build["num_pages"], config.page_size, mc.num_kv_heads // size, mc.head_dim,
                       dtype=config.dtype, device=device, kv_layout=config.kv_layout, copy_pages=copy_pages_unchecked)
    runner = ModelRunner(model, pool, config)
    try:
        _serve_steps(runner, pool, device, control)
    finally:
        if runner.graphs is not None:  # before the group ends (DecodeGraphs.release says why)
            runner.graphs.release()


def _serve_steps(runner, pool, device: torch.device, control) -> None:
    from cascadeinfer.kernels.copy_pages import copy_pages_unchecked  # noqa: PLC0415

    rows = RowReceiver()
    previous = None
    while True:
        box: list = [None]
        dist.broadcast_object_list(box, src=0, group=control)
        message: StepMessage = box[0]
        if message.samples is not None:  # rank 0's last samples, in the collectives' order
            tokens = torch.empty(len(message.samples), dtype=torch.int64, device=device)
            dist.broadcast(tokens, src=0)
            previous = (tokens, {seq_id: i for i, seq_id in enumerate(message.samples)})
        if message.stop:
            return
        if message.probe is not None:
            all_reduce_seconds(*message.probe, device, dist.group.WORLD)
            continue
        if message.copies:
            src, dst = zip(*message.copies)
            idx = torch.tensor([src, dst], dtype=torch.int32).to(device)
            copy_pages_unchecked(pool.cache, idx[0], idx[1])
        runner.execute(rows.batch(message), previous if message.from_previous else None)


def all_reduce_seconds(shape: tuple[int, ...], dtype: torch.dtype, count: int, device: torch.device,
                       group=None, reps: int = 20) -> float:
    """Seconds that ``count`` all-reduces of a ``shape`` tensor take back to back, as a
    step runs them (on a GPU replayed from one CUDA graph; the median of ``reps``), the
    slowest rank's. Every rank of ``group`` must call it (a collective)."""
    x = torch.ones(shape, dtype=dtype, device=device)

    def run() -> None:
        for _ in range(count):
            dist.all_reduce(x, group=group)

    seconds = median_seconds(run, device, reps, graph=True)
    slowest = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    return slowest.item()


def launched_group(size: int, device: torch.device) -> tuple[int, torch.device, bool] | None:
    """Under ``torchrun`` (or with a process group already initialised): this process's rank
    and device, and whether the group was started here, from the environment; None
    otherwise (the engine then spawns its workers). The group's size must be ``size``."""
    env = all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))
    if not dist.is_initialized() and not env:
        return None
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ["WORLD_SIZE"])
    if world != size:
        raise ValueError(f"tensor_parallel_size: {size}, but this process was launched in a group of {world}")
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", dist.get_rank() if dist.is_initialized() else 0)))
        torch.cuda.set_device(device)
    started = not dist.is_initialized()
    if started:
        dist.init_process_group(backend(device), init_method="env://", timeout=_timeout())
    return dist.get_rank(), device, started
