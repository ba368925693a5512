"""MultiLevelCascadeAttention against flat attention over each request's whole sequence."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cascadeinfer.cascade.multi_level import MultiLevelCascadeAttention
from cascadeinfer.kernels import paged_num_splits
from cascadeinfer.kernels.policy import CONCURRENT_MAX_KEYS, all_heads_beside
from cascadeinfer.kernels.reference import attention_state_ref
from cascadeinfer.layouts.paged_cache import page_tokens, unpack_paged_kv_cache


def random_tree(rng: random.Random, num_levels: int, batch: int, max_len: int, page_size: int,
                queries_per_request: int, causal: bool):
    """A random cascade: level 0 shared by all, middle levels by random groups, then one
    group per request. Returns per-level CSR tables and each request's full key list."""
    # One level is plain per-request attention; with more, level 0 is shared by all.
    group_of = [list(range(batch)) if num_levels == 1 else [0] * batch]
    for _ in range(1, num_levels - 1):  # middle levels: contiguous random groups
        cuts = sorted(rng.sample(range(1, batch), rng.randint(0, batch - 1))) if batch > 1 else []
        bounds = [0, *cuts, batch]
        group_of.append([g for g in range(len(bounds) - 1) for _ in range(bounds[g + 1] - bounds[g])])
    if num_levels > 1:
        group_of.append(list(range(batch)))
    levels, next_page = [], 0
    for lv, groups in enumerate(group_of):
        num_groups = groups[-1] + 1
        last = lv == num_levels - 1
        lens = [rng.choice([0, 1, page_size, rng.randint(0, max_len)]) for _ in range(num_groups)]
        counts = [groups.count(g) * queries_per_request for g in range(num_groups)]
        if last and causal:  # causal queries are the last tokens of their group's keys
            lens = [max(n, c) for n, c in zip(lens, counts)]
        if not last and rng.random() < 0.5:  # whole pages above the last level allow flat decode
            lens = [math.ceil(n / page_size) * page_size for n in lens]
        pages = [list(range(next_page + sum(math.ceil(m / page_size) for m in lens[:g]),
                            next_page + sum(math.ceil(m / page_size) for m in lens[:g + 1])))
                 for g in range(num_groups)]
        next_page += sum(len(p) for p in pages)
        levels.append(dict(lens=lens, pages=pages, counts=counts, groups=groups))
    return levels, next_page


def tables(levels, page_size, perm, device):
    out = []
    for lv in levels:
        qo = torch.tensor([0, *torch.tensor(lv["counts"]).cumsum(0).tolist()], dtype=torch.int32)
        kp = torch.tensor([0, *torch.tensor([len(p) for p in lv["pages"]]).cumsum(0).tolist()], dtype=torch.int32)
        ki = torch.tensor([perm[p] for ps in lv["pages"] for p in ps], dtype=torch.int32)
        kl = torch.tensor([(n - 1) % page_size + 1 if n else 0 for n in lv["lens"]], dtype=torch.int32)
        out.append([t.to(device) for t in (qo, kp, ki, kl)])
    return [list(x) for x in zip(*out)]


def reference(q, kv, levels, perm, batch, qpr, causal, sm_scale):
    o_ref = torch.empty(q.shape, dtype=torch.float64)
    lse_ref = torch.empty(q.shape[:2], dtype=torch.float64)
    for r in range(batch):
        ks, vs = [], []
        for lv in levels:
            g = lv["groups"][r]
            pages = torch.tensor([perm[p] for p in lv["pages"][g]], dtype=torch.long)
            n = lv["lens"][g]
            ks.append(page_tokens(kv, "k", pages)[:n].cpu())
            vs.append(page_tokens(kv, "v", pages)[:n].cpu())
        rows = slice(r * qpr, (r + 1) * qpr)
        o, lse = attention_state_ref(q[rows].cpu(), torch.cat(ks), torch.cat(vs), sm_scale=sm_scale, causal=causal)
        o_ref[rows], lse_ref[rows] = o, lse
    return o_ref, lse_ref


