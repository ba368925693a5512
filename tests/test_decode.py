"""batch_decode_paged against the float64 reference on each request's gathered pages."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cascadeinfer.kernels import decode as decode_mod
from cascadeinfer.kernels import policy
from cascadeinfer.kernels.decode import batch_decode_paged, batch_decode_paged_ref
from cascadeinfer.kernels.policy import (
    CONCURRENT_MAX_KEYS,
    DECODE_VARIANTS,
    MAX_SPLITS,
    DecodeConfig,
    decode_num_splits,
    pick_decode_config,
)
from cascadeinfer.kernels.reference import attention_state_ref
from cascadeinfer.layouts.indptr import indptr_from_lengths
from cascadeinfer.layouts.paged_cache import gather_paged_kv, unpack_paged_kv_cache

# (atol, rtol) on o; fp32 products are exact fp32 (input_precision="ieee"), 16-bit ones
# round the probabilities to the input dtype before p @ v.
O_TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.5e-2, 1.5e-2)}
LSE_TOL = 1e-4  # the LSE is accumulated in fp32 from exact products: ~1e-6 seen


def make_case(device, *, lens, page_size=16, hq=4, hkv=1, head_dim=64, dtype=torch.float16,
              layout="NHD", form="tensor", spare_pages=3, spare_indices=0, indptr_offset=0, seed=0):
    """A random pool with the requests' pages randomly permuted in it, plus the CSR table
    (``indptr_offset``: kv_indptr[0], with that many unrelated page ids before the rows')."""
    g = torch.Generator().manual_seed(seed)
    npages = [(n + page_size - 1) // page_size for n in lens]
    pool = sum(npages) + spare_pages
    inner = (page_size, hkv, head_dim) if layout == "NHD" else (hkv, page_size, head_dim)
    if form == "tensor":
        cache = torch.randn((pool, 2, *inner), generator=g).to(device, dtype)
    else:
        cache = tuple(torch.randn((pool, *inner), generator=g).to(device, dtype) for _ in range(2))
    indices = torch.randperm(pool, generator=g)[: sum(npages)]
    indices = torch.cat([torch.randint(0, pool, (indptr_offset,), generator=g), indices,
                         torch.randint(0, pool, (spare_indices,), generator=g)])
    indptr = indptr_offset + torch.tensor([0, *torch.tensor(npages, dtype=torch.int64).cumsum(0).tolist()])
    last = torch.tensor([n - (p - 1) * page_size if p else 0 for n, p in zip(lens, npages)])
    q = torch.randn((len(lens), hq, head_dim), generator=g).to(device, dtype)
    i32 = dict(device=device, dtype=torch.int32)
    return q, cache, indptr.to(**i32), indices.to(**i32), last.to(**i32)


def check_against_reference(q, cache, indptr, indices, last, o, lse, *, layout="NHD", sm_scale=None):
    kv = unpack_paged_kv_cache(cache, layout)
    atol, rtol = O_TOL[q.dtype]
    assert o.shape == q.shape and o.dtype == q.dtype
    assert lse.shape == q.shape[:2] and lse.dtype == torch.float32
    for b in range(q.shape[0]):
        k, v = gather_paged_kv(kv, indptr.cpu(), indices.cpu(), last.cpu(), b)
        o_ref, lse_ref = attention_state_ref(q[b:b + 1], k, v, sm_scale=sm_scale)
        if k.shape[0] == 0:
            assert torch.all(o[b] == 0), f"row {b}: empty row must give o = 0"
            assert torch.all(lse[b] == -math.inf), f"row {b}: empty row must give lse = -inf"
            continue
        torch.testing.assert_close(o[b].double(), o_ref[0], atol=atol, rtol=rtol, msg=lambda m: f"row {b}: {m}")
        torch.testing.assert_close(lse[b].double(), lse_ref[0], atol=LSE_TOL, rtol=LSE_TOL,
                                   msg=lambda m: f"row {b} lse: {m}")


def poisoned(q):
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:2], float("nan"), dtype=torch.float32, device=q.device)
    return out, lse


def run_and_check(device, *, layout="NHD", num_splits=2, schedule=None, sm_scale=None, **case):
    q, cache, indptr, indices, last = make_case(device, layout=layout, **case)
    out, lse = poisoned(q)
    o, s = batch_decode_paged(q, cache, indptr, indices, last, kv_layout=layout, num_splits=num_splits,
                              schedule=schedule, sm_scale=sm_scale, out=out, lse=lse)
    assert o is out and s is lse
    check_against_reference(q, cache, indptr, indices, last, o, s, layout=layout, sm_scale=sm_scale)


# Lengths with the edges: empty row, one token, last page exactly full, several pages.
EDGE_LENS = [0, 1, 16, 33, 70]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("form", ["tensor", "tuple"])
def test_matches_reference(device, dtype, layout, form):
    run_and_check(device, lens=EDGE_LENS, dtype=dtype, layout=layout, form=form, hq=8, hkv=2, seed=1)


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_page_sizes(device, page_size, num_splits):
    lens = [0, 1, page_size, 2 * page_size + 5, 90]
    run_and_check(device, lens=lens, page_size=page_size, num_splits=num_splits, hq=4, hkv=2,
                  layout="HND" if page_size == 64 else "NHD", seed=page_size)


