"""Prefill kernels (batch_prefill_paged, batch_prefill_ragged, shared_prefix_attention)
against the float64 reference, on fresh random inputs with NaN-poisoned outputs.

On the CPU the kernels run through the Triton interpreter: shapes stay tiny (few programs
× few key tiles), and small tile configs are forced where a case needs several M tiles,
several key tiles or KV splits. The same tests run unchanged on CUDA; tests marked
``gpu`` add realistic shapes (128 queries × 32K prefix, a 100K+ prefix past 2^31 cache
elements, CUDA-graph capture).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cascadeinfer.kernels import policy
from cascadeinfer.kernels import prefill as P
from cascadeinfer.kernels.prefill import (
    batch_prefill_paged,
    batch_prefill_ragged,
    shared_prefix_attention,
)
from cascadeinfer.kernels.reference import attention_state_ref, merge_state_ref
from cascadeinfer.layouts.indptr import indptr_from_lengths
from cascadeinfer.layouts.page_table import PageTable
from cascadeinfer.layouts.paged_cache import gather_paged_kv, unpack_paged_kv_cache

i32 = torch.int32
SMALL = policy.TileConfig(16, 16, 4, 1)  # many tiles from few tokens (GPU-valid: dot dims >= 16)
# (o atol/rtol, lse atol/rtol, o error norm / reference norm) per dtype: bf16/fp16 round
# p before the PV dot and o at the store; float32 dots use input_precision="ieee" on the
# GPU. The norm check keeps long prefixes honest, where o is small and atol alone is loose.
TOL = {torch.bfloat16: (2e-2, 2e-3, 1e-2), torch.float16: (3e-3, 2e-3, 2e-3), torch.float32: (2e-5, 2e-5, 1e-5)}


# ---------------------------------------------------------------------------- helpers


def _randn(shape, dtype, device, gen):
    return torch.randn(shape, generator=gen).to(dtype).to(device)


def make_paged(device, *, kv_lens, page_size, num_kv_heads, head_dim, dtype, layout="NHD", form="single",
               gen, spare_pages=3):
    """A random paged cache (``spare_pages`` owned by nobody) and a shuffled CSR page table."""
    need = [-(-n // page_size) for n in kv_lens]
    num_pages = sum(need) + spare_pages
    perm = torch.randperm(num_pages, generator=gen).tolist()
    lists, at = [], 0
    for k in need:
        lists.append(perm[at:at + k])
        at += k
    table = PageTable.from_page_lists(lists, kv_lens, page_size, num_pages=num_pages, device=device)
    inner = (page_size, num_kv_heads) if layout == "NHD" else (num_kv_heads, page_size)
    if form == "single":
        cache = _randn((num_pages, 2, *inner, head_dim), dtype, device, gen)
    else:
        cache = tuple(_randn((num_pages, *inner, head_dim), dtype, device, gen) for _ in range(2))
    return cache, table


def poisoned(q):
    return torch.full_like(q, math.nan), torch.full(q.shape[:2], math.nan, device=q.device)


def check_state(o, lse, ref_o, ref_lse, dtype):
    """Every element written, empty rows exactly (0, -inf), the rest within tolerance."""
    assert not torch.isnan(o).any(), "output has unwritten (NaN) elements"
    assert not torch.isnan(lse).any(), "lse has unwritten (NaN) elements"
    ref_o, ref_lse = ref_o.to(o.device), ref_lse.to(o.device)
    empty = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), empty), "rows that see no key must have lse = -inf, and only those"
    assert (lse[empty] < 0).all()
    assert (o[empty] == 0).all(), "rows that see no key must have o = 0"
    o_tol, lse_tol, norm_tol = TOL[dtype]
    torch.testing.assert_close(o.double(), ref_o, atol=o_tol, rtol=o_tol)
    if ref_o.norm() > 0:
        rel = ((o.double() - ref_o).norm() / ref_o.norm()).item()
        assert rel <= norm_tol, f"relative error norm {rel:.2e} > {norm_tol:.0e}"
    torch.testing.assert_close(lse.double()[~empty], ref_lse[~empty], atol=lse_tol, rtol=lse_tol)


def run_paged(device, *, qo_lens, kv_lens, num_kv_heads, group, head_dim, dtype, page_size, layout="NHD",
              form="single", causal=False, seed=0, num_splits=None, config=None, q_view=None):
    """Run batch_prefill_paged (or its split path when num_splits/config are forced) and check it."""
    gen = torch.Generator().manual_seed(seed)
    cache, table = make_paged(device, kv_lens=kv_lens, page_size=page_size, num_kv_heads=num_kv_heads,
                              head_dim=head_dim, dtype=dtype, layout=layout, form=form, gen=gen)
    qo_indptr = indptr_from_lengths(qo_lens, device=device)
    shape = (sum(qo_lens), num_kv_heads * group, head_dim)
    q = _randn(shape, dtype, device, gen) if q_view is None else q_view(shape, dtype, device, gen)
    out, lse = poisoned(q)
    args = (q, qo_indptr, cache, table.kv_indptr, table.kv_indices, table.kv_last_page_len)
    if num_splits is None and config is None:
        o, s = batch_prefill_paged(*args, causal=causal, kv_layout=layout, out=out, lse=lse)
        assert o is out and s is lse
    else:
        source = P.paged_source(unpack_paged_kv_cache(cache, layout), *args[3:])
        P.run_prefill(q, qo_indptr, source, out, lse, causal=causal, sm_scale=head_dim ** -0.5, num_splits=num_splits,
               config=config)
    ref = P.batch_prefill_paged_ref(*args, causal=causal, kv_layout=layout)
    check_state(out, lse, *ref, dtype)


# ------------------------------------------------------------------ batch_prefill_paged

# (qo_lens, kv_lens, Hkv, G, D, dtype, page_size, layout, form, causal)
PAGED_CASES = [
    # empty groups of every kind (no queries, no keys, neither), length-1 queries and keys
    ([3, 0, 1, 4, 0], [40, 17, 1, 0, 0], 2, 4, 64, torch.float16, 16, "NHD", "single", False),
    # last page exactly full, page_size 1, GQA 7, head_dim 96, HND, tuple form
    ([5, 2], [32, 16], 1, 7, 96, torch.bfloat16, 16, "HND", "tuple", False),
    ([6, 1], [13, 9], 2, 1, 64, torch.float32, 1, "NHD", "tuple", True),
    # causal, qo_len > kv_len: the first rows see nothing
    ([9, 3], [4, 70], 1, 8, 64, torch.float16, 16, "HND", "single", True),
    ([2, 7], [33, 7], 1, 16, 64, torch.bfloat16, 5, "NHD", "single", True),
    ([4], [130], 4, 4, 96, torch.float32, 16, "HND", "tuple", False),
]


@pytest.mark.parametrize("qo_lens,kv_lens,hkv,group,head_dim,dtype,page_size,layout,form,causal", PAGED_CASES)
def test_paged_matches_reference(device, qo_lens, kv_lens, hkv, group, head_dim, dtype, page_size, layout, form,
                                 causal):
    run_paged(device, qo_lens=qo_lens, kv_lens=kv_lens, num_kv_heads=hkv, group=group, head_dim=head_dim,
              dtype=dtype, page_size=page_size, layout=layout, form=form, causal=causal)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("causal", [False, True])
def test_paged_many_tiles_and_splits(device, layout, causal):
    """Small tiles: several M tiles per group (the sync-free tile map's binary search over
    11 groups, with empty groups between), several key tiles (unmasked + masked loops), 3
    KV splits, some of them empty for short groups."""
    run_paged(device, qo_lens=[7, 0, 1, 12, 0, 0, 3, 5, 0, 2, 9], kv_lens=[50, 3, 0, 64, 0, 20, 1, 16, 33, 0, 90],
              num_kv_heads=2, group=3, head_dim=64, dtype=torch.float16, page_size=16, layout=layout,
              causal=causal, num_splits=3, config=SMALL, seed=1)


@pytest.mark.parametrize("num_splits", [1, 2, 5])
def test_split_partials_merge_to_reference(device, num_splits):
    """The split kernel's partial states, merged by the float64 merge, equal the full state;
    an empty split (keys beyond the group) is exactly the identity (0, -inf)."""
    gen = torch.Generator().manual_seed(2)
    hkv, group, d, dtype = 2, 2, 64, torch.float16
    cache, table = make_paged(device, kv_lens=[70, 9], page_size=16, num_kv_heads=hkv, head_dim=d, dtype=dtype,
                              gen=gen)
    qo_indptr = indptr_from_lengths([5, 3], device=device)
    q = _randn((8, hkv * group, d), dtype, device, gen)
    source = P.paged_source(unpack_paged_kv_cache(cache, "NHD"), table.kv_indptr, table.kv_indices,
                             table.kv_last_page_len)
    part_o = torch.full((8, num_splits, hkv * group, d), math.nan, dtype=dtype, device=device)
    part_lse = torch.full((8, num_splits, hkv * group), math.nan, device=device)
    P.launch_prefill(q, qo_indptr, source, part_o, part_lse, causal=False, sm_scale=d ** -0.5, config=SMALL)
    assert not part_o.isnan().any() and not part_lse.isnan().any()
    o, s = part_o[:, 0].double(), part_lse[:, 0].double()
    for j in range(1, num_splits):
        o, s = merge_state_ref(o, s, part_o[:, j], part_lse[:, j])
    ref = P.batch_prefill_paged_ref(q, qo_indptr, cache, table.kv_indptr, table.kv_indices, table.kv_last_page_len)
    check_state(o.to(dtype), s.float(), *ref, dtype)
    if num_splits == 5:  # group 1 has 9 keys: one 16-key chunk, splits 1..4 are empty
        assert (part_lse[5:, 1:] == -math.inf).all() and (part_o[5:, 1:] == 0).all()


def test_paged_default_split_path(device):
    """Forcing the split count through the public path's merge (merge_states)."""
    run_paged(device, qo_lens=[6], kv_lens=[100], num_kv_heads=1, group=4, head_dim=64, dtype=torch.bfloat16,
              page_size=16, num_splits=4, seed=3)