def check_close(o, lse, o_ref, lse_ref, dtype):
    tol = {torch.float32: 2e-3, torch.float16: 5e-3, torch.bfloat16: 3e-2}[dtype]
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    torch.testing.assert_close(o.double().cpu(), o_ref, atol=tol, rtol=tol)
    finite = torch.isfinite(lse_ref)
    assert torch.equal(torch.isfinite(lse.cpu()), finite)
    torch.testing.assert_close(lse.double().cpu()[finite], lse_ref[finite], atol=1e-3, rtol=1e-3)


def run_case(seed, num_levels, batch, page_size, qpr, causal, kv_layout, use_cascade, device,
             dtype=torch.float16, hq=4, hkv=2, d=32):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    levels, used = random_tree(rng, num_levels, batch, 3 * page_size + 1, page_size, qpr, causal)
    num_pages = used + 3
    perm = torch.randperm(num_pages).tolist()
    shape = (num_pages, 2, page_size, hkv, d) if kv_layout == "NHD" else (num_pages, 2, hkv, page_size, d)
    cache = torch.randn(shape, dtype=dtype, device=device)
    q = torch.randn(batch * qpr, hq, d, dtype=dtype, device=device)
    qo, kp, ki, kl = tables(levels, page_size, perm, device)
    attn = MultiLevelCascadeAttention(num_levels, kv_layout=kv_layout, device=device)
    try:
        attn.plan(qo, kp, ki, kl, hq, hkv, d, page_size, causal=causal, num_pages=num_pages,
                  dtype=dtype, use_cascade=use_cascade)
    except ValueError as exc:
        assert use_cascade is False and "full page" in str(exc)
        return
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:2], float("nan"), device=device)
    scale = 0.3
    o, lse_out = attn.run(q, cache, out=out, lse=lse, return_lse=True, sm_scale=scale)
    assert o is out and lse_out is lse
    o_ref, lse_ref = reference(q, unpack_paged_kv_cache(cache, kv_layout), levels, perm, batch, qpr, causal, scale)
    check_close(o, lse, o_ref, lse_ref, dtype)


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**31), num_levels=st.integers(1, 3), batch=st.integers(1, 4),
       page_size=st.sampled_from([1, 4, 16]), decode=st.booleans(), kv_layout=st.sampled_from(["NHD", "HND"]),
       use_cascade=st.sampled_from([None, True, False]))
def test_cascade_equals_flat_attention(seed, num_levels, batch, page_size, decode, kv_layout, use_cascade):
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    qpr, causal = (1, False) if decode else (2, True)
    run_case(seed, num_levels, batch, page_size, qpr, causal, kv_layout, use_cascade, dev)


def test_two_level_shared_prefix_bf16(device):
    run_case(7, 2, 3, 16, 1, False, "NHD", True, device, dtype=torch.bfloat16, hq=8, hkv=2, d=64)


def test_run_before_plan_raises(device):
    attn = MultiLevelCascadeAttention(2, device=device)
    with pytest.raises(RuntimeError, match="before plan"):
        attn.run(torch.randn(1, 4, 32, device=device), torch.randn(1, 2, 4, 2, 32, device=device))