@pytest.mark.parametrize("group", [1, 4, 7, 8, 16])
@pytest.mark.parametrize("head_dim", [64, 96])
def test_gqa_groups_and_head_dims(device, group, head_dim):
    run_and_check(device, lens=[1, 40, 17], hq=2 * group, hkv=2, head_dim=head_dim, dtype=torch.bfloat16,
                  seed=group * 1000 + head_dim)


@pytest.mark.parametrize("head_dim", [128, 256])
def test_large_head_dims(device, head_dim):
    run_and_check(device, lens=[5, 48], hq=8, hkv=2, head_dim=head_dim, dtype=torch.float16, seed=head_dim)


def test_small_odd_head_dim(device):
    # head_dim 40 pads to 64 and below 16 pads to 16 (tl.dot needs K >= 16).
    run_and_check(device, lens=[3, 20], hq=3, hkv=3, head_dim=40, seed=40)
    run_and_check(device, lens=[3, 20], hq=2, hkv=1, head_dim=8, seed=8)


@pytest.mark.parametrize("num_splits", [1, 2, 7])
def test_num_splits_more_than_pages(device, num_splits):
    # 7 splits over at most 3 pages: most splits are empty and must merge as identities.
    run_and_check(device, lens=[0, 9, 40, 48], num_splits=num_splits, hq=4, hkv=2, seed=num_splits)


def test_default_split_plan(device):
    q, cache, indptr, indices, last = make_case(device, lens=[0, 200], hq=4, hkv=1, seed=3)
    out, lse = poisoned(q)
    assert decode_num_splits(2, 1, device) > 1  # the default really splits here
    o, s = batch_decode_paged(q, cache, indptr, indices, last, out=out, lse=lse)
    check_against_reference(q, cache, indptr, indices, last, o, s)


def test_sm_scale(device):
    run_and_check(device, lens=[12, 30], sm_scale=0.3, seed=5)


def test_noncontiguous_q_out_lse(device):
    q, cache, indptr, indices, last = make_case(device, lens=[7, 0, 50], hq=8, hkv=2, seed=6)
    q_nc = torch.randn(q.shape[1], q.shape[0], q.shape[2] + 8, device=device, dtype=q.dtype)
    q_nc = q_nc[..., :q.shape[2]].transpose(0, 1)  # strides (D + 8, B * (D + 8), 1)
    q_nc.copy_(q)
    assert not q_nc.is_contiguous()
    out_big = torch.full((q.shape[0], q.shape[1], q.shape[2] + 4), float("nan"), device=device, dtype=q.dtype)
    out = out_big[..., :q.shape[2]]
    lse_big = torch.full((q.shape[1], q.shape[0]), float("nan"), device=device)
    lse = lse_big.t()
    for splits in (1, 3):
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        o, s = batch_decode_paged(q_nc, cache, indptr, indices, last, num_splits=splits, out=out, lse=lse)
        assert o is out and s is lse
        check_against_reference(q, cache, indptr, indices, last, o, s)
        assert torch.isnan(out_big[..., q.shape[2]:]).all(), "padding past head_dim must stay untouched"


def test_kv_indices_longer_than_needed(device):
    # Buffers sized for CUDA graphs: entries past kv_indptr[-1] are ignored.
    run_and_check(device, lens=[20, 3], spare_indices=5, seed=7)


def test_all_rows_empty(device):
    run_and_check(device, lens=[0, 0, 0], seed=8)


def test_returns_fresh_outputs(device):
    q, cache, indptr, indices, last = make_case(device, lens=[10, 25], seed=9)
    o, s = batch_decode_paged(q, cache, indptr, indices, last, num_splits=2)
    check_against_reference(q, cache, indptr, indices, last, o, s)


def test_validate_false_skips_content_checks(device, monkeypatch):
    def fail(*args):
        raise AssertionError("content checks ran although validate=False")

    q, cache, indptr, indices, last = make_case(device, lens=[10, 25], seed=16)
    monkeypatch.setattr(decode_mod, "_check_page_table", fail)
    o, s = batch_decode_paged(q, cache, indptr, indices, last, num_splits=2, validate=False)
    check_against_reference(q, cache, indptr, indices, last, o, s)
    with pytest.raises(AssertionError, match="validate=False"):
        batch_decode_paged(q, cache, indptr, indices, last)


def test_empty_batch(device):
    q, cache, indptr, indices, last = make_case(device, lens=[], seed=10)
    o, s = batch_decode_paged(q, cache, indptr, indices, last)
    assert o.shape == (0, 4, 64) and s.shape == (0, 4)


def test_torch_path(device, monkeypatch):
    """The vectorised PyTorch path that plain-CPU tensors take."""
    monkeypatch.setattr(decode_mod, "use_triton", lambda dev: False)
    for layout in ("NHD", "HND"):
        run_and_check(device, lens=EDGE_LENS, layout=layout, hq=6, hkv=2, dtype=torch.float32, seed=11)