def test_paged_strided_q_and_out(device):
    """q and out with non-contiguous token/head strides are honoured, never copied."""
    gen = torch.Generator().manual_seed(4)
    cache, table = make_paged(device, kv_lens=[20, 37], page_size=16, num_kv_heads=2, head_dim=64,
                              dtype=torch.float16, gen=gen)
    qo_indptr = indptr_from_lengths([3, 4], device=device)
    big = _randn((7, 3, 8, 64), torch.float16, device, gen)
    q = big[:, 1, ::2]  # [7, 4, 64]: token stride 3*8*64, head stride 128
    out_big = torch.full((7, 4, 2, 64), math.nan, dtype=torch.float16, device=device)
    out = out_big[:, :, 0]
    lse = torch.full((4, 7), math.nan, device=device).t()
    o, s = batch_prefill_paged(q, qo_indptr, cache, table.kv_indptr, table.kv_indices, table.kv_last_page_len,
                               out=out, lse=lse)
    assert o is out and s is lse
    assert out_big[:, :, 1].isnan().all(), "wrote outside the out view"
    ref = P.batch_prefill_paged_ref(q, qo_indptr, cache, table.kv_indptr, table.kv_indices,
                                    table.kv_last_page_len)
    check_state(out, lse, *ref, torch.float16)


