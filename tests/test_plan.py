"""The cascade planner on the host (numpy): the flat table against a per-row loop, HostLevel
and LevelArrays inputs giving one plan, re-planning in place on the CPU, and the page-table
rule on numpy arrays as on tensors."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from cascadeinfer.cascade import plan as plan_mod
from cascadeinfer.cascade.grouping import group_levels
from cascadeinfer.cascade.multi_level import MultiLevelCascadeAttention
from cascadeinfer.cascade.plan import check_levels, choose_cascade, flat_page_table, host_levels, level_shapes
from cascadeinfer.kernels import paged_num_splits
from cascadeinfer.kernels.policy import pick_decode_schedule, whole_sm_decode_programs
from cascadeinfer.layouts.page_table import check_page_table_values


def random_levels(rng: random.Random, num_levels: int, batch: int, page_size: int):
    """A random tree of one query per request: per level the host lists ``(qo_indptr,
    kv_indptr, kv_indices, kv_last_page_len)``, and the group bounds of every level."""
    bounds = [[0, batch]] if num_levels > 1 else []
    for _ in range(1, num_levels - 1):  # each level cuts the groups of the one above further
        cuts = rng.sample(range(1, batch), rng.randint(0, batch - 1)) if batch > 1 else []
        bounds.append(sorted(set(bounds[-1]) | set(cuts)))
    bounds.append(list(range(batch + 1)))
    levels, next_page = [], 0
    for lv, cut in enumerate(bounds):
        lens = [rng.choice([0, 1, page_size, rng.randint(0, 5 * page_size)]) for _ in cut[1:]]
        if lv < len(bounds) - 1 and rng.random() < 0.6:  # whole pages above the last level
            lens = [-(-n // page_size) * page_size for n in lens]
        kv, idx = [0], []
        for n in lens:
            idx += [next_page + 3 * p for p in range(-(-n // page_size))]  # spread over the pool
            next_page += 3 * (-(-n // page_size))
            kv.append(len(idx))
        levels.append((cut, kv, idx, [(n - 1) % page_size + 1 if n else 0 for n in lens]))
    return levels, bounds, max(next_page, 1)


def flat_rows_reference(levels, bounds, page_size):
    """Each request's pages level by level and its last page's length, or None when a
    level's pages would follow a partly filled page (the rule flat_page_table follows)."""
    rows, lasts = [], []
    for r in range(len(bounds[-1]) - 1):
        pages, last_len = [], 0
        for (_, kv, idx, last), cut in zip(levels, bounds):
            g = max(i for i in range(len(cut) - 1) if cut[i] <= r)
            if kv[g + 1] == kv[g]:
                continue
            if pages and last_len != page_size:
                return None
            pages += idx[kv[g]:kv[g + 1]]
            last_len = last[g]
        rows.append(pages)
        lasts.append(last_len)
    return rows, lasts


def as_tensors(levels, dtype=torch.int32):
    return [[torch.tensor(lv[i], dtype=dtype) for lv in levels] for i in range(4)]


@pytest.mark.parametrize("seed", range(40))
def test_flat_page_table_matches_a_row_loop(seed):
    rng = random.Random(seed)
    num_levels, batch, page_size = rng.randint(1, 4), rng.randint(1, 12), rng.choice([1, 4, 16])
    levels, bounds, num_pages = random_levels(rng, num_levels, batch, page_size)
    want = flat_rows_reference(levels, bounds, page_size)
    tables = as_tensors(levels, rng.choice([torch.int32, torch.int64]))
    arrays = check_levels(*tables, num_levels, page_size, num_pages)
    for given in (arrays, host_levels(*tables, num_levels, page_size, num_pages)):
        flat = flat_page_table(given, page_size)
        assert (flat is None) == (want is None)
        if flat is None:
            continue
        rows, lasts = want
        assert flat.kv_indptr.tolist() == [0, *np.cumsum([len(r) for r in rows]).tolist()]
        assert flat.kv_indices.tolist() == [p for r in rows for p in r]
        assert flat.kv_last_page_len.tolist() == lasts
        assert flat.qo_indptr.tolist() == bounds[-1]


