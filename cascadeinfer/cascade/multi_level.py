"""``MultiLevelCascadeAttention``: plan once on the host, run many times on the device.

``run`` launches one kernel per level (tensor-core prefill for levels with many queries
per group, split-KV decode for a last level of one query per request) and merges the
level states. The decode level under a prefill level (the shared-prefix batch decode
case) runs on a side stream while the prefill level, sized to leave it a share of the
SMs, runs on the caller's stream: one is compute-bound, the other bandwidth-bound. Or,
when the planner predicts it is faster, one flat paged decode over
each request's concatenated page list. ``run`` reads nothing back from the device, so
it can be captured in a CUDA graph. Constructed with ``use_cuda_graph=True`` the plan
owns fixed-capacity device buffers and keeps the launch choices of its first plan, so a
graph captured around ``run`` replays every later plan's tables (FlashInfer's
``use_cuda_graph`` idea); without it, re-planning with tables of the same shapes writes
into the same device buffers too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from cascadeinfer._checks import (
    FLOAT_DTYPES,
    check_last_dim_contiguous,
    check_tensor,
    default_sm_scale,
)
from cascadeinfer._device import capturing, normalize_device, use_triton
from cascadeinfer.cascade.context_parallel import page_share
from cascadeinfer.cascade.plan import (
    LevelArrays,
    LevelTensors,
    check_levels,
    choose_cascade,
    flat_page_table,
    prefix_splits_beside_decode,
)
from cascadeinfer.distributed import merge_states_across
from cascadeinfer.kernels import (
    batch_decode_paged,
    batch_prefill_paged,
    merge_state,
    pick_decode_schedule,
)
from cascadeinfer.kernels.backend import check_backend, hopper_prefill_shape
from cascadeinfer.kernels.launch import (
    LAUNCH,
    RECORD,
    WAIT,
    HotProgram,
    LaunchCache,
    Recording,
    given,
    hot_roots,
    recording,
)
from cascadeinfer.kernels.policy import decode_schedule_beside_prefill
from cascadeinfer.layouts.page_table import PageTable
from cascadeinfer.layouts.paged_cache import (
    cache_tensors,
    check_kv_layout,
    check_layout_fits,
    unpack_paged_kv_cache,
)
from cascadeinfer.ops import split_cache


@dataclass(slots=True)
class _DeviceLevel(LevelTensors):
    """One level on the device: its query groups (int32), its page table (a device copy of
    the validated host :class:`PageTable`) and the launch choices the plan made for it;
    ``decode`` when every group has one query."""

    qo_indptr: torch.Tensor
    table: PageTable
    decode: bool
    num_splits: int | None = None  # prefill levels: KV splits (None: the kernel's default)
    schedule: str | None = None  # decode levels: batch_decode_paged's schedule (None: from shapes)
    backend: str | None = "portable"  # prefill levels: batch_prefill_paged's backend


def _device_levels(levels: list[LevelArrays], packed: torch.Tensor, sizes: list[int]) -> list[_DeviceLevel]:
    """The levels as views of ``packed``: per level, ``sizes`` gives its qo_indptr,
    kv_indptr, kv_indices and kv_last_page_len in that order."""
    views = list(torch.split(packed, sizes))
    return [_DeviceLevel(views[4 * i], PageTable.trusted(*views[4 * i + 1:4 * i + 4], lv.page_size, lv.num_pages),
                         decode=lv.decode)
            for i, lv in enumerate(levels)]


def _upload(levels: list[LevelArrays], device: torch.device, old: list[_DeviceLevel],
            packed: torch.Tensor | None) -> tuple[list[_DeviceLevel], torch.Tensor]:
    """The levels' tables as int32 on ``device``, all in one buffer (one host-to-device copy).

    When every table has the shape it had in ``old``, the copy goes into the same buffer,
    so a graph captured on these tensors sees the new tables, and ``old`` is returned.
    """
    host = [a for lv in levels for a in (lv.qo_indptr, lv.kv_indptr, lv.kv_indices, lv.kv_last_page_len)]
    sizes = [a.size for a in host]
    if packed is not None and len(old) == len(levels) and [t.numel() for o in old for t in o.tensors()] == sizes:
        # In place: a graph captured on these buffers sees the new tables. A CPU buffer is
        # written directly (no staging copy, and no torch copy waiting on its thread pool).
        if packed.device.type == "cpu":
            np.concatenate(host, out=packed.numpy(), casting="same_kind")
        else:
            packed.copy_(torch.from_numpy(np.concatenate(host, dtype=np.int32)))
        for o, lv in zip(old, levels):
            o.decode, o.num_splits, o.schedule = lv.decode, None, None
        return old, packed
    packed = torch.from_numpy(np.concatenate(host, dtype=np.int32)).to(device)
    return _device_levels(levels, packed, sizes), packed


class _Staging:
    """A pinned host buffer for the plan's table copies in graph mode.

    The copy into the device buffers is enqueued on the current stream behind the work
    that reads the previous tables, so it must not wait for that work on the host: from
    pinned memory it is a true asynchronous copy. The buffer is written again only after
    the previous copy out of it has finished (an event; long done in a steady loop).
    """

    def __init__(self) -> None:
        self.host: torch.Tensor | None = None
        self.done: torch.cuda.Event | None = None

    def write(self, host: np.ndarray, packed: torch.Tensor) -> None:
        if packed.device.type != "cuda":
            packed.numpy()[:] = host
            return
        if self.host is None:
            self.host = torch.empty(packed.numel(), dtype=torch.int32, pin_memory=True)
            self.done = torch.cuda.Event()
        else:
            self.done.synchronize()
        self.host.numpy()[:] = host
        packed.copy_(self.host, non_blocking=True)
        self.done.record()


def _upload_fixed(levels: list[LevelArrays], device: torch.device, capacity: list[int],
                  old: list[_DeviceLevel], packed: torch.Tensor | None,
                  staging: _Staging) -> tuple[list[_DeviceLevel], torch.Tensor]:
    """The levels' int32 tables in fixed-capacity device buffers (graph mode).

    Level ``l``'s page list sits in a buffer of ``capacity[l]`` entries (its unused tail
    zero; kernels read a row's pages only up to ``kv_indptr``), so every plan of the same
    group counts has the same buffer shapes: the first allocates them, later ones copy
    into them through ``staging`` (one host-to-device copy, ordered after the work already
    on the stream, so a graph replayed before it still reads the previous tables).
    """
    sizes = [n for lv, cap in zip(levels, capacity) for n in (lv.num_groups + 1, lv.num_groups + 1, cap, lv.num_groups)]
    host = np.zeros(sum(sizes), dtype=np.int32)
    start = 0
    for lv, cap in zip(levels, capacity):
        for a, n in zip((lv.qo_indptr, lv.kv_indptr, lv.kv_indices, lv.kv_last_page_len),
                        (lv.num_groups + 1, lv.num_groups + 1, cap, lv.num_groups)):
            host[start:start + a.size] = a
            start += n
    if packed is not None:
        staging.write(host, packed)
        return old, packed
    packed = torch.from_numpy(host).to(device)
    return _device_levels(levels, packed, sizes), packed


@dataclass(frozen=True, slots=True)
class _GraphShape:
    """What every plan of a graph-mode ``MultiLevelCascadeAttention`` must share with its
    first: the recorded launches (and a graph captured on them) depend on it."""

    geometry: tuple[int, int, int, int]  # num_qo_heads, num_kv_heads, head_dim, page_size
    causal: bool
    sm_scale: float
    num_tokens: int
    groups: tuple[int, ...]  # per level

    @classmethod
    def of(cls, levels, num_qo_heads, num_kv_heads, head_dim, page_size, causal, sm_scale) -> _GraphShape:
        return cls((num_qo_heads, num_kv_heads, head_dim, page_size), bool(causal), sm_scale,
                   int(levels[0].qo_indptr[-1]), tuple(lv.num_groups for lv in levels))

    def check_matches(self, first: _GraphShape) -> None:
        if self.geometry != first.geometry:
            raise ValueError("num_qo_heads, num_kv_heads, head_dim, page_size: expected "
                             f"{first.geometry} as in the first plan (use_cuda_graph=True), got {self.geometry}")
        if (self.causal, self.sm_scale) != (first.causal, first.sm_scale):
            raise ValueError(f"causal, sm_scale: expected {first.causal}, {first.sm_scale} as in the first plan "
                             f"(use_cuda_graph=True), got {self.causal}, {self.sm_scale}")
        if self.num_tokens != first.num_tokens:
            raise ValueError(f"qo_indptr_arr: expected {first.num_tokens} query tokens as in the first plan "
                             f"(use_cuda_graph=True; pad with rows that have no pages), got {self.num_tokens}")
        for lv, (g, g0) in enumerate(zip(self.groups, first.groups)):
            if g != g0:
                raise ValueError(f"qo_indptr_arr[{lv}]: expected {g0} groups as in the first plan "
                                 f"(use_cuda_graph=True; pad with groups of no queries and no pages), got {g}")


def _check_capacity(max_pages, num_levels: int) -> list[int]:
    """``max_pages`` as one int per level (graph mode's page-list capacities)."""
    if max_pages is None:
        raise ValueError("max_pages: use_cuda_graph=True needs the capacity of each level's page list")
    caps = [max_pages] * num_levels if isinstance(max_pages, int) else list(max_pages)
    if len(caps) != num_levels or any(not isinstance(c, int) or isinstance(c, bool) or c < 0 for c in caps):
        raise ValueError(f"max_pages: expected a non-negative int or {num_levels} of them, got {max_pages!r}")
    return caps


class MultiLevelCascadeAttention:
    """Attention over a KV cache split into levels, each level's state merged into one.

    Args:
        num_levels: number of levels (≥ 1); level 0 is the most shared (e.g. a system
            prompt for all requests), the last is each request's own suffix.
        kv_layout: ``"NHD"`` or ``"HND"``, the layout of the paged cache given to ``run``.
        device: where the metadata lives (default: CUDA if available, else CPU).
        use_cuda_graph: keep everything a captured ``run`` reads at fixed addresses
            across plans. The first :meth:`plan` allocates the device buffers and makes the
            launch choices (kernels, KV splits, decode schedule, side stream); every later
            plan must have the same query tokens and groups per level (pad a level with
            groups of no queries and no pages) and at most ``max_pages[l]`` pages in level
            ``l``; it rewrites the tables in place and keeps those choices, so a CUDA graph
            captured around ``run`` replays with the new tables. With more than one level
            the plan runs the cascade (plan flat decode as one level of every row's pages).
        max_pages: with ``use_cuda_graph``, the capacity of each level's page list (one
            int for every level, or one per level).
        context_parallel_level: a level whose pages are cut across the ranks of
            ``context_parallel_group`` (``torch.distributed``, initialised before
            :meth:`plan`): every rank plans the same tables, keeps a contiguous share of
            each group's pages of that level (:mod:`~cascadeinfer.cascade.context_parallel`),
            and ``run`` merges that level's states across the ranks (one all-gather of the
            state) before merging it with the other levels, which every rank computes
            whole. Every rank gets the same output. The plan runs the cascade, the levels
            one after the other on the caller's stream, without recorded launches (the
            collective sits between them) and outside ``torch.compile``; not with
            ``use_cuda_graph``, nor on a causal last level.
        context_parallel_group: the process group (default: the default group).
        backend: the prefill kernel of the levels that are not decode levels: ``None``
            (per level, as :func:`~cascadeinfer.batch_prefill_paged` picks, with the
            bounds taken from the level's own keys at plan time: the Hopper kernel on
            compute capability 9.0 for one group of >= 256 packed rows over >= 2^23 packed
            rows x keys or >= 512 rows over >= 2^22, else the portable kernel; a plan with
            ``use_cuda_graph`` keeps its first plan's pick), ``"portable"``, or ``"hopper"``
            (the warp-specialised kernel for every such level; a level it does not run,
            e.g. a group of fewer than 65 packed rows, raises a ``ValueError`` at ``run``).
            Decode levels always run the decode kernel.

    Example (two levels, shared-prefix batch decode)::

        attn = MultiLevelCascadeAttention(2)
        attn.plan([shared_qo_indptr, unique_qo_indptr], [shared_kv_indptr, unique_kv_indptr],
                  [shared_kv_indices, unique_kv_indices], [shared_last, unique_last],
                  num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=16)
        o, lse = attn.run(q, paged_kv_cache, return_lse=True)
    """

    def __init__(self, num_levels: int, *, kv_layout: str = "NHD", device: torch.device | str | None = None,
                 use_cuda_graph: bool = False, max_pages: int | Sequence[int] | None = None,
                 context_parallel_level: int | None = None, context_parallel_group=None,
                 backend: str | None = None):
        if not isinstance(num_levels, int) or isinstance(num_levels, bool) or num_levels < 1:
            raise ValueError(f"num_levels: expected a positive int, got {num_levels!r}")
        self.backend = check_backend(backend)
        self.num_levels = num_levels
        if not isinstance(use_cuda_graph, bool):
            raise TypeError(f"use_cuda_graph: expected a bool, got {type(use_cuda_graph).__name__}")
        self.use_cuda_graph = use_cuda_graph
        self._capacity = _check_capacity(max_pages, num_levels) if use_cuda_graph else None
        if max_pages is not None and not use_cuda_graph:
            raise ValueError("max_pages: only used with use_cuda_graph=True")
        # graph mode, after the first plan: what every later plan must match
        self._fixed: tuple | None = None
        if context_parallel_level is not None:
            if (not isinstance(context_parallel_level, int) or isinstance(context_parallel_level, bool)
                    or not 0 <= context_parallel_level < num_levels):
                raise ValueError(f"context_parallel_level: expected a level in [0, {num_levels}) or None, "
                                 f"got {context_parallel_level!r}")
            if use_cuda_graph:
                raise ValueError("context_parallel_level: not with use_cuda_graph=True")
        self.context_parallel_level = context_parallel_level
        self.context_parallel_group = context_parallel_group
        self._staging = _Staging()
        self.kv_layout = check_kv_layout(kv_layout)
        self.device = normalize_device(device if device is not None else (
            "cuda" if torch.cuda.is_available() else "cpu"))
        self._levels: list[_DeviceLevel] = []
        self._flat: _DeviceLevel | None = None
        self._packed: torch.Tensor | None = None  # the levels' tables, one device buffer
        self._packed_flat: torch.Tensor | None = None
        self._overlap = False
        self._stream: torch.cuda.Stream | None = None
        self._planned = False
        # Recorded runs by call signature (see run), one cache per launch signature of the
        # plan (_signature). A graph captured earlier may replay the recordings of an
        # earlier signature on the same buffers (their scratch holds its intermediate
        # states), so those are kept until the buffers themselves change; in graph mode
        # none is ever evicted.
        self._launch_sets: dict[tuple, LaunchCache] = {}
        self._launch_buffers: tuple = ()
        self._launches = LaunchCache()
        self._launch_signature: tuple | None = None

    def plan(
        self,
        qo_indptr_arr: Sequence[torch.Tensor],
        kv_indptr_arr: Sequence[torch.Tensor],
        kv_indices_arr: Sequence[torch.Tensor],
        kv_last_page_len_arr: Sequence[torch.Tensor],
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        *,
        causal: bool = False,
        sm_scale: float | None = None,
        num_pages: int | None = None,
        dtype: torch.dtype = torch.bfloat16,
        use_cascade: bool | None = None,
    ) -> None:
        """Validate the levels on the host and lay out the metadata for :meth:`run`.

        Args:
            qo_indptr_arr: per level, int32 ``[groups_l + 1]`` splitting the query tokens
                into that level's groups. Every level covers the same tokens, and each group
                lies inside one group of every level above it.
            kv_indptr_arr, kv_indices_arr, kv_last_page_len_arr: per level, the CSR page
                table of its groups (DESIGN.md conventions). A group may have no pages.
            num_qo_heads, num_kv_heads, head_dim, page_size: the geometry ``run`` will see.
            causal: causal mask on the last level (its last query aligned with its last key);
                the levels above are always fully visible.
            sm_scale: default softmax scale for ``run`` (``head_dim ** -0.5`` if None).
            num_pages: pool size, to check that every page index lies inside it.
            dtype: the cache dtype, for the cost model's byte count.
            use_cascade: force cascade (True) or flat decode (False); None lets the cost
                model choose. Flat needs every level above the last to end on a full page
                (or be empty); where it cannot, cascade is used and forcing flat raises.

        This reads the tables on the host (a sync): call it once per batch, not per
        layer. Re-planning with tables of the same shapes updates the device buffers in
        place; a CUDA graph captured around :meth:`run` stays valid across plans that make
        the same launch choices, and across every plan with ``use_cuda_graph=True``
        (which fixes them at the first plan).
        """
        for name, x in (("num_qo_heads", num_qo_heads), ("num_kv_heads", num_kv_heads),
                        ("head_dim", head_dim), ("page_size", page_size)):
            if not isinstance(x, int) or isinstance(x, bool) or x < 1:
                raise ValueError(f"{name}: expected a positive int, got {x!r}")
        if num_qo_heads % num_kv_heads:
            raise ValueError(f"num_qo_heads: {num_qo_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype: expected a torch.dtype, got {dtype!r}")
        levels = check_levels(qo_indptr_arr, kv_indptr_arr, kv_indices_arr, kv_last_page_len_arr,
                              self.num_levels, page_size, num_pages)
        if causal:
            short = levels[-1].queries > levels[-1].keys
            if short.any():
                g = int(short.argmax())
                raise ValueError(
                    f"qo_indptr_arr[{self.num_levels - 1}]: with causal=True each last-level group's queries must be "
                    f"its last keys, but group {g} has more queries than keys")
        if self.context_parallel_level is not None:
            levels = self._share_of_this_rank(levels, causal, use_cascade)
            use_cascade = True
        if self.use_cuda_graph:
            for lv, (level, cap) in enumerate(zip(levels, self._capacity)):
                if level.kv_indices.size > cap:
                    raise ValueError(f"kv_indptr_arr[{lv}]: level {lv} uses {level.kv_indices.size} pages, more "
                                     f"than max_pages={cap} (use_cuda_graph=True)")
            shape = _GraphShape.of(levels, num_qo_heads, num_kv_heads, head_dim, page_size, causal,
                                   default_sm_scale(head_dim, sm_scale))
            if self._fixed is not None:
                self._replan_in_place(levels, shape)
                return
            if self.num_levels > 1 and use_cascade is False:
                raise ValueError("use_cascade: with use_cuda_graph=True a plan of several levels runs the cascade; "
                                 "plan flat decode as one level of every row's pages")
            use_cascade = True
        cascade, self.predicted_cascade_s, self.predicted_flat_s, prefix_share = choose_cascade(
            levels, page_size=page_size, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
            head_dim=head_dim, elem_bytes=dtype.itemsize, device=self.device,
        )
        if use_cascade is not None:
            cascade = use_cascade
        flat = None
        if not cascade and self.num_levels > 1:  # the flat table is built only when flat is wanted
            flat = flat_page_table(levels, page_size)
            if flat is None:
                if use_cascade is False:
                    raise ValueError("use_cascade: flat decode needs every level above the last to end on a full page")
                cascade = True
        self.use_cascade = cascade or self.num_levels == 1
        if self.use_cascade:
            if self.use_cuda_graph:
                self._levels, self._packed = _upload_fixed(levels, self.device, self._capacity, [], None,
                                                           self._staging)
                self._fixed = shape
            else:
                self._levels, self._packed = _upload(levels, self.device, self._levels, self._packed)
        else:
            (self._flat,), self._packed_flat = _upload(
                [flat], self.device, [self._flat] if self._flat else [], self._packed_flat)
        if self.use_cascade:
            # Each prefill level's kernel from its own keys (its page table may be a graph
            # plan's capacity, which the launcher's bounds would read as its length).
            group = num_qo_heads // num_kv_heads
            for dev, host in zip(self._levels, levels):
                if not dev.decode:
                    dev.backend = self.backend if self.backend is not None else (None if hopper_prefill_shape(
                        int(host.qo_indptr[-1] - host.qo_indptr[0]) * group, int(host.keys.max(initial=0)),
                        head_dim, host.num_groups) else "portable")
        # A decode level's schedule from its lengths, known here on the host: the balanced
        # one when they vary a lot or the per-request grid ends in a partial wave.
        dev_level, host_level = (self._levels[-1], levels[-1]) if self.use_cascade else (self._flat, flat)
        if dev_level.decode:
            dev_level.schedule = pick_decode_schedule(
                host_level.num_groups, num_kv_heads, self.device, head_dim=head_dim, dtype=dtype,
                seq_lens=host_level.keys)
            if (not self.use_cascade and dev_level.schedule == "per_request"
                    and any(lv.num_groups < levels[-1].num_groups for lv in levels[:-1])):
                # Flat over levels whose groups hold several rows: the rows re-read those
                # pages, which L2 serves (batch_decode_paged's "shared_pages" tiles).
                dev_level.schedule = "shared_pages"
        # The decode level runs on a side stream beside the prefill level above it; that
        # level's grid is sized to leave the decode its share of the SMs (from shapes), or
        # is its whole grid where the decode's programs each need an SM for the whole
        # level (cascade.plan.prefix_splits_beside_decode).
        # The planner gives a share wherever a decode level sits under a prefill level
        # (cost.overlaps); groups of a few rows (16-32-row tiles, bandwidth-bound) keep
        # their whole grid beside the decode.
        self._overlap = (self.use_cascade and prefix_share is not None and self.device.type == "cuda"
                         and self.context_parallel_level is None)  # that run is one stream
        if self._overlap:
            pre = levels[-2]
            self._levels[-2].num_splits = prefix_splits_beside_decode(
                int(pre.qo_indptr[-1]), pre.num_groups, pre.kv_indices.size * page_size, levels[-1].num_groups,
                self._levels[-1].schedule, prefix_share, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
                head_dim=head_dim, page_size=page_size, dtype=dtype, device=self.device)
            # Beside the prefill level, short rows take the tiles made for sharing SMs.
            self._levels[-1].schedule = decode_schedule_beside_prefill(
                self._levels[-1].schedule, levels[-1].keys, num_kv_heads=num_kv_heads,
                group=num_qo_heads // num_kv_heads, head_dim=head_dim, dtype=dtype, device=self.device)
        self.num_qo_heads, self.num_kv_heads, self.head_dim, self.page_size = num_qo_heads, num_kv_heads, head_dim, page_size
        self.num_tokens = int(levels[0].qo_indptr[-1])
        self.causal = bool(causal)
        self.sm_scale = default_sm_scale(head_dim, sm_scale)
        self.pages_needed = max((int(lv.kv_indices.max()) + 1 for lv in levels if lv.kv_indices.size), default=0)
        signature = self._signature()
        if signature != self._launch_signature:
            buffers = (self._packed, self._packed_flat)
            if any(a is not b for a, b in zip(self._launch_buffers, buffers)):
                self._launch_sets.clear()  # new buffers: no graph can replay the old recordings
            self._launch_buffers = buffers
            self._launches = self._launch_sets.setdefault(
                signature, LaunchCache(maxsize=1 << 30 if self.use_cuda_graph else 8))
            self._launch_signature = signature
        self._planned = True

    def _share_of_this_rank(self, levels: list[LevelArrays], causal: bool, use_cascade: bool | None) -> list[LevelArrays]:
        """The levels with this rank's share of the context-parallel level's pages."""
        lv = self.context_parallel_level
        if causal and lv == self.num_levels - 1:
            raise ValueError("context_parallel_level: the causal last level cannot be cut across ranks")
        if use_cascade is False:
            raise ValueError("use_cascade: a context-parallel plan runs the cascade")
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("context_parallel_level: torch.distributed is not initialised (init_process_group first)")
        group = self.context_parallel_group
        return [page_share(level, dist.get_rank(group), dist.get_world_size(group)) if i == lv else level
                for i, level in enumerate(levels)]

    def _replan_in_place(self, levels: list[LevelArrays], shape: _GraphShape) -> None:
        """A later plan in graph mode: same shapes and launch choices, new tables."""
        shape.check_matches(self._fixed)
        for lv, (dev, host) in enumerate(zip(self._levels, levels)):
            if dev.decode and not host.decode:
                raise ValueError(f"qo_indptr_arr[{lv}]: level {lv} was planned as a decode level (one query per "
                                 "group); with use_cuda_graph=True it must stay one")
        _upload_fixed(levels, self.device, self._capacity, self._levels, self._packed, self._staging)
        self.pages_needed = max((int(lv.kv_indices.max()) + 1 for lv in levels if lv.kv_indices.size), default=0)

    def level_table(self, level: int) -> PageTable:
        """Level ``level``'s page table on the device, as the kernels read it (int32;
        ``kv_indptr`` counted from 0, only its used entries meaningful). With
        ``use_cuda_graph`` the tensors stay the same across plans, so an engine can
        capture other kernels on them (e.g. the append of the step's new tokens through
        the last level's table). Flat plans have one table, ``level`` 0 or -1."""
        if not self._planned:
            raise RuntimeError("MultiLevelCascadeAttention.level_table called before plan()")
        levels = self._levels if self.use_cascade else [self._flat]
        if not isinstance(level, int) or not -len(levels) <= level < len(levels):
            raise IndexError(f"level: expected an int in [{-len(levels)}, {len(levels)}), got {level!r}")
        return levels[level].table

    def _signature(self) -> tuple:
        """Everything the recorded launches of :meth:`run` depend on besides the call's own
        tensors: the device buffers (re-planning with tables of the same shapes fills the
        same ones in place), every level's launch choices and the geometry."""
        levels = self._levels if self.use_cascade else [self._flat]
        return (
            self.use_cascade, self._overlap, self.num_tokens, self.causal, self.sm_scale,
            self.num_qo_heads, self.num_kv_heads, self.head_dim, self.page_size,
            *((lv.decode, lv.num_splits, lv.schedule, lv.backend, *((t.data_ptr(), t.shape) for t in lv.tensors()))
              for lv in levels),
        )

    def _level_state(self, level: _DeviceLevel, q, paged_kv_cache, causal, sm_scale, out, lse) -> None:
        """One level's state into ``out``/``lse``: the public launchers (validate=False;
        plan() checked the tables), or their custom ops while ``torch.compile`` traces."""
        if torch.compiler.is_compiling():
            k_cache, v_cache = split_cache(paged_kv_cache)
            if level.decode:
                torch.ops.cascadeinfer.batch_decode_paged(
                    q, k_cache, v_cache, level.kv_indptr, level.kv_indices, level.kv_last_page_len,
                    self.kv_layout, sm_scale, None, out, lse, level.schedule)
            else:
                torch.ops.cascadeinfer.batch_prefill_paged(
                    q, level.qo_indptr, k_cache, v_cache, level.kv_indptr, level.kv_indices,
                    level.kv_last_page_len, causal, self.kv_layout, sm_scale, level.num_splits, out, lse,
                    backend=level.backend)
        elif level.decode:
            # One query per group: causal changes nothing (the query sees every key).
            batch_decode_paged(q, paged_kv_cache, level.kv_indptr, level.kv_indices, level.kv_last_page_len,
                               kv_layout=self.kv_layout, sm_scale=sm_scale, schedule=level.schedule,
                               out=out, lse=lse, validate=False)
        else:
            batch_prefill_paged(q, level.qo_indptr, paged_kv_cache, level.kv_indptr, level.kv_indices,
                                level.kv_last_page_len, causal=causal, kv_layout=self.kv_layout, sm_scale=sm_scale,
                                num_splits=level.num_splits, out=out, lse=lse, validate=False, backend=level.backend)

    def _merge(self, o_a, lse_a, o_b, lse_b, out, lse) -> None:
        if torch.compiler.is_compiling():
            torch.ops.cascadeinfer.merge_state(o_a, lse_a, o_b, lse_b, out, lse)
        else:
            merge_state(o_a, lse_a, o_b, lse_b, out=out, out_lse=lse, validate=False)

    def _side_stream(self) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        return self._stream

    def _state(self, level: _DeviceLevel, q, paged_kv_cache, causal, sm_scale, out, lse) -> None:
        """:meth:`_level_state`; for the context-parallel level, this rank's share's state
        merged across the ranks (every rank gets the level's whole state)."""
        cp = self.context_parallel_level
        if cp is None or level is not self._levels[cp]:
            self._level_state(level, q, paged_kv_cache, causal, sm_scale, out, lse)
            return
        o_part, lse_part = torch.empty_like(out), torch.empty_like(lse)
        self._level_state(level, q, paged_kv_cache, causal, sm_scale, o_part, lse_part)
        merge_states_across(o_part, lse_part, self.context_parallel_group, out=out, out_lse=lse)

    def _merged_levels(self, levels, q, paged_kv_cache, sm_scale):
        """The merged state of ``levels`` (none of them the last, so never causal)."""
        o_acc, lse_acc = torch.empty_like(q), torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
        self._state(levels[0], q, paged_kv_cache, False, sm_scale, o_acc, lse_acc)
        for level in levels[1:]:
            o_i, lse_i = torch.empty_like(o_acc), torch.empty_like(lse_acc)
            self._state(level, q, paged_kv_cache, False, sm_scale, o_i, lse_i)
            o_next, lse_next = torch.empty_like(o_acc), torch.empty_like(lse_acc)
            self._merge(o_acc, lse_acc, o_i, lse_i, o_next, lse_next)
            o_acc, lse_acc = o_next, lse_next
        return o_acc, lse_acc

    def run(
        self,
        q: torch.Tensor,
        paged_kv_cache,
        *,
        out: torch.Tensor | None = None,
        lse: torch.Tensor | None = None,
        return_lse: bool = False,
        sm_scale: float | None = None,
    ):
        """Attention of ``q: [num_tokens, num_qo_heads, head_dim]`` over all levels.

        Args:
            q: the query tokens of the plan, fp16/bf16/fp32, last dim contiguous.
            paged_kv_cache: the paged cache (single tensor or ``(k, v)``) in the planned
                layout, with at least as many pages as the plan's tables index.
            out: optional output buffer like ``q``.
            lse: optional float32 ``[num_tokens, num_qo_heads]`` buffer for the LSE.
            return_lse: return ``(o, lse)`` instead of ``o``.
            sm_scale: this call's softmax scale (one plan serves every layer).

        Returns ``o`` (like ``q``), or ``(o, lse)`` with the natural-log LSE in float32;
        a token that sees no key gets ``(0, -inf)``. No host synchronisation.

        Host cost: the first call of a signature (the shapes, strides, dtypes and
        alignment of ``q``, the cache, ``out`` and ``lse``, and ``sm_scale``) after
        :meth:`plan` checks them and records the kernel launches; later calls replay
        them (:mod:`cascadeinfer.kernels.launch`), paying little more than Triton's own
        launcher per kernel (benchmarks/NOTES.md, "Host cost"). The plan owns the
        intermediate states, so runs of one plan must be ordered (one stream, or
        synchronised streams), as with one workspace buffer.
        """
        if not self._planned:
            raise RuntimeError("MultiLevelCascadeAttention.run called before plan()")
        if self.context_parallel_level is not None:  # its all-gather sits between the levels: no recording
            if torch.compiler.is_compiling():
                raise RuntimeError("MultiLevelCascadeAttention.run: a context-parallel plan is not traceable by "
                                   "torch.compile (its all-gather sits between the levels)")
            return self._run_traced(q, paged_kv_cache, out, lse, return_lse, sm_scale)
        if torch.compiler.is_compiling():
            return self._run_traced(q, paged_kv_cache, out, lse, return_lse, sm_scale)
        cache = cache_tensors(paged_kv_cache)
        tensors = (q, *cache, *given(out, lse))
        # Recorded apart for CUDA-graph capture: its decode level merges KV splits the way
        # a graph runs fastest (kernels.policy.merge_in_kernel).
        options = (len(cache), out is None, lse is None, sm_scale, capturing(), return_lse)
        done = self._launches.hot(tensors, options)
        if done is not None:
            return done
        launches, key, ptrs = self._launches.find(tensors, options[:-1])
        if launches is None:
            self._check_run(q, paged_kv_cache, out, lse)
            if not use_triton(q.device):  # the PyTorch path launches nothing to replay
                return self._run_traced(q, paged_kv_cache, out, lse, return_lse, sm_scale)
            launches = self._record(q, paged_kv_cache, sm_scale)
            self._launches.put(key, launches)
        if out is None:
            out = launches.upper.fresh(len(cache) + 1)
        if lse is None:
            # An LSE nobody reads goes to the recording's own buffer (runs are ordered).
            lse = launches.upper.fresh(len(cache) + 2) if return_lse else launches.lse
        launches.replay((q, *cache, out, lse), ptrs[:1 + len(cache)])
        # Later calls like this one take the C++ hot path (kernels.hot_path).
        self._launches.bind(launches.hot_program(1 + len(cache), options[1], options[2], return_lse), tensors, options)
        return (out, lse) if return_lse else out

    def _check_run(self, q, paged_kv_cache, out, lse) -> None:
        """Every check of a run's arguments against the plan (shapes only, no sync)."""
        check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES, device=self.device,
                     shape=(self.num_tokens, self.num_qo_heads, self.head_dim))
        check_last_dim_contiguous("q", q)
        kv = unpack_paged_kv_cache(paged_kv_cache, self.kv_layout)
        check_layout_fits(kv, num_kv_heads=self.num_kv_heads, page_size=self.page_size)
        if (kv.page_size, kv.num_kv_heads, kv.head_dim) != (self.page_size, self.num_kv_heads, self.head_dim):
            raise ValueError(
                f"paged_kv_cache: planned for page_size={self.page_size}, num_kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}; got {kv.page_size}, {kv.num_kv_heads}, {kv.head_dim}")
        if kv.dtype != q.dtype:
            raise TypeError(f"paged_kv_cache: expected dtype {q.dtype} (the dtype of q), got {kv.dtype}")
        if kv.device != q.device:
            raise ValueError(f"paged_kv_cache: expected a tensor on {q.device} (like q), got {kv.device}")
        if kv.num_pages < self.pages_needed:
            raise ValueError(
                f"paged_kv_cache: the plan's tables index page {self.pages_needed - 1}, but the cache has "
                f"{kv.num_pages} pages")
        if out is not None:
            check_tensor("out", out, dtypes=(q.dtype,), device=q.device, shape=tuple(q.shape))
            check_last_dim_contiguous("out", out)
        if lse is not None:
            check_tensor("lse", lse, dtypes=(torch.float32,), device=q.device, shape=tuple(q.shape[:2]))

    def _record(self, q, paged_kv_cache, sm_scale) -> _Launches:
        """Run once with fresh outputs, recording the launches of each stream's part."""
        scale = self.sm_scale if sm_scale is None else default_sm_scale(self.head_dim, sm_scale)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
        roots = (q, *cache_tensors(paged_kv_cache), out, lse)
        if not self.use_cascade or self.num_levels == 1:
            level = self._levels[0] if self.use_cascade else self._flat
            with recording(roots, keep_scratch=True) as only:
                self._level_state(level, q, paged_kv_cache, self.causal, scale, out, lse)
            return _Launches(lse, only)
        # The intermediate states live in the recordings (the plan's own buffers).
        o_last, lse_last = torch.empty_like(out), torch.empty_like(lse)
        side = self._side_stream() if self._overlap else None
        with recording(roots, keep_scratch=True) as upper:
            o_up, lse_up = self._merged_levels(self._levels[:-1], q, paged_kv_cache, scale)
        if side is not None:
            side.wait_stream(torch.cuda.current_stream(q.device))
        with recording(roots, keep_scratch=True) as last, _on(side):
            self._level_state(self._levels[-1], q, paged_kv_cache, self.causal, scale, o_last, lse_last)
        if side is not None:
            torch.cuda.current_stream(q.device).wait_stream(side)
        with recording(roots, keep_scratch=True) as merge:
            self._merge(o_up, lse_up, o_last, lse_last, out, lse)
        return _Launches(lse, upper, last, merge, side)

    def _run_traced(self, q, paged_kv_cache, out, lse, return_lse, sm_scale):
        """``run`` without recordings: every check, then the levels one after the other on
        the caller's stream; through the custom ops (opaque to the tracer) while
        ``torch.compile`` traces, and on the PyTorch path for plain CPU tensors."""
        self._check_run(q, paged_kv_cache, out, lse)
        scale = self.sm_scale if sm_scale is None else default_sm_scale(self.head_dim, sm_scale)
        if out is None:
            out = torch.empty_like(q)
        if lse is None:
            lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
        if not self.use_cascade or self.num_levels == 1:
            level = self._levels[0] if self.use_cascade else self._flat
            self._state(level, q, paged_kv_cache, self.causal, scale, out, lse)
        else:
            o_up, lse_up = self._merged_levels(self._levels[:-1], q, paged_kv_cache, scale)
            o_last, lse_last = torch.empty_like(q), torch.empty_like(lse)
            self._state(self._levels[-1], q, paged_kv_cache, self.causal, scale, o_last, lse_last)
            self._merge(o_up, lse_up, o_last, lse_last, out, lse)
        return (out, lse) if return_lse else out


@contextlib.contextmanager
def _on(stream: torch.cuda.Stream | None):
    """``torch.cuda.stream(stream)``, or nothing for None."""
    if stream is None:
        yield
    else:
        with torch.cuda.stream(stream):
            yield


class _Launches:
    """A plan's recorded run: the levels above the last (caller's stream), the last level
    (on ``side`` when it runs beside them), and the final merge; ``lse`` is the LSE buffer
    of calls that do not ask for it."""

    def __init__(self, lse: torch.Tensor, upper: Recording, last: Recording | None = None,
                 merge: Recording | None = None, side: torch.cuda.Stream | None = None) -> None:
        self.lse = lse
        self.upper, self.last, self.merge, self.side = upper, last, merge, side
        self.valid = all(r.valid for r in (upper, last, merge) if r is not None)
        if side is not None:
            self._fork, self._join = torch.cuda.Event(), torch.cuda.Event()
            self._side_raw = side.cuda_stream
            self._main, self._main_raw = None, None

    def replay(self, roots, known: list[int]) -> None:
        """Every recording on ``roots``; ``known``: the first roots' addresses (from
        find), the rest read here, once for all the recordings."""
        known = [*known, *(t.data_ptr() for t in roots[len(known):])]
        if self.last is None:
            self.upper.replay(roots, known=known)
            return
        if self.side is None:
            self.upper.replay(roots, known=known)
            self.last.replay(roots, known=known)
            self.merge.replay(roots, known=known)
            return
        # The side stream starts after what the caller enqueued before (q, the cache),
        # and the merge after both streams' levels, as in the recorded run.
        main = self._current_stream(roots[0])
        self._fork.record(main)
        self.side.wait_event(self._fork)
        self.upper.replay(roots, self._main_raw, known)
        self.last.replay(roots, self._side_raw, known)
        self._join.record(self.side)
        main.wait_event(self._join)
        self.merge.replay(roots, self._main_raw, known)

    def hot_program(self, num_inputs: int, out_none: bool, lse_none: bool, return_lse: bool) -> HotProgram | None:
        """The last replay as the C++ hot path repeats it, for a run whose roots are
        ``num_inputs`` inputs (q and the cache), then out and lse (each given, or: out
        allocated, lse allocated where returned and else this plan's own buffer); None
        where a recording did not go out through the direct launcher."""
        recordings = [r for r in (self.upper, self.last, self.merge) if r is not None]
        if any(r._hot_state is None or r._hot_state[0] or not r._direct for r in recordings):
            return None
        num_tensors = num_inputs + (not out_none) + (not lse_none)
        sources, returned = hot_roots((num_inputs, out_none, lse_none), num_tensors)
        templates = [self.upper._templates[r] if src < 0 else None for r, src in enumerate(sources)]
        sources = list(sources)
        if lse_none and not return_lse:  # the plan's own LSE buffer, never handed out
            sources[-1], templates[-1] = -2, self.lse
        if self.side is None:
            steps = ((LAUNCH, None, tuple(ln for r in recordings for ln in r._direct)),)
        else:
            fork, join, side = self._fork.cuda_event, self._join.cuda_event, self._side_raw
            if not fork or not join:
                return None
            steps = ((RECORD, None, fork), (WAIT, side, fork), (LAUNCH, None, self.upper._direct),
                     (LAUNCH, side, self.last._direct), (RECORD, side, join), (WAIT, None, join),
                     (LAUNCH, None, self.merge._direct))
        returned = returned if return_lse else returned[:1]
        return HotProgram(tuple(sources), tuple(templates), returned, not return_lse, steps, False, 0, 0, 0, None,
                          None, self)

    def _current_stream(self, t: torch.Tensor) -> torch.cuda.Stream:
        """The caller's current stream, as an object (torch.cuda.current_stream costs
        several µs; the raw handle a fraction of one, so the object is kept while the
        handle stays the same)."""
        raw = torch._C._cuda_getCurrentRawStream(t.get_device())
        if raw != self._main_raw:
            self._main, self._main_raw = torch.cuda.current_stream(t.device), raw
        return self._main
