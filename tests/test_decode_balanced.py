"""batch_decode_paged's balanced schedule, and the choice between the two schedules.

The balanced schedule cuts the batch's concatenated pages into ``P`` equal pieces per kv
head; these tests put program boundaries on every page, on empty rows and inside rows,
and compare every row with the float64 reference (helpers from test_decode.py).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_decode import (
    check_against_reference,
    make_case,
    poisoned,
    replay_with_new_lengths,
    run_and_check,
    run_config,
)

from cascadeinfer.cascade import MultiLevelCascadeAttention
from cascadeinfer.kernels import decode as decode_mod
from cascadeinfer.kernels import decode_balanced
from cascadeinfer.kernels.decode import batch_decode_paged
from cascadeinfer.kernels.policy import (
    BALANCED_VARIANTS,
    MAX_SPLITS,
    balanced_num_programs,
    pick_balanced_config,
    pick_decode_schedule,
)


def run_balanced(device, **kwargs):
    run_and_check(device, schedule="balanced", **kwargs)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_matches_reference(device, dtype, layout):
    run_balanced(device, lens=[0, 33, 1, 70, 16], num_splits=3, hq=4, hkv=2, dtype=dtype, layout=layout,
                 form="tuple" if layout == "HND" else "tensor", seed=1)


# Pages per request (page_size 4): empty rows first, last, in runs and between others, so
# that for some P a program boundary falls on an empty row, inside a row, and at a row end.
BOUNDARY_LENS = [0, 8, 0, 5, 0, 0, 12, 1, 0, 3, 0]  # pages 0,2,0,2,0,0,3,1,0,1,0 (10 in all)


@pytest.mark.parametrize("num_splits", [1, 2, 3, 4, 5, 7, 10, 13])
def test_program_boundaries_everywhere(device, num_splits):
    """W = cdiv(10, P) pages per program: 10, 5, 4, 3, 2, 2, 1, 1 — with W = 1 every page
    boundary is a program boundary, and P = 13 leaves programs with no pages at all."""
    run_balanced(device, lens=BOUNDARY_LENS, page_size=4, num_splits=num_splits, hq=2, hkv=1, head_dim=16,
                 seed=num_splits)


@pytest.mark.parametrize("num_splits", [5, 12])
def test_request_spanning_many_programs(device, num_splits):
    """One long row among short and empty ones is cut over most programs; stage 2 merges
    up to 10 partial states (several of its loads)."""
    run_balanced(device, lens=[0, 3, 600, 0, 5, 17], num_splits=num_splits, hq=8, hkv=2, dtype=torch.bfloat16,
                 seed=num_splits)


@pytest.mark.parametrize("num_splits", [1, 2, 3])
def test_program_spanning_many_requests(device, num_splits):
    run_balanced(device, lens=[5, 0, 16, 1, 33, 0, 2, 7, 0, 20, 4, 0], page_size=4, num_splits=num_splits,
                 hq=4, hkv=2, head_dim=32, seed=20 + num_splits)


def test_request_search_over_several_blocks(device, monkeypatch):
    """The kernel counts kv_indptr entries _BLOCK_B at a time; 16 makes 40 rows three blocks."""
    monkeypatch.setattr(decode_balanced, "_BLOCK_B", 16)
    lens = [(7 * i) % 23 if i % 5 else 0 for i in range(40)]
    for splits in (3, 9):
        run_balanced(device, lens=lens, page_size=4, num_splits=splits, hq=2, hkv=1, head_dim=16, seed=splits)


def test_kv_indptr_not_starting_at_zero(device):
    run_balanced(device, lens=[0, 30, 7, 0, 50], indptr_offset=5, num_splits=3, hq=4, hkv=2, seed=21)


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_variable_lengths_default_plan(device, page_size):
    """The default plan (P from the SM count, at least min_tokens per program): most of
    its programs have no pages here and exit."""
    run_balanced(device, lens=[0, 700, 1, 0, 45, 0], page_size=page_size, num_splits=None, hq=4, hkv=2,
                 head_dim=32, seed=page_size)


@pytest.mark.parametrize("group", [1, 7, 16])
@pytest.mark.parametrize("head_dim", [96, 256])
def test_gqa_groups_and_head_dims(device, group, head_dim):
    run_balanced(device, lens=[40, 0, 90, 3], layout="HND", num_splits=5, hq=2 * group, hkv=2, head_dim=head_dim,
                 dtype=torch.bfloat16, seed=22 + group)


def test_noncontiguous_q_and_buffers(device):
    q, cache, indptr, indices, last = make_case(device, lens=[50, 0, 20], hq=4, hkv=2, head_dim=32, seed=30)
    q_wide = torch.randn((3, 8, 32), device=device, dtype=q.dtype)[:, ::2]  # head stride 64
    q_wide.copy_(q)
    out = torch.full((3, 4, 64), float("nan"), device=device, dtype=q.dtype)[..., :32]
    lse = torch.full((4, 3), float("nan"), device=device).t()
    batch_decode_paged(q_wide, cache, indptr, indices, last, num_splits=4, schedule="balanced", out=out, lse=lse)
    check_against_reference(q, cache, indptr, indices, last, out, lse)


class _NoLaunch:
    """Stands in for a kernel: ``k[grid](...)`` does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def test_each_row_written_once(device, monkeypatch):
    """Stage 1 writes exactly the rows that lie inside one program's pages (and the empty
    ones); with stage 2 switched off, the rows cut by a program boundary stay poisoned."""
    lens, splits = [0, 3, 600, 0, 5, 40, 70, 0, 16, 33], 11
    q, cache, indptr, indices, last = make_case(device, lens=lens, hq=4, hkv=2, seed=23)
    monkeypatch.setattr(decode_balanced, "_balanced_merge_kernel", _NoLaunch())
    out, lse = poisoned(q)
    batch_decode_paged(q, cache, indptr, indices, last, num_splits=splits, schedule="balanced", out=out, lse=lse)
    ip = indptr.tolist()
    per = -(-ip[-1] // splits)  # W
    cut = [ip[r + 1] > ip[r] and ip[r] // per != (ip[r + 1] - 1) // per for r in range(len(lens))]
    assert sum(cut) == 3  # the case does exercise stage 2
    for r in range(len(lens)):
        if cut[r]:
            assert torch.isnan(out[r]).all() and torch.isnan(lse[r]).all(), f"row {r} was written by stage 1"
    keep = [r for r in range(len(lens)) if not cut[r]]
    sel = torch.tensor(keep, device=device)
    sub_ip = torch.tensor([0, *torch.tensor([ip[r + 1] - ip[r] for r in keep]).cumsum(0).tolist()],
                          dtype=torch.int32, device=device)
    sub_idx = torch.cat([indices[ip[r]:ip[r + 1]] for r in keep])
    check_against_reference(q[sel], cache, sub_ip, sub_idx, last[sel], out[sel], lse[sel])


@pytest.mark.parametrize("name", list(BALANCED_VARIANTS))
def test_balanced_variants(device, name):
    for splits in (1, 4):
        run_config(device, BALANCED_VARIANTS[name], num_splits=splits, schedule="balanced", lens=[0, 300, 17],
                   hq=8, hkv=2, head_dim=128, dtype=torch.bfloat16, seed=24)


@settings(max_examples=10, deadline=None)
@given(
    lens=st.lists(st.one_of(st.just(0), st.integers(0, 80)), min_size=1, max_size=6),
    page_size=st.sampled_from([1, 3, 16]),
    hkv=st.integers(1, 2),
    group=st.integers(1, 5),
    head_dim=st.sampled_from([16, 24, 64]),
    num_splits=st.integers(1, 9),
    dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32]),
    layout=st.sampled_from(["NHD", "HND"]),
    seed=st.integers(0, 2**16),
)
def test_random_shapes(lens, page_size, hkv, group, head_dim, num_splits, dtype, layout, seed):
    run_balanced("cuda" if torch.cuda.is_available() else "cpu", lens=lens, page_size=page_size, hq=hkv * group,
                 hkv=hkv, head_dim=head_dim, dtype=dtype, layout=layout, num_splits=num_splits, seed=seed)


