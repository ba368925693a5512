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
rank), started with a timeout: a worker that dies or hangs ends the run with an error on
the other ranks instead of a silent wait.
"""

from __future__ import annotations

import datetime
import os
import statistics
import tempfile
import time
import traceback
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


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

    @classmethod
    def of(cls, seq) -> RowView:
        """A view of ``seq`` for a message sent at once (its page list is shared, not copied)."""
        return cls(seq.seq_id, seq.pages, seq.num_computed, _TailTokens(seq.num_computed, seq.tokens[seq.num_computed:]))


@dataclass(slots=True)
class StepMessage:
    """One step for the workers: its rows and the page copies made before it; or, with
    ``probe``, the arguments of :func:`all_reduce_seconds` for every rank to time."""

    prefill: list[tuple[RowView, int]] = field(default_factory=list)
    decode: list[RowView] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    stop: bool = False
    probe: tuple | None = None

    def batch(self):
        from cascadeinfer.engine.scheduler import ScheduledBatch  # noqa: PLC0415

        return ScheduledBatch(list(self.prefill), list(self.decode))


def backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


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
        if launched is not None:
            self._dir, self._procs = None, []
            self.group = dist.group.WORLD
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

    def send(self, message: StepMessage) -> None:
        """Broadcast one step; a dead worker raises here (or in the step's collectives)."""
        self.check_alive()
        try:
            dist.broadcast_object_list([message], src=0, group=self.group)
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
        try:
            if all(p.is_alive() for p in self._procs):  # (a launcher's ranks: assumed alive)
                dist.broadcast_object_list([StepMessage(stop=True)], src=0, group=self.group)
        except Exception:  # noqa: BLE001 - closing after a failure: the workers are gone already
            pass
        for p in self._procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        if self._owns_group and dist.is_initialized():  # a group the caller started stays
            dist.destroy_process_group()
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
    from cascadeinfer.layouts.pool import PagedKVPool, copy_pages  # noqa: PLC0415

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
                       dtype=config.dtype, device=device, kv_layout=config.kv_layout)
    runner = ModelRunner(model, pool, config)
    while True:
        box: list = [None]
        dist.broadcast_object_list(box, src=0)
        message: StepMessage = box[0]
        if message.stop:
            return
        if message.probe is not None:
            all_reduce_seconds(*message.probe, device, dist.group.WORLD)
            continue
        if message.copies:
            src, dst = zip(*message.copies)
            idx = torch.tensor([src, dst], dtype=torch.int32).to(device)
            copy_pages(pool.cache, idx[0], idx[1], validate=False)
        runner.execute(message.batch())


def all_reduce_seconds(shape: tuple[int, ...], dtype: torch.dtype, count: int, device: torch.device,
                       group=None, reps: int = 20) -> float:
    """Seconds that ``count`` all-reduces of a ``shape`` tensor take back to back, as a
    step runs them (on a GPU replayed from one CUDA graph; the median of ``reps``), the
    slowest rank's. Every rank of ``group`` must call it (a collective)."""
    x = torch.ones(shape, dtype=dtype, device=device)
    dist.all_reduce(x, group=group)  # the communicator exists before any capture

    def run() -> None:
        for _ in range(count):
            dist.all_reduce(x, group=group)

    times = []
    if device.type == "cuda":
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        graph.replay()
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            graph.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e-3)
    else:
        for _ in range(reps):
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
    slowest = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
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
