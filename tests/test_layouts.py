"""Ragged indptr helpers and CSR page tables (cascadeinfer.layouts.indptr / page_table)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cascadeinfer.layouts.indptr import indptr_from_lengths, lengths_from_indptr, validate_indptr
from cascadeinfer.layouts.page_table import (
    PageTable,
    get_batch_indices_positions,
    get_seq_lens,
    validate_page_table,
)

i32 = torch.int32
lengths_st = st.lists(st.integers(0, 50), max_size=12)


# ---- indptr ---------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(lengths=lengths_st)
def test_indptr_round_trip_sequences(lengths):
    indptr = indptr_from_lengths(lengths)
    assert indptr.dtype == i32 and indptr.shape == (len(lengths) + 1,)
    assert indptr.tolist() == [sum(lengths[:i]) for i in range(len(lengths) + 1)]
    validate_indptr("indptr", indptr, total=sum(lengths))
    back = lengths_from_indptr(indptr)
    assert back.dtype == i32 and back.tolist() == lengths
    assert lengths_from_indptr(indptr.tolist()).tolist() == lengths


@settings(max_examples=30, deadline=None)
@given(lengths=lengths_st, dtype=st.sampled_from([torch.int32, torch.int64, torch.int16, torch.uint8]))
def test_indptr_round_trip_tensors(lengths, dtype):
    dev = (torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu"))
    t = torch.tensor(lengths, dtype=dtype, device=dev)
    indptr = indptr_from_lengths(t)
    assert indptr.device == dev and indptr.dtype == i32
    back = lengths_from_indptr(indptr)
    assert back.device == dev and back.dtype == i32
    assert back.cpu().tolist() == lengths
    # validate=False runs the same device ops with no content checks
    assert torch.equal(indptr_from_lengths(t, validate=False), indptr)
    assert torch.equal(lengths_from_indptr(indptr.long(), validate=False), back)


def test_indptr_empty_and_device(device):
    assert indptr_from_lengths([]).tolist() == [0]
    assert lengths_from_indptr([0]).tolist() == []
    out = indptr_from_lengths([2, 0, 3], device=device)
    assert out.device.type == device.type and out.tolist() == [0, 2, 2, 5]
    validate_indptr("x", [0])
    validate_indptr("x", torch.zeros(1, dtype=i32, device=device), total=0)


def test_indptr_bad_inputs():
    with pytest.raises(ValueError, match="lengths: length -1 at position 1"):
        indptr_from_lengths([2, -1])
    with pytest.raises(ValueError, match="lengths: length -3 at position 0"):
        indptr_from_lengths(torch.tensor([-3, 1]))
    with pytest.raises(ValueError, match="lengths: .*int32"):
        indptr_from_lengths([2**30, 2**30])
    with pytest.raises(TypeError, match="lengths: expected an integer dtype"):
        indptr_from_lengths(torch.tensor([1.0, 2.0]))
    with pytest.raises(TypeError, match="lengths: entry 1 is float"):
        indptr_from_lengths([1, 2.5])
    with pytest.raises(TypeError, match="lengths: entry 0 is a bool"):
        indptr_from_lengths([True])
    with pytest.raises(ValueError, match="lengths: expected 1 dimensions"):
        indptr_from_lengths(torch.ones(2, 2, dtype=i32))
    with pytest.raises(ValueError, match="lengths: is on cpu"):
        indptr_from_lengths(torch.ones(2, dtype=i32), device="meta")
    with pytest.raises(ValueError, match="indptr: expected at least one entry"):
        lengths_from_indptr(torch.zeros(0, dtype=i32))
    with pytest.raises(ValueError, match=r"indptr: expected monotone .*indptr\[1\] = 5 > indptr\[2\] = 3"):
        lengths_from_indptr(torch.tensor([0, 5, 3], dtype=i32))


@pytest.mark.parametrize(
    "values, total, err, pattern",
    [
        (torch.tensor([0, 2, 1], dtype=i32), None, ValueError, r"qo_indptr: expected monotone .*qo_indptr\[1\] = 2"),
        (torch.tensor([1, 2], dtype=i32), None, ValueError, "qo_indptr: expected the first entry to be 0, got 1"),
        (torch.tensor([0, 2], dtype=i32), 3, ValueError, "qo_indptr: expected the last entry to be 3, got 2"),
        (torch.tensor([0, 2], dtype=torch.int64), None, TypeError, "qo_indptr: expected dtype torch.int32"),
        (torch.zeros(0, dtype=i32), None, ValueError, "qo_indptr: expected at least one entry"),
        (torch.zeros(1, 2, dtype=i32), None, ValueError, "qo_indptr: expected 1 dimensions"),
        ([0, 3, 2], None, ValueError, "qo_indptr: expected monotone"),
        ([0, "a"], None, TypeError, "qo_indptr: entry 1 is str"),
        ([0, 2**31], None, ValueError, "qo_indptr: last entry .* int32"),
        ("012", None, TypeError, "qo_indptr: expected a tensor or a sequence of ints"),
    ],
)
def test_validate_indptr_rejects(values, total, err, pattern):
    with pytest.raises(err, match=pattern):
        validate_indptr("qo_indptr", values, total=total)


# ---- get_seq_lens / get_batch_indices_positions -----------------------------------------


def _random_table(gen: torch.Generator, n: int, page_size: int, num_pages: int, device):
    seq_lens = torch.randint(0, 4 * page_size, (n,), generator=gen).tolist()
    need = [-(-s // page_size) for s in seq_lens]
    perm = torch.randperm(num_pages, generator=gen).tolist()
    lists, at = [], 0
    for k in need:
        lists.append(perm[at:at + k])
        at += k
    return PageTable.from_page_lists(lists, seq_lens, page_size, num_pages=num_pages, device=device), seq_lens, lists


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_page_table_from_lists_and_seq_lens(device, page_size):
    gen = torch.Generator().manual_seed(page_size)
    table, seq_lens, lists = _random_table(gen, 7, page_size, 64 if page_size > 1 else 256, device)
    assert table.num_rows == 7 and table.device.type == device.type
    assert table.kv_indptr.tolist() == [sum(len(x) for x in lists[:i]) for i in range(8)]
    assert table.kv_indices.tolist() == [p for x in lists for p in x]
    for i, s in enumerate(seq_lens):
        want = 0 if s == 0 else s - (len(lists[i]) - 1) * page_size
        assert table.kv_last_page_len[i].item() == want
    got = table.seq_lens()
    assert got.dtype == i32 and got.device.type == device.type and got.tolist() == seq_lens
    assert get_seq_lens(table.kv_indptr, table.kv_last_page_len, page_size).tolist() == seq_lens


def test_page_table_edges(device):
    # last page exactly full, empty rows at both ends, a single token, no rows at all
    t = PageTable.from_page_lists([[], [4, 2], [0], []], [0, 32, 1, 0], 16, num_pages=5, device=device)
    assert t.kv_last_page_len.tolist() == [0, 16, 1, 0]
    assert t.seq_lens().tolist() == [0, 32, 1, 0]
    empty = PageTable.from_page_lists([], [], 4, device=device)
    assert empty.num_rows == 0 and empty.seq_lens().shape == (0,)
    # get_seq_lens ignores last_page_len of empty rows (FlashInfer's reading)
    lens = get_seq_lens(torch.tensor([0, 0, 1], dtype=i32, device=device),
                        torch.tensor([7, 3], dtype=i32, device=device), 4)
    assert lens.tolist() == [0, 3]
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.page_size = 3


def _batch_indices_positions_ref(append_indptr, seq_lens, nnz):
    bi, pos = [-1] * nnz, [-1] * nnz
    for i in range(len(seq_lens)):
        start, end = append_indptr[i], append_indptr[i + 1]
        for t in range(end - start):
            if start + t < nnz:
                bi[start + t] = i
                pos[start + t] = seq_lens[i] - (end - start) + t
    return bi, pos


@settings(max_examples=40, deadline=None)
@given(
    rows=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 30)), max_size=8),
    pad=st.integers(0, 3),
)
def test_get_batch_indices_positions(rows, pad):
    dev = (torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu"))
    append_lens = [a for a, _ in rows]
    seq_lens = [a + before for a, before in rows]
    append_indptr = indptr_from_lengths(append_lens, device=dev)
    nnz = sum(append_lens) + pad  # padded tails come back as -1
    bi, pos = get_batch_indices_positions(append_indptr, torch.tensor(seq_lens, dtype=i32, device=dev), nnz)
    assert bi.dtype == i32 and pos.dtype == i32 and bi.shape == (nnz,) and pos.shape == (nnz,)
    want_bi, want_pos = _batch_indices_positions_ref(append_indptr.tolist(), seq_lens, nnz)
    assert bi.cpu().tolist() == want_bi
    assert pos.cpu().tolist() == want_pos


def test_get_batch_indices_positions_truncated_and_bad(device):
    append_indptr = torch.tensor([0, 2, 5], dtype=i32, device=device)
    seq_lens = torch.tensor([4, 3], dtype=i32, device=device)
    bi, pos = get_batch_indices_positions(append_indptr, seq_lens, 3)  # fewer than all tokens
    assert bi.tolist() == [0, 0, 1] and pos.tolist() == [2, 3, 0]
    bi, pos = get_batch_indices_positions(torch.zeros(1, dtype=i32, device=device), seq_lens[:0], 2)
    assert bi.tolist() == [-1, -1] and pos.tolist() == [-1, -1]
    with pytest.raises(TypeError, match="append_indptr: expected dtype torch.int32"):
        get_batch_indices_positions(append_indptr.long(), seq_lens, 5)
    with pytest.raises(ValueError, match=r"seq_lens: expected shape \[2\]"):
        get_batch_indices_positions(append_indptr, seq_lens[:1], 5)
    with pytest.raises(ValueError, match="seq_lens: expected a tensor on"):
        get_batch_indices_positions(append_indptr, torch.zeros(2, dtype=i32, device="meta"), 5)
    with pytest.raises(ValueError, match="nnz: expected an int >= 0"):
        get_batch_indices_positions(append_indptr, seq_lens, -1)
    with pytest.raises(TypeError, match="kv_last_page_len: expected dtype torch.int32"):
        get_seq_lens(append_indptr, seq_lens.long(), 4)
    with pytest.raises(ValueError, match="page_size: expected an int >= 1"):
        get_seq_lens(append_indptr, seq_lens, 0)


@pytest.mark.gpu
def test_device_helpers_capture_in_cuda_graph():
    """get_seq_lens and get_batch_indices_positions never sync: they record in a graph."""
    dev = torch.device("cuda")
    kv_indptr = torch.tensor([0, 2, 2, 5], dtype=i32, device=dev)
    last = torch.tensor([3, 0, 16], dtype=i32, device=dev)
    append_indptr = torch.tensor([0, 1, 1, 4], dtype=i32, device=dev)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        seq_lens = get_seq_lens(kv_indptr, last, 16)
        bi, pos = get_batch_indices_positions(append_indptr, seq_lens, 6)
    graph.replay()
    torch.cuda.synchronize()
    assert seq_lens.tolist() == [19, 0, 48]
    assert bi.tolist() == [0, 2, 2, 2, -1, -1] and pos.tolist() == [18, 45, 46, 47, -1, -1]


# ---- validation -----------------------------------------------------------------------


def _table_args(device):
    return dict(
        kv_indptr=torch.tensor([0, 2, 2, 3], dtype=i32, device=device),
        kv_indices=torch.tensor([5, 1, 7], dtype=i32, device=device),
        kv_last_page_len=torch.tensor([4, 0, 1], dtype=i32, device=device),
        page_size=4,
        num_pages=8,
    )


@pytest.mark.parametrize(
    "change, err, pattern",
    [
        (dict(kv_indices=[5, 1, 70]), ValueError, "kv_indices: index 70 at position 2 is outside the pool of 8 pages"),
        (dict(kv_indices=[5, -1, 2]), ValueError, "kv_indices: index -1 at position 1 is outside the pool"),
        (dict(kv_indices=[5, 1]), ValueError, r"kv_indices: has 2 entries but kv_indptr\[-1\] is 3"),
        (dict(kv_indptr=[0, 2, 1, 3]), ValueError, "kv_indptr: expected monotone"),
        (dict(kv_indptr=[-1, 2, 2, 3]), ValueError, "kv_indptr: expected a first entry >= 0, got -1"),
        (dict(kv_last_page_len=[5, 0, 1]), ValueError,
         r"kv_last_page_len: row 0 has 2 pages and last_page_len 5; expected 1\.\.4"),
        (dict(kv_last_page_len=[0, 0, 1]), ValueError, "kv_last_page_len: row 0 has 2 pages and last_page_len 0"),
        (dict(kv_last_page_len=[4, 1, 1]), ValueError, "kv_last_page_len: row 1 has no pages and last_page_len 1"),
        (dict(kv_last_page_len=[4, 0]), ValueError, r"kv_last_page_len: expected shape \[3\]"),
        (dict(page_size=0), ValueError, "page_size: expected an int >= 1"),
        (dict(num_pages=2.0), TypeError, "num_pages: expected an int"),
        (dict(kv_indices="int64"), TypeError, "kv_indices: expected dtype torch.int32"),
        (dict(kv_indptr="int64"), TypeError, "kv_indptr: expected dtype torch.int32"),
        (dict(kv_last_page_len="meta"), ValueError, "kv_last_page_len: expected a tensor on"),
        (dict(kv_indices="strided"), ValueError, "kv_indices: expected a contiguous tensor"),
    ],
)
def test_validate_page_table_rejects(device, change, err, pattern):
    args = _table_args(device)
    for key, value in change.items():
        if isinstance(value, list):
            args[key] = torch.tensor(value, dtype=i32, device=device)
        elif value == "int64":
            args[key] = args[key].long()
        elif value == "meta":
            args[key] = args[key].to("meta")
        elif value == "strided":
            args[key] = torch.stack([args[key], args[key]], 1)[:, 0]
        else:
            args[key] = value
    with pytest.raises(err, match=pattern):
        validate_page_table(**args)
    with pytest.raises(err, match=pattern):
        PageTable(**args)


def test_validate_page_table_accepts_and_shape_only(device):
    args = _table_args(device)
    validate_page_table(**args)
    table = PageTable(**args)
    assert table.seq_lens().tolist() == [8, 0, 1]
    # contents=False skips only the content checks (no host sync)
    args["kv_indices"] = torch.tensor([5, 1, 70], dtype=i32, device=device)
    validate_page_table(**args, contents=False)
    args["num_pages"] = None  # no pool size: only negative indices are out of range
    validate_page_table(**args)


def test_from_page_lists_rejects():
    with pytest.raises(ValueError, match=r"page_lists: row 1 has 1 pages but seq_len 17 needs cdiv\(17, 16\) = 2"):
        PageTable.from_page_lists([[0], [1]], [3, 17], 16)
    with pytest.raises(ValueError, match="page_lists: row 0 has 1 pages but seq_len 0 needs"):
        PageTable.from_page_lists([[0]], [0], 16)
    with pytest.raises(ValueError, match="seq_lens: has 1 entries but page_lists has 2 rows"):
        PageTable.from_page_lists([[0], [1]], [3], 16)
    with pytest.raises(ValueError, match="seq_lens: entry 0 is -2"):
        PageTable.from_page_lists([[]], [-2], 16)
    with pytest.raises(ValueError, match="kv_indices: index 9 at position 1 is outside the pool of 4 pages"):
        PageTable.from_page_lists([[0, 9]], [20], 16, num_pages=4)
    with pytest.raises(TypeError, match=r"page_lists\[0\]: entry 0 is float"):
        PageTable.from_page_lists([[0.0]], [3], 16)
    assert PageTable.from_page_lists([[3]], torch.tensor([2]), 16).kv_indices.tolist() == [3]


def test_from_page_lists_rejects_ids_outside_int32():
    with pytest.raises(ValueError, match=r"page_lists: row 0 holds page id 1099511627776; page ids are int32"):
        PageTable.from_page_lists([[2**40]], [3], 4)
    with pytest.raises(ValueError, match="page_lists: row 1 holds page id -1"):
        PageTable.from_page_lists([[0], [-1, 2]], [3, 5], 4)
    with pytest.raises(ValueError, match="page_size: expected at most 2147483647"):
        PageTable.from_page_lists([[0]], [3], 2**40)
    assert PageTable.from_page_lists([[2**31 - 1]], [3], 4).kv_indices.tolist() == [2**31 - 1]


def test_get_batch_indices_positions_seq_lens_shorter_than_the_append(device):
    """Validated: an error naming seq_lens. Not validated (no host sync): the tokens that
    would land at negative positions are skipped (-1), never given a negative position."""
    append_indptr = torch.tensor([0, 3, 5, 6], dtype=i32, device=device)
    seq_lens = torch.tensor([1, 7, 1], dtype=i32, device=device)  # row 0 appends 3 tokens but has length 1
    with pytest.raises(ValueError, match="seq_lens: row 0 has length 1 but appends 3 tokens"):
        get_batch_indices_positions(append_indptr, seq_lens, 6)
    bi, pos = get_batch_indices_positions(append_indptr, seq_lens, 7, validate=False)
    assert bi.tolist() == [-1, -1, 0, 1, 1, 2, -1] and pos.tolist() == [-1, -1, 0, 5, 6, 0, -1]
    with pytest.raises(TypeError, match="validate: expected a bool"):
        get_batch_indices_positions(append_indptr, seq_lens, 6, validate=1)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_cache_of_the_other_layout_is_named(device, layout):
    """A cache passed with the wrong kv_layout: the error names the layout mismatch, not
    q's head count or kv_last_page_len (which the swapped page/head axes would break)."""
    from cascadeinfer.cascade.multi_level import MultiLevelCascadeAttention  # noqa: PLC0415
    from cascadeinfer.kernels.decode import batch_decode_paged  # noqa: PLC0415
    from cascadeinfer.kernels.prefill import batch_prefill_paged  # noqa: PLC0415

    page_size, hkv, d = 16, 2, 32
    other = "HND" if layout == "NHD" else "NHD"
    inner = (hkv, page_size) if other == "HND" else (page_size, hkv)
    cache = torch.randn(6, 2, *inner, d, device=device)  # built in the other layout
    indptr, indices = torch.tensor([0, 3, 6], dtype=i32, device=device), torch.arange(6, dtype=i32, device=device)
    last = torch.tensor([9, 16], dtype=i32, device=device)
    qo_indptr = torch.tensor([0, 1, 2], dtype=i32, device=device)
    for hq in (4, 32):  # 4 heads: q's head count breaks too; 32: only kv_last_page_len does
        q = torch.randn(2, hq, d, device=device)
        with pytest.raises(ValueError, match=f"paged_kv_cache: read as kv_layout='{layout}'.*pass kv_layout='{other}'"):
            batch_decode_paged(q, cache, indptr, indices, last, kv_layout=layout)
        with pytest.raises(ValueError, match=f"is it an {other} cache"):
            batch_prefill_paged(q, qo_indptr, cache, indptr, indices, last, kv_layout=layout)
    attn = MultiLevelCascadeAttention(1, kv_layout=layout, device=device)
    attn.plan([qo_indptr], [indptr], [indices], [last], 4, hkv, d, page_size)
    with pytest.raises(ValueError, match=f"pass kv_layout='{other}'"):
        attn.run(torch.randn(2, 4, d, device=device), cache)
    # where the other reading does not fit either, the usual checks speak
    with pytest.raises(ValueError, match="kv_last_page_len"):
        batch_decode_paged(torch.randn(2, 32, d, device=device), cache, indptr, indices,
                           torch.tensor([9, 40], dtype=i32, device=device), kv_layout=other)


