"""MultiLevelCascadeAttention with use_cuda_graph=True: fixed buffers, the first plan's
launch choices, new tables every plan; on a GPU, a captured run replayed after re-plans."""

from __future__ import annotations

import random

import pytest
import torch

from cascadeinfer.cascade.multi_level import MultiLevelCascadeAttention
from cascadeinfer.layouts.paged_cache import unpack_paged_kv_cache
from test_cascade import check_close, reference
from test_cascade import tables as cascade_tables

HQ, HKV, D, PAGE = 8, 2, 32, 4


def padded_tree(rng: random.Random, batch: int, groups: list[int], max_len: int, num_pages: int, page: int = PAGE):
    """A random decode cascade over ``batch`` rows, padded to fixed group counts.

    Level ``l < L - 1`` has ``groups[l]`` groups: a random number of real groups (contiguous
    rows, full pages, random lengths) and empty groups (no queries, no pages) after them;
    the last level has one group per row. Returns the per-level description the test
    module's ``reference`` reads and the page permutation it uses.
    """
    levels, next_page = [], 0
    bounds = [0, batch]
    for lv, count in enumerate(groups):
        # Each group refines the groups above (nested), with at most `count` of them.
        free = [c for c in range(1, batch) if c not in bounds]
        extra = rng.randint(0, min(len(free), count - (len(bounds) - 1)))
        bounds = sorted(set(bounds) | set(rng.sample(free, extra)))
        real = len(bounds) - 1
        of = [g for g in range(real) for _ in range(bounds[g + 1] - bounds[g])]
        lens = [rng.randint(0, max_len // page) * page for _ in range(real)] + [0] * (count - real)
        levels.append(dict(groups=of, lens=lens, counts=[of.count(g) for g in range(count)]))
    lens = [rng.randint(0, max_len) for _ in range(batch)]
    levels.append(dict(groups=list(range(batch)), lens=lens, counts=[1] * batch))
    for lv in levels:
        lv["pages"] = []
        for n in lv["lens"]:
            k = -(-n // page)
            lv["pages"].append(list(range(next_page, next_page + k)))
            next_page += k
    assert next_page <= num_pages
    return levels


def tables(levels, perm, device, page: int = PAGE):
    return cascade_tables(levels, page, perm, device)


def choices(attn) -> tuple:
    return attn._overlap, [(lv.decode, lv.num_splits, lv.schedule) for lv in attn._levels]


def same_choices(attn, tables_, num_pages, hq=HQ, hkv=HKV, d=D, page=PAGE) -> bool:
    """The graph-mode plan made the launch choices a plain plan makes for the same tables."""
    plain = MultiLevelCascadeAttention(attn.num_levels, device=attn.device)
    plain.plan(*tables_, hq, hkv, d, page, num_pages=num_pages, use_cascade=True)
    return choices(attn) == choices(plain)


def check_against_reference(attn, q, cache, levels, perm, batch, out, lse):
    o_ref, lse_ref = reference(q, unpack_paged_kv_cache(cache, "NHD"), levels, perm, batch, 1, False, D ** -0.5)
    check_close(out, lse, o_ref, lse_ref, q.dtype)


@pytest.mark.parametrize("groups", [[2], [3, 4]])
def test_replans_rewrite_the_same_buffers(device, groups):
    rng = random.Random(len(groups))
    torch.manual_seed(0)
    batch, num_pages = 5, 160
    cache = torch.randn(num_pages, 2, PAGE, HKV, D, dtype=torch.float16, device=device)
    attn = MultiLevelCascadeAttention(len(groups) + 1, device=device, use_cuda_graph=True, max_pages=40)
    q = torch.randn(batch, HQ, D, dtype=torch.float16, device=device)
    out, lse = torch.empty_like(q), torch.empty(batch, HQ, device=device)
    first_tables = None
    for step in range(3):
        levels = padded_tree(rng, batch, groups, 3 * PAGE + 1, num_pages)
        perm = torch.randperm(num_pages).tolist()
        attn.plan(*tables(levels, perm, device), HQ, HKV, D, PAGE, num_pages=num_pages)
        assert attn.use_cascade
        current = [attn.level_table(lv) for lv in range(len(groups) + 1)]
        if first_tables is None:
            first_tables = [t.kv_indices.data_ptr() for t in current]
            assert all(t.kv_indices.numel() == 40 for t in current)
            assert same_choices(attn, tables(levels, perm, device), num_pages)
        assert [t.kv_indices.data_ptr() for t in current] == first_tables
        out.fill_(float("nan"))
        attn.run(q, cache, out=out, lse=lse)
        check_against_reference(attn, q, cache, levels, perm, batch, out, lse)


def test_graph_mode_rejects_what_a_captured_run_cannot_follow(device):
    i32 = dict(dtype=torch.int32, device=device)
    t = lambda *x: torch.tensor(x, **i32)  # noqa: E731
    two = ([t(0, 2), t(0, 1, 2)], [t(0, 1), t(0, 1, 2)], [t(0), t(1, 2)], [t(4), t(2, 3)])
    with pytest.raises(ValueError, match="max_pages"):
        MultiLevelCascadeAttention(2, device=device, use_cuda_graph=True)
    with pytest.raises(ValueError, match="max_pages"):
        MultiLevelCascadeAttention(2, device=device, use_cuda_graph=True, max_pages=[4])
    with pytest.raises(ValueError, match="max_pages"):
        MultiLevelCascadeAttention(2, device=device, max_pages=4)
    with pytest.raises(TypeError, match="use_cuda_graph"):
        MultiLevelCascadeAttention(2, device=device, use_cuda_graph=1)
    attn = MultiLevelCascadeAttention(2, device=device, use_cuda_graph=True, max_pages=[1, 2])
    with pytest.raises(ValueError, match="use_cascade"):
        attn.plan(*two, 4, 2, 32, 4, use_cascade=False)
    with pytest.raises(ValueError, match=r"kv_indptr_arr\[0\].*max_pages=1"):
        attn.plan([two[0][0], two[0][1]], [t(0, 2), two[1][1]], [t(0, 3), two[2][1]], two[3], 4, 2, 32, 4)
    attn.plan(*two, 4, 2, 32, 4)
    with pytest.raises(ValueError, match="query tokens"):
        attn.plan([t(0, 3), t(0, 1, 2, 3)], [two[1][0], t(0, 1, 2, 2)], two[2], [two[3][0], t(2, 3, 0)],
                  4, 2, 32, 4)
    with pytest.raises(ValueError, match=r"qo_indptr_arr\[0\]: expected 1 groups"):
        attn.plan([t(0, 1, 2), two[0][1]], [t(0, 1, 1), two[1][1]], two[2], [t(4, 0), two[3][1]], 4, 2, 32, 4)
    with pytest.raises(ValueError, match="decode level"):  # the last level held one query per group
        attn.plan([two[0][0], t(0, 0, 2)], two[1], two[2], two[3], 4, 2, 32, 4)
    with pytest.raises(ValueError, match="head_dim"):
        attn.plan(*two, 4, 2, 64, 4)
    with pytest.raises(ValueError, match="sm_scale"):
        attn.plan(*two, 4, 2, 32, 4, sm_scale=0.5)
    attn.plan(*two, 4, 2, 32, 4)  # the rejected plans changed nothing


@pytest.mark.gpu
@pytest.mark.parametrize("groups,batch", [([2], 64), ([3, 5], 48)])
def test_captured_run_follows_new_plans(groups, batch):
    """One graph captured after the first plan serves later plans with other tables,
    side stream (two levels, many rows sharing a prefix) included."""
    dev = torch.device("cuda")
    rng = random.Random(batch)
    num_pages = 6000
    hq, hkv, d, page = 32, 8, 128, 16
    cache = torch.randn(num_pages, 2, page, hkv, d, dtype=torch.bfloat16, device=dev)
    q = torch.randn(batch, hq, d, dtype=torch.bfloat16, device=dev)
    out, lse = torch.empty_like(q), torch.empty(batch, hq, device=dev)
    attn = MultiLevelCascadeAttention(len(groups) + 1, device=dev, use_cuda_graph=True, max_pages=batch * 130)
    graph = None
    for step in range(3):
        levels = padded_tree(rng, batch, groups, 2000, num_pages, page)
        perm = torch.randperm(num_pages).tolist()
        attn.plan(*tables(levels, perm, dev, page), hq, hkv, d, page, num_pages=num_pages)
        if graph is None:
            assert same_choices(attn, tables(levels, perm, dev, page), num_pages, hq, hkv, d, page)
            assert attn._overlap or len(groups) > 1  # two levels: the decode beside the prefix level
            attn.run(q, cache, out=out, lse=lse)  # records outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                attn.run(q, cache, out=out, lse=lse)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        o_ref, lse_ref = reference(q, unpack_paged_kv_cache(cache, "NHD"), levels, perm, batch, 1, False,
                                   d ** -0.5)
        check_close(out, lse, o_ref, lse_ref, torch.bfloat16)