def test_reference_helper_matches_rowwise_reference(device):
    q, cache, indptr, indices, last = make_case(device, lens=EDGE_LENS, layout="HND", hq=4, hkv=2, seed=12)
    kv = unpack_paged_kv_cache(cache, "HND")
    o, s = batch_decode_paged_ref(q, kv, indptr, indices, last)
    for b in range(q.shape[0]):
        k, v = gather_paged_kv(kv, indptr, indices, last, b)
        o_ref, s_ref = attention_state_ref(q[b:b + 1], k, v)
        torch.testing.assert_close(o[b], o_ref[0])
        torch.testing.assert_close(s[b], s_ref[0])


# Random decode batches: rows of 0-80 keys, small and odd pages, GQA 1-5, padded and
# unpadded head dims, splits, every dtype.
RANDOM_ROWS = dict(
    lens=st.lists(st.integers(0, 80), min_size=1, max_size=4),
    page_size=st.sampled_from([1, 3, 16]),
    hkv=st.integers(1, 2),
    group=st.integers(1, 5),
    head_dim=st.sampled_from([16, 24, 64]),
    num_splits=st.integers(1, 4),
    dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32]),
    seed=st.integers(0, 2**16),
)


@settings(max_examples=12, deadline=None)
@given(**RANDOM_ROWS, layout=st.sampled_from(["NHD", "HND"]))
def test_random_shapes(lens, page_size, hkv, group, head_dim, num_splits, dtype, layout, seed):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    run_and_check(device, lens=lens, page_size=page_size, hq=hkv * group, hkv=hkv, head_dim=head_dim,
                  dtype=dtype, layout=layout, num_splits=num_splits, seed=seed)


# --------------------------------------------------------------------------- launch variants


def run_config(device, cfg, *, num_splits, layout="NHD", schedule="per_request", **case):
    q, cache, indptr, indices, last = make_case(device, layout=layout, **case)
    out, lse = poisoned(q)
    o, s = decode_mod.decode_with_config(
        q, cache, indptr, indices, last, kv_layout=layout, sm_scale=None, num_splits=num_splits,
        schedule=schedule, out=out, lse=lse, validate=True, config=cfg)
    assert o is out and s is lse
    check_against_reference(q, cache, indptr, indices, last, o, s, layout=layout)


@pytest.mark.parametrize("name", list(DECODE_VARIANTS))
def test_decode_variants(device, name):
    """Every launch variant the benchmarks time computes the same attention (1 split;
    2 splits, merged by the two-state kernel; 5, by the many-state kernel)."""
    cfg = DECODE_VARIANTS[name]
    for splits in (1, 2, 5):
        run_config(device, cfg, num_splits=splits, lens=[0, 300, 17], hq=8, hkv=2, head_dim=128,
                   dtype=torch.bfloat16, seed=24)


@pytest.mark.parametrize("page_size,head_dim", [(16, 128), (3, 96), (1, 64)])
def test_clamped_tail_tiles(device, page_size, head_dim):
    """The partial last tile inside the key loop (``clamp_tail``): its rows past the end
    read the range's last key, unmasked, and weigh 0. The slots past each request's end
    hold NaN, so a row read there, or a weight that is not exactly 0, poisons the answer;
    unsplit and split 3 and 4 ways (ranges ending mid-tile and empty splits)."""
    lens = [0, 1, 15, 16, 17, 70, 300]
    q, cache, indptr, indices, last = make_case(device, lens=lens, page_size=page_size, hq=8, hkv=2,
                                                head_dim=head_dim, dtype=torch.bfloat16, seed=41)
    for b, n in enumerate(lens):
        if n:  # NaN in every slot of the last page past the request's end
            cache[indices[indptr[b + 1] - 1].long(), :, int(last[b]):] = float("nan")
    for cfg in (DecodeConfig(block_n=16, num_warps=1, num_stages=5, clamp_tail=True),
                DecodeConfig(block_n=64, num_warps=4, num_stages=3, clamp_tail=True)):
        for splits in (1, 3, 4):
            out, lse = poisoned(q)
            o, s = decode_mod.decode_with_config(
                q, cache, indptr, indices, last, kv_layout="NHD", sm_scale=None, num_splits=splits,
                schedule="per_request", out=out, lse=lse, validate=True, config=cfg)
            check_against_reference(q, cache, indptr, indices, last, o, s)


