"""The fused last-two-levels kernel (shared prefix + suffix decode in one launch)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cascadeinfer.cascade.multi_level import MultiLevelCascadeAttention
from cascadeinfer.kernels.fused_cascade import fused_cascade_attention, plan_fused
from cascadeinfer.kernels.reference import attention_state_ref
from cascadeinfer.layouts.paged_cache import page_tokens, unpack_paged_kv_cache


def _case(prefix_lens, suffix_lens, page_size, hq, hkv, d, dtype, device, kv_layout="NHD", seed=0):
    """Pools, tables and the float64 reference of a two-level cascade: groups of tokens
    share a prefix (``prefix_lens[g]`` keys for group g, ``len(suffix_lens)`` tokens split
    evenly), every token has its own suffix."""
    g = torch.Generator().manual_seed(seed)
    batch, groups = len(suffix_lens), len(prefix_lens)
    qo = torch.tensor([batch * i // groups for i in range(groups + 1)])
    pages = [math.ceil(n / page_size) for n in list(prefix_lens) + list(suffix_lens)]
    num_pages = sum(pages) + 5
    perm = torch.randperm(num_pages, generator=g)
    ids = torch.split(perm[:sum(pages)], pages)
    shape = (num_pages, 2, page_size, hkv, d) if kv_layout == "NHD" else (num_pages, 2, hkv, page_size, d)
    cache = torch.randn(shape, generator=g).to(dtype).to(device)
    q = torch.randn(batch, hq, d, generator=g).to(dtype).to(device)

    def table(lens, page_ids):
        indptr = torch.tensor([0, *torch.tensor([len(p) for p in page_ids]).cumsum(0).tolist()])
        last = torch.tensor([(n - 1) % page_size + 1 if n else 0 for n in lens])
        indices = torch.cat(page_ids) if page_ids else torch.zeros(0, dtype=torch.long)
        return indptr, indices, last

    pre = table(prefix_lens, ids[:groups])
    suf = table(suffix_lens, ids[groups:])
    kv = unpack_paged_kv_cache(cache, kv_layout)
    scale = 0.2
    o_ref = torch.empty(q.shape, dtype=torch.float64)
    lse_ref = torch.empty(q.shape[:2], dtype=torch.float64)
    for t in range(batch):
        grp = int(torch.searchsorted(qo, t, right=True)) - 1
        keys = [(page_tokens(kv, "k", ids[grp])[:prefix_lens[grp]], page_tokens(kv, "v", ids[grp])[:prefix_lens[grp]]),
                (page_tokens(kv, "k", ids[groups + t])[:suffix_lens[t]],
                 page_tokens(kv, "v", ids[groups + t])[:suffix_lens[t]])]
        k = torch.cat([a for a, _ in keys]).cpu()
        v = torch.cat([b for _, b in keys]).cpu()
        o_ref[t], lse_ref[t] = (x[0] for x in attention_state_ref(q[t:t + 1].cpu(), k, v, sm_scale=scale))
    return dict(q=q, cache=cache, kv=kv, qo=qo, pre=pre, suf=suf, scale=scale, ref=(o_ref, lse_ref),
                suffix_lens=torch.tensor(suffix_lens), num_pages=num_pages)


def _check(o, lse, o_ref, lse_ref, dtype):
    tol = {torch.float16: 5e-3, torch.bfloat16: 3e-2}[dtype]
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    torch.testing.assert_close(o.double().cpu(), o_ref, atol=tol, rtol=tol)
    finite = torch.isfinite(lse_ref)
    assert torch.equal(torch.isfinite(lse.cpu()), finite)
    torch.testing.assert_close(lse.double().cpu()[finite], lse_ref[finite], atol=1e-3, rtol=1e-3)


def _run_direct(c, num_splits, device, dtype):
    """plan_fused + fused_cascade_attention on the case's tables (poisoned outputs)."""
    hq, hkv = c["q"].shape[1], c["kv"].num_kv_heads
    qo, (kp, ki, kl), (sp, si, _) = c["qo"], c["pre"], c["suf"]
    plan = plan_fused(qo, kp, ki.numel(), sp, c["suffix_lens"], si.numel(), num_qo_heads=hq, num_kv_heads=hkv,
                      page_size=c["kv"].page_size, device=device, num_splits=num_splits)
    i32 = [t.to(device=device, dtype=torch.int32) for t in (qo, kp, ki, kl, si)]
    out = torch.full_like(c["q"], float("nan"))
    lse = torch.full(c["q"].shape[:2], float("nan"), device=device)
    fused_cascade_attention(c["q"], c["kv"], *i32, plan, sm_scale=c["scale"], out=out, lse=lse)
    return plan, out, lse


