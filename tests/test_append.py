"""append_paged_kv_cache: every token lands in its slot, nothing else in the cache changes."""

from __future__ import annotations

import pytest
import torch

from cascadeinfer.kernels.append import append_paged_kv_cache
from cascadeinfer.kernels.reference import append_paged_kv_cache_ref
from cascadeinfer.layouts.indptr import indptr_from_lengths
from cascadeinfer.layouts.page_table import PageTable, get_batch_indices_positions
from cascadeinfer.layouts.paged_cache import gather_paged_kv, unpack_paged_kv_cache

i32 = torch.int32


def _make_case(device, *, layout, form, dtype, page_size, num_kv_heads, head_dim, before, append, seed=0):
    """A NaN-poisoned cache, a shuffled page table whose rows already hold ``before[i]``
    tokens and grow by ``append[i]``, the append metadata and fresh random K/V."""
    gen = torch.Generator().manual_seed(seed)
    totals = [b + a for b, a in zip(before, append)]
    need = [-(-t // page_size) for t in totals]
    num_pages = sum(need) + 3  # a few pages nobody owns
    perm = torch.randperm(num_pages, generator=gen).tolist()
    lists, at = [], 0
    for k in need:
        lists.append(perm[at:at + k])
        at += k
    table = PageTable.from_page_lists(lists, totals, page_size, num_pages=num_pages, device=device)
    inner = (page_size, num_kv_heads) if layout == "NHD" else (num_kv_heads, page_size)
    if form == "single":
        cache = torch.full((num_pages, 2, *inner, head_dim), float("nan"), dtype=dtype, device=device)
    else:
        cache = tuple(torch.full((num_pages, *inner, head_dim), float("nan"), dtype=dtype, device=device)
                      for _ in range(2))
    append_indptr = indptr_from_lengths(append, device=device)
    nnz = sum(append)
    batch_indices, positions = get_batch_indices_positions(append_indptr, table.seq_lens(), nnz)
    key = torch.randn(nnz, num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    value = torch.randn(nnz, num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    return dict(table=table, cache=cache, append_indptr=append_indptr, batch_indices=batch_indices,
                positions=positions, key=key, value=value)


def _run(case, layout, **kw):
    t = case["table"]
    append_paged_kv_cache(case["key"], case["value"], case["batch_indices"], case["positions"], case["cache"],
                          t.kv_indices, t.kv_indptr, t.kv_last_page_len, kv_layout=layout, **kw)


def _check(case, layout, expected):
    """Compare with the reference; and independently: each row's tail is the appended
    tokens, and exactly 2 * nnz * Hkv * D elements of the poisoned cache were written."""
    t = case["table"]
    kv = unpack_paged_kv_cache(case["cache"], layout)
    ref_k, ref_v = expected
    torch.testing.assert_close(kv.k.double().cpu(), ref_k, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(kv.v.double().cpu(), ref_v, rtol=0, atol=0, equal_nan=True)
    indptr = case["append_indptr"].tolist()
    for row in range(t.num_rows):
        k, v = gather_paged_kv(kv, t.kv_indptr, t.kv_indices, t.kv_last_page_len, row)
        n_app = indptr[row + 1] - indptr[row]
        if n_app:
            assert torch.equal(k[-n_app:], case["key"][indptr[row]:indptr[row + 1]])
            assert torch.equal(v[-n_app:], case["value"][indptr[row]:indptr[row + 1]])
    written = (~torch.isnan(kv.k)).sum() + (~torch.isnan(kv.v)).sum()
    assert int(written) == 2 * case["key"].numel()


def _reference(case, layout):
    t = case["table"]
    return append_paged_kv_cache_ref(case["key"], case["value"], case["batch_indices"], case["positions"],
                                     case["cache"], t.kv_indices, t.kv_indptr, t.kv_last_page_len,
                                     kv_layout=layout)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("form", ["single", "tuple"])
@pytest.mark.parametrize(
    "dtype, page_size, num_kv_heads, head_dim",
    [
        (torch.bfloat16, 16, 2, 64),
        (torch.float16, 1, 1, 96),
        (torch.float32, 4, 3, 96),
    ],
)
def test_append_matches_reference(device, layout, form, dtype, page_size, num_kv_heads, head_dim):
    # rows: decode step into a fresh page, prefill from empty, a row that appends nothing,
    # a row whose last page ends exactly full, a long append spanning pages
    before = [page_size * 2, 0, 5, page_size * 2 - 1, 1]
    append = [1, 3, 0, 1, 2 * page_size + 1]
    case = _make_case(device, layout=layout, form=form, dtype=dtype, page_size=page_size,
                      num_kv_heads=num_kv_heads, head_dim=head_dim, before=before, append=append)
    assert case["table"].seq_lens().tolist()[3] % page_size == 0  # last page exactly full
    expected = _reference(case, layout)
    _run(case, layout)
    _check(case, layout, expected)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_append_noncontiguous_inputs_and_gqa_heads(device, layout):
    """append_key a slice of a bigger tensor, append_value head-major storage: honoured."""
    case = _make_case(device, layout=layout, form="single", dtype=torch.float16, page_size=16,
                      num_kv_heads=4, head_dim=64, before=[3, 30], append=[2, 4], seed=1)
    nnz = case["key"].shape[0]
    big = torch.randn(nnz, 6, 80, device=device).to(torch.float16)
    big[:, :4, :64] = case["key"]
    head_major = case["value"].transpose(0, 1).contiguous().transpose(0, 1)
    case["key"], case["value"] = big[:, :4, :64], head_major
    assert not case["key"].is_contiguous() and not case["value"].is_contiguous()
    expected = _reference(case, layout)
    _run(case, layout)
    _check(case, layout, expected)


def test_append_into_pool_layer_and_padding(device):
    """The pool's per-layer view is a valid cache; tokens past append_indptr[-1] are skipped."""
    from cascadeinfer.layouts.pool import PagedKVPool

    pool = PagedKVPool(2, 6, 4, 2, 32, dtype=torch.bfloat16, device=device)
    pool.cache.fill_(float("nan"))
    pages = [pool.allocate(2), pool.allocate(1)]
    table = pool.page_table(pages, [6, 3])
    append_indptr = torch.tensor([0, 2, 3], dtype=i32, device=device)
    bi, pos = get_batch_indices_positions(append_indptr, table.seq_lens(), 5)  # 2 padding tokens
    assert bi.tolist()[-2:] == [-1, -1]
    key = torch.randn(5, 2, 32, device=device).to(torch.bfloat16)
    value = torch.randn(5, 2, 32, device=device).to(torch.bfloat16)
    append_paged_kv_cache(key, value, bi, pos, pool.layer(1), table.kv_indices, table.kv_indptr,
                          table.kv_last_page_len)
    assert bool(torch.isnan(pool.cache[0]).all())  # other layer untouched
    layer = pool.layer(1)
    assert torch.equal(layer[pages[0][1], 0, 0:2], key[0:2])  # positions 4, 5 -> page 2nd, slots 0, 1
    assert torch.equal(layer[pages[0][1], 1, 0:2], value[0:2])
    assert torch.equal(layer[pages[1][0], 0, 2], key[2])
    assert int((~torch.isnan(layer)).sum()) == 2 * 3 * 2 * 32


def test_append_validate_false_and_empty(device):
    case = _make_case(device, layout="NHD", form="single", dtype=torch.float32, page_size=4,
                      num_kv_heads=1, head_dim=16, before=[2, 0], append=[3, 1], seed=2)
    expected = _reference(case, "NHD")
    _run(case, "NHD", validate=False)
    _check(case, "NHD", expected)
    empty = _make_case(device, layout="HND", form="tuple", dtype=torch.float32, page_size=4,
                       num_kv_heads=1, head_dim=16, before=[2, 0], append=[0, 0])
    _run(empty, "HND")
    assert bool(torch.isnan(empty["cache"][0]).all())


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_append_torch_path(monkeypatch, layout):
    """Plain CPU without the interpreter takes the vectorised torch path: same result."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    case = _make_case(torch.device("cpu"), layout=layout, form="tuple", dtype=torch.bfloat16, page_size=4,
                      num_kv_heads=2, head_dim=24, before=[5, 0, 8], append=[3, 2, 0], seed=3)
    case["key"] = torch.randn(5, 3, 24).to(torch.bfloat16)[:, 1:]
    expected = _reference(case, layout)
    _run(case, layout)
    _check(case, layout, expected)


# ---- bad inputs: ValueError/TypeError naming the argument, cache untouched ------------------


def _bad(case, **override):
    t = case["table"]
    args = dict(append_key=case["key"], append_value=case["value"], batch_indices=case["batch_indices"],
                positions=case["positions"], paged_kv_cache=case["cache"], kv_indices=t.kv_indices,
                kv_indptr=t.kv_indptr, kv_last_page_len=t.kv_last_page_len)
    kw = {k: override.pop(k) for k in ("kv_layout", "validate") if k in override}
    args.update(override)
    return args, kw


def _i32(values, device):
    return torch.tensor(values, dtype=i32, device=device)


@pytest.mark.parametrize(
    "name, err, pattern",
    [
        ("batch_indices_int64", TypeError, "batch_indices: expected dtype torch.int32"),
        ("kv_indices_int64", TypeError, "kv_indices: expected dtype torch.int32"),
        ("key_dtype", TypeError, "append_key: expected dtype torch.float32"),
        ("key_heads", ValueError, r"append_key: expected shape \[\*, 2, 16\]"),
        ("value_nnz", ValueError, r"append_value: expected shape \[4, 2, 16\]"),
        ("key_last_stride", ValueError, "append_key: the last dimension must have stride 1"),
        ("positions_len", ValueError, r"positions: expected shape \[4\]"),
        ("positions_device", ValueError, "positions: expected a tensor on"),
        ("indptr_device", ValueError, "kv_indptr: expected a tensor on"),
        ("layout", ValueError, "kv_layout: expected 'NHD' or 'HND'"),
        ("cache_type", TypeError, "paged_kv_cache: expected a tensor"),
        ("page_outside", ValueError, "kv_indices: index 99 at position 0 is outside the pool of 7 pages"),
        ("indptr_not_monotone", ValueError, r"kv_indptr: expected monotone .*kv_indptr\[1\] = 3 > kv_indptr\[2\] = 1"),
        ("last_len_empty_row", ValueError, "kv_last_page_len: row 1 has 1 pages and last_page_len 0"),
        ("position_past_row", ValueError, "positions: entry 3 is 9 but row 1 holds 1 tokens"),
        ("position_negative", ValueError, "positions: entry 0 is -2"),
        ("row_outside", ValueError, "batch_indices: entry 0 is 2, outside the 2 rows"),
        ("same_slot", ValueError, "positions: tokens 0 and 1 both write page"),
    ],
)
def test_append_rejects(device, name, err, pattern):
    case = _make_case(device, layout="NHD", form="single", dtype=torch.float32, page_size=4,
                      num_kv_heads=2, head_dim=16, before=[7, 0], append=[3, 1])
    # kv_indptr [0, 3, 4]; rows hold 10 and 1 tokens; 7 pages in the pool
    t, dev = case["table"], device
    override = {
        "batch_indices_int64": dict(batch_indices=case["batch_indices"].long()),
        "kv_indices_int64": dict(kv_indices=t.kv_indices.long()),
        "key_dtype": dict(append_key=case["key"].half()),
        "key_heads": dict(append_key=case["key"][:, :1]),
        "value_nnz": dict(append_value=case["value"][:3]),
        "key_last_stride": dict(append_key=case["key"].transpose(1, 2).contiguous().transpose(1, 2)),
        "positions_len": dict(positions=case["positions"][:3]),
        "positions_device": dict(positions=case["positions"].to("meta")),
        "indptr_device": dict(kv_indptr=t.kv_indptr.to("meta")),
        "layout": dict(kv_layout="DHN"),
        "cache_type": dict(paged_kv_cache=[case["cache"]]),
        "page_outside": dict(kv_indices=_i32([99] + t.kv_indices.tolist()[1:], dev)),
        "indptr_not_monotone": dict(kv_indptr=_i32([0, 3, 1], dev)),
        "last_len_empty_row": dict(kv_last_page_len=_i32([2, 0], dev)),
        "position_past_row": dict(positions=_i32([7, 8, 9, 9], dev)),
        "position_negative": dict(positions=_i32([-2, 8, 9, 0], dev)),
        "row_outside": dict(batch_indices=_i32([2, 0, 0, 1], dev)),
        "same_slot": dict(positions=_i32([7, 7, 9, 0], dev)),
    }[name]
    args, kw = _bad(case, **override)
    with pytest.raises(err, match=pattern):
        append_paged_kv_cache(**args, **kw)
    assert bool(torch.isnan(case["cache"]).all())  # nothing launched


def test_append_rejects_write_into_shared_page(device):
    """Two rows sharing a page and both appending into the same slot: caught."""
    table = PageTable.from_page_lists([[0, 1], [0, 2]], [5, 5], 4, device=device)
    cache = torch.full((3, 2, 4, 1, 8), float("nan"), device=device)
    key = torch.randn(2, 1, 8, device=device)
    with pytest.raises(ValueError, match="positions: tokens 0 and 1 both write page 0 slot 3"):
        append_paged_kv_cache(key, key, _i32([0, 1], device), _i32([3, 3], device), cache,
                              table.kv_indices, table.kv_indptr, table.kv_last_page_len)


# ---- GPU: realistic shapes and CUDA-graph capture ---------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_append_realistic_gpu(layout):
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(7)
    before = torch.randint(0, 300, (48,), generator=gen).tolist()
    append = [1] * 32 + torch.randint(1, 100, (16,), generator=gen).tolist()
    case = _make_case(dev, layout=layout, form="single", dtype=torch.bfloat16, page_size=16,
                      num_kv_heads=8, head_dim=128, before=before, append=append)
    expected = _reference(case, layout)
    _run(case, layout)
    _check(case, layout, expected)


@pytest.mark.gpu
def test_append_cuda_graph_capture():
    """Positions computed on the device and the append, with a padded nnz, replayed from a graph."""
    dev = torch.device("cuda")
    case = _make_case(dev, layout="HND", form="tuple", dtype=torch.float16, page_size=16,
                      num_kv_heads=4, head_dim=96, before=[100, 3, 0], append=[1, 1, 17])
    expected = _reference(case, "HND")
    t = case["table"]
    seq_lens = t.seq_lens()
    padded_key = torch.cat([case["key"], case["key"][:3]])  # 3 padding tokens at the end
    padded_value = torch.cat([case["value"], case["value"][:3]])

    def step():
        bi, pos = get_batch_indices_positions(case["append_indptr"], seq_lens, padded_key.shape[0])
        append_paged_kv_cache(padded_key, padded_value, bi, pos, case["cache"], t.kv_indices, t.kv_indptr,
                              t.kv_last_page_len, kv_layout="HND", validate=False)

    step()  # compile outside the graph
    for c in case["cache"]:
        c.fill_(float("nan"))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    torch.cuda.synchronize()
    _check(case, "HND", expected)
