"""The Hopper prefill kernel beside the portable one: dispatch everywhere, numerics on a GPU.

On a CPU (CI) the dispatch runs: the argument, the reasons the Hopper kernel declines a
launch, the shapes ``backend=None`` gives it, the portable fallback; and the kernel is
compiled for sm_90 to check its copies are committed before they are waited for. On a GPU
of compute capability 9.0 every case runs through both backends against the float64
reference (poisoned outputs, empty groups, key length 1, page sizes 8-128, full last pages,
GQA 1-16, head_dim 64/128, fp16/bf16, NHD/HND, both cache forms, forced splits, strided q
and out, NaN/inf planted, CUDA-graph capture, eager replays on new tensors, the default,
the cascade).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from test_prefill import TOL, check_state, make_paged, poisoned

from cascadeinfer import MultiLevelCascadeAttention, batch_prefill_paged
from cascadeinfer.kernels import backend as B
from cascadeinfer.kernels import prefill as P
from cascadeinfer.layouts.indptr import indptr_from_lengths
from cascadeinfer.layouts.paged_cache import unpack_paged_kv_cache

HOPPER = torch.cuda.is_available() and B.hopper_unavailable(torch.device("cuda")) is None
hopper_gpu = pytest.mark.skipif(not HOPPER, reason="needs a GPU of compute capability 9.0")
BACKENDS = ["portable", "hopper"]


def _case(device, *, qo_lens, kv_lens, hkv, group, head_dim, dtype, page_size, layout="NHD", form="single", seed=0):
    gen = torch.Generator().manual_seed(seed)
    cache, table = make_paged(device, kv_lens=kv_lens, page_size=page_size, num_kv_heads=hkv, head_dim=head_dim,
                              dtype=dtype, layout=layout, form=form, gen=gen)
    q = torch.randn((sum(qo_lens), hkv * group, head_dim), generator=gen).to(dtype).to(device)
    qo_indptr = indptr_from_lengths(qo_lens, device=device)
    return q, (q, qo_indptr, cache, table.kv_indptr, table.kv_indices, table.kv_last_page_len)


# ------------------------------------------------------------------ dispatch (every machine)


def test_backend_argument_is_checked(device):
    _, args = _case(device, qo_lens=[3], kv_lens=[20], hkv=1, group=2, head_dim=16, dtype=torch.float32,
                    page_size=4)
    with pytest.raises(ValueError, match="backend"):
        batch_prefill_paged(*args, backend="fast")


@pytest.mark.skipif(HOPPER, reason="checks the fallback where the Hopper kernel cannot run")
def test_hopper_declines_here_and_portable_runs(device):
    q, args = _case(device, qo_lens=[40], kv_lens=[300], hkv=1, group=4, head_dim=64, dtype=torch.bfloat16,
                    page_size=16)
    with pytest.raises(ValueError, match="backend='hopper'"):
        batch_prefill_paged(*args, backend="hopper")
    ref = P.batch_prefill_paged_ref(*args)
    for backend in (None, "portable"):
        out, lse = poisoned(q)
        batch_prefill_paged(*args, out=out, lse=lse, backend=backend)
        check_state(out, lse, *ref, torch.bfloat16)


def _meta_source(*, page_size=16, hkv=8, d=128, dtype=torch.bfloat16, layout="NHD", paged=True, pad_page=0,
                 num_indices=2):
    """A meta cache's KV side; ``pad_page``: elements of padding after every page (the
    tuple form), so that a page is not a whole number of token rows; ``num_indices``: the
    page table's length."""
    if pad_page:
        per_page = page_size * hkv * d + pad_page
        k = torch.empty(64 * per_page, dtype=dtype, device="meta").as_strided(
            (64, page_size, hkv, d), (per_page, hkv * d, d, 1))
        cache = (k, k)
    else:
        cache = torch.empty((64, 2, page_size, hkv, d) if layout == "NHD" else (64, 2, hkv, page_size, d),
                            dtype=dtype, device="meta")
    kv = unpack_paged_kv_cache(cache, layout)
    i32 = torch.empty(2, dtype=torch.int32, device="meta")
    source = P.paged_source(kv, i32, torch.empty(num_indices, dtype=torch.int32, device="meta"), i32)
    if not paged:
        source = P.KVSource(kv.k, kv.v, False, 1, hkv, (0, *source.k_strides[1:]), (0, *source.v_strides[1:]), i32)
    return source