def test_gather_runs_with_int64_positions(monkeypatch):
    source = np.arange(100, 140, dtype=np.int32)
    starts, lengths = np.array([5, 0, 30, 7]), np.array([3, 0, 10, 1])
    want = np.concatenate([source[s:s + n] for s, n in zip(starts, lengths)])
    assert plan_mod._gather_runs(source, starts, lengths).tolist() == want.tolist()
    monkeypatch.setattr(plan_mod, "_INT32_POSITIONS", 0)  # as for tables past 2**31 entries
    assert plan_mod._gather_runs(source, starts, lengths).tolist() == want.tolist()
    assert plan_mod._gather_runs(source, starts[:0], lengths[:0]).tolist() == []


@pytest.mark.parametrize("seed", range(10))
def test_host_levels_and_arrays_plan_alike(seed):
    """choose_cascade and level_shapes take HostLevels (an engine's, from group_levels, with
    no parents) or check_levels' arrays, and give the same numbers."""
    rng = random.Random(seed)
    page_size = rng.choice([4, 16])
    prompts = [[rng.randrange(500) for _ in range(rng.randint(0, 6))] for _ in range(3)]
    page_lists = [rng.choice(prompts) + [1000 + 8 * r + j for j in range(rng.randint(1, 4))] for r in range(20)]
    last_lens = [rng.randint(1, page_size) for _ in page_lists]
    for num_levels in (2, 3):
        _, levels = group_levels(page_lists, last_lens, num_levels, page_size)
        tables = [[getattr(lv, name) for lv in levels] for name in
                  ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len")]
        arrays = check_levels(*tables, num_levels, page_size, None)
        kw = dict(page_size=page_size, num_qo_heads=32, num_kv_heads=8, head_dim=128, elem_bytes=2, device=None)
        assert choose_cascade(levels, **kw) == choose_cascade(arrays, **kw)
        assert level_shapes(levels, page_size) == level_shapes(arrays, page_size)


def test_host_levels_copy_the_used_entries():
    i32 = dict(dtype=torch.int32)
    qo = [torch.tensor([0, 3], **i32), torch.tensor([0, 1, 3], **i32)]
    kp = [torch.tensor([2, 4], **i32), torch.tensor([1, 2, 2], **i32)]  # starting past 0
    ki = [torch.tensor([-1, -1, 7, 8, -1], **i32), torch.tensor([-5, 9, 99], **i32)]
    kl = [torch.tensor([16], **i32), torch.tensor([3, 0], **i32)]
    levels = host_levels(qo, kp, ki, kl, 2, 16, 10)
    assert [lv.kv_indptr.tolist() for lv in levels] == [[0, 2], [0, 1, 1]]
    assert [lv.kv_indices.tolist() for lv in levels] == [[7, 8], [9]]
    assert levels[0].parent is None and levels[1].parent.tolist() == [0, 0]
    assert levels[1].qo_indptr.dtype == torch.int64 and levels[1].kv_indices.dtype == torch.int32
    qo[1][1], ki[0][2] = 2, 0  # the levels hold copies
    assert levels[1].qo_indptr.tolist() == [0, 1, 3] and levels[0].kv_indices.tolist() == [7, 8]


@pytest.mark.parametrize("use_cascade", [True, False])
def test_replan_with_tables_of_the_same_shapes_writes_in_place(use_cascade):
    """On the CPU too, a re-plan with tables of the same shapes fills the plan's buffers."""
    attn = MultiLevelCascadeAttention(2, device="cpu")
    i32 = dict(dtype=torch.int32)

    def tables(perm):
        return ([torch.tensor([0, 4], **i32), torch.arange(5, **i32)],
                [torch.tensor([0, 2], **i32), torch.tensor([0, 1, 3, 3, 4], **i32)],
                [torch.tensor(perm[:2], **i32), torch.tensor(perm[2:6], **i32)],
                [torch.tensor([4], **i32), torch.tensor([2, 4, 0, 1], **i32)])

    def device_tables():
        levels = attn._levels if attn.use_cascade else [attn._flat]
        return [t for lv in levels for t in lv.tensors()]

    attn.plan(*tables([0, 1, 2, 3, 4, 5]), 4, 2, 32, 4, num_pages=8, use_cascade=use_cascade)
    before = [t.data_ptr() for t in device_tables()]
    attn.plan(*tables([7, 6, 5, 4, 3, 2]), 4, 2, 32, 4, num_pages=8, use_cascade=use_cascade)
    assert [t.data_ptr() for t in device_tables()] == before
    levels = attn._levels if attn.use_cascade else [attn._flat]
    assert all(type(lv.decode) is bool for lv in levels)  # run() branches on it, torch.compile too
    got = [t.tolist() for t in device_tables()]
    if use_cascade:
        assert got == [[0, 4], [0, 2], [7, 6], [4], [0, 1, 2, 3, 4], [0, 1, 3, 3, 4], [5, 4, 3, 2], [2, 4, 0, 1]]
    else:  # each request: the two shared pages, then its own
        assert got == [[0, 1, 2, 3, 4], [0, 3, 7, 9, 12], [7, 6, 5, 7, 6, 4, 3, 7, 6, 7, 6, 2], [2, 4, 4, 1]]
    qo, (kp_top, _), (ki_top, _), (last_top, _) = tables([7, 6, 5, 4, 3, 2])
    attn.plan(qo, [kp_top, torch.tensor([0, 1, 3, 3, 3], **i32)], [ki_top, torch.tensor([5, 4, 3], **i32)],
              [last_top, torch.tensor([2, 4, 0, 0], **i32)], 4, 2, 32, 4, use_cascade=use_cascade)  # new shapes
    want = [5, 4, 3] if use_cascade else [7, 6, 5, 7, 6, 4, 3, 7, 6, 7, 6]
    assert device_tables()[-2].tolist() == want


def test_plan_rejects_a_dtype_that_is_not_one():
    attn = MultiLevelCascadeAttention(1, device="cpu")
    one = [torch.tensor([0, 1], dtype=torch.int32)]
    with pytest.raises(TypeError, match="dtype"):
        attn.plan(one, one, [torch.tensor([0], dtype=torch.int32)], [torch.tensor([1], dtype=torch.int32)],
                  4, 2, 32, 4, dtype="bf16")


def outcome(*args, **kwargs) -> str:
    try:
        check_page_table_values(*args, **kwargs)
    except ValueError as exc:
        return str(exc)
    return "ok"


@pytest.mark.parametrize("num_pages", [6, None, 2**40])
def test_page_table_rule_on_numpy_arrays_as_on_tensors(num_pages):
    cases = [
        ([0, 2, 3], [4, 5, 1], [16, 2]),  # valid
        ([0, 2, 3], [4, -1, 1], [16, 2]),  # a negative page id (caught in the unsigned pass)
        ([0, 2, 3], [4, 6, 1], [16, 2]),  # past the pool
        ([0, 3, 2], [4, 5, 1], [16, 2]),  # not monotone
        ([1, 2, 3], [-9, 5, 1], [16, 2]),  # an unread entry before the first row
        ([0, 2, 2], [4, 5, 1], [16, 1]),  # an empty row with a length
        ([0, 2, 3], [4, 5, 1], [0, 17]),  # two bad lengths: the first row is named
    ]
    for indptr, indices, last in cases:
        results = {outcome(*(conv(x) for x in (indptr, indices, last)), 16, num_pages)
                   for conv in (lambda x: torch.tensor(x, dtype=torch.int32), lambda x: torch.tensor(x),
                                lambda x: np.array(x, dtype=np.int32), lambda x: np.array(x, dtype=np.int64))}
        assert len(results) == 1, results
    assert outcome(np.array([0, 2, 3]), np.array([4, -1, 1], dtype=np.int32), np.array([16, 2]), 16, 6) == (
        "kv_indices: index -1 at position 1 is outside the pool of 6 pages")
    assert outcome(np.array([0, 2]), np.array([4, -1], dtype=np.int32), np.array([16]), 16, 2**40) == (
        f"kv_indices: index -1 at position 1 is outside the pool of {2**40} pages")


def test_pick_decode_schedule_takes_numpy_lengths():
    cpu = torch.device("cpu")
    assert pick_decode_schedule(64, 8, cpu, seq_lens=np.array([65536] + [1024] * 63)) == "balanced"
    assert pick_decode_schedule(4, 8, cpu, seq_lens=np.array([100, 90, 95, 99])) == "per_request"


def test_flat_over_shared_pages_takes_the_shared_pages_schedule():
    """A flat plan whose upper level groups several rows decodes with the "shared_pages"
    tiles (the rows re-read those pages from L2); one row per upper group, or a cascade,
    keeps the per-request schedule."""
    i32 = dict(dtype=torch.int32)
    batch, own = 4, [1, 1, 1, 1]  # equal lengths: per-request, not balanced

    def tables(shared: bool):
        top = [0, 4] if shared else list(range(batch + 1))
        top_pages = 2 if shared else 2 * batch
        own_ptr = [0, *np.cumsum(own).tolist()]
        return ([torch.tensor(top, **i32), torch.arange(batch + 1, **i32)],
                [torch.tensor([0, 2] if shared else list(range(0, 2 * batch + 1, 2)), **i32),
                 torch.tensor(own_ptr, **i32)],
                [torch.arange(top_pages, **i32), torch.arange(top_pages, top_pages + sum(own), **i32)],
                [torch.full((len(top) - 1,), 4, **i32), torch.tensor([4, 4, 3, 4], **i32)])

    for shared, use_cascade, want in ((True, False, "shared_pages"), (False, False, "per_request"),
                                      (True, True, "per_request")):
        attn = MultiLevelCascadeAttention(2, device="cpu")
        attn.plan(*tables(shared), 8, 2, 128, 4, use_cascade=use_cascade)
        level = attn._levels[-1] if use_cascade else attn._flat
        assert level.schedule == want, (shared, use_cascade)


def test_prefix_takes_its_whole_grid_beside_whole_sm_decode_programs():
    # (16, 8192, 16384): 128 decode programs, one per SM, one wave; at the share the cost
    # model gives (0.084) the prefix's 8 programs would leave 124 SMs, so it takes its
    # whole one-wave grid. Shapes planned for the reference SM count (CPU tensors).
    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    kw = dict(num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=16, dtype=bf16, device=cpu)
    whole = paged_num_splits(16, 1, 32, 8, 128, bf16, 8192, cpu)
    assert whole == 16
    assert plan_mod.prefix_splits_beside_decode(16, 1, 8192, 16, "per_request", 0.084, **kw) == whole
    # The balanced schedule and the shared-pages tiles keep the share's grid.
    for schedule in ("balanced", "shared_pages"):
        assert plan_mod.prefix_splits_beside_decode(16, 1, 8192, 16, schedule, 0.084, **kw) == 1
    # Many requests: decode programs several to an SM, or more than one wave: the share's grid.
    for batch, prefix, share in ((64, 8192, 0.565), (128, 32768, 0.739), (256, 4096, 0.583), (512, 1024, 0.444)):
        shared = paged_num_splits(batch, 1, 32, 8, 128, bf16, prefix, cpu, sm_share=share)
        assert plan_mod.prefix_splits_beside_decode(batch, 1, prefix, batch, "per_request", share, **kw) == shared
    assert whole_sm_decode_programs(16, 32, 8, 128, bf16, 16, cpu) == 128
    assert whole_sm_decode_programs(256, 32, 8, 128, bf16, 16, cpu) == 0


def test_prefix_of_a_few_rows_takes_the_side_stream_with_its_whole_grid():
    # (4, 8192, 4096): 16 packed rows per kv head pick 16-row tiles, bandwidth-bound like the
    # decode level. The planner still gives a share (the side stream runs), and the prefix
    # level keeps its whole one-wave grid beside the decode, whatever the share and schedule.
    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    batch, prefix_pages, own_pages, page_size = 4, 512, 256, 16
    i32 = dict(dtype=torch.int32)
    arrays = check_levels([torch.tensor([0, batch], **i32), torch.arange(batch + 1, **i32)],
                          [torch.tensor([0, prefix_pages], **i32), torch.arange(batch + 1, **i32) * own_pages],
                          [torch.arange(prefix_pages, **i32), torch.arange(prefix_pages, prefix_pages + batch * own_pages,
                                                                             **i32)],
                          [torch.tensor([page_size], **i32), torch.full((batch,), page_size, **i32)], 2, page_size, None)
    _, _, _, share = choose_cascade(arrays, page_size=page_size, num_qo_heads=32, num_kv_heads=8, head_dim=128,
                                    elem_bytes=2, device=None)
    assert share is not None and share < 1
    kw = dict(num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=page_size, dtype=bf16, device=cpu)
    whole = paged_num_splits(batch, 1, 32, 8, 128, bf16, prefix_pages * page_size, cpu)
    assert whole > paged_num_splits(batch, 1, 32, 8, 128, bf16, prefix_pages * page_size, cpu, sm_share=share)
    for schedule in ("per_request", "concurrent", "balanced"):
        for s in (share, 0.05, 0.9):
            assert plan_mod.prefix_splits_beside_decode(batch, 1, prefix_pages * page_size, batch, schedule, s,
                                                        **kw) == whole