def test_schedules_agree(device):
    """The same inputs through both schedules: equal up to the rounding of the split."""
    q, cache, indptr, indices, last = make_case(device, lens=[0, 90, 300, 7], hq=4, hkv=2, head_dim=32,
                                                dtype=torch.float32, seed=31)
    a = batch_decode_paged(q, cache, indptr, indices, last, num_splits=3, schedule="per_request")
    b = batch_decode_paged(q, cache, indptr, indices, last, num_splits=5, schedule="balanced")
    torch.testing.assert_close(a[0], b[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(a[1], b[1], atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------- plans


def test_pick_decode_schedule_from_shapes():
    cpu = torch.device("cpu")  # 132 SMs assumed

    def pick(batch, heads=8, **kw):
        return pick_decode_schedule(batch, heads, cpu, **kw)

    # one program per SM or fewer: nobody waits on a busier SM
    assert pick(1) == pick(12) == pick(16) == "per_request"
    # 17 x 8 pairs, 2 splits on 3 per SM: 272 programs, the busiest SM has 3 against 2.06
    assert pick(17) == "balanced"
    assert pick(40) == "balanced"  # 320 programs: 3 against 2.42
    assert pick(100) == "balanced"  # 800: 7 against 6.06
    assert pick(64) == pick(128) == pick(256) == "per_request"  # 512 / 1024 / 2048: >= 0.97
    assert pick(33) == "per_request"  # 264 programs, exactly 2 per SM


def test_pick_decode_schedule_from_lengths():
    cpu = torch.device("cpu")
    assert pick_decode_schedule(64, 8, cpu, seq_lens=[4096] * 64) == "per_request"
    assert pick_decode_schedule(64, 8, cpu, seq_lens=[65536] + [1024] * 63) == "balanced"
    assert pick_decode_schedule(4, 8, cpu, seq_lens=torch.tensor([100, 90, 95, 99])) == "per_request"
    assert pick_decode_schedule(4, 8, cpu, seq_lens=[0, 0, 0, 0]) == "per_request"
    assert pick_decode_schedule(0, 8, cpu, seq_lens=[]) == "per_request"
    with pytest.raises(ValueError, match="seq_lens"):
        pick_decode_schedule(3, 8, cpu, seq_lens=[1, 2])
    with pytest.raises(ValueError, match="num_kv_heads"):
        pick_decode_schedule(3, 0, cpu)


def test_default_schedule_is_the_picked_one(device, monkeypatch):
    """schedule=None runs pick_decode_schedule's choice; num_splits alone means per-request."""
    q, cache, indptr, indices, last = make_case(device, lens=[20, 0, 45], hq=4, hkv=2, head_dim=32, seed=32)
    seen = []
    real = decode_mod._launch_balanced
    monkeypatch.setattr(decode_mod, "pick_decode_schedule", lambda *a, **k: "balanced")
    monkeypatch.setattr(decode_mod, "_launch_balanced", lambda *a: (seen.append(a), real(*a)))
    o, s = batch_decode_paged(q, cache, indptr, indices, last)
    assert len(seen) == 1
    check_against_reference(q, cache, indptr, indices, last, o, s)
    batch_decode_paged(q, cache, indptr, indices, last, num_splits=2)
    assert len(seen) == 1


def test_balanced_plan():
    cpu = torch.device("cpu")
    assert balanced_num_programs(8, cpu) == 16  # n128_w4_s5: one per SM, 128 programs
    assert balanced_num_programs(8, cpu, programs_per_sm=2) == 33
    assert balanced_num_programs(1, cpu) == 132
    assert balanced_num_programs(256, cpu) == 1  # more kv heads than a wave: one program each
    assert balanced_num_programs(1, cpu, programs_per_sm=100) == decode_balanced.MAX_PROGRAMS
    with pytest.raises(ValueError, match="num_kv_heads"):
        balanced_num_programs(0, cpu)

    def per_sm(heads):
        return pick_balanced_config(128, torch.bfloat16, num_kv_heads=heads, num_sms=132).programs_per_sm

    # one per SM while floor(132 / heads) programs per kv head fill 90% of the SMs
    assert per_sm(1) == per_sm(8) == per_sm(12) == per_sm(32) == per_sm(60) == per_sm(200) == 1
    assert per_sm(48) == 3  # 1 per SM: 96 of 132 busy; 3 per SM: 384 of 396
    assert per_sm(100) == 2  # 100 of 132; 200 of 264 (and 300 of 396: a tie, the fewer programs)
    assert pick_balanced_config(128, torch.float32, num_kv_heads=8).num_warps == 8
    assert pick_balanced_config(256, torch.bfloat16, num_kv_heads=8).block_n == 32
    assert pick_balanced_config(64, torch.bfloat16, num_kv_heads=8).programs_per_sm == 2


def test_rejects_bad_schedule_and_splits(device):
    q, cache, indptr, indices, last = make_case(device, lens=[5, 9], seed=33)
    with pytest.raises(ValueError, match="schedule"):
        batch_decode_paged(q, cache, indptr, indices, last, schedule="even")
    with pytest.raises(ValueError, match="num_splits"):
        batch_decode_paged(q, cache, indptr, indices, last, num_splits=MAX_SPLITS + 1, schedule="per_request")
    with pytest.raises(ValueError, match="num_splits"):
        batch_decode_paged(q, cache, indptr, indices, last, num_splits=decode_balanced.MAX_PROGRAMS + 1,
                           schedule="balanced")
    with pytest.raises(ValueError, match="num_splits"):
        batch_decode_paged(q, cache, indptr, indices, last, num_splits=2.0, schedule="balanced")
    # more programs than per-request splits are allowed: the limits are the schedules' own
    run_balanced(device, lens=[5, 9], num_splits=MAX_SPLITS + 1, hq=4, hkv=1, seed=34)


def test_cascade_plan_picks_the_schedule_from_lengths(device):
    """The planner knows the suffix lengths: balanced for one long suffix among short ones."""
    page, hkv = 4, 2
    suffix_lens = [3, 200, 2, 1] + [1] * 12
    npages = [(n + page - 1) // page for n in suffix_lens]
    pool = 8 + sum(npages)
    cache = torch.randn((pool, 2, page, hkv, 16), device=device, dtype=torch.float16)
    batch = len(suffix_lens)
    ind = torch.arange(8, pool, dtype=torch.int32)
    indptr = torch.tensor([0, *torch.tensor(npages).cumsum(0).tolist()], dtype=torch.int32)
    last = torch.tensor([n - (p - 1) * page for n, p in zip(suffix_lens, npages)], dtype=torch.int32)
    attn = MultiLevelCascadeAttention(2, device=device)
    attn.plan([torch.tensor([0, batch], dtype=torch.int32), torch.arange(batch + 1, dtype=torch.int32)],
              [torch.tensor([0, 2], dtype=torch.int32), indptr],
              [torch.tensor([0, 1], dtype=torch.int32), ind],
              [torch.tensor([page], dtype=torch.int32), last],
              num_qo_heads=4, num_kv_heads=hkv, head_dim=16, page_size=page, num_pages=pool, use_cascade=True)
    assert attn._levels[-1].schedule == "balanced"
    q = torch.randn((batch, 4, 16), device=device, dtype=torch.float16)
    o, lse = attn.run(q, cache, return_lse=True)
    # the same requests through flat decode of each one's full page list
    flat_ptr = torch.tensor([0, *(torch.tensor(npages) + 2).cumsum(0).tolist()], dtype=torch.int32)
    flat_ind = torch.cat([torch.cat([torch.tensor([0, 1], dtype=torch.int32), ind[indptr[i]:indptr[i + 1]]])
                          for i in range(batch)])
    check_against_reference(q, cache, flat_ptr.to(device), flat_ind.to(device), last.to(device), o, lse)


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_realistic_shape_between_waves():
    """batch 17 x 8K, Hq 32, Hkv 8, D 128, bf16, page 16, the default: 136 (request, kv
    head) pairs, where the per-request plan ends in a partial wave, so balanced."""
    device = torch.device("cuda")
    assert pick_decode_schedule(17, 8, device) == "balanced" or torch.cuda.get_device_properties(
        device).multi_processor_count != 132
    q, cache, indptr, indices, last = make_case(device, lens=[8192] * 17, hq=32, hkv=8, head_dim=128,
                                                dtype=torch.bfloat16, seed=17)
    out, lse = poisoned(q)
    o, s = batch_decode_paged(q, cache, indptr, indices, last, out=out, lse=lse)
    check_against_reference(q, cache, indptr, indices, last, o, s)


@pytest.mark.gpu
def test_cuda_graph_replay_with_new_totals():
    """One captured balanced call replayed after the page table is rewritten in place:
    other lengths and permutation, a different total number of pages (W is read on the
    device), one long row among short ones, every row empty."""
    device = torch.device("cuda")
    lens = [300, 0, 1, 1024, 77, 16, 500, 2048]
    q, cache, indptr, indices, last = make_case(device, lens=lens, hq=32, hkv=8, head_dim=128,
                                                dtype=torch.bfloat16, spare_pages=2000, seed=15)
    capacity = 2000 + indices.numel()
    idx_buf = torch.zeros(capacity, device=device, dtype=torch.int32)
    idx_buf[: indices.numel()] = indices
    out, lse = poisoned(q)
    kwargs = dict(schedule="balanced", out=out, lse=lse)
    batch_decode_paged(q, cache, indptr, idx_buf, last, **kwargs)  # compile outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        batch_decode_paged(q, cache, indptr, idx_buf, last, **kwargs)
    for new_lens in (lens, [17, 2100, 0, 5, 999, 64, 1, 1500], [0, 30_000, 3, 0, 0, 1, 16, 40], [0] * 8,
                     [1, 2, 3, 4, 5, 6, 7, 8]):
        replay_with_new_lengths(graph, new_lens, q, cache, indptr, idx_buf, last, out, lse)