class _FakeTensor:
    """Stands in for q where only device, dtype, shape, strides and address are read."""

    def __init__(self, shape, dtype=torch.bfloat16, strides=None, ptr=0):
        self.device, self.dtype, self.shape = torch.device("cuda", 0), dtype, shape
        self._strides = strides or (shape[1] * shape[2], shape[2], 1)
        self._ptr = ptr

    def stride(self, dim):
        return self._strides[dim]

    def data_ptr(self):
        return self._ptr


@pytest.mark.parametrize("change,reason", [
    (dict(causal=True), "causal"),
    (dict(paged=False), "contiguous"),
    (dict(dtype=torch.float32), "dtype"),
    (dict(head_dim=96), "head_dim 96"),
    (dict(block_m=64), "64 packed rows"),
    (dict(q_strides=(32 * 128 + 4, 128, 1)), "16-byte"),
    (dict(q_ptr=8), "16-byte"),
    (dict(page_size=5), "page size 5"),
    (dict(page_size=256), "page size 256"),
    (dict(pad_page=8), "not whole rows"),
    (dict(), None),
])
def test_prefill_declines_reasons(monkeypatch, change, reason):
    """What the Hopper kernel takes on a Hopper GPU (the device check faked), and why not."""
    monkeypatch.setattr(B, "hopper_unavailable", lambda device: None)
    d = change.get("head_dim", 128)
    dtype = change.get("dtype", torch.bfloat16)
    q = _FakeTensor((100, 32, d), dtype, change.get("q_strides"), change.get("q_ptr", 0))
    kv = _meta_source(d=d, dtype=dtype, paged=change.get("paged", True), page_size=change.get("page_size", 16),
                      pad_page=change.get("pad_page", 0))
    got = B.prefill_declines(q, _AlignedKV(kv), change.get("causal", False), change.get("block_m", 128))
    if reason is None:
        assert got is None
        assert B.pick_prefill_backend("hopper", q, _AlignedKV(kv), False, 128, 3) == "hopper"
        assert B.pick_prefill_backend("portable", q, _AlignedKV(kv), False, 128, 1) == "portable"
        assert B.pick_prefill_backend(None, q, _AlignedKV(kv), False, 128, 1) == "portable"  # 400 rows x 32 keys
    else:
        assert reason in got
        big = _meta_source(d=d, dtype=dtype, paged=change.get("paged", True), page_size=change.get("page_size", 16),
                           pad_page=change.get("pad_page", 0), num_indices=2**20)  # work enough for None
        assert B.pick_prefill_backend(None, q, _AlignedKV(big), change.get("causal", False),
                                      change.get("block_m", 128), 1) == "portable"
        with pytest.raises(ValueError, match=reason):
            B.pick_prefill_backend("hopper", q, _AlignedKV(kv), change.get("causal", False),
                                   change.get("block_m", 128), 1)