@pytest.mark.parametrize("page_size,causal", [(3, False), (32, True), (1, False)])
def test_paged_full_tiles_any_page_size(device, page_size, causal):
    """Many unmasked key tiles per program (their page ids are fetched one tile ahead and
    carried in registers): a page size that does not divide the 16-key tile, one larger
    than it, and pages of one token; two KV splits."""
    run_paged(device, qo_lens=[3, 2], kv_lens=[150, 97], num_kv_heads=1, group=4, head_dim=64,
              dtype=torch.float16, page_size=page_size, causal=causal, num_splits=2, config=SMALL, seed=9)


ADDRESS_PATHS = [policy.AddressPath(o32, aligned) for o32 in (False, True) for aligned in (False, True)]


@pytest.mark.parametrize("page_size,layout,causal", [(4, "NHD", False), (16, "HND", True), (5, "NHD", False)])
def test_paged_address_paths_agree(device, page_size, layout, causal):
    """int64 vs int32 row offsets, with and without the hoisted page math (page sizes that
    divide the 16-key tile, and one that does not): the same loads, so bit-identical outputs,
    and the reference. Several unmasked tiles per program, two splits, two groups."""
    gen = torch.Generator().manual_seed(11)
    hkv, group, d, dtype = 2, 2, 64, torch.bfloat16
    cache, table = make_paged(device, kv_lens=[70, 53], page_size=page_size, num_kv_heads=hkv, head_dim=d,
                              dtype=dtype, layout=layout, gen=gen)
    qo_indptr = indptr_from_lengths([3, 2], device=device)
    q = _randn((5, hkv * group, d), dtype, device, gen)
    args = (q, qo_indptr, cache, table.kv_indptr, table.kv_indices, table.kv_last_page_len)
    source = P.paged_source(unpack_paged_kv_cache(cache, layout), *args[3:])
    safe = policy.exact_address_path(source, SMALL)
    assert safe == policy.AddressPath(offsets_32=True, aligned_pages=16 % page_size == 0)
    ref = P.batch_prefill_paged_ref(*args, causal=causal, kv_layout=layout)
    results = []
    for address in ADDRESS_PATHS:
        if address.aligned_pages and not safe.aligned_pages:
            continue
        out, lse = poisoned(q)
        P.run_prefill(q, qo_indptr, source, out, lse, causal=causal, sm_scale=d ** -0.5, num_splits=2, config=SMALL,
               address=address)
        check_state(out, lse, *ref, dtype)
        results.append((address, out, lse))
    for address, out, lse in results[1:]:
        assert torch.equal(out, results[0][1]) and torch.equal(lse, results[0][2]), f"{address} differs from int64"


def test_ragged_address_paths_agree(device):
    """The contiguous path's int32 offsets (counted from each group's first key) against int64."""
    gen = torch.Generator().manual_seed(12)
    fused = _randn((90, 3, 3, 64), torch.float16, device, gen)
    k, v = fused[:, 0, 1:], fused[:, 2, :2]  # different strides for k and v
    q = _randn((5, 4, 64), torch.float16, device, gen)
    qo_indptr = indptr_from_lengths([3, 2], device=device)
    kv_indptr = indptr_from_lengths([37, 53], device=device)
    source = P.ragged_source(q, k, v, kv_indptr)
    assert policy.exact_address_path(source, SMALL) == policy.AddressPath(offsets_32=True, aligned_pages=False)
    ref = P.batch_prefill_ragged_ref(q, qo_indptr, k, v, kv_indptr)
    outs = []
    for address in (policy.AddressPath(False, False), policy.AddressPath(True, False)):
        out, lse = poisoned(q)
        P.run_prefill(q, qo_indptr, source, out, lse, causal=False, sm_scale=0.125, num_splits=2, config=SMALL,
               address=address)
        check_state(out, lse, *ref, torch.float16)
        outs.append((out, lse))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def _meta_paged_source(num_pages, page_size=16, hkv=8, d=128, layout="NHD"):
    """A paged source over a pool on the meta device: real shapes and strides, no memory."""
    inner = (page_size, hkv) if layout == "NHD" else (hkv, page_size)
    cache = torch.empty((num_pages, 2, *inner, d), dtype=torch.bfloat16, device="meta")
    idx = torch.empty(1, dtype=i32, device="meta")
    return P.paged_source(unpack_paged_kv_cache(cache, layout), idx, idx, idx), cache


def test_exact_address_path_int32_bound():
    """int32 offsets exactly while the largest element offset of the K and V views is below
    2**31; a pool past it (the GPU test's 100K prefix at page 70000) keeps int64."""
    big = policy.TileConfig(128, 128, 8, 3)
    # NHD pool [P, 2, 16, 8, 128]: the K and V views' largest offset (each from its own
    # first element) is (P - 1) * 32768 + 16383.
    per_page = 2 * 16 * 8 * 128
    fits = (2**31 - 1 - 16383) // per_page + 1  # the most pages with every offset < 2**31
    for num_pages, expect in ((fits, True), (fits + 1, False), (76_251, False)):
        assert ((num_pages - 1) * per_page + 16383 < 2**31) == expect
        source, _ = _meta_paged_source(num_pages)
        assert policy.exact_address_path(source, big) == policy.AddressPath(offsets_32=expect, aligned_pages=True)
    source, _ = _meta_paged_source(1000, page_size=256, layout="HND")  # 128-key tiles inside a page
    assert policy.exact_address_path(source, big) == policy.AddressPath(offsets_32=True, aligned_pages=False)
    # Ragged [nnz_kv, 1, 128] contiguous: largest offset (nnz_kv - 1) * 128 + 127.
    q = torch.empty((1, 4, 128), dtype=torch.bfloat16, device="meta")
    for nnz_kv, expect in ((2**24, True), (2**24 + 1, False)):
        k = torch.empty((nnz_kv, 1, 128), dtype=torch.bfloat16, device="meta")
        v = torch.empty((1, 1, 128), dtype=torch.bfloat16, device="meta").expand(nnz_kv, 1, 128)  # stride 0
        assert policy.exact_address_path(P.ragged_source(q, k, v, None), big).offsets_32 == expect
        assert policy.exact_address_path(P.ragged_source(q, v, k, None), big).offsets_32 == expect  # V alone