def test_plan_rejects_bad_tables(device):
    attn = MultiLevelCascadeAttention(2, device=device)
    i32 = dict(dtype=torch.int32)
    good = ([torch.tensor([0, 2], **i32), torch.tensor([0, 1, 2], **i32)],
            [torch.tensor([0, 1], **i32), torch.tensor([0, 1, 2], **i32)],
            [torch.tensor([0], **i32), torch.tensor([1, 2], **i32)],
            [torch.tensor([4], **i32), torch.tensor([2, 3], **i32)])
    attn.plan(*good, 4, 2, 32, 4, num_pages=3)
    with pytest.raises(ValueError, match="qo_indptr_arr"):
        attn.plan([good[0][0]], *good[1:], 4, 2, 32, 4)
    with pytest.raises(ValueError, match=r"kv_indices_arr\[1\]"):
        attn.plan(*good, 4, 2, 32, 4, num_pages=2)
    with pytest.raises(ValueError, match=r"kv_last_page_len_arr\[0\]"):
        attn.plan(good[0], good[1], good[2], [torch.tensor([5], **i32), good[3][1]], 4, 2, 32, 4)
    with pytest.raises(ValueError, match=r"qo_indptr_arr\[1\]"):  # a group straddling two parents
        attn.plan([torch.tensor([0, 1, 2], **i32), torch.tensor([0, 2], **i32)],
                  [good[1][1], torch.tensor([0, 1], **i32)], [good[2][1], torch.tensor([0], **i32)],
                  [good[3][1], torch.tensor([1], **i32)], 4, 2, 32, 4)
    with pytest.raises(ValueError, match="num_qo_heads"):
        attn.plan(*good, 3, 2, 32, 4)
    attn.plan(*good, 4, 2, 32, 4)
    with pytest.raises(ValueError, match="q"):
        attn.run(torch.randn(3, 4, 32, device=device), torch.randn(3, 2, 4, 2, 32, device=device))
    with pytest.raises(ValueError, match="paged_kv_cache"):
        attn.run(torch.randn(2, 4, 32, device=device), torch.randn(3, 2, 8, 2, 32, device=device))