@pytest.mark.parametrize("tokens,hkv,d,keys,groups,expect", [
    (256, 8, 128, 8192, 1, "hopper"),  # 1024 packed rows x 8192 keys: 2^23
    (127, 8, 128, 8192, 1, "portable"),  # 508 rows: below both bounds
    (63, 8, 128, 65536, 1, "portable"),  # 252 rows
    (64, 8, 128, 32768, 1, "hopper"),  # 256 rows: the fewest it takes
    (512, 8, 128, 4096, 1, "hopper"),
    (64, 8, 128, 16384, 1, "portable"),
    (128, 8, 128, 8192, 1, "hopper"),  # 512 rows x 8192 keys (2^22): 1.12x (v8, H200)
    (256, 8, 128, 4096, 1, "hopper"),  # 1024 rows x 4096 keys (2^22): 1.14x
    (128, 8, 128, 4096, 1, "portable"),  # 2^21
    (128, 32, 128, 65536, 1, "portable"),  # 128 rows (one head per group), memory-bound: 0.99x
    (512, 32, 128, 32768, 1, "hopper"),
    (128, 1, 128, 8192, 1, "hopper"),  # 4096 rows (GQA 32)
    (256, 8, 64, 8192, 1, "portable"),  # head_dim 64: 1.10x at 2^23, taken from 2^25
    (128, 8, 64, 65536, 1, "hopper"),
    (256, 8, 128, 8192, 2, "portable"),  # several groups: their sizes are not in the shapes
])
def test_hopper_default_rule(monkeypatch, tokens, hkv, d, keys, groups, expect):
    """backend=None takes the Hopper kernel for one group of >= 256 packed rows and >= 2^23
    packed rows x keys or >= 512 rows and >= 2^22 (head_dim 128), >= 256 rows and 2^25
    (64): the shapes where it measured >= 10% faster; "portable" never does."""
    monkeypatch.setattr(B, "hopper_unavailable", lambda device: None)
    q = _FakeTensor((tokens, 32, d))
    kv = _AlignedKV(_meta_source(hkv=hkv, d=d, num_indices=keys // 16))
    assert B.pick_prefill_backend(None, q, kv, False, 128, groups) == expect
    assert B.pick_prefill_backend("portable", q, kv, False, 128, groups) == "portable"


@pytest.mark.parametrize("batch,prefix,backend,groups,expect", [
    (128, 32768, None, 1, None),  # 512 packed rows over 32K keys: 2^24
    (64, 32768, None, 1, None),  # 256 rows: 2^23
    (64, 16384, None, 1, "portable"),  # 256 rows: 2^22
    (256, 4096, None, 1, None),  # the engine's prefix level: 1024 rows over 4K keys, 2^22
    (128, 4096, None, 1, "portable"),  # 512 rows: 2^21
    (128, 32768, None, 2, "portable"),  # two groups
    (64, 16384, "hopper", 1, "hopper"),
    (128, 32768, "portable", 1, "portable"),
])
def test_cascade_picks_each_prefill_level_from_its_keys(batch, prefix, backend, groups, expect):
    """The cascade's prefill levels: with ``backend=None`` the launcher's own rule (None,
    so the launcher takes the Hopper kernel where it runs) inside its shape bounds, counted
    from the level's keys, else "portable"; a graph plan's capacity (its page tables sized
    for far more keys) changes nothing, and the first plan's pick is kept."""
    ps, hq, hkv, d = 16, 32, 8, 128
    per_group = prefix // ps
    suffix_pages = 1
    qo0 = np.linspace(0, batch, groups + 1).astype(np.int64)
    kv0 = np.arange(groups + 1, dtype=np.int64) * per_group
    idx0 = np.arange(groups * per_group, dtype=np.int64)
    own = groups * per_group + np.arange(batch, dtype=np.int64)
    tables = ([qo0, np.arange(batch + 1)], [kv0, np.arange(batch + 1) * suffix_pages], [idx0, own],
              [np.full(groups, ps), np.full(batch, 5)])
    for graph in (False, True):
        kw = dict(use_cuda_graph=True, max_pages=[groups * per_group * 4, batch * 4]) if graph else {}
        casc = MultiLevelCascadeAttention(2, device="cpu", backend=backend, **kw)
        casc.plan(*tables, hq, hkv, d, ps, use_cascade=True, dtype=torch.bfloat16)
        assert casc._levels[0].backend == expect and casc._levels[1].decode
        if graph:  # a later plan with a short prefix keeps the first plan's kernel
            short = ([qo0, np.arange(batch + 1)], [np.arange(groups + 1) * 2, np.arange(batch + 1) * suffix_pages],
                     [idx0[:2 * groups], own], tables[3])
            casc.plan(*short, hq, hkv, d, ps, use_cascade=True, dtype=torch.bfloat16)
            assert casc._levels[0].backend == expect


class _AlignedKV:
    """A meta KVSource whose tensors report 16-byte aligned addresses (shapes kept)."""

    def __init__(self, kv):
        self._kv = kv
        self.k = self.v = _FakeTensor(tuple(kv.k.shape), kv.k.dtype, strides=tuple(kv.k.stride()))

    def __getattr__(self, name):
        return getattr(self._kv, name)


@pytest.mark.parametrize("layout,form", [("NHD", "single"), ("HND", "single"), ("NHD", "tuple"), ("HND", "tuple")])
def test_tma_rows_address_every_slot(layout, form):
    """The 2-D view the TMA descriptors take: every (page, head, slot) row of K and V found
    where the kernel computes it, and the view inside the storage."""
    gen = torch.Generator().manual_seed(9)
    cache, _ = make_paged(torch.device("cpu"), kv_lens=[40], page_size=8, num_kv_heads=3, head_dim=16,
                          dtype=torch.float32, layout=layout, form=form, gen=gen, spare_pages=2)
    kv = unpack_paged_kv_cache(cache, layout)
    source = P.paged_source(kv, *(torch.zeros(2, dtype=torch.int32),) * 3)
    rows = B.tma_rows(source)
    stride_page, stride_token, stride_head = source.k_strides
    for t in (kv.k, kv.v):
        view = torch.as_strided(t, (rows, stride_token), (stride_token, 1))  # raises if past the storage
        for p in range(t.shape[0]):
            for h in range(3):
                head_row, head_col = (h * stride_head) // stride_token, (h * stride_head) % stride_token
                for s in range(8):
                    got = view[p * (stride_page // stride_token) + head_row + s, head_col:head_col + 16]
                    want = t[p, s, h] if layout == "NHD" else t[p, h, s]
                    assert torch.equal(got, want)


def test_tma_rows_checks_every_head():
    """A layout (token stride 136, head stride 200, head_dim 64) whose first and last of 4
    heads fit inside a row but whose third (columns 128..191 of a 136-element row) does not
    has no 2-D view."""
    per_page = 8 * 136
    k = torch.empty(16 * per_page + 1024, dtype=torch.bfloat16, device="meta").as_strided(
        (16, 8, 4, 64), (per_page, 136, 200, 1))
    i32 = torch.empty(2, dtype=torch.int32, device="meta")
    assert B.tma_rows(P.paged_source(unpack_paged_kv_cache((k, k), "NHD"), i32, i32, i32)) is None


def test_hopper_unavailable_reasons(monkeypatch):
    assert "cpu device" in B.hopper_unavailable(torch.device("cpu"))
    monkeypatch.setattr(B, "_capability", lambda index: (8, 0))
    assert "8.0" in B.hopper_unavailable(torch.device("cuda", 0))
    monkeypatch.setattr(B, "_capability", lambda index: (9, 0))
    monkeypatch.setattr(B.triton, "__version__", "3.7.0")
    assert "Triton 3.7.0" in B.hopper_unavailable(torch.device("cuda", 0))
    monkeypatch.setattr(B.triton, "__version__", "3.6.0")
    assert B.hopper_unavailable(torch.device("cuda", 0)) is None


# ------------------------------------------------------------------ numerics (Hopper GPUs)

# (qo_lens, kv_lens, Hkv, G, D, dtype, page_size, layout, form): every group of >= 65 packed
# rows somewhere, so the 128-row tiles (and with them the Hopper kernel) are used.
CASES = [
    # empty groups (no queries, no keys, neither), key length 1, a partial last tile
    ([40, 0, 33, 17, 5], [600, 50, 1000, 0, 1], 2, 4, 128, torch.bfloat16, 16, "NHD", "single"),
    # GQA 1 (128 single-head rows), one key, page 8, fp16, HND, the tuple form
    ([130], [1], 1, 1, 64, torch.float16, 8, "HND", "tuple"),
    # page size 32, GQA 8, a long group whose last page is partial
    ([20, 20], [32, 4103], 4, 8, 128, torch.float16, 32, "NHD", "single"),
    # page size 128 (one TMA box per tile), several whole tiles
    ([40], [2000], 2, 4, 128, torch.bfloat16, 128, "NHD", "single"),
    # GQA 16, page 64, every last page full, HND
    ([17, 9], [2048, 640], 2, 16, 64, torch.bfloat16, 64, "HND", "single"),
    # GQA 2, D 128 in HND, tuple form, a tile boundary exactly at the end
    ([70], [1024], 3, 2, 128, torch.bfloat16, 16, "HND", "tuple"),
]


@hopper_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("qo_lens,kv_lens,hkv,group,head_dim,dtype,page_size,layout,form", CASES)
def test_hopper_matches_reference(backend, qo_lens, kv_lens, hkv, group, head_dim, dtype, page_size, layout, form):
    device = torch.device("cuda")
    q, args = _case(device, qo_lens=qo_lens, kv_lens=kv_lens, hkv=hkv, group=group, head_dim=head_dim,
                    dtype=dtype, page_size=page_size, layout=layout, form=form)
    ref = P.batch_prefill_paged_ref(*args, kv_layout=layout)
    out, lse = poisoned(q)
    batch_prefill_paged(*args, kv_layout=layout, out=out, lse=lse, backend=backend)
    check_state(out, lse, *ref, dtype)


@hopper_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 2, 3, 8])
def test_hopper_splits(num_splits):
    """One group of 64 queries x G 4 over 8229 keys (a partial last tile) in 1-8 splits,
    the partial states merged; the split count the cascade's planner forces."""
    device = torch.device("cuda")
    q, args = _case(device, qo_lens=[64], kv_lens=[8229], hkv=8, group=4, head_dim=128, dtype=torch.bfloat16,
                    page_size=16, seed=3)
    ref = P.batch_prefill_paged_ref(*args)
    out, lse = poisoned(q)
    batch_prefill_paged(*args, out=out, lse=lse, num_splits=num_splits, backend="hopper")
    check_state(out, lse, *ref, torch.bfloat16)


@hopper_gpu
@pytest.mark.gpu
def test_hopper_strided_q_and_out():
    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(4)
    cache, table = make_paged(device, kv_lens=[500, 77], page_size=16, num_kv_heads=2, head_dim=128,
                              dtype=torch.bfloat16, gen=gen)
    big = torch.randn((90, 3, 8, 128), generator=gen).to(torch.bfloat16).to(device)
    q = big[:, 1]  # token stride 3 * 8 * 128
    out = torch.full((90, 8, 2, 128), math.nan, dtype=torch.bfloat16, device=device)[:, :, 0]
    lse = torch.full((8, 90), math.nan, device=device).t()
    args = (q, indptr_from_lengths([50, 40], device=device), cache, table.kv_indptr, table.kv_indices,
            table.kv_last_page_len)
    batch_prefill_paged(*args, out=out, lse=lse, backend="hopper")
    check_state(out, lse, *P.batch_prefill_paged_ref(*args), torch.bfloat16)


@hopper_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("value", [math.nan, math.inf])
@pytest.mark.parametrize("where", ["k", "v"])
def test_hopper_nonfinite_poisons_its_group(value, where):
    """A non-finite key or value poisons exactly the rows that see it (its group's), as in
    the float64 reference; the other group is untouched."""
    device = torch.device("cuda")
    q, args = _case(device, qo_lens=[40, 40], kv_lens=[300, 300], hkv=2, group=4, head_dim=128,
                    dtype=torch.bfloat16, page_size=16, seed=5)
    cache, kv_indices = args[2], args[4]
    cache[kv_indices[3].item(), 0 if where == "k" else 1, 7, 1, 5] = value  # group 0, token 55, kv head 1
    ref_o, ref_lse = P.batch_prefill_paged_ref(*args)
    out, lse = poisoned(q)
    batch_prefill_paged(*args, out=out, lse=lse, backend="hopper")
    bad = torch.isnan(ref_lse.to(device))
    assert bad.any() and torch.equal(torch.isnan(lse), bad)
    assert torch.isnan(out[bad]).all()
    o_tol, lse_tol, _ = TOL[torch.bfloat16]
    torch.testing.assert_close(out[~bad].double(), ref_o.to(device)[~bad], atol=o_tol, rtol=o_tol)
    torch.testing.assert_close(lse[~bad].double(), ref_lse.to(device)[~bad], atol=lse_tol, rtol=lse_tol)


@hopper_gpu
@pytest.mark.gpu
def test_hopper_cuda_graph_replays_new_inputs():
    device = torch.device("cuda")
    q, args = _case(device, qo_lens=[64, 30], kv_lens=[2000, 700], hkv=8, group=4, head_dim=128,
                    dtype=torch.bfloat16, page_size=16, seed=6)
    out, lse = poisoned(q)
    batch_prefill_paged(*args, out=out, lse=lse, validate=False, backend="hopper")  # compile and record
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        batch_prefill_paged(*args, out=out, lse=lse, validate=False, backend="hopper")
    q.copy_(torch.randn_like(q))
    args[2].copy_(torch.randn_like(args[2]))
    out.fill_(math.nan)
    graph.replay()
    torch.cuda.synchronize()
    check_state(out, lse, *P.batch_prefill_paged_ref(*args), torch.bfloat16)


@hopper_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("form", ["single", "tuple"])
@pytest.mark.parametrize("splits", [1, 3])
def test_hopper_eager_replay_repoints_descriptors(form, splits):
    """A second eager call of the same signature replays the first call's launches with
    every TMA descriptor re-encoded on the new tensors' addresses: new q, a new cache (K
    and V at new addresses, both cache forms), new outputs; the recording is kept."""
    device = torch.device("cuda")
    shape = dict(qo_lens=[64, 30], kv_lens=[2000, 700], hkv=8, group=4, head_dim=128, dtype=torch.bfloat16,
                 page_size=16, form=form)
    q, args = _case(device, seed=8, **shape)
    out, lse = poisoned(q)
    batch_prefill_paged(*args, out=out, lse=lse, validate=False, num_splits=splits, backend="hopper")  # records
    check_state(out, lse, *P.batch_prefill_paged_ref(*args), torch.bfloat16)
    recordings = [r for r in P._PAGED._items.values() if r.valid and any(ln.descriptors for ln in r.launches)]
    assert recordings, "the Hopper call's recording was not kept"
    q2, args2 = _case(device, seed=9, **shape)  # same signature, new tensors everywhere
    out2, lse2 = poisoned(q2)
    batch_prefill_paged(*args2, out=out2, lse=lse2, validate=False, num_splits=splits, backend="hopper")
    check_state(out2, lse2, *P.batch_prefill_paged_ref(*args2), torch.bfloat16)
    del q, args, out, lse  # the recorded call's tensors are freed: a replay reads nothing of them
    torch.cuda.empty_cache()
    for _ in range(2):  # outputs left to the launcher: recorded, then replayed
        o3, l3 = batch_prefill_paged(*args2, validate=False, num_splits=splits, backend="hopper")
        check_state(o3, l3, *P.batch_prefill_paged_ref(*args2), torch.bfloat16)


@hopper_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("form", ["single", "tuple"])
@pytest.mark.parametrize("splits", [1, 3])
def test_hopper_replays_through_the_direct_launcher_and_the_hot_path(monkeypatch, form, splits):
    """The Hopper kernel's replays go out through the direct launcher, its TMA descriptors
    encoded at each launch on the new addresses (checked against Triton's encoding when
    prepared), and then through the C++ hot path: bit for bit what Triton's launcher
    computes, on new tensors every call."""
    from cascadeinfer.kernels import launch as L

    device = torch.device("cuda")
    P._PAGED.clear()
    shape = dict(qo_lens=[64, 30], kv_lens=[2000, 700], hkv=8, group=4, head_dim=128, dtype=torch.bfloat16,
                 page_size=16, form=form)

    def call(seed):
        _, args = _case(device, seed=seed, **shape)
        return args, batch_prefill_paged(*args, validate=False, num_splits=splits, backend="hopper")

    for seed in range(3):  # records, replays (prepares the direct launches), replays and binds
        call(seed)
    rec = next(r for r in P._PAGED._items.values() if any(ln.descriptors for ln in r.launches))
    assert rec._direct and len(rec._direct) == len(rec.launches), "the Hopper launches were not prepared"
    assert L._hot_module().size(P._PAGED._hot) == 1
    args, (o, lse) = call(10)  # the hot path
    with monkeypatch.context() as m:  # Triton's launcher, on the same inputs
        m.setattr(P._PAGED, "hot", lambda *a: None)
        m.setattr(rec, "_direct", ())
        o_ref, lse_ref = batch_prefill_paged(*args, validate=False, num_splits=splits, backend="hopper")
    torch.testing.assert_close(o, o_ref, atol=0, rtol=0)
    torch.testing.assert_close(lse, lse_ref, atol=0, rtol=0)
    check_state(o, lse, *P.batch_prefill_paged_ref(*args), torch.bfloat16)
    monkeypatch.setattr(L.LaunchCache, "find", lambda *a, **k: pytest.fail("the call took the Python path"))
    for seed in (11, 12):
        args, (o, lse) = call(seed)
        check_state(o, lse, *P.batch_prefill_paged_ref(*args), torch.bfloat16)


@hopper_gpu
@pytest.mark.gpu
def test_hopper_is_the_default_for_a_large_group(monkeypatch):
    """backend=None runs the Hopper kernel on one group of 2^23 packed rows x keys (256
    queries x G 4 over 8192 keys), the portable kernel below it; both against float64."""
    device = torch.device("cuda")
    for qo_len, expect in ((256, True), (64, False)):
        q, args = _case(device, qo_lens=[qo_len], kv_lens=[8192], hkv=2, group=4, head_dim=128,
                        dtype=torch.bfloat16, page_size=16, seed=10)
        out, lse = poisoned(q)
        before = {id(r) for r in P._PAGED._items.values()}
        batch_prefill_paged(*args, out=out, lse=lse, validate=False)  # a new signature: recorded
        check_state(out, lse, *P.batch_prefill_paged_ref(*args), torch.bfloat16)
        new = [r for r in P._PAGED._items.values() if id(r) not in before]
        assert new, "the call was not recorded"
        assert any(ln.descriptors for r in new for ln in r.launches) == expect
    # The cascade's prefix level picks the same way, from the level's keys: (128, 32768,
    # 512)'s, 512 packed rows over 32K keys, runs on the Hopper kernel beside the decode level.
    plan, q, cache, ref = _two_levels(device, batch=128, prefix=32768, hkv=2, group=4, d=128, ps=16,
                                      dtype=torch.bfloat16, seed=12)
    casc = MultiLevelCascadeAttention(2, device=device)
    casc.plan(*plan, use_cascade=True)
    assert casc.backend is None and casc._levels[0].backend is None
    launched = []
    real = P.launch_prefill
    monkeypatch.setattr(P, "launch_prefill", lambda *a, **k: launched.append(k["backend"]) or real(*a, **k))
    check_state(*casc.run(q, cache, return_lse=True), *ref, torch.bfloat16)
    assert launched == ["hopper"]


def _two_levels(device, *, batch, prefix, hkv, group, d, ps, dtype, seed):
    """A shared prefix of ``prefix`` keys, then each request's own 1-299 keys: the cascade's
    plan arguments, q, the cache and the flat float64 reference."""
    gen = torch.Generator().manual_seed(seed)
    suffix = [int(x) for x in torch.randint(1, 300, (batch,), generator=gen)]
    pages_prefix = -(-prefix // ps)
    starts = [pages_prefix]
    for s in suffix:
        starts.append(starts[-1] + -(-s // ps))
    cache = torch.randn((starts[-1] + 2, 2, ps, hkv, d), generator=gen).to(dtype).to(device)
    q = torch.randn((batch, hkv * group, d), generator=gen).to(dtype).to(device)
    i32 = {"dtype": torch.int32, "device": device}
    last = torch.tensor([(s - 1) % ps + 1 for s in suffix], **i32)
    plan = ([torch.tensor([0, batch], **i32), torch.arange(batch + 1, **i32)],
            [torch.tensor([0, pages_prefix], **i32), torch.tensor(starts, **i32) - pages_prefix],
            [torch.arange(pages_prefix, **i32), torch.arange(pages_prefix, starts[-1], **i32)],
            [torch.tensor([(prefix - 1) % ps + 1], **i32), last],
            hkv * group, hkv, d, ps)
    flat_indptr = torch.tensor([0, *[pages_prefix * (i + 1) + starts[i + 1] - pages_prefix for i in range(batch)]],
                               **i32)
    flat_indices = torch.cat([torch.cat([torch.arange(pages_prefix, **i32),
                                         torch.arange(starts[i], starts[i + 1], **i32)]) for i in range(batch)])
    ref = P.batch_prefill_paged_ref(q, torch.arange(batch + 1, **i32), cache, flat_indptr, flat_indices, last)
    return plan, q, cache, ref


def test_cascade_backend_argument(device):
    """The cascade takes ``backend`` for its prefill levels: checked at construction,
    "portable" gives the default's answer, "hopper" raises where it cannot run."""
    with pytest.raises(ValueError, match="backend"):
        MultiLevelCascadeAttention(2, device=device, backend="fast")
    plan, q, cache, ref = _two_levels(device, batch=20, prefix=40, hkv=1, group=4, d=16, ps=8,
                                      dtype=torch.float32, seed=8)
    for backend in (None, "portable"):
        casc = MultiLevelCascadeAttention(2, device=device, backend=backend)
        casc.plan(*plan, use_cascade=True, dtype=torch.float32)
        check_state(*casc.run(q, cache, return_lse=True), *ref, torch.float32)
    if not HOPPER:
        casc = MultiLevelCascadeAttention(2, device=device, backend="hopper")
        casc.plan(*plan, use_cascade=True, dtype=torch.float32)
        with pytest.raises(ValueError, match="backend='hopper'"):
            casc.run(q, cache)


@hopper_gpu
@pytest.mark.gpu
def test_hopper_in_the_cascade():
    """A two-level cascade whose prefix level (64 queries x G 4 over 4096 keys) runs on the
    Hopper kernel, against the flat float64 reference."""
    device = torch.device("cuda")
    plan, q, cache, ref = _two_levels(device, batch=64, prefix=4096, hkv=8, group=4, d=128, ps=16,
                                      dtype=torch.bfloat16, seed=7)
    casc = MultiLevelCascadeAttention(2, device=device, backend="hopper")
    casc.plan(*plan, use_cascade=True)
    check_state(*casc.run(q, cache, return_lse=True), *ref, torch.bfloat16)


# ------------------------------------------------------------------ the compiled code (every machine)


def _hopper_ptx(head_dim: int, page_size: int, dtype: str) -> str:
    """The Hopper kernel compiled for sm_90 on this machine (no GPU needed), as the
    launcher would specialise it: divisible pointers and strides, its tiles and registers.
    Compiled in a child process: under the interpreter (this process) Gluon compiles nothing."""
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import test_prefill_hopper as t; "
            f"sys.stdout.write(t._compile_hopper_ptx({head_dim}, {page_size}, {dtype!r}))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def _compile_hopper_ptx(head_dim: int, page_size: int, dtype: str) -> str:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as ttgl
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type

    from cascadeinfer.kernels import prefill_kernel_hopper

    block_n, k_stages, v_stages = B.HOPPER_PREFILL_TILES[head_dim]
    torch_dtype, gluon_dtype = {"bf16": (torch.bfloat16, ttgl.bfloat16), "fp16": (torch.float16, ttgl.float16)}[dtype]
    pool = torch.empty(64 * page_size, 8 * head_dim, dtype=torch_dtype)
    box = ttgl.NVMMASharedLayout.get_default_for([page_size, head_dim], gluon_dtype)
    desc = mangle_type(TensorDescriptor(pool, list(pool.shape), [pool.shape[1], 1], [page_size, head_dim], box))
    kernel = prefill_kernel_hopper.prefill_kernel_hopper
    names = [p.name for p in kernel.params]
    constexprs = {"GROUP_SIZE": 4, "PAGE_SIZE": page_size, "HEAD_DIM": head_dim, "BLOCK_N": block_n,
                  "K_STAGES": k_stages, "V_STAGES": v_stages, "PRODUCER_REGS": B.HOPPER_PREFILL_REGS[0],
                  "CONSUMER_REGS": B.HOPPER_PREFILL_REGS[1]}
    signature = {}
    for n in names:
        if n in constexprs:
            signature[n] = "constexpr"
        elif n.endswith("_desc"):
            signature[n] = desc
        elif n in ("q_ptr", "k_ptr", "v_ptr", "o_ptr"):
            signature[n] = f"*{dtype}"
        elif n.endswith("_ptr"):
            signature[n] = "*fp32" if n == "lse_ptr" else "*i32"
        else:
            signature[n] = "fp32" if n == "qk_scale" else "i32"
    aligned = [n for n in names if n.endswith("_ptr") or (n.startswith("stride_") and n[-2] in "qko")]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    source = GluonASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]


@pytest.mark.parametrize("head_dim,page_size,dtype", [(128, 16, "bf16"), (64, 8, "fp16")])
def test_hopper_waits_for_committed_copies(head_dim, page_size, dtype):
    """Every ``cp.async.wait_group`` of the compiled kernel follows a ``commit_group`` of
    the copies before it: wait_group waits only for committed groups, so an uncommitted
    copy could still be landing when the producer's barrier tells the consumers it has
    (a race seen once on an H100 as wrong scores from a stale key row)."""
    pending = False
    waits = 0
    for line in _hopper_ptx(head_dim, page_size, dtype).splitlines():
        op = line.strip()
        if op.startswith(("cp.async.ca", "cp.async.cg")):
            pending = True
        elif op.startswith("cp.async.commit_group"):
            pending = False
        elif op.startswith("cp.async.wait_group"):
            waits += 1
            assert not pending, f"uncommitted cp.async copies before {op!r}"
    assert waits == 3  # Q (after tile 0's loads are issued, or with no tile), the split's partial last tile