def test_one_page_table_rule_everywhere(device):
    """The same table is accepted, or refused with the same message, by PageTable, decode,
    prefill, append and the cascade plan: a start past 0 and unread entries past
    kv_indptr[-1] are fine; an empty row with a last-page length is not."""
    from cascadeinfer import (MultiLevelCascadeAttention, append_paged_kv_cache, batch_decode_paged,
                              batch_prefill_paged)

    t = lambda x: torch.tensor(x, dtype=i32, device=device)  # noqa: E731
    cache = torch.randn(6, 2, 4, 2, 16, device=device)
    q = torch.randn(2, 4, 16, device=device)
    qo = torch.arange(3, dtype=i32, device=device)
    ok = dict(kv_indptr=t([1, 3, 4]), kv_indices=t([5, 0, 2, 4, 1]), kv_last_page_len=t([2, 4]))
    empty_row = dict(kv_indptr=t([0, 2, 2]), kv_indices=t([0, 2]), kv_last_page_len=t([2, 3]))

    def calls(tab):
        return [
            lambda: PageTable(tab["kv_indptr"], tab["kv_indices"], tab["kv_last_page_len"], 4, 6),
            lambda: batch_decode_paged(q, cache, tab["kv_indptr"], tab["kv_indices"], tab["kv_last_page_len"]),
            lambda: batch_prefill_paged(q, qo, cache, tab["kv_indptr"], tab["kv_indices"], tab["kv_last_page_len"]),
            lambda: append_paged_kv_cache(q[:, :2], q[:, 2:], t([-1, -1]), t([0, 0]), cache, tab["kv_indices"],
                                          tab["kv_indptr"], tab["kv_last_page_len"]),
            lambda: MultiLevelCascadeAttention(1, device=device).plan(
                [qo], [tab["kv_indptr"]], [tab["kv_indices"]], [tab["kv_last_page_len"]], 4, 2, 16, 4, num_pages=6),
        ]

    for call in calls(ok):
        call()
    for call in calls(empty_row):
        with pytest.raises(ValueError, match="row 1 has no pages and last_page_len 3"):
            call()