@settings(max_examples=10, deadline=None)
@given(**RANDOM_ROWS, block_n=st.sampled_from([16, 32]), num_stages=st.sampled_from([2, 4]))
def test_clamped_tail_random_shapes(lens, page_size, hkv, group, head_dim, num_splits, dtype, block_n, num_stages,
                                    seed):
    """The clamped-tail tiles on random rows, page sizes, groups, head dims, splits and
    dtypes: the float64 reference's answer, as every other tile config gives."""
    cfg = DecodeConfig(block_n=block_n, num_warps=1, num_stages=num_stages, clamp_tail=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    run_config(device, cfg, num_splits=num_splits, lens=lens, page_size=page_size, hq=hkv * group, hkv=hkv,
               head_dim=head_dim, dtype=dtype, seed=seed)


def test_clamp_tail_needs_one_state_per_tile():
    with pytest.raises(ValueError, match="DecodeConfig"):
        DecodeConfig(block_n=32, num_warps=2, num_stages=5, subtiles=2, clamp_tail=True)


@pytest.mark.parametrize("shared_pages", [False, True])
def test_head_dim_256_tiles(device, shared_pages):
    """head_dim 256 with the plain rule's tiles (4 warps over 32 keys) and the
    "shared_pages" schedule's (one warp per 16 keys, spilling a little on sm_90a),
    unsplit and split 3 ways."""
    cfg = pick_decode_config(256, torch.bfloat16, 16, work=1024, num_sms=132, group_size=4,
                             shared_pages=shared_pages)
    assert (cfg == DECODE_VARIANTS["n16_w1_s5_p4"]) == shared_pages
    for splits in (1, 3):
        run_config(device, cfg, num_splits=splits, lens=[0, 70, 33], hq=8, hkv=2, head_dim=256,
                   dtype=torch.bfloat16, seed=31)


def test_probe_config_names():
    """The --configs names of probe_flat_shared and tune_decode_level: keys, warps, stages,
    sub-tiles, programs per SM, clamped tail."""
    from benchmarks._common import parse_config  # noqa: PLC0415

    assert parse_config("n16_w1_s5") == DecodeConfig(block_n=16, num_warps=1, num_stages=5)
    assert parse_config("n32_w4_s5_x2") == DecodeConfig(block_n=32, num_warps=4, num_stages=5, subtiles=2)
    assert parse_config("n16_w1_s5_p8_c") == DecodeConfig(block_n=16, num_warps=1, num_stages=5,
                                                          programs_per_sm=8, clamp_tail=True)
    assert parse_config("n16_w1_s5_p4") == DECODE_VARIANTS["n16_w1_s5_p4"]
    for bad in ("n16w1s5", "n16_w1", "x2_n16_w1_s5"):
        with pytest.raises(ValueError, match="config"):
            parse_config(bad)
    with pytest.raises(ValueError, match="block_n"):
        parse_config("n24_w1_s5")


def test_decode_config_rejects_bad_values():
    for bad in (dict(block_n=48), dict(num_warps=3), dict(num_stages=0), dict(programs_per_sm=0), dict(min_tokens=0)):
        with pytest.raises(ValueError):
            DecodeConfig(**(dict(block_n=64, num_warps=4, num_stages=3) | bad))


# --------------------------------------------------------------------------- split plan


def test_decode_num_splits_plan():
    cpu = torch.device("cpu")  # 132 SMs assumed
    assert decode_num_splits(16, 8, cpu) == 1  # 128 pairs: one n128_w4_s5 program per SM
    assert decode_num_splits(1, 8, cpu) == 16
    assert decode_num_splits(4, 8, cpu) == 4
    assert decode_num_splits(9, 8, cpu) == 3  # 72 pairs: 2 per SM keep 1.5x the loads in flight
    assert decode_num_splits(17, 8, cpu) == 2  # 136 pairs: n64_w4_s5, one wave of 2-3 per SM
    assert decode_num_splits(40, 8, cpu) == 1  # 320 pairs: n64_w4_s5, one wave, no split
    assert decode_num_splits(256, 8, cpu) == 1
    assert decode_num_splits(1, 8, cpu, programs_per_sm=2) == 33
    assert decode_num_splits(1, 1, cpu) == 132
    assert decode_num_splits(1, 1, cpu, programs_per_sm=4) == MAX_SPLITS
    assert decode_num_splits(0, 8, cpu) >= 1
    with pytest.raises(ValueError, match="num_kv_heads"):
        decode_num_splits(4, 0, cpu)


def test_pick_decode_config():
    def pick(work, dtype=torch.bfloat16, head_dim=128):
        return pick_decode_config(head_dim, dtype, 16, work=work, num_sms=132)

    one, two, three = (DECODE_VARIANTS[k] for k in ("n128_w4_s5", "n128_w4_s3", "n64_w4_s5"))
    assert pick(8) == pick(32) == pick(128) == one and one.programs_per_sm == 1
    assert pick(72) == two  # 3 splits at 2 per SM beat 1 split at 1 per SM
    assert pick(133) == pick(198) == pick(199) == pick(396) == three
    assert pick(397) == pick(2048) == two == pick_decode_config(128, torch.float16, 16)
    # many programs per SM, small query groups: 8 small programs per SM
    small = DECODE_VARIANTS["n16_w1_s5"]
    grouped = lambda work, group, **kw: pick_decode_config(128, torch.bfloat16, 16, work=work, num_sms=132,  # noqa: E731
                                                           group_size=group, **kw)
    assert grouped(264, 4) == grouped(989, 4) == grouped(2048, 1) == small and small.programs_per_sm == 8
    assert grouped(263, 4) == three and grouped(2048, 8) == two
    # beside another stream's kernel: from 7.5 SMs of work the clamped 4-stage tiles
    concurrent = DECODE_VARIANTS["n16_w1_s4_c"]
    assert concurrent.clamp_tail and concurrent.programs_per_sm == small.programs_per_sm
    assert grouped(990, 4, concurrent=True) == grouped(2048, 1, concurrent=True) == concurrent
    assert grouped(989, 4, concurrent=True) == small
    assert grouped(2048, 8, concurrent=True) == two and grouped(100, 4, concurrent=True) == one
    assert pick_decode_config(64, torch.bfloat16, 16, work=2048, num_sms=132, group_size=4) == two
    assert pick_decode_config(128, torch.float32, 16, work=2048, num_sms=132, group_size=4).num_warps == 8
    # past 1.5 pairs per SM no split, whatever the residency of the config
    assert decode_num_splits(25, 8, "cpu", programs_per_sm=8) == decode_num_splits(256, 8, "cpu") == 1
    assert pick(8, head_dim=256).block_n <= two.block_n
    # head_dim 256: 32-key tiles on 4 warps, two programs per SM (8 warps fit one)
    plain = pick(8, head_dim=256)
    assert plain == pick(2048, head_dim=256) and (plain.block_n, plain.num_warps, plain.programs_per_sm) == (32, 4, 2)
    assert pick(8, dtype=torch.float32).num_warps == 8


def test_pick_decode_config_shared_pages():
    """Page lists that share their pages: the sub-tiled tiles from 3/4 pair per SM up,
    16-bit, head_dim 65-128, groups of at most 4 (one-warp tiles at head_dim 256); the
    plain rule everywhere else."""
    def pick(work, group=4, dtype=torch.bfloat16, head_dim=128, shared=True):
        return pick_decode_config(head_dim, dtype, 16, work=work, num_sms=132, group_size=group,
                                  shared_pages=shared)

    sub = DECODE_VARIANTS["n32_w2_s5_x2"]
    assert sub.subtiles == 2 and sub.block_n // sub.subtiles == 16
    assert pick(99) == pick(128) == pick(2048, group=1) == pick(4096, dtype=torch.float16) == sub
    assert pick(98) == pick(98, shared=False)  # below 3/4 pair per SM the default's splits do as well
    assert pick(2048, shared=False) == DECODE_VARIANTS["n16_w1_s5"]
    assert pick(512, group=8) == pick(512, group=8, shared=False)
    assert pick(512, head_dim=64) == pick(512, head_dim=64, shared=False)
    one_warp = DECODE_VARIANTS["n16_w1_s5_p4"]
    assert pick(99, head_dim=256) == pick(1024, head_dim=256) == one_warp and one_warp.num_warps == 1
    assert pick(98, head_dim=256) == pick(98, head_dim=256, shared=False)
    assert pick(1024, head_dim=256, group=8) == pick(1024, head_dim=256, shared=False)
    # 128 pairs x 4 splits: (16, 65536, 1024)'s best split count at head_dim 256 too
    assert decode_num_splits(16, 8, "cpu", programs_per_sm=one_warp.programs_per_sm) == 4
    assert pick(512, dtype=torch.float32) == pick(512, dtype=torch.float32, shared=False)
    # 128 pairs x 4 splits at 4 programs per SM: (16, 65536, 1024)'s best split count
    assert decode_num_splits(16, 8, "cpu", programs_per_sm=sub.programs_per_sm) == 4


@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_shared_pages_schedule(device, num_splits):
    """schedule="shared_pages" over page lists that repeat a common prefix: the same
    attention (at this small shape it runs the default tiles; the sub-tiled ones run in
    test_decode_variants and test_subtiles_share_prefix_pages)."""
    run_and_check(device, lens=[40, 0, 33, 17], hq=8, hkv=2, head_dim=128, dtype=torch.bfloat16,
                  num_splits=num_splits, schedule="shared_pages", seed=5)


@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_concurrent_schedule(device, num_splits):
    """schedule="concurrent": the same attention (at this small shape the plain rule's
    tiles; the clamped ones run in test_decode_variants and test_clamped_tail_tiles)."""
    run_and_check(device, lens=[40, 0, 33, 17], hq=8, hkv=2, head_dim=128, dtype=torch.bfloat16,
                  num_splits=num_splits, schedule="concurrent", seed=6)


# ----------------------------------------------------------------- the "all_heads" schedule


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("num_splits", [None, 3])
def test_all_heads_matches_reference(device, dtype, layout, num_splits):
    """schedule="all_heads": empty row, one key, a full last page, several pages; one
    split and three (some empty, states merged by merge_states' kernel)."""
    run_and_check(device, lens=EDGE_LENS, dtype=dtype, layout=layout, hq=8, hkv=2, seed=21,
                  schedule="all_heads", num_splits=num_splits)


@pytest.mark.parametrize("page_size", [1, 3, 16, 64])
def test_all_heads_page_sizes(device, page_size):
    """Pages smaller than a 16-key tile (one page index per key) and pages of several tiles."""
    lens = [0, 1, page_size, 2 * page_size + 5, 90]
    run_and_check(device, lens=lens, page_size=page_size, num_splits=2, hq=4, hkv=2, schedule="all_heads",
                  layout="HND" if page_size == 64 else "NHD", seed=30 + page_size)


@pytest.mark.parametrize("hkv,group,head_dim", [
    (3, 1, 64), (3, 3, 96), (3, 7, 64), (2, 16, 128), (8, 4, 128), (32, 1, 128), (4, 4, 256), (1, 8, 40),
])
def test_all_heads_heads_groups_and_dims(device, hkv, group, head_dim):
    """Head blocks that do not divide the kv heads (3 of 4), padded groups and head_dims,
    several head blocks (32 kv heads), one kv head; Llama-3-8B's (8, 4, 128) is the one
    8-warp, register-capped program."""
    run_and_check(device, lens=[1, 40, 17], hq=hkv * group, hkv=hkv, head_dim=head_dim, dtype=torch.bfloat16,
                  schedule="all_heads", num_splits=None, seed=hkv * 100 + group * 10 + head_dim)


def test_all_heads_noncontiguous_q_out_lse(device):
    q, cache, indptr, indices, last = make_case(device, lens=[7, 0, 50], hq=8, hkv=2, seed=22)
    q_nc = torch.randn(q.shape[1], q.shape[0], q.shape[2] + 8, device=device, dtype=q.dtype)
    q_nc = q_nc[..., :q.shape[2]].transpose(0, 1)
    q_nc.copy_(q)
    out_big = torch.full((q.shape[0], q.shape[1], q.shape[2] + 4), float("nan"), device=device, dtype=q.dtype)
    out, lse = out_big[..., :q.shape[2]], torch.full((q.shape[1], q.shape[0]), float("nan"), device=device).t()
    for splits in (1, 3):
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        o, s = batch_decode_paged(q_nc, cache, indptr, indices, last, schedule="all_heads", num_splits=splits,
                                  out=out, lse=lse)
        assert o is out and s is lse
        check_against_reference(q, cache, indptr, indices, last, o, s)
        assert torch.isnan(out_big[..., q.shape[2]:]).all(), "padding past head_dim must stay untouched"


def test_all_heads_config():
    """The "all_heads" programs from shapes: every kv head of Llama-3-8B's layer in one
    8-warp program capped at 128 registers; fewer heads where the accumulator or the K
    tile would grow; splits only when the programs do not cover the SMs."""
    cfg = policy.all_heads_config
    assert cfg(8, 4, 128, torch.bfloat16) == policy.AllHeadsConfig(8, 16, 8, 3, 128)
    assert cfg(32, 1, 128, torch.bfloat16).heads == 8
    assert cfg(2, 16, 128, torch.bfloat16) == policy.AllHeadsConfig(2, 16, 2, 3, None)
    assert cfg(8, 4, 128, torch.float32).heads == 4 and cfg(8, 4, 256, torch.float16).heads == 4
    assert cfg(3, 3, 96, torch.bfloat16).heads == 4  # a block of 4 over 3 heads, one masked
    splits = policy.all_heads_num_splits
    assert splits(256, 8, 4, 128, torch.bfloat16, "cpu") == 1
    assert splits(16, 8, 4, 128, torch.bfloat16, "cpu") == 132 // 16
    assert splits(1, 32, 1, 128, torch.bfloat16, "cpu") == 132 // 4


def test_decode_schedule_beside_prefill():
    """Short rows beside a prefill level take "concurrent", or "all_heads" at the measured
    shapes; long rows, and every other schedule, stay as they are."""
    beside = policy.decode_schedule_beside_prefill
    short, long = [1, 300, CONCURRENT_MAX_KEYS], [1, CONCURRENT_MAX_KEYS + 1]
    assert beside("per_request", short) == beside("per_request", np.array(short)) == "concurrent"
    assert beside("per_request", torch.tensor(short)) == "concurrent"
    assert beside("per_request", long) == "per_request"
    assert beside("balanced", short) == "balanced" and beside("shared_pages", short) == "shared_pages"
    assert beside("per_request", []) == "per_request"
    # Shapes given: Llama-3-8B's kv heads over enough rows to cover the SMs take "all_heads".
    llama = dict(num_kv_heads=8, group=4, head_dim=128, dtype=torch.bfloat16, device="cpu")
    assert beside("per_request", [300] * 132, **llama) == "all_heads"
    assert beside("per_request", [300] * 64, **llama) == "concurrent"  # it would need 2 splits
    assert beside("per_request", [CONCURRENT_MAX_KEYS + 1] * 256, **llama) == "per_request"
    assert beside("per_request", [300] * 256, **{**llama, "head_dim": 64}) == "concurrent"  # not measured
    assert beside("per_request", [300] * 256, **{**llama, "dtype": torch.float32}) == "concurrent"
    assert beside("balanced", [300] * 256, **llama) == "balanced"


@pytest.mark.parametrize("num_splits", [1, 4])
def test_subtiles_share_prefix_pages(device, num_splits):
    """The sub-tiled kernel over page lists that all start with the same prefix pages (the
    shape it is picked for), ragged own pages, a tail tile, an empty row."""
    lens = [0, 1, 70, 45, 16]
    q, cache, indptr, indices, last = make_case(device, lens=lens, page_size=16, hq=8, hkv=2, head_dim=128,
                                                dtype=torch.bfloat16, seed=9)
    prefix = indices[indptr[2]:indptr[2] + 2].clone()  # two pages every non-empty row starts with
    rows = [indices[indptr[b]:indptr[b + 1]] for b in range(len(lens))]
    rows = [r if r.numel() == 0 else torch.cat([prefix, r[2:] if b == 2 else r]) for b, r in enumerate(rows)]
    indptr = indptr_from_lengths([r.numel() for r in rows], device=device)
    indices = torch.cat(rows).to(torch.int32)
    out, lse = poisoned(q)
    o, s = decode_mod.decode_with_config(
        q, cache, indptr, indices, last, kv_layout="NHD", sm_scale=None, num_splits=num_splits,
        schedule="per_request", out=out, lse=lse, validate=True, config=DECODE_VARIANTS["n32_w2_s5_x2"])
    check_against_reference(q, cache, indptr, indices, last, o, s)


# --------------------------------------------------------------------------- bad input


def bad_case(device):
    return make_case(device, lens=[5, 20], hq=4, hkv=2, seed=13)


def test_rejects_dtype_mismatch(device):
    q, cache, indptr, indices, last = bad_case(device)
    with pytest.raises(TypeError, match="paged_kv_cache"):
        batch_decode_paged(q.float(), cache, indptr, indices, last)
    with pytest.raises(TypeError, match="q"):
        batch_decode_paged(q.to(torch.int32), cache, indptr, indices, last)


def test_rejects_bad_head_ratio_and_head_dim(device):
    q, cache, indptr, indices, last = bad_case(device)
    with pytest.raises(ValueError, match="q: num_qo_heads"):
        batch_decode_paged(q[:, :3], cache, indptr, indices, last)
    with pytest.raises(ValueError, match="head_dim"):
        batch_decode_paged(q[..., :32], cache, indptr, indices, last)
    with pytest.raises(ValueError, match="q"):
        batch_decode_paged(q[0], cache, indptr, indices, last)


def test_rejects_bad_metadata_types_and_lengths(device):
    q, cache, indptr, indices, last = bad_case(device)
    with pytest.raises(TypeError, match="kv_indices"):
        batch_decode_paged(q, cache, indptr, indices.long(), last)
    with pytest.raises(TypeError, match="kv_indptr"):
        batch_decode_paged(q, cache, indptr.long(), indices, last)
    with pytest.raises(ValueError, match="kv_indptr"):
        batch_decode_paged(q, cache, indptr[:-1], indices, last)
    with pytest.raises(ValueError, match="kv_last_page_len"):
        batch_decode_paged(q, cache, indptr, indices, last[:1])
    with pytest.raises(ValueError, match="kv_indices"):
        batch_decode_paged(q, cache, indptr, torch.stack([indices, indices], 1), last)


def test_rejects_bad_contents(device):
    q, cache, indptr, indices, last = bad_case(device)
    pool = unpack_paged_kv_cache(cache, "NHD").num_pages
    with pytest.raises(ValueError, match="kv_indices"):
        batch_decode_paged(q, cache, indptr, torch.full_like(indices, pool), last)
    with pytest.raises(ValueError, match="kv_indices"):
        batch_decode_paged(q, cache, indptr, torch.full_like(indices, -1), last)
    with pytest.raises(ValueError, match="kv_last_page_len"):
        batch_decode_paged(q, cache, indptr, indices, torch.full_like(last, 17))
    with pytest.raises(ValueError, match="kv_last_page_len"):
        batch_decode_paged(q, cache, indptr, indices, torch.zeros_like(last))
    with pytest.raises(ValueError, match="kv_indptr"):
        batch_decode_paged(q, cache, indptr.flip(0), indices, last)
    with pytest.raises(ValueError, match="kv_indptr"):
        batch_decode_paged(q, cache, indptr * 2, indices, last)


def test_rejects_bad_buffers_and_options(device):
    q, cache, indptr, indices, last = bad_case(device)
    with pytest.raises(ValueError, match="out"):
        batch_decode_paged(q, cache, indptr, indices, last, out=torch.empty_like(q)[:, :2])
    with pytest.raises(TypeError, match="out"):
        batch_decode_paged(q, cache, indptr, indices, last, out=torch.empty_like(q, dtype=torch.float32))
    with pytest.raises(ValueError, match="out"):
        batch_decode_paged(q, cache, indptr, indices, last, out=torch.empty_like(q).transpose(1, 2).contiguous().transpose(1, 2))
    with pytest.raises(TypeError, match="lse"):
        batch_decode_paged(q, cache, indptr, indices, last, lse=torch.empty(q.shape[:2], dtype=q.dtype, device=device))
    with pytest.raises(ValueError, match="lse"):
        batch_decode_paged(q, cache, indptr, indices, last, lse=torch.empty(q.shape[0], device=device))
    with pytest.raises(ValueError, match="num_splits"):
        batch_decode_paged(q, cache, indptr, indices, last, num_splits=0)
    with pytest.raises(ValueError, match="kv_layout"):
        batch_decode_paged(q, cache, indptr, indices, last, kv_layout="NDH")
    with pytest.raises(ValueError, match="sm_scale"):
        batch_decode_paged(q, cache, indptr, indices, last, sm_scale=-1.0)
    with pytest.raises(ValueError, match="q"):
        batch_decode_paged(q.transpose(1, 2).contiguous().transpose(1, 2), cache, indptr, indices, last)
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="kv_indices"):
            batch_decode_paged(q, cache, indptr, indices.cpu(), last)


