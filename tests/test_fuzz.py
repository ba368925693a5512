"""Fuzz: random page tables (valid and not) and caches with NaN/inf planted, against every
public launcher and the cascade. Each call either raises a clear ``ValueError`` /
``TypeError`` before any launch, or returns the float64 reference's answer (NaN where it
is NaN, ``(0, -inf)`` where it is empty).

The number of examples is bounded for CI (the interpreter costs ~1.5 ms per loop step);
on a GPU every test draws many more.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import cascadeinfer as ci
from cascadeinfer.kernels import decode as decode_mod
from cascadeinfer.kernels import prefill as prefill_mod
from cascadeinfer.kernels.reference import attention_state_ref
from cascadeinfer.layouts.paged_cache import gather_paged_kv, unpack_paged_kv_cache

EXAMPLES = 300 if torch.cuda.is_available() else 12
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
D, PAGE = 16, 4
CORRUPTIONS = ("none", "indptr_down", "indptr_past_indices", "page_past_pool", "negative_page",
               "last_too_long", "last_zero", "empty_row_last", "int64_indices", "short_last")

pytestmark = pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning", "ignore:overflow:RuntimeWarning",
                                        "ignore:All-NaN slice:RuntimeWarning")


@st.composite
def tables(draw):
    """Rows' lengths, a pool, a CSR table over it, a corruption and planted garbage."""
    lens = draw(st.lists(st.integers(0, 3 * PAGE + 1), min_size=1, max_size=4))
    pages = [-(-n // PAGE) for n in lens]
    num_pages = sum(pages) + draw(st.integers(0, 3))
    perm = draw(st.permutations(range(num_pages)))
    indptr = [0]
    for p in pages:
        indptr.append(indptr[-1] + p)
    indices = list(perm[:indptr[-1]])
    last = [(n - 1) % PAGE + 1 if n else 0 for n in lens]
    corruption = draw(st.sampled_from(CORRUPTIONS))
    garbage = draw(st.sampled_from(["none", "nan", "inf", "-inf"]))
    where = draw(st.sampled_from(["k", "v", "q"]))
    seed = draw(st.integers(0, 2**16))
    return lens, num_pages, indptr, indices, last, corruption, garbage, where, seed


def corrupt(kind, indptr, indices, last, num_pages):
    """Apply one invalid change where the table has room for it (else leave it valid)."""
    indptr, indices, last = list(indptr), list(indices), list(last)
    full = [i for i in range(len(last)) if indptr[i + 1] > indptr[i]]
    empty = [i for i in range(len(last)) if indptr[i + 1] == indptr[i]]
    if kind == "indptr_down" and len(indptr) > 2 and indptr[1] > 0:
        indptr[1], indptr[2] = indptr[1] + 1 + indptr[2], 0
    elif kind == "indptr_past_indices":
        indptr[-1] += 1
    elif kind == "page_past_pool" and indices:
        indices[-1] = num_pages + 7
    elif kind == "negative_page" and indices:
        indices[0] = -1
    elif kind == "last_too_long" and full:
        last[full[0]] = PAGE + 1
    elif kind == "last_zero" and full:
        last[full[-1]] = 0
    elif kind == "empty_row_last" and empty:
        last[empty[0]] = 2
    elif kind in ("int64_indices", "short_last"):
        pass  # applied to the tensors below
    else:
        return indptr, indices, last, False
    return indptr, indices, last, True


def build(draw_out, device, hq=4, hkv=2):
    lens, num_pages, indptr, indices, last, corruption, garbage, where, seed = draw_out
    indptr, indices, last, bad = corrupt(corruption, indptr, indices, last, num_pages)
    g = torch.Generator().manual_seed(seed)
    cache = torch.randn(num_pages, 2, PAGE, hkv, D, generator=g)
    q = torch.randn(len(lens), hq, D, generator=g)
    if garbage != "none":
        value = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}[garbage]
        if where == "q":
            q[seed % len(lens), seed % hq, seed % D] = value
        elif num_pages:
            cache[seed % num_pages, 0 if where == "k" else 1, seed % PAGE, seed % hkv, seed % D] = value
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    t_indptr, t_indices, t_last = i32(indptr), i32(indices), i32(last)
    if corruption == "int64_indices":
        t_indices, bad = t_indices.long(), True
    if corruption == "short_last":
        t_last, bad = t_last[:-1], True
    return (q.to(device), cache.to(device), t_indptr.to(device), t_indices.to(device), t_last.to(device),
            bad, lens)


def reference(q, cache, indptr, indices, last):
    kv = unpack_paged_kv_cache(cache.cpu(), "NHD")
    os_, ls_ = [], []
    for r in range(q.shape[0]):
        k, v = gather_paged_kv(kv, indptr.cpu(), indices.cpu(), last.cpu(), r)
        o, lse = attention_state_ref(q[r:r + 1].cpu(), k, v)
        os_.append(o)
        ls_.append(lse)
    return torch.cat(os_), torch.cat(ls_)


def assert_matches(o, lse, o_ref, lse_ref):
    o, lse = o.double().cpu(), lse.double().cpu()
    nan = torch.isnan(lse_ref)
    assert torch.equal(torch.isnan(lse), nan), f"NaN LSE at {torch.isnan(lse).nonzero().tolist()}, want {nan.nonzero().tolist()}"
    ok = ~nan
    assert torch.equal(lse[ok] == -math.inf, lse_ref[ok] == -math.inf)
    fin = ok & torch.isfinite(lse_ref)
    torch.testing.assert_close(lse[fin], lse_ref[fin], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(o[fin], o_ref[fin], atol=1e-4, rtol=1e-4)
    assert bool((o[ok & (lse_ref == -math.inf)] == 0).all())


@pytest.fixture(params=["triton", "torch"])
def path(request, monkeypatch):
    """The Triton kernels (GPU or interpreter) or the plain PyTorch path."""
    if request.param == "torch":
        for mod in (decode_mod, prefill_mod):
            monkeypatch.setattr(mod, "use_triton", lambda dev: False)
    return request.param


@FUZZ
@given(case=tables(), schedule=st.sampled_from(["per_request", "balanced", "all_heads"]))
def test_decode(device, path, case, schedule):
    q, cache, indptr, indices, last, bad, _ = build(case, device)
    if bad:
        with pytest.raises((ValueError, TypeError)):
            ci.batch_decode_paged(q, cache, indptr, indices, last, schedule=schedule)
        return
    o, lse = ci.batch_decode_paged(q, cache, indptr, indices, last, schedule=schedule)
    assert_matches(o, lse, *reference(q, cache, indptr, indices, last))


@FUZZ
@given(case=tables())
def test_prefill_paged(device, path, case):
    q, cache, indptr, indices, last, bad, lens = build(case, device)
    qo = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=device)
    if bad:
        with pytest.raises((ValueError, TypeError)):
            ci.batch_prefill_paged(q, qo, cache, indptr, indices, last)
        return
    o, lse = ci.batch_prefill_paged(q, qo, cache, indptr, indices, last)
    assert_matches(o, lse, *reference(q, cache, indptr, indices, last))


@FUZZ
@given(case=tables())
def test_append_then_decode(device, case):
    """Append one token per non-empty row at its last position, then decode: a bad table
    is refused before anything is written."""
    q, cache, indptr, indices, last, bad, lens = build(case, device)
    n = q.shape[0]
    k_new = torch.randn(n, 2, D, device=device)
    seq = [max(x, 1) for x in lens]
    rows = torch.tensor([i if lens[i] else -1 for i in range(n)], dtype=torch.int32, device=device)
    pos = torch.tensor([s - 1 for s in seq], dtype=torch.int32, device=device)
    before = cache.clone()
    if bad:
        with pytest.raises((ValueError, TypeError)):
            ci.append_paged_kv_cache(k_new, k_new.clone(), rows, pos, cache, indices, indptr, last)
        assert torch.equal(cache.nan_to_num(), before.nan_to_num())
        return
    ci.append_paged_kv_cache(k_new, k_new.clone(), rows, pos, cache, indices, indptr, last)
    o, lse = ci.batch_decode_paged(q, cache, indptr, indices, last)
    assert_matches(o, lse, *reference(q, cache, indptr, indices, last))


@FUZZ
@given(case=tables(), use_cascade=st.sampled_from([True, None]))
def test_cascade(device, case, use_cascade):
    """Two levels: the first page of row 0 as a prefix shared by all rows (when it is a
    full page), each row's own table below it. (plan() takes int64 host tables too.)"""
    assume(case[5] != "int64_indices")
    q, cache, indptr, indices, last, bad, lens = build(case, device)
    n = q.shape[0]
    i32 = dict(dtype=torch.int32, device=device)
    shared = not bad and lens[0] >= PAGE
    prefix = indices[:1] if shared else indices[:0]
    attn = ci.MultiLevelCascadeAttention(2, device=device)
    args = ([torch.tensor([0, n], **i32), torch.arange(n + 1, **i32)],
            [torch.tensor([0, int(shared)], **i32), indptr], [prefix, indices],
            [torch.tensor([PAGE if shared else 0], **i32), last], 4, 2, D, PAGE)
    if bad:
        with pytest.raises((ValueError, TypeError)):
            attn.plan(*args, use_cascade=use_cascade)
            attn.run(q, cache)
        return
    attn.plan(*args, use_cascade=use_cascade)
    o, lse = attn.run(q, cache, return_lse=True)
    # Row r sees the shared page, then its own pages.
    if shared:
        pre_i = torch.cat([torch.tensor([0]), (indptr.cpu()[1:] - indptr.cpu()[:-1]).cumsum(0) + torch.arange(1, n + 1)])
        rows = [torch.cat([prefix.cpu(), indices.cpu()[int(indptr[r]):int(indptr[r + 1])]]) for r in range(n)]
        flat_idx = torch.cat(rows).to(torch.int32)
        flat_last = torch.where(indptr.cpu()[1:] > indptr.cpu()[:-1], last.cpu(), PAGE).to(torch.int32)
        o_ref, lse_ref = reference(q, cache, pre_i.to(torch.int32), flat_idx, flat_last)
    else:
        o_ref, lse_ref = reference(q, cache, indptr, indices, last)
    assert_matches(o, lse, o_ref, lse_ref)