def test_default_address_path_per_tile():
    """The measured choice: 128-row tiles hoist the page math (int32 only where pages do
    not align), 64-row tiles take both switches, 16-32-row tiles neither; never more
    than is exact."""
    source, _ = _meta_paged_source(1000)
    tiles = {m: policy.TileConfig(m, 64, 4, 3) for m in (16, 32, 64)} | {128: policy.TileConfig(128, 128, 8, 3)}
    assert policy.default_address_path(source, tiles[128]) == policy.AddressPath(offsets_32=False, aligned_pages=True)
    assert policy.default_address_path(source, tiles[64]) == policy.AddressPath(offsets_32=True, aligned_pages=True)
    assert policy.default_address_path(source, tiles[16]) == policy.default_address_path(source, tiles[32]) == \
        policy.AddressPath(offsets_32=False, aligned_pages=False)
    unaligned, _ = _meta_paged_source(1000, page_size=256)
    assert policy.default_address_path(unaligned, tiles[128]) == policy.AddressPath(offsets_32=True, aligned_pages=False)
    big, _ = _meta_paged_source(76_251, page_size=256)
    for config in tiles.values():
        path, exact = policy.default_address_path(big, config), policy.exact_address_path(big, config)
        assert not path.offsets_32 and (exact.aligned_pages or not path.aligned_pages)


def test_forced_int32_past_2_31_is_refused():
    """A forced int32 path is checked against the same bound before any launch."""
    source, _ = _meta_paged_source(76_251)
    q = torch.empty((4, 32, 128), dtype=torch.bfloat16, device="meta")
    out = torch.empty((4, 1, 32, 128), dtype=torch.bfloat16, device="meta")
    lse = torch.empty((4, 1, 32), dtype=torch.float32, device="meta")
    qo = torch.empty(2, dtype=i32, device="meta")
    with pytest.raises(ValueError, match="address"):
        P.launch_prefill(q, qo, source, out, lse, causal=False, sm_scale=0.1, config=policy.TileConfig(128, 128, 8, 3),
                  address=policy.AddressPath(offsets_32=True, aligned_pages=True))
    small_pages, _ = _meta_paged_source(8, page_size=5)
    with pytest.raises(ValueError, match="address"):
        P.launch_prefill(q, qo, small_pages, out, lse, causal=False, sm_scale=0.1, config=SMALL,
                  address=policy.AddressPath(offsets_32=False, aligned_pages=True))


def test_running_max_grows_every_tile(device):
    """Keys whose scores grow along the sequence: the running max moves at every key tile
    (every rescale of acc and l is exercised), across splits, with large logits."""
    gen = torch.Generator().manual_seed(10)
    hkv, group, d, dtype = 1, 4, 64, torch.bfloat16
    cache, table = make_paged(device, kv_lens=[130], page_size=16, num_kv_heads=hkv, head_dim=d, dtype=dtype,
                              gen=gen)
    growth = torch.linspace(0.2, 4.0, cache.shape[0] * 16).reshape(cache.shape[0], 16, 1, 1)
    order = table.kv_indices.cpu().long()  # scale the pages in the order the row reads them
    scale = torch.ones(cache.shape[0], 16, 1, 1)
    scale[order] = growth[: order.numel()]
    cache[:, 0] = (cache[:, 0].float().cpu() * scale).to(dtype).to(device)
    q = _randn((3, hkv * group, d), dtype, device, gen) * 3
    qo_indptr = indptr_from_lengths([3], device=device)
    args = (q, qo_indptr, cache, table.kv_indptr, table.kv_indices, table.kv_last_page_len)
    ref = P.batch_prefill_paged_ref(*args)
    assert ref[1].max() > 15, "the test wants large logits"
    source = P.paged_source(unpack_paged_kv_cache(cache, "NHD"), *args[3:])
    for splits in (1, 3):
        out, lse = poisoned(q)
        P.run_prefill(q, qo_indptr, source, out, lse, causal=False, sm_scale=d ** -0.5, num_splits=splits, config=SMALL)
        check_state(out, lse, *ref, dtype)


def test_default_tile_config_follows_rows_per_group():
    """Few rows per group get small tiles (no 128-row padding); long groups the tuned 128x128."""
    bf16 = torch.bfloat16
    assert policy.default_tile_config(128, bf16) == policy.TileConfig(128, 128, 8, 3)
    assert policy.default_tile_config(128, bf16, 4).block_m == 16
    assert policy.default_tile_config(128, bf16, 32).block_m == 32
    assert policy.default_tile_config(96, torch.float16, 60).block_m == 64
    assert policy.default_tile_config(64, bf16, 65).block_m == 128
    assert policy.default_tile_config(256, bf16, 8) == policy.TileConfig(16, 32, 4, 3)
    assert policy.default_tile_config(256, bf16, 500) == policy.TileConfig(128, 32, 8, 3)
    assert policy.default_tile_config(128, torch.float32, 4).block_m == 32  # float32 keeps its FMA tiles


