"""Host-side planning of a multi-level cascade: validate the levels once, decide between
cascade and flat decode, and lay the metadata out on the device for sync-free runs.

A level is a batch of groups: the queries ``q[qo_indptr[g]:qo_indptr[g+1]]`` of group
``g`` attend to the pages of row ``g`` of the level's CSR page table. Every level
partitions the same query tokens, and each group of a lower level lies inside one group
of every level above it (a tree: system prompt → few-shot block → request suffix).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from cascadeinfer.cascade.cost import DeviceModel, LevelShape, predict_seconds, prefix_sm_fraction, side_stream_runs
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
        i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
        return cls(torch.tensor(qo_indptr, dtype=torch.int64),
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


def _to_host(name: str, t: object) -> torch.Tensor:
    if isinstance(t, torch.Tensor):
        if t.dtype not in (torch.int32, torch.int64) or t.dim() != 1:
            raise TypeError(f"{name}: expected a 1-D int32 tensor, got {t.dtype} of shape {list(t.shape)}")
        return t.detach().to("cpu", torch.int64)
    try:
        return torch.as_tensor(list(t), dtype=torch.int64)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{name}: expected a 1-D int32 tensor or a sequence of ints") from exc


def _check_qo_indptr(name: str, qo: torch.Tensor) -> None:
    """A query indptr: at least one entry, starts at 0, non-decreasing (host tensor)."""
    if qo.numel() == 0:
        raise ValueError(f"{name}: expected at least one entry (an indptr of n groups has n + 1)")
    if int(qo[0]) != 0:
        raise ValueError(f"{name}: expected the first entry to be 0, got {int(qo[0])}")
    check_monotone(name, qo)


def host_levels(
    qo_indptr_arr: Sequence,
    kv_indptr_arr: Sequence,
    kv_indices_arr: Sequence,
    kv_last_page_len_arr: Sequence,
    num_levels: int,
    page_size: int,
    num_pages: int | None,
) -> list[HostLevel]:
    """Validate every level's metadata on the host; raise naming the argument and level."""
    for name, arr in (("qo_indptr_arr", qo_indptr_arr), ("kv_indptr_arr", kv_indptr_arr),
                      ("kv_indices_arr", kv_indices_arr), ("kv_last_page_len_arr", kv_last_page_len_arr)):
        if not isinstance(arr, (list, tuple)) or len(arr) != num_levels:
            got = len(arr) if isinstance(arr, (list, tuple)) else type(arr).__name__
            raise ValueError(f"{name}: expected a list of {num_levels} tensors (one per level), got {got}")
    levels = []
    for lv in range(num_levels):
        names = (f"kv_indptr_arr[{lv}]", f"kv_indices_arr[{lv}]", f"kv_last_page_len_arr[{lv}]")
        qo = _to_host(f"qo_indptr_arr[{lv}]", qo_indptr_arr[lv])
        kp, ki, kl = (_to_host(name, arr[lv]) for name, arr in zip(
            names, (kv_indptr_arr, kv_indices_arr, kv_last_page_len_arr)))
        _check_qo_indptr(f"qo_indptr_arr[{lv}]", qo)
        groups = qo.numel() - 1
        if kp.numel() != groups + 1 or kl.numel() != groups:
            raise ValueError(
                f"kv_indptr_arr[{lv}] / kv_last_page_len_arr[{lv}]: level {lv} has {groups} query groups, "
                f"so expected {groups + 1} and {groups} entries, got {kp.numel()} and {kl.numel()}"
            )
        check_page_table_values(kp, ki, kl, page_size, num_pages, names=names)
        if lv and int(qo[-1]) != int(levels[0].qo_indptr[-1]):
            raise ValueError(
                f"qo_indptr_arr[{lv}]: every level must cover the same {int(levels[0].qo_indptr[-1])} query tokens, "
                f"got {int(qo[-1])}"
            )
        # The plan keeps its own copy of the used entries, counted from 0 (the rule lets
        # kv_indices run past kv_indptr[-1] and kv_indptr start past 0).
        first = int(kp[0])
        i32 = torch.int32
        levels.append(HostLevel(qo, PageTable.trusted((kp - first).to(i32), ki[first:int(kp[-1])].to(i32), kl.to(i32),
                                                      page_size, num_pages)))
    for lv in range(1, num_levels):
        levels[lv] = replace(levels[lv], parent=parent_of(levels[lv - 1], levels[lv], lv))
    return levels