@pytest.mark.gpu
def test_cuda_graph_replay_after_tables_change():
    dev = torch.device("cuda")
    batch, page_size, hq, hkv, d = 8, 16, 32, 8, 128
    num_pages = 4096
    cache = torch.randn(num_pages, 2, page_size, hkv, d, dtype=torch.bfloat16, device=dev)
    q = torch.randn(batch, hq, d, dtype=torch.bfloat16, device=dev)

    def tables(seed):
        g = torch.Generator().manual_seed(seed)
        perm = torch.randperm(num_pages, generator=g).int()
        prefix = perm[:64]
        suffix = perm[64:64 + batch * 4]
        qo = [torch.tensor([0, batch]), torch.arange(batch + 1)]
        kp = [torch.tensor([0, 64]), torch.arange(batch + 1) * 4]
        ki = [prefix, suffix]
        kl = [torch.tensor([16]), torch.randint(1, 17, (batch,), generator=g)]
        return [[t.int().to(dev) for t in x] for x in (qo, kp, ki, kl)]

    attn = MultiLevelCascadeAttention(2, device=dev)
    attn.plan(*tables(0), hq, hkv, d, page_size, use_cascade=True)
    out = torch.empty_like(q)
    lse = torch.empty(batch, hq, device=dev)
    attn.run(q, cache, out=out, lse=lse)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attn.run(q, cache, out=out, lse=lse)
    new = tables(1)
    attn.plan(*new, hq, hkv, d, page_size, use_cascade=True)  # same shapes: buffers updated in place
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    fresh = MultiLevelCascadeAttention(2, device=dev)
    fresh.plan(*new, hq, hkv, d, page_size, use_cascade=False)
    o_flat, lse_flat = fresh.run(q, cache, return_lse=True)
    torch.testing.assert_close(out.float(), o_flat.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, lse_flat, atol=1e-3, rtol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("batch,hkv,suffix_pages", [(64, 8, 16), (16, 8, 16), (64, 32, 16), (16, 8, 1024),
                                                     (256, 8, 16), (256, 8, 40), (160, 8, 9)])
def test_decode_level_beside_the_prefix_level(batch, hkv, suffix_pages):
    # Shared-prefix batch decode: the decode level runs on a side stream while the prefix
    # level, with fewer KV splits than fill the GPU, runs on the caller's stream; its tiles
    # are 128 rows (64 x 4 packed rows per kv head) or 64 (16 x 4, 64 x 1: two per SM).
    # 16 requests: one wave of whole-SM decode programs, so the prefix level takes its
    # whole grid (prefix_splits_beside_decode), over 256 and over 16K own tokens. Rows of
    # at most 512 own tokens take the "concurrent" schedule, or "all_heads" where its
    # programs cover the SMs (160 and 256 requests at Hkv 8), longer ones keep theirs.
    dev = torch.device("cuda")
    prefix_pages, page_size, hq, d = 512, 16, 32, 128
    num_pages = prefix_pages + batch * suffix_pages
    g = torch.Generator().manual_seed(3)
    perm = torch.randperm(num_pages, generator=g).int()
    tables = [[torch.tensor([0, batch]), torch.arange(batch + 1)],
              [torch.tensor([0, prefix_pages]), torch.arange(batch + 1) * suffix_pages],
              [perm[:prefix_pages], perm[prefix_pages:]],
              [torch.tensor([page_size]), torch.randint(1, page_size + 1, (batch,), generator=g)]]
    tables = [[t.int().to(dev) for t in x] for x in tables]
    cache = torch.randn(num_pages, 2, page_size, hkv, d, dtype=torch.bfloat16, device=dev)
    q = torch.randn(batch, hq, d, dtype=torch.bfloat16, device=dev)
    attn = MultiLevelCascadeAttention(2, device=dev)
    attn.plan(*tables, hq, hkv, d, page_size, use_cascade=True)
    assert attn._overlap and attn._levels[0].num_splits is not None
    short = suffix_pages * page_size <= CONCURRENT_MAX_KEYS
    wide = all_heads_beside(batch, hkv, hq // hkv, d, torch.bfloat16, dev)
    assert wide == (batch >= 160 and hkv == 8)
    assert attn._levels[1].schedule == ("all_heads" if wide else "concurrent") if short else (
        attn._levels[1].schedule not in ("all_heads", "concurrent"))
    if batch * hkv <= 128:
        assert attn._levels[0].num_splits == paged_num_splits(batch, 1, hq, hkv, d, torch.bfloat16,
                                                              prefix_pages * page_size, dev)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((batch, hq), float("nan"), device=dev)
    attn.run(q, cache, out=out, lse=lse)
    flat = MultiLevelCascadeAttention(2, device=dev)
    flat.plan(*tables, hq, hkv, d, page_size, use_cascade=False)
    o_flat, lse_flat = flat.run(q, cache, return_lse=True)
    torch.testing.assert_close(out.float(), o_flat.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, lse_flat, atol=1e-3, rtol=1e-3)
    o_ref, lse_ref = shared_prefix_reference(q, cache, perm, prefix_pages, suffix_pages, tables[3][1], page_size)
    check_close(out, lse, o_ref, lse_ref, torch.bfloat16)


def shared_prefix_reference(q, cache, perm, prefix_pages, suffix_pages, last_page_len, page_size):
    """Float64 (o, natural-log lse) of row ``r`` over pages ``perm[:prefix_pages]`` then its
    own ``suffix_pages`` (the last holding ``last_page_len[r]`` tokens), NHD cache."""
    kv = unpack_paged_kv_cache(cache, "NHD")
    o_ref = torch.empty(q.shape, dtype=torch.float64)
    lse_ref = torch.empty(q.shape[:2], dtype=torch.float64)
    for r in range(q.shape[0]):
        own = perm[prefix_pages + r * suffix_pages:prefix_pages + (r + 1) * suffix_pages]
        pages = torch.cat([perm[:prefix_pages], own]).to(cache.device)
        n = (prefix_pages + suffix_pages - 1) * page_size + int(last_page_len[r])
        k, v = (page_tokens(kv, which, pages)[:n].cpu() for which in ("k", "v"))
        o_ref[r:r + 1], lse_ref[r:r + 1] = attention_state_ref(q[r:r + 1].cpu(), k, v)
    return o_ref, lse_ref