@pytest.mark.parametrize("num_splits", [1, 3])
def test_fused_interleaves_both_levels(device, num_splits):
    # Prefix of 300 keys: full 64-key tiles run in the fused loop beside the suffix items,
    # the last partial tile in the masked loop; suffixes of 0..70 keys over page size 16.
    dtype = torch.float16
    c = _case([300], [0, 1, 16, 70, 33, 64, 5], 16, 8, 2, 32, dtype, device)
    plan, out, lse = _run_direct(c, num_splits, device, dtype)
    _check(out, lse, *c["ref"], dtype)
    items = plan.items[: int(plan.item_indptr[-1])].cpu()
    assert int(items[:, 3].sum()) == int(c["suffix_lens"].sum())  # every suffix key in exactly one item
    slots = items[:, 4][items[:, 4] >= 0]
    assert slots.unique().numel() == slots.numel()  # one writer per slot


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**31), groups=st.integers(1, 3), batch=st.integers(1, 6),
       page_size=st.sampled_from([1, 3, 16]), gqa=st.sampled_from([1, 4, 7]), splits=st.integers(1, 3),
       kv_layout=st.sampled_from(["NHD", "HND"]))
def test_fused_random_tables(seed, groups, batch, page_size, gqa, splits, kv_layout):
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator().manual_seed(seed)
    groups = min(groups, batch)
    prefix = [int(x) for x in torch.randint(0, 200, (groups,), generator=g)]
    suffix = [int(x) for x in torch.randint(0, 90, (batch,), generator=g)]
    c = _case(prefix, suffix, page_size, 2 * gqa, 2, 32, torch.bfloat16, dev, kv_layout, seed)
    _, out, lse = _run_direct(c, splits, dev, torch.bfloat16)
    _check(out, lse, *c["ref"], torch.bfloat16)


def test_cascade_uses_fused_and_matches_unfused(device):
    dtype = torch.bfloat16
    c = _case([150], [20, 0, 90, 7], 16, 8, 2, 64, dtype, device)
    qo, (kp, ki, kl), (sp, si, sl) = c["qo"], c["pre"], c["suf"]
    tables = [[t.to(device=device, dtype=torch.int32) for t in pair]
              for pair in ((qo, torch.arange(5)), (kp, sp), (ki, si), (kl, sl))]
    results = []
    for fuse in (None, False):
        attn = MultiLevelCascadeAttention(2, device=device)
        attn.plan(*tables, 8, 2, 64, 16, dtype=dtype, use_cascade=True, fuse=fuse)
        assert (attn._fused is not None) == (fuse is None)
        results.append(attn.run(c["q"], c["cache"], return_lse=True, sm_scale=c["scale"]))
    for o, lse in results:
        _check(o, lse, *c["ref"], dtype)


def test_fuse_true_needs_a_fusable_pair(device):
    i32 = dict(dtype=torch.int32, device=device)
    attn = MultiLevelCascadeAttention(2, device=device)
    tables = ([torch.tensor([0, 1, 2], **i32)] * 2, [torch.tensor([0, 1, 2], **i32)] * 2,
              [torch.tensor([0, 1], **i32)] * 2, [torch.tensor([4, 4], **i32)] * 2)
    with pytest.raises(ValueError, match="fuse"):  # both levels decode: nothing to fuse
        attn.plan(*tables, 4, 2, 32, 4, use_cascade=True, fuse=True)


@pytest.mark.gpu
def test_fused_realistic_shape():
    dev = torch.device("cuda")
    dtype = torch.bfloat16
    batch, prefix, suffix = 48, 4099, 300
    c = _case([prefix], [suffix + (i % 17) for i in range(batch)], 16, 32, 8, 128, dtype, dev)
    _, out, lse = _run_direct(c, None, dev, dtype)
    _check(out, lse, *c["ref"], dtype)