@settings(max_examples=25, deadline=None)
@given(
    qo_lens=st.lists(st.integers(0, 9), min_size=1, max_size=4),
    kv_extra=st.lists(st.integers(0, 40), min_size=4, max_size=4),
    page_size=st.sampled_from([1, 3, 16]),
    hkv=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 4, 7, 8, 16]),
    head_dim=st.sampled_from([64, 96]),
    dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32]),
    layout=st.sampled_from(["NHD", "HND"]),
    form=st.sampled_from(["single", "tuple"]),
    causal=st.booleans(),
    small=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_paged_random(qo_lens, kv_extra, page_size, hkv, group, head_dim, dtype, layout, form, causal, small, seed):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    kv_lens = [q + e if causal else e for q, e in zip(qo_lens, kv_extra)]  # causal: mostly kv >= qo
    run_paged(device, qo_lens=qo_lens, kv_lens=kv_lens, num_kv_heads=hkv, group=group, head_dim=head_dim,
              dtype=dtype, page_size=page_size, layout=layout, form=form, causal=causal, seed=seed,
              num_splits=2 if small else None, config=SMALL if small else None)


@settings(max_examples=10, deadline=None)
@given(
    prefix=st.integers(0, 60),
    suffixes=st.lists(st.integers(1, 20), min_size=1, max_size=3),
    queries=st.lists(st.integers(1, 3), min_size=3, max_size=3),
    page_size=st.sampled_from([1, 16]),
    seed=st.integers(0, 2**31 - 1),
)
def test_cascade_property(prefix, suffixes, queries, page_size, seed):
    """Prefix level (one group of all queries, non-causal) merged with the suffix level (one
    group per request, causal) equals causal attention over prefix + suffix pages."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator().manual_seed(seed)
    hkv, group, d, dtype = 2, 4, 64, torch.float32
    qo_lens = [min(n, s) for n, s in zip(queries, suffixes)]  # suffix holds the query tokens
    prefix_pages = -(-prefix // page_size)
    suffix_pages = [-(-s // page_size) for s in suffixes]
    num_pages = prefix_pages + sum(suffix_pages) + 2
    perm = torch.randperm(num_pages, generator=gen).tolist()
    pre_list, at, suf_lists = perm[:prefix_pages], prefix_pages, []
    for k in suffix_pages:
        suf_lists.append(perm[at:at + k])
        at += k
    # A prefix that fills whole pages, so prefix + suffix pages form one CSR row.
    prefix_len = prefix_pages * page_size
    cache = _randn((num_pages, 2, page_size, hkv, d), dtype, device, gen)
    q = _randn((sum(qo_lens), hkv * group, d), dtype, device, gen)
    qo_indptr = indptr_from_lengths(qo_lens, device=device)
    pre = PageTable.from_page_lists([pre_list], [prefix_len], page_size, device=device)
    suf = PageTable.from_page_lists(suf_lists, suffixes, page_size, device=device)
    full = PageTable.from_page_lists([pre_list + s for s in suf_lists], [prefix_len + s for s in suffixes],
                                     page_size, device=device)
    all_q = indptr_from_lengths([sum(qo_lens)], device=device)
    o1, s1 = batch_prefill_paged(q, all_q, cache, pre.kv_indptr, pre.kv_indices, pre.kv_last_page_len)
    o2, s2 = batch_prefill_paged(q, qo_indptr, cache, suf.kv_indptr, suf.kv_indices, suf.kv_last_page_len,
                                 causal=True)
    o, s = merge_state_ref(o1, s1, o2, s2)
    ref = P.batch_prefill_paged_ref(q, qo_indptr, cache, full.kv_indptr, full.kv_indices, full.kv_last_page_len,
                                    causal=True)
    check_state(o.to(dtype), s.float(), *ref, dtype)


# ----------------------------------------------------------------- batch_prefill_ragged


def run_ragged(device, *, qo_lens, kv_lens, hkv, group, head_dim, dtype, causal, seed=0, strided_kv=False):
    gen = torch.Generator().manual_seed(seed)
    nnz_kv = sum(kv_lens)
    if strided_kv:  # k and v as views of one fused [nnz_kv, 2, Hkv + 1, D] tensor: different strides
        fused = _randn((nnz_kv, 3, hkv + 1, head_dim), dtype, device, gen)
        k, v = fused[:, 0, 1:], fused[:, 2, :hkv]
    else:
        k = _randn((nnz_kv, hkv, head_dim), dtype, device, gen)
        v = _randn((nnz_kv, hkv, head_dim), dtype, device, gen)
    q = _randn((sum(qo_lens), hkv * group, head_dim), dtype, device, gen)
    qo_indptr = indptr_from_lengths(qo_lens, device=device)
    kv_indptr = indptr_from_lengths(kv_lens, device=device)
    out, lse = poisoned(q)
    o, s = batch_prefill_ragged(q, qo_indptr, k, v, kv_indptr, causal=causal, out=out, lse=lse)
    assert o is out and s is lse
    ref = P.batch_prefill_ragged_ref(q, qo_indptr, k, v, kv_indptr, causal=causal)
    check_state(out, lse, *ref, dtype)


@pytest.mark.parametrize("qo_lens,kv_lens,hkv,group,head_dim,dtype,causal,strided", [
    ([4, 0, 1, 3], [4, 5, 0, 70], 2, 4, 64, torch.float16, True, False),
    ([6, 2], [3, 20], 1, 7, 96, torch.bfloat16, True, True),
    ([1, 5], [1, 66], 3, 1, 64, torch.float32, False, True),
])
def test_ragged_matches_reference(device, qo_lens, kv_lens, hkv, group, head_dim, dtype, causal, strided):
    run_ragged(device, qo_lens=qo_lens, kv_lens=kv_lens, hkv=hkv, group=group, head_dim=head_dim, dtype=dtype,
               causal=causal, strided_kv=strided)


@settings(max_examples=10, deadline=None)
@given(
    qo_lens=st.lists(st.integers(0, 8), min_size=1, max_size=3),
    kv_lens=st.lists(st.integers(0, 40), min_size=3, max_size=3),
    group=st.sampled_from([1, 4, 7]),
    dtype=st.sampled_from([torch.float16, torch.bfloat16]),
    causal=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_ragged_random(qo_lens, kv_lens, group, dtype, causal, seed):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    run_ragged(device, qo_lens=qo_lens, kv_lens=kv_lens[:len(qo_lens)], hkv=2, group=group, head_dim=64,
               dtype=dtype, causal=causal, seed=seed, strided_kv=seed % 2 == 1)


# -------------------------------------------------------------- shared_prefix_attention


@pytest.mark.parametrize("n,length,hkv,group,head_dim,dtype", [
    (5, 70, 2, 4, 64, torch.float16),
    (1, 1, 1, 16, 96, torch.bfloat16),
    (3, 0, 2, 2, 64, torch.float16),  # empty prefix: (0, -inf) everywhere
    (9, 33, 1, 7, 64, torch.float32),
])
def test_shared_prefix_matches_reference(device, n, length, hkv, group, head_dim, dtype):
    gen = torch.Generator().manual_seed(5)
    q = _randn((n, 2, hkv * group, head_dim), dtype, device, gen)[:, 1]  # strided q
    kv = _randn((length, 2, hkv, head_dim), dtype, device, gen)
    k, v = kv[:, 0], kv[:, 1]  # strided prefix views
    out, lse = poisoned(q)
    o, s = shared_prefix_attention(q, k, v, out=out, lse=lse)
    assert o is out and s is lse
    check_state(out, lse, *attention_state_ref(q, k, v), dtype)
    o2, s2 = shared_prefix_attention(q, k, v, sm_scale=0.3)
    check_state(o2, s2, *attention_state_ref(q, k, v, sm_scale=0.3), dtype)


def test_shared_prefix_split(device):
    """Forced KV splits on the indptr-free path (one group, no index tensors at all)."""
    gen = torch.Generator().manual_seed(6)
    q = _randn((6, 4, 64), torch.float16, device, gen)
    k = _randn((90, 2, 64), torch.float16, device, gen)
    v = _randn((90, 2, 64), torch.float16, device, gen)
    out, lse = poisoned(q)
    source = P.ragged_source(q, k, v, None)
    P.run_prefill(q, None, source, out, lse, causal=False, sm_scale=0.125, num_splits=3, config=SMALL)
    check_state(out, lse, *attention_state_ref(q, k, v), torch.float16)


def test_plain_torch_path(device, monkeypatch):
    """Without Triton (plain CPU tensors, no interpreter) the same results come from PyTorch."""
    monkeypatch.setattr(P, "use_triton", lambda dev: False)
    run_paged(device, qo_lens=[3, 2], kv_lens=[5, 0], num_kv_heads=1, group=2, head_dim=64, dtype=torch.float16,
              page_size=4, causal=True)
    run_ragged(device, qo_lens=[2, 3], kv_lens=[4, 1], hkv=1, group=2, head_dim=64, dtype=torch.bfloat16,
               causal=True)
    gen = torch.Generator().manual_seed(7)
    q, k, v = (_randn(s, torch.float32, device, gen) for s in [(3, 2, 64), (5, 1, 64), (5, 1, 64)])
    check_state(*shared_prefix_attention(q, k, v), *attention_state_ref(q, k, v), torch.float32)


# ------------------------------------------------------------------------- bad inputs


def _paged_args(device):
    gen = torch.Generator().manual_seed(8)
    cache, table = make_paged(device, kv_lens=[5, 20], page_size=16, num_kv_heads=2, head_dim=64,
                              dtype=torch.float16, gen=gen)
    q = _randn((4, 4, 64), torch.float16, device, gen)
    return dict(q=q, qo_indptr=indptr_from_lengths([1, 3], device=device), paged_kv_cache=cache,
                kv_indptr=table.kv_indptr, kv_indices=table.kv_indices, kv_last_page_len=table.kv_last_page_len)


def _set(**changes):
    return lambda a: {**a, **{k: (f(a) if callable(f) else f) for k, f in changes.items()}}


BAD_PAGED = [
    (_set(q=lambda a: a["q"].float()), TypeError, "paged_kv_cache"),
    (_set(q=lambda a: a["q"].to(torch.int32)), TypeError, "q"),
    (_set(q=lambda a: a["q"][:, :3]), ValueError, "q"),  # 3 heads, 2 kv heads
    (_set(q=lambda a: a["q"][..., :32]), ValueError, "paged_kv_cache"),  # head_dim mismatch
    (_set(q=lambda a: a["q"].transpose(1, 2).contiguous().transpose(1, 2)), ValueError, "q"),
    (_set(q=lambda a: a["q"][0]), ValueError, "q"),
    (_set(qo_indptr=lambda a: a["qo_indptr"].long()), TypeError, "qo_indptr"),
    (_set(qo_indptr=lambda a: a["qo_indptr"] * 2), ValueError, "qo_indptr"),  # does not end at nnz_qo
    (_set(qo_indptr=lambda a: a["qo_indptr"].flip(0)), ValueError, "qo_indptr"),
    (_set(kv_indptr=lambda a: a["kv_indptr"][:2]), ValueError, "kv_indptr"),
    (_set(kv_indptr=lambda a: a["kv_indptr"].flip(0)), ValueError, "kv_indptr"),
    (_set(kv_indices=lambda a: a["kv_indices"] + 100), ValueError, "kv_indices"),
    (_set(kv_indices=lambda a: a["kv_indices"].long()), TypeError, "kv_indices"),
    (_set(kv_last_page_len=lambda a: a["kv_last_page_len"] * 0), ValueError, "kv_last_page_len"),
    (_set(kv_last_page_len=lambda a: a["kv_last_page_len"][:1]), ValueError, "kv_last_page_len"),
    (_set(paged_kv_cache=lambda a: a["paged_kv_cache"][:, :1]), ValueError, "paged_kv_cache"),
    (_set(paged_kv_cache="nope"), TypeError, "paged_kv_cache"),
]


@pytest.mark.parametrize("change,error,name", BAD_PAGED)
def test_paged_bad_inputs(device, change, error, name):
    args = change(_paged_args(device))
    with pytest.raises(error, match=rf"^{name}\b"):
        batch_prefill_paged(**args)


@pytest.mark.parametrize("make_kw,error,name", [
    (lambda dev: dict(kv_layout="NDH"), ValueError, "kv_layout"),
    (lambda dev: dict(causal=1), TypeError, "causal"),
    (lambda dev: dict(sm_scale=-1.0), ValueError, "sm_scale"),
    (lambda dev: dict(out=torch.empty(4, 4, 32, dtype=torch.float16, device=dev)), ValueError, "out"),
    (lambda dev: dict(out=torch.empty(4, 4, 64, dtype=torch.float32, device=dev)), TypeError, "out"),
    (lambda dev: dict(lse=torch.empty(4, 4, dtype=torch.float64, device=dev)), TypeError, "lse"),
    (lambda dev: dict(lse=torch.empty(4, 2, device=dev)), ValueError, "lse"),
    (lambda dev: dict(num_splits=0), ValueError, "num_splits"),
    (lambda dev: dict(num_splits=2.0), ValueError, "num_splits"),
])
def test_paged_bad_options(device, make_kw, error, name):
    with pytest.raises(error, match=rf"^{name}\b"):
        batch_prefill_paged(**_paged_args(device), **make_kw(device))


def test_ragged_and_prefix_bad_inputs(device):
    q = torch.randn(4, 4, 64, device=device, dtype=torch.float16)
    k = torch.randn(10, 2, 64, device=device, dtype=torch.float16)
    qo, kvp = indptr_from_lengths([1, 3], device=device), indptr_from_lengths([4, 6], device=device)
    with pytest.raises(ValueError, match="^v"):
        batch_prefill_ragged(q, qo, k, k[:5], kvp)
    with pytest.raises(TypeError, match="^k"):
        batch_prefill_ragged(q, qo, k.float(), k.float(), kvp)
    with pytest.raises(ValueError, match="^kv_indptr"):
        batch_prefill_ragged(q, qo, k, k, indptr_from_lengths([4, 7], device=device))
    with pytest.raises(ValueError, match="^kv_indptr"):
        batch_prefill_ragged(q, qo, k, k, kvp[:2])
    with pytest.raises(ValueError, match="^qo_indptr"):
        batch_prefill_ragged(q, indptr_from_lengths([1, 2], device=device), k, k, kvp)
    with pytest.raises(ValueError, match="^q"):
        shared_prefix_attention(q.new_empty(4, 4, 512), k, k)
    with pytest.raises(ValueError, match="^k"):
        shared_prefix_attention(q, k.transpose(1, 2).contiguous().transpose(1, 2), k)
    with pytest.raises(ValueError, match="^lse"):
        shared_prefix_attention(q, k, k, lse=torch.empty(4, 3, device=device))


@pytest.mark.parametrize("num_groups", [0, 2])
def test_empty_batch(device, num_groups):
    """No queries at all (no groups, or only empty ones): empty outputs, nothing launched."""
    args = _paged_args(device)
    q = args["q"][:0]
    qo = torch.zeros(num_groups + 1, dtype=i32, device=device)
    table = PageTable.from_page_lists([[0]] * num_groups, [3] * num_groups, 16, device=device)
    o, s = batch_prefill_paged(q, qo, args["paged_kv_cache"], table.kv_indptr, table.kv_indices,
                               table.kv_last_page_len)
    assert o.shape == (0, 4, 64) and s.shape == (0, 4)
    k = torch.randn(5, 2, 64, dtype=q.dtype, device=device)
    o, s = batch_prefill_ragged(q, qo, k, k, torch.zeros(num_groups + 1, dtype=i32, device=device), causal=True)
    assert o.shape == (0, 4, 64) and s.shape == (0, 4)


def test_validate_false_skips_content_checks(device):
    """validate=False reads nothing on the host: bad contents are the caller's promise."""
    args = _paged_args(device)
    qo = args["qo_indptr"].clone()
    qo[-1] = 3  # one query too few: would raise with validate=True
    o, _ = batch_prefill_paged(**{**args, "qo_indptr": qo}, validate=False)
    assert o.shape == args["q"].shape