def parent_of(upper: HostLevel, lower: HostLevel, lv: int) -> torch.Tensor:
    """Index of the group of ``upper`` holding each group of ``lower`` (nesting check)."""
    starts, ends = lower.qo_indptr[:-1], lower.qo_indptr[1:]
    parent = torch.searchsorted(upper.qo_indptr, starts, right=True) - 1
    parent = parent.clamp(0, upper.num_groups - 1)
    inside = (ends <= upper.qo_indptr[parent + 1]) | (ends == starts)
    if not bool(inside.all()):
        g = int(torch.nonzero(~inside)[0])
        raise ValueError(
            f"qo_indptr_arr[{lv}]: group {g} (queries {int(starts[g])}..{int(ends[g])}) straddles two groups of level {lv - 1}; "
            "each group must lie inside one group of every level above it"
        )
    return parent


def ancestors(levels: list[HostLevel]) -> list[torch.Tensor]:
    """``ancestors(levels)[l][g]``: the group of level ``l`` above last-level group ``g``."""
    chain = [torch.arange(levels[-1].num_groups)]
    for lv in range(len(levels) - 1, 0, -1):
        parent = levels[lv].parent if levels[lv].parent is not None else parent_of(levels[lv - 1], levels[lv], lv)
        chain.append(parent[chain[-1]])
    return chain[::-1]


def level_shapes(levels: list[HostLevel], page_size: int) -> list[LevelShape]:
    shapes = []
    above = ancestors(levels)
    for lv, anc in zip(levels, above):
        q_per_group = lv.qo_indptr[1:] - lv.qo_indptr[:-1]
        keys = lv.kv_lens(page_size)
        shapes.append(LevelShape(
            num_queries=int(lv.qo_indptr[-1]),
            decode=bool((q_per_group == 1).all()),
            unique_keys=int(keys[q_per_group > 0].sum()),
            query_key_pairs=int((q_per_group * keys).sum()),
            flat_key_reads=int(keys[anc].sum()),
            num_groups=lv.num_groups,
        ))
    return shapes


def flat_page_table(levels: list[HostLevel], page_size: int) -> HostLevel | None:
    """Each last-level group's full page list (all levels concatenated), or None when some
    level above the last ends on a partly filled page (its keys then cannot be followed
    by the next level's pages in one table)."""
    last = levels[-1]
    above = ancestors(levels)
    rows, last_lens = [], []
    for g in range(last.num_groups):
        pages, last_len = [], 0
        for lv, level in enumerate(levels):
            a = int(above[lv][g])
            s, e = int(level.kv_indptr[a]), int(level.kv_indptr[a + 1])
            if e == s:
                continue
            if pages and last_len != page_size:
                return None
            pages.extend(level.kv_indices[s:e].tolist())
            last_len = int(level.kv_last_page_len[a])
        rows.append(pages)
        last_lens.append(last_len)
    indptr = torch.zeros(len(rows) + 1, dtype=torch.int32)
    indptr[1:] = torch.tensor([len(r) for r in rows], dtype=torch.int32).cumsum(0)
    indices = torch.tensor([p for r in rows for p in r], dtype=torch.int32)
    table = PageTable.trusted(indptr, indices, torch.tensor(last_lens, dtype=torch.int32), page_size,
                              last.table.num_pages)
    return HostLevel(last.qo_indptr, table)


def choose_cascade(
    levels: list[HostLevel], *, page_size: int, num_qo_heads: int, num_kv_heads: int, head_dim: int,
    elem_bytes: int, device: torch.device | None,
) -> tuple[bool, float, float, float | None]:
    """(is cascade predicted faster?, predicted cascade seconds, predicted flat seconds,
    the SM share of the prefill level when the decode level runs beside it on a side
    stream (:func:`~cascadeinfer.cascade.cost.side_stream_runs`), else None).

    Whether flat decode is possible at all (:func:`flat_page_table`) is the caller's check.
    """
    shapes = level_shapes(levels, page_size)
    times: list[float] = []
    t_cascade, t_flat = predict_seconds(
        shapes, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, elem_bytes=elem_bytes, model=DeviceModel.for_device(device), per_level=times,
    )
    side = side_stream_runs(shapes, group_size=num_qo_heads // num_kv_heads, head_dim=head_dim, elem_bytes=elem_bytes)
    share = prefix_sm_fraction(times[-2], times[-1]) if side else None
    return t_cascade < t_flat, t_cascade, t_flat, share
