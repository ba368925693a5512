"""Host-side planning of a multi-level cascade: validate the levels once, decide between
cascade and flat decode, and lay the metadata out on the device for sync-free runs.

A level is a batch of groups: the queries ``q[qo_indptr[g]:qo_indptr[g+1]]`` of group
``g`` attend to the pages of row ``g`` of the level's CSR page table. Every level
partitions the same query tokens, and each group of a lower level lies inside one group
of every level above it (a tree: system prompt → few-shot block → request suffix).

Planning reads the host tables as numpy arrays (:class:`LevelArrays`): a level has a few
hundred groups, where a numpy op costs well under a microsecond and a torch op several.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from cascadeinfer._host import host_tensor
from cascadeinfer.cascade.cost import (
    DeviceModel,
    LevelShape,
    is_narrow_tile,
    overlaps,
    predict_seconds,
    prefix_sm_fraction,
)
from cascadeinfer.kernels.policy import (
    groups_tile_config,
    num_m_tiles,
    paged_num_splits,
    planning_sms,
    whole_sm_decode_programs,
)
from cascadeinfer.layouts.indptr import check_monotone
from cascadeinfer.layouts.page_table import PageTable, check_page_table_values


class LevelTensors:
    """The page-table tensors of a level that holds a ``table`` (host or device)."""

    __slots__ = ()

    @property
    def kv_indptr(self) -> torch.Tensor:
        return self.table.kv_indptr

    @property
    def kv_indices(self) -> torch.Tensor:
        return self.table.kv_indices

    @property
    def kv_last_page_len(self) -> torch.Tensor:
        return self.table.kv_last_page_len

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.qo_indptr, self.kv_indptr, self.kv_indices, self.kv_last_page_len


@dataclass(frozen=True, slots=True)
class HostLevel(LevelTensors):
    """One cascade level on the host: its query groups and their page table.

    ``qo_indptr`` int64 ``[groups + 1]`` cuts the query tokens into groups; ``table`` is
    the groups' :class:`~cascadeinfer.layouts.page_table.PageTable` (host, int32, passed the
    library's page-table rule); ``parent[g]`` is the group of the level above holding group
    ``g`` (None for the top level, or before :func:`host_levels` has nested the levels).
    """

    qo_indptr: torch.Tensor  # [groups + 1]
    table: PageTable
    parent: torch.Tensor | None = None  # [groups]

    @classmethod
    def from_lists(cls, qo_indptr: list[int], kv_indptr: list[int], kv_indices: list[int],
                   kv_last_page_len: list[int], page_size: int) -> HostLevel:
        """A level from host lists that satisfy the page-table rule by construction
        (e.g. :func:`~cascadeinfer.cascade.grouping.group_levels`'); no second check."""
        i32 = lambda x: host_tensor(x, torch.int32)  # noqa: E731
        return cls(host_tensor(qo_indptr, torch.int64),
                   PageTable.trusted(i32(kv_indptr), i32(kv_indices), i32(kv_last_page_len), page_size))

    @property
    def num_groups(self) -> int:
        return self.qo_indptr.numel() - 1

    def kv_lens(self, page_size: int) -> torch.Tensor:
        """Keys per group, int64."""
        pages = (self.kv_indptr[1:] - self.kv_indptr[:-1]).long()
        return torch.where(pages > 0, (pages - 1) * page_size + self.kv_last_page_len.long(), 0)

    def kv_tokens(self, page_size: int) -> int:
        """Keys this level reads (each group's pages once)."""
        return int(self.kv_lens(page_size).sum())


@dataclass(slots=True, eq=False)
class LevelArrays:
    """One level's page table on the host as numpy arrays, with the per-group counts that
    planning reads (computed once, in :meth:`build`).

    ``qo_indptr`` ``[groups + 1]``; ``kv_indptr`` ``[groups + 1]`` (offsets into
    ``kv_indices``); ``kv_indices`` ``[>= kv_indptr[-1]]`` (page ids); ``kv_last_page_len``
    ``[groups]``: int32 or int64, possibly views of the caller's tensors (read them only
    while planning); ``page_size``, ``num_pages`` as in :class:`PageTable`. Derived:
    ``queries``, ``pages``, ``keys`` int64 ``[groups]`` per group; ``decode`` when every
    group has one query; ``parent`` int64 ``[groups]``, the group of the level above that
    holds each group (None for the top level, or before :func:`check_levels` nests them).
    """

    qo_indptr: np.ndarray
    kv_indptr: np.ndarray
    kv_indices: np.ndarray
    kv_last_page_len: np.ndarray
    page_size: int
    num_pages: int | None
    queries: np.ndarray
    pages: np.ndarray
    keys: np.ndarray
    decode: bool
    parent: np.ndarray | None = None

    @classmethod
    def build(cls, qo_indptr: np.ndarray, kv_indptr: np.ndarray, kv_indices: np.ndarray,
              kv_last_page_len: np.ndarray, page_size: int, num_pages: int | None,
              parent: np.ndarray | None = None) -> LevelArrays:
        """From the tables of a level that passed the page-table rule (the counts in int64)."""
        queries = np.subtract(qo_indptr[1:], qo_indptr[:-1], dtype=np.int64)
        pages = np.subtract(kv_indptr[1:], kv_indptr[:-1], dtype=np.int64)
        keys = np.where(pages > 0, (pages - 1) * page_size + kv_last_page_len, 0)
        # One query per group: as many queries as groups, none of them empty (queries >= 0).
        # A Python bool: run() branches on it, and torch.compile must see a constant.
        groups = queries.size
        decode = int(qo_indptr[-1]) - int(qo_indptr[0]) == groups and int(np.count_nonzero(queries)) == groups
        return cls(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, page_size, num_pages,
                   queries, pages, keys, decode, parent)

    @classmethod
    def of(cls, level: HostLevel | LevelArrays, page_size: int) -> LevelArrays:
        """A :class:`HostLevel`'s tables as arrays (its keys counted with ``page_size``)."""
        if isinstance(level, LevelArrays):
            return level
        host = lambda t: t.numpy(force=True)  # noqa: E731
        return cls.build(host(level.qo_indptr), host(level.kv_indptr), host(level.kv_indices),
                         host(level.kv_last_page_len), page_size, level.table.num_pages,
                         None if level.parent is None else host(level.parent))

    @property
    def num_groups(self) -> int:
        return self.qo_indptr.size - 1

    def host_level(self) -> HostLevel:
        """As a :class:`HostLevel`: copies, an int64 ``qo_indptr`` and an int32 table."""
        i32 = lambda a: torch.from_numpy(a.astype(np.int32))  # noqa: E731
        table = PageTable.trusted(i32(self.kv_indptr), i32(self.kv_indices), i32(self.kv_last_page_len),
                                  self.page_size, self.num_pages)
        parent = None if self.parent is None else torch.from_numpy(self.parent.astype(np.int64))
        return HostLevel(torch.from_numpy(self.qo_indptr.astype(np.int64)), table, parent)


def _to_host(name: str, t: object) -> np.ndarray:
    """A level's tensor (int32 or int64, 1-D) or sequence of ints as a host numpy array:
    a view of a CPU tensor, a copy from another device."""
    if isinstance(t, torch.Tensor):
        if t.dtype not in (torch.int32, torch.int64) or t.dim() != 1:
            raise TypeError(f"{name}: expected a 1-D int32 tensor, got {t.dtype} of shape {list(t.shape)}")
        return t.numpy(force=True)
    try:
        return torch.as_tensor(list(t), dtype=torch.int64).numpy()
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{name}: expected a 1-D int32 tensor or a sequence of ints") from exc


def _check_qo_indptr(name: str, qo: np.ndarray) -> None:
    """A query indptr: at least one entry, starts at 0, non-decreasing."""
    if qo.size == 0:
        raise ValueError(f"{name}: expected at least one entry (an indptr of n groups has n + 1)")
    if int(qo[0]) != 0:
        raise ValueError(f"{name}: expected the first entry to be 0, got {int(qo[0])}")
    if np.count_nonzero(qo[1:] < qo[:-1]):
        check_monotone(name, qo)  # raises, naming the first drop


def check_levels(
    qo_indptr_arr: Sequence,
    kv_indptr_arr: Sequence,
    kv_indices_arr: Sequence,
    kv_last_page_len_arr: Sequence,
    num_levels: int,
    page_size: int,
    num_pages: int | None,
) -> list[LevelArrays]:
    """Validate every level's metadata on the host; raise naming the argument and level.

    Returns each level's used tables (``kv_indptr`` counted from 0, ``kv_indices`` only the
    entries it reads) with the parents of every level below the first.
    """
    for name, arr in (("qo_indptr_arr", qo_indptr_arr), ("kv_indptr_arr", kv_indptr_arr),
                      ("kv_indices_arr", kv_indices_arr), ("kv_last_page_len_arr", kv_last_page_len_arr)):
        if not isinstance(arr, (list, tuple)) or len(arr) != num_levels:
            got = len(arr) if isinstance(arr, (list, tuple)) else type(arr).__name__
            raise ValueError(f"{name}: expected a list of {num_levels} tensors (one per level), got {got}")
    levels: list[LevelArrays] = []
    for lv in range(num_levels):
        names = (f"kv_indptr_arr[{lv}]", f"kv_indices_arr[{lv}]", f"kv_last_page_len_arr[{lv}]")
        qo = _to_host(f"qo_indptr_arr[{lv}]", qo_indptr_arr[lv])
        kp, ki, kl = (_to_host(name, arr[lv]) for name, arr in zip(
            names, (kv_indptr_arr, kv_indices_arr, kv_last_page_len_arr)))
        _check_qo_indptr(f"qo_indptr_arr[{lv}]", qo)
        groups = qo.size - 1
        if kp.size != groups + 1 or kl.size != groups:
            raise ValueError(
                f"kv_indptr_arr[{lv}] / kv_last_page_len_arr[{lv}]: level {lv} has {groups} query groups, "
                f"so expected {groups + 1} and {groups} entries, got {kp.size} and {kl.size}"
            )
        check_page_table_values(kp, ki, kl, page_size, num_pages, names=names)
        if lv and int(qo[-1]) != int(levels[0].qo_indptr[-1]):
            raise ValueError(
                f"qo_indptr_arr[{lv}]: every level must cover the same {int(levels[0].qo_indptr[-1])} query tokens, "
                f"got {int(qo[-1])}"
            )
        # The plan reads only the used entries, counted from 0 (the rule lets kv_indices
        # run past kv_indptr[-1] and kv_indptr start past 0).
        first = int(kp[0])
        levels.append(LevelArrays.build(qo, kp - first if first else kp, ki[first:int(kp[-1])], kl,
                                        page_size, num_pages))
    for lv in range(1, num_levels):
        levels[lv].parent = parent_of(levels[lv - 1], levels[lv], lv)
    return levels


def host_levels(
    qo_indptr_arr: Sequence,
    kv_indptr_arr: Sequence,
    kv_indices_arr: Sequence,
    kv_last_page_len_arr: Sequence,
    num_levels: int,
    page_size: int,
    num_pages: int | None,
) -> list[HostLevel]:
    """:func:`check_levels`, as :class:`HostLevel` tensors (int32 tables counted from 0)."""
    return [lv.host_level() for lv in check_levels(qo_indptr_arr, kv_indptr_arr, kv_indices_arr,
                                                    kv_last_page_len_arr, num_levels, page_size, num_pages)]


def parent_of(upper: LevelArrays, lower: LevelArrays, lv: int) -> np.ndarray:
    """Index of the group of ``upper`` holding each group of ``lower`` (nesting check), int64."""
    starts, ends = lower.qo_indptr[:-1], lower.qo_indptr[1:]
    parent = upper.qo_indptr.searchsorted(starts, side="right") - 1
    # Empty groups at the very end start past every group above: they take the last one.
    parent = np.minimum(parent, upper.num_groups - 1)
    inside = (ends <= upper.qo_indptr[parent + 1]) | (ends == starts)
    if not inside.all():
        g = int((~inside).argmax())
        raise ValueError(
            f"qo_indptr_arr[{lv}]: group {g} (queries {int(starts[g])}..{int(ends[g])}) straddles two groups of level {lv - 1}; "
            "each group must lie inside one group of every level above it"
        )
    return parent


def ancestors(levels: list[LevelArrays]) -> list[np.ndarray]:
    """``ancestors(levels)[l][g]``: the group of level ``l`` above last-level group ``g``."""
    chain = [np.arange(levels[-1].num_groups)]
    for lv in range(len(levels) - 1, 0, -1):
        parent = levels[lv].parent if levels[lv].parent is not None else parent_of(levels[lv - 1], levels[lv], lv)
        chain.append(parent[chain[-1]])
    return chain[::-1]


def level_shapes(levels: Sequence[HostLevel | LevelArrays], page_size: int) -> list[LevelShape]:
    """What each level costs, for :func:`~cascadeinfer.cascade.cost.predict_seconds`."""
    levels = [LevelArrays.of(lv, page_size) for lv in levels]
    return [
        LevelShape(
            num_queries=int(lv.qo_indptr[-1]),
            decode=lv.decode,
            unique_keys=int(lv.keys[lv.queries > 0].sum()),
            query_key_pairs=int(lv.queries @ lv.keys),
            flat_key_reads=int(lv.keys[anc].sum()),
            num_groups=lv.num_groups,
        )
        for lv, anc in zip(levels, ancestors(levels))
    ]


def flat_page_table(levels: Sequence[HostLevel | LevelArrays], page_size: int) -> LevelArrays | None:
    """Each last-level group's full page list (all levels concatenated), or None when some
    level above the last ends on a partly filled page (its keys then cannot be followed
    by the next level's pages in one table).

    The result has the last level's ``qo_indptr`` and one row per last-level group:
    ``kv_indptr`` int64 ``[groups + 1]``, ``kv_indices`` ``[kv_indptr[-1]]`` (the levels'
    dtype), ``kv_last_page_len`` int64 ``[groups]``.
    """
    levels = [LevelArrays.of(lv, page_size) for lv in levels]
    num_rows = levels[-1].num_groups
    row_pages = np.zeros(num_rows, dtype=np.int64)  # pages of the levels so far, per row
    last_len = np.zeros(num_rows, dtype=np.int64)  # the last of those pages' length (0: none)
    starts, lengths = [], []  # per level: where each row's run of it starts in `source`, its pages
    base = 0  # the level's offset in `source`
    for lv, anc in zip(levels, ancestors(levels)):
        pages = lv.pages[anc]
        has = pages > 0
        # A level's pages can follow those of the levels above only after a full page.
        if np.count_nonzero(has & (row_pages > 0) & (last_len != page_size)):
            return None
        last_len = np.where(has, lv.kv_last_page_len[anc], last_len)
        row_pages += pages
        starts.append(np.add(lv.kv_indptr[anc], base, dtype=np.int64))
        lengths.append(pages)
        base += lv.kv_indices.size
    indptr = np.zeros(num_rows + 1, dtype=np.int64)
    np.cumsum(row_pages, out=indptr[1:])
    # Row by row, level by level: the runs in the order of the flat table.
    source = np.concatenate([lv.kv_indices for lv in levels])
    indices = _gather_runs(source, np.stack(starts, axis=1).ravel(), np.stack(lengths, axis=1).ravel())
    return LevelArrays.build(levels[-1].qo_indptr, indptr, indices, last_len, page_size, levels[-1].num_pages)


_INT32_POSITIONS = 2**31  # positions below this fit in int32


def _gather_runs(source: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``source[starts[i]:starts[i] + lengths[i]]`` for every ``i``, concatenated: one
    index array for all runs instead of a Python loop over them.

    ``source`` ``[n]``; ``starts``, ``lengths`` int64 ``[runs]``; returns
    ``[lengths.sum()]`` of ``source``'s dtype.
    """
    firsts = np.cumsum(lengths) - lengths  # each run's first position in the output
    total = int(firsts[-1] + lengths[-1]) if lengths.size else 0
    # int32 positions where they fit: half the bytes through the three passes below.
    dtype = np.int32 if max(total, source.size) < _INT32_POSITIONS else np.int64
    index = np.repeat((starts - firsts).astype(dtype), lengths)
    index += np.arange(total, dtype=dtype)
    return source.take(index)


def choose_cascade(
    levels: Sequence[HostLevel | LevelArrays], *, page_size: int, num_qo_heads: int, num_kv_heads: int, head_dim: int,
    elem_bytes: int, device: torch.device | None,
) -> tuple[bool, float, float, float | None]:
    """(is cascade predicted faster?, predicted cascade seconds, predicted flat seconds,
    the SM share of the prefill level when the decode level runs beside it on a side
    stream (:func:`~cascadeinfer.cascade.cost.overlaps`), else None).

    Whether flat decode is possible at all (:func:`flat_page_table`) is the caller's check.
    """
    shapes = level_shapes(levels, page_size)
    times: list[float] = []
    t_cascade, t_flat = predict_seconds(
        shapes, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, elem_bytes=elem_bytes, model=DeviceModel.for_device(device), per_level=times,
    )
    share = prefix_sm_fraction(times[-2], times[-1]) if overlaps(shapes) else None
    return t_cascade < t_flat, t_cascade, t_flat, share


def prefix_splits_beside_decode(
    prefix_queries: int, prefix_groups: int, prefix_max_keys: int, decode_rows: int, decode_schedule: str | None,
    share: float, *, num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int, dtype: torch.dtype,
    device: torch.device,
) -> int:
    """KV splits of a prefill level (``prefix_queries`` queries in ``prefix_groups``
    groups over at most ``prefix_max_keys`` keys each) whose decode level below it
    (``decode_rows`` rows, ``decode_schedule``) runs beside it on a side stream.

    Its grid is sized to ``share`` of the SMs (:func:`choose_cascade`), except in two
    cases, where it is the level's whole one-wave grid. (1) Its tiles are 16 or 32 rows
    (groups of a few rows): bandwidth-bound like the decode, and as fast on any split (at
    (4, 8192, 4096) and (4, 8192, 16384) on an H200, 96-128 programs beside the decode were
    within 4.5% of each other; benchmarks/NOTES.md, "Cascade" v12). (2) The decode level's
    programs are one wave of whole SMs
    (:func:`~cascadeinfer.kernels.policy.whole_sm_decode_programs`: per-request plans of
    few requests) that would not all find an SM beside the share's grid. The GPU gives each
    of the prefill level's programs an SM of its own first, so a decode program left over
    starts only when a prefill program ends, and the decode level, each of whose programs
    runs for the whole level, ends that much later. At
    (16, 8192, 16384) on an H200 (the share's grid: 16 prefill programs beside 128 decode
    programs) the cascade took 319-320 µs, with the whole prefill grid first 261
    (benchmarks/NOTES.md, "Cascade" v11).
    """
    args = (prefix_queries, prefix_groups, num_qo_heads, num_kv_heads, head_dim, dtype, prefix_max_keys, device)
    group = num_qo_heads // num_kv_heads
    tile = groups_tile_config(prefix_queries, prefix_groups, group, head_dim, dtype)
    if is_narrow_tile(tile):
        return paged_num_splits(*args)
    splits = paged_num_splits(*args, sm_share=share)
    if decode_schedule != "per_request":
        return splits
    decode_programs = whole_sm_decode_programs(decode_rows, num_qo_heads, num_kv_heads, head_dim, dtype, page_size,
                                               device)
    prefix_programs = num_m_tiles(prefix_queries, prefix_groups, group, tile.block_m) * num_kv_heads * splits
    if decode_programs and decode_programs > planning_sms(device) - prefix_programs:
        return paged_num_splits(*args)
    return splits