# ------------------------------------------------------------------ GPU: real shapes


def _prefix_case(length, n, *, page_size=16, hq=32, hkv=8, d=128, dtype=torch.bfloat16, seed=0, high_pages=0):
    """One group of ``n`` single-token queries over a ``length``-token shared prefix,
    placed at pages ``high_pages ..`` of the pool (to push offsets past 2^31 elements)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    pages = -(-length // page_size)
    num_pages = high_pages + pages
    cache = torch.empty((num_pages, 2, page_size, hkv, d), dtype=dtype, device="cuda")
    cache[high_pages:].normal_(generator=gen)
    idx = high_pages + torch.randperm(pages, device="cuda", generator=gen).to(i32)
    table = PageTable(torch.tensor([0, pages], dtype=i32, device="cuda"), idx,
                      torch.tensor([length - (pages - 1) * page_size], dtype=i32, device="cuda"), page_size)
    q = torch.randn((n, hq, d), dtype=dtype, device="cuda", generator=gen)
    qo_indptr = torch.tensor([0, n], dtype=i32, device="cuda")
    return q, qo_indptr, cache, table


@pytest.mark.gpu
@pytest.mark.parametrize("length,n,high_pages", [(32768, 128, 0), (100_003, 64, 70_000)])
def test_gpu_shared_prefix_realistic(length, n, high_pages):
    """bf16, Hq=32, Hkv=8, D=128: 128 queries × 32K prefix; and a 100K-token prefix whose
    pages sit past 2^31 cache elements (int64 page offsets)."""
    q, qo_indptr, cache, t = _prefix_case(length, n, high_pages=high_pages)
    if high_pages:
        assert t.kv_indices.min().item() * cache.stride(0) > 2**31
    source = P.paged_source(unpack_paged_kv_cache(cache, "NHD"), t.kv_indptr, t.kv_indices, t.kv_last_page_len)
    config = policy.groups_tile_config(n, 1, 4, 128, torch.bfloat16)
    assert policy.exact_address_path(source, config).offsets_32 == (not high_pages), "int64 offsets past 2^31"
    out, lse = poisoned(q)
    batch_prefill_paged(q, qo_indptr, cache, t.kv_indptr, t.kv_indices, t.kv_last_page_len, out=out, lse=lse)
    kv = unpack_paged_kv_cache(cache, "NHD")
    k, v = gather_paged_kv(kv, t.kv_indptr, t.kv_indices, t.kv_last_page_len, 0)
    ref = attention_state_ref(q, k, v)
    check_state(out, lse, *ref, torch.bfloat16)
    # The contiguous-prefix entry point on the same keys.
    check_state(*shared_prefix_attention(q, k, v), *ref, torch.bfloat16)


@pytest.mark.gpu
def test_gpu_address_paths_agree():
    """128 queries over a 8229-token prefix (a partial last tile), the default 128x128 tiles
    and splits: int64 and int32 row offsets, with and without the hoisted page math, give
    bit-identical outputs, within tolerance of the float64 reference."""
    q, qo_indptr, cache, t = _prefix_case(8229, 128, seed=2)
    source = P.paged_source(unpack_paged_kv_cache(cache, "NHD"), t.kv_indptr, t.kv_indices, t.kv_last_page_len)
    kv = unpack_paged_kv_cache(cache, "NHD")
    ref = attention_state_ref(q, *gather_paged_kv(kv, t.kv_indptr, t.kv_indices, t.kv_last_page_len, 0))
    first = None
    for address in ADDRESS_PATHS:
        out, lse = poisoned(q)
        P.run_prefill(q, qo_indptr, source, out, lse, causal=False, sm_scale=128 ** -0.5, address=address)
        check_state(out, lse, *ref, torch.bfloat16)
        if first is None:
            first = (out, lse)
        assert torch.equal(out, first[0]) and torch.equal(lse, first[1]), f"{address} differs from int64"


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim,dtype", [(128, torch.float16), (256, torch.bfloat16), (128, torch.float32),
                                            (256, torch.float32)])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_head_dims(head_dim, dtype, causal):
    run_paged(torch.device("cuda"), qo_lens=[40, 0, 130, 7], kv_lens=[600, 50, 1000, 3], num_kv_heads=2, group=4,
              head_dim=head_dim, dtype=dtype, page_size=16, causal=causal)
    run_ragged(torch.device("cuda"), qo_lens=[40, 0, 130], kv_lens=[600, 50, 100], hkv=2, group=7,
               head_dim=head_dim, dtype=dtype, causal=causal, strided_kv=True)


@pytest.mark.gpu
@pytest.mark.parametrize("queries,head_dim", [(1, 128), (8, 128), (16, 128), (2, 256)])
def test_gpu_small_groups(queries, head_dim):
    """Cascade middle levels and decode-like groups (few rows per group: 16-64-row tiles),
    ragged KV lengths, bf16, Hq=32 Hkv=8."""
    lens = [300 + 97 * i for i in range(24)]
    run_paged(torch.device("cuda"), qo_lens=[queries] * 24, kv_lens=lens, num_kv_heads=8, group=4,
              head_dim=head_dim, dtype=torch.bfloat16, page_size=16)


@pytest.mark.gpu
def test_gpu_cuda_graph_capture():
    """The launch (tile map, split count, merge) reads nothing on the host: it captures, and
    replays correctly on new data written into the same buffers."""
    q, qo_indptr, cache, t = _prefix_case(8192, 128, seed=1)
    out, lse = poisoned(q)
    args = (q, qo_indptr, cache, t.kv_indptr, t.kv_indices, t.kv_last_page_len)
    batch_prefill_paged(*args, out=out, lse=lse)  # compile outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        batch_prefill_paged(*args, out=out, lse=lse)  # validate=True is skipped while capturing
    q.copy_(torch.randn_like(q))
    out.fill_(math.nan)
    lse.fill_(math.nan)
    graph.replay()
    torch.cuda.synchronize()
    check_state(out, lse, *P.batch_prefill_paged_ref(*args), torch.bfloat16)