# --------------------------------------------------------------------------- GPU only


@pytest.mark.gpu
def test_realistic_long_context_int64_offsets():
    """batch 16, Hq 32, Hkv 8, D 128, bf16, page 16; one request of ~130K tokens whose pages
    lie past element 2**31 of the pool (page id x page stride needs int64)."""
    device = torch.device("cuda")
    page, hkv, hq, d = 16, 8, 32, 128
    g = torch.Generator(device="cpu").manual_seed(14)
    lens = [130_001] + torch.randint(1, 9000, (15,), generator=g).tolist()
    lens[1], lens[2] = 0, 1
    npages = [(n + page - 1) // page for n in lens]
    page_elems = 2 * page * hkv * d
    pool = max(sum(npages), 2**31 // page_elems + 4096)  # > 2**31 elements in all
    cache = torch.empty((pool, 2, page, hkv, d), device=device, dtype=torch.bfloat16)
    cache.normal_()
    indices = torch.randperm(pool, device=device)[: sum(npages)].int()
    # the long request gets the pages at the top of the pool
    indices[: npages[0]] = torch.arange(pool - npages[0], pool, device=device, dtype=torch.int32).flip(0)
    indptr = torch.tensor([0, *torch.tensor(npages).cumsum(0).tolist()], device=device, dtype=torch.int32)
    last = torch.tensor([n - (p - 1) * page if p else 0 for n, p in zip(lens, npages)],
                        device=device, dtype=torch.int32)
    q = torch.randn((16, hq, d), device=device, dtype=torch.bfloat16)
    for splits in (None, 1):
        out, lse = poisoned(q)
        o, s = batch_decode_paged(q, cache, indptr, indices, last, num_splits=splits, out=out, lse=lse)
        check_against_reference(q, cache, indptr, indices, last, o, s)
    del cache
    torch.cuda.empty_cache()


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", [None, "all_heads"])
def test_cuda_graph_capture_and_replay_with_new_page_table(schedule):
    device = torch.device("cuda")
    lens = [300, 0, 1, 1024, 77, 16, 500, 2048]
    q, cache, indptr, indices, last = make_case(device, lens=lens, hq=32, hkv=8, head_dim=128,
                                                dtype=torch.bfloat16, spare_pages=400, seed=15)
    capacity = 400 + indices.numel()
    idx_buf = torch.zeros(capacity, device=device, dtype=torch.int32)
    idx_buf[: indices.numel()] = indices
    out, lse = poisoned(q)
    batch_decode_paged(q, cache, indptr, idx_buf, last, out=out, lse=lse, schedule=schedule)  # compile first
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        batch_decode_paged(q, cache, indptr, idx_buf, last, out=out, lse=lse, schedule=schedule)
    out.fill_(float("nan"))
    lse.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    check_against_reference(q, cache, indptr, idx_buf, last, out, lse)

    # New lengths and a new page permutation, written in place; same graph.
    replay_with_new_lengths(graph, [17, 2100, 0, 5, 999, 64, 1, 1500], q, cache, indptr, idx_buf, last, out, lse)


def replay_with_new_lengths(graph, new_lens, q, cache, indptr, idx_buf, last, out, lse, page_size=16):
    """Rewrite the page table in place for ``new_lens`` (a new random page permutation),
    draw a new q, poison the outputs, replay the captured ``graph`` and check every row."""
    pool = unpack_paged_kv_cache(cache, "NHD").num_pages
    npages = [(n + page_size - 1) // page_size for n in new_lens]
    new_idx = torch.randperm(pool, device=q.device)[: sum(npages)].int()
    idx_buf.zero_()
    idx_buf[: new_idx.numel()] = new_idx
    indptr.copy_(torch.tensor([0, *torch.tensor(npages).cumsum(0).tolist()], dtype=torch.int32))
    last.copy_(torch.tensor([n - (p - 1) * page_size if p else 0 for n, p in zip(new_lens, npages)],
                            dtype=torch.int32))
    q.copy_(torch.randn_like(q))
    out.fill_(float("nan"))
    lse.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    check_against_reference(q, cache, indptr, idx_buf, last, out, lse)
