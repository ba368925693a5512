"""append_paged_kv_cache_rope: bit for bit apply_rope then append_paged_kv_cache, in one launch."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cascadeinfer.ops  # noqa: F401  (registers torch.ops.cascadeinfer.*)
from cascadeinfer import append_paged_kv_cache_rope
from cascadeinfer.kernels import rope_append
from cascadeinfer.kernels.append import append_paged_kv_cache
from cascadeinfer.kernels.fused import apply_rope
from cascadeinfer.kernels.launch import LaunchCache
from cascadeinfer.kernels.reference import append_paged_kv_cache_ref, apply_rope_ref
from cascadeinfer.layouts.indptr import indptr_from_lengths
from cascadeinfer.layouts.page_table import PageTable, get_batch_indices_positions
from cascadeinfer.layouts.paged_cache import cache_tensors, unpack_paged_kv_cache

i32 = torch.int32
BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
MAX_POS = 64


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits: NaN poison compares equal to itself, and -0.0 differs from 0.0."""
    return t.view(BITS[t.dtype])


def _cos_sin(head_dim: int, dtype, device) -> torch.Tensor:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.arange(MAX_POS).float()[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype).to(device)


class Case:
    """One call's inputs: q, k, v views of a NaN-padded qkv buffer (as the engine cuts
    them from its projection), a shuffled page table whose rows hold ``before[i]`` tokens
    and grow by ``append[i]``, ``pad`` padding tokens (batch index -1) at the end, a
    NaN-poisoned cache, and rotation positions drawn apart from the append positions."""

    def __init__(self, device, *, layout="NHD", form="single", dtype=torch.bfloat16, page_size=4, heads=(4, 2),
                 head_dim=16, before=(5, 0), append=(2, 3), pad=0, rope_dtype=torch.int64, seed=0):
        gen = torch.Generator().manual_seed(seed)
        hq, hkv = heads
        self.layout, self.dtype, self.heads, self.head_dim = layout, dtype, heads, head_dim
        totals = [b + a for b, a in zip(before, append)]
        need = [-(-t // page_size) for t in totals]
        num_pages = sum(need) + 3  # pages nobody owns: they must stay poisoned
        perm = torch.randperm(num_pages, generator=gen).tolist()
        lists, at = [], 0
        for n in need:
            lists.append(perm[at:at + n])
            at += n
        self.table = PageTable.from_page_lists(lists, totals, page_size, num_pages=num_pages, device=device)
        inner = (page_size, hkv) if layout == "NHD" else (hkv, page_size)
        if form == "single":
            self.cache = torch.full((num_pages, 2, *inner, head_dim), math.nan, dtype=dtype, device=device)
        else:
            self.cache = tuple(torch.full((num_pages, *inner, head_dim), math.nan, dtype=dtype, device=device)
                               for _ in range(2))
        self.nnz = nnz = sum(append) + pad
        self.batch_indices, self.positions = get_batch_indices_positions(
            indptr_from_lengths(list(append), device=device), self.table.seq_lens(), nnz)
        width = (hq + 2 * hkv) * head_dim
        self.qkv = torch.full((nnz + 1, width + 8), math.nan, dtype=dtype, device=device)
        self.qkv[:nnz, :width] = (torch.randn(nnz, width, generator=gen) * 2).to(dtype).to(device)
        self.rope_positions = torch.randint(0, MAX_POS, (nnz,), generator=gen).to(rope_dtype).to(device)
        self.cos_sin = _cos_sin(head_dim, dtype, device)

    def views(self, qkv: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        hq, hkv = self.heads
        d, n = self.head_dim, self.nnz
        qkv = self.qkv if qkv is None else qkv
        return (qkv[:n, :hq * d].view(n, hq, d), qkv[:n, hq * d:(hq + hkv) * d].view(n, hkv, d),
                qkv[:n, (hq + hkv) * d:(hq + 2 * hkv) * d].view(n, hkv, d))

    def args(self, qkv=None, cache=None) -> tuple:
        t = self.table
        return (*self.views(qkv), self.batch_indices, self.positions, self.cache if cache is None else cache,
                t.kv_indices, t.kv_indptr, t.kv_last_page_len, self.rope_positions, self.cos_sin)

    def fresh_cache(self):
        return self.cache.clone() if isinstance(self.cache, torch.Tensor) else tuple(c.clone() for c in self.cache)

    def separate(self) -> tuple:
        """The two launches this one replaces, on copies: ``(qkv, cache)`` after them."""
        qkv, cache = self.qkv.clone(), self.fresh_cache()
        q, k, v, bi, pos, _, idx, indptr, last, rope_pos, cs = self.args(qkv, cache)
        apply_rope(q, k, rope_pos, cs)
        append_paged_kv_cache(k, v, bi, pos, cache, idx, indptr, last, kv_layout=self.layout)
        return qkv, cache

    def run(self, qkv=None, cache=None, **kw) -> None:
        append_paged_kv_cache_rope(*self.args(qkv, cache), kv_layout=self.layout, **kw)


def _assert_same_bits(case: Case, want: tuple, qkv=None, cache=None) -> None:
    want_qkv, want_cache = want
    got_qkv = case.qkv if qkv is None else qkv
    got_cache = case.cache if cache is None else cache
    assert torch.equal(_bits(got_qkv), _bits(want_qkv)), "q, k or v (or the padding around them) differ"
    for got, exp in zip(cache_tensors(got_cache), cache_tensors(want_cache)):
        assert torch.equal(_bits(got), _bits(exp)), "the cache differs"


# ---- bit for bit against the two launches it fuses -------------------------------------


@pytest.mark.parametrize(
    "layout, form, dtype, page_size, heads, head_dim",
    [
        ("NHD", "single", torch.bfloat16, 16, (8, 2), 128),
        ("HND", "tuple", torch.bfloat16, 16, (8, 2), 128),
        ("HND", "single", torch.float16, 1, (6, 2), 96),
        ("NHD", "tuple", torch.float16, 1, (6, 2), 96),
        ("NHD", "single", torch.float32, 4, (3, 3), 64),
        ("HND", "tuple", torch.float32, 4, (3, 3), 64),
        ("HND", "single", torch.bfloat16, 3, (4, 1), 256),
        ("NHD", "tuple", torch.bfloat16, 3, (4, 1), 256),
    ],
)
def test_matches_rope_then_append(device, layout, form, dtype, page_size, heads, head_dim):
    # rows: a decode token into a fresh page, a prefill from empty, a row that appends
    # nothing, a row ending exactly on a page boundary, an append spanning pages; then
    # two padding tokens
    before = [page_size * 2, 0, 5, page_size * 2 - 1, 1]
    append = [1, 3, 0, 1, page_size + 2]
    case = Case(device, layout=layout, form=form, dtype=dtype, page_size=page_size, heads=heads, head_dim=head_dim,
                before=before, append=append, pad=2, seed=page_size + head_dim)
    assert case.table.seq_lens().tolist()[3] % page_size == 0  # the last page exactly full
    want = case.separate()
    case.run()
    _assert_same_bits(case, want)


@settings(max_examples=12, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    layout=st.sampled_from(["NHD", "HND"]),
    form=st.sampled_from(["single", "tuple"]),
    dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32]),
    page_size=st.sampled_from([1, 2, 5, 16]),
    heads=st.sampled_from([(1, 1), (2, 2), (4, 1), (8, 2), (12, 4)]),
    head_dim=st.sampled_from([8, 16, 64, 96, 128, 256]),
    rows=st.lists(st.tuples(st.integers(0, 20), st.integers(0, 4)), min_size=1, max_size=4),
    pad=st.integers(0, 2),
    rope_dtype=st.sampled_from([torch.int32, torch.int64]),
)
def test_random_cases_match_rope_then_append(seed, layout, form, dtype, page_size, heads, head_dim, rows, pad,
                                             rope_dtype):
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    before, append = zip(*rows)
    case = Case(device, layout=layout, form=form, dtype=dtype, page_size=page_size, heads=heads, head_dim=head_dim,
                before=before, append=append, pad=pad, rope_dtype=rope_dtype, seed=seed)
    want = case.separate()
    case.run()
    _assert_same_bits(case, want)


def test_matches_the_references(device):
    """Against the references of both ops (independent of either kernel): the rotation of
    every token, padding included; the rotated keys and the values in their slots."""
    case = Case(device, layout="HND", form="tuple", dtype=torch.float16, page_size=4, heads=(6, 3), head_dim=32,
                before=[3, 9, 0], append=[2, 1, 5], pad=2, seed=5)
    q, k, v = (t.clone() for t in case.views())
    want_q, want_k = apply_rope_ref(q, k, case.rope_positions, case.cos_sin)
    t = case.table
    want_cache = append_paged_kv_cache_ref(want_k, v, case.batch_indices, case.positions, case.cache, t.kv_indices,
                                           t.kv_indptr, t.kv_last_page_len, kv_layout="HND")
    case.run()
    got_q, got_k, got_v = case.views()
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k) and torch.equal(got_v, v)
    kv = unpack_paged_kv_cache(case.cache, "HND")
    for got, want in zip((kv.k, kv.v), want_cache):
        torch.testing.assert_close(got.double().cpu(), want, rtol=0, atol=0, equal_nan=True)
    real = int((case.batch_indices >= 0).sum())
    assert int((~kv.k.isnan()).sum() + (~kv.v.isnan()).sum()) == 2 * real * 3 * 32  # nothing else written


def test_padding_tokens_are_rotated_not_appended(device):
    """Only padding tokens: q and k rotate (as apply_rope rotates them), the cache stays poisoned."""
    case = Case(device, before=[4, 2], append=[0, 0], pad=3, seed=6)
    assert case.batch_indices.tolist() == [-1, -1, -1]
    unrotated = case.qkv.clone()
    want = case.separate()
    case.run()
    _assert_same_bits(case, want)
    assert bool(case.cache.isnan().all())
    assert not torch.equal(_bits(case.qkv), _bits(unrotated))


def test_empty_and_unvalidated(device):
    empty = Case(device, before=[3], append=[0], seed=7)
    empty.run()
    assert bool(empty.cache.isnan().all())
    case = Case(device, layout="HND", dtype=torch.float32, before=[2, 6], append=[3, 1], seed=8)
    want = case.separate()
    case.run(validate=False)
    _assert_same_bits(case, want)


@pytest.mark.parametrize("pair", [tuple, list])
def test_replay_with_new_tensors(device, monkeypatch, pair):
    """The second call of a signature replays the first one's launch on new tensors (new
    addresses, same shapes and strides), without the Python checks; validate=True still
    checks the new contents first. A (k, v) cache given as a list is a root like the
    tuple: the replay writes the new call's cache."""
    monkeypatch.setattr(rope_append, "_LAUNCHES", LaunchCache())
    first = Case(device, layout="HND", form="tuple", heads=(8, 2), head_dim=64, before=[3, 17], append=[1, 1],
                 pad=1, seed=9)
    first.run(first.qkv, pair(first.cache))
    second = Case(device, layout="HND", form="tuple", heads=(8, 2), head_dim=64, before=[3, 17], append=[1, 1],
                  pad=1, seed=10)
    want = second.separate()
    qkv, cache = second.qkv.clone(), pair(second.fresh_cache())

    def no_checks(*args, **kwargs):
        raise AssertionError("a replayed call ran the argument checks")

    monkeypatch.setattr(rope_append, "_check_args", no_checks)
    second.run(qkv, cache)
    _assert_same_bits(second, want, qkv, cache)
    if device.type == "cpu":  # under the interpreter the recording is what ran: it is there
        assert len(rope_append._LAUNCHES._items) == 1
    # The contents are still checked before a replay when asked.
    bad = second.positions.clone()
    bad[0] = 99
    t = second.table
    before = second.fresh_cache()
    with pytest.raises(ValueError, match="positions: entry 0 is 99"):
        append_paged_kv_cache_rope(*second.views(), second.batch_indices, bad, before, t.kv_indices, t.kv_indptr,
                                   t.kv_last_page_len, second.rope_positions, second.cos_sin, kv_layout="HND")
    assert all(bool(c.isnan().all()) for c in before)


def test_torch_path(monkeypatch):
    """Plain CPU without the interpreter: both fused ops' PyTorch paths, the same bits; a
    token outside its row raises and leaves q, k and the cache as they were."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    case = Case(torch.device("cpu"), layout="NHD", form="tuple", dtype=torch.bfloat16, page_size=4, heads=(4, 2),
                head_dim=24, before=[5, 0, 8], append=[3, 2, 0], pad=1, seed=11)
    want = case.separate()
    case.run()
    _assert_same_bits(case, want)
    fresh = Case(torch.device("cpu"), before=[5, 0], append=[2, 1], seed=12)
    fresh.positions = torch.tensor([5, 9, 0], dtype=i32)  # 9: past the first row's pages
    qkv_before = fresh.qkv.clone()
    with pytest.raises(IndexError, match="positions"):
        fresh.run(validate=False)
    assert torch.equal(_bits(fresh.qkv), _bits(qkv_before)) and bool(fresh.cache.isnan().all())


# ---- bad input: named, before any launch -----------------------------------------------


def test_rejects_bad_input(device):
    case = Case(device, dtype=torch.float32, heads=(4, 2), head_dim=16, before=[7, 0], append=[3, 1], seed=13)
    q, k, v, bi, pos, cache, idx, indptr, last, rope_pos, cs = case.args()
    cases = [
        (dict(q=[[0.0]]), TypeError, "q: expected a torch.Tensor"),
        (dict(q=q.half()), TypeError, "q: expected dtype torch.float32"),
        (dict(q=q[:3]), ValueError, r"q: expected shape \[4, \*, 16\]"),
        (dict(q=q[..., :8]), ValueError, r"q: expected shape \[4, \*, 16\]"),
        (dict(q=q.transpose(1, 2).contiguous().transpose(1, 2)), ValueError, "q: the last dimension"),
        (dict(append_key=k[:, :1]), ValueError, r"append_key: expected shape \[\*, 2, 16\]"),
        (dict(append_key=q[:, :2]), ValueError, "append_key: overlaps q"),
        (dict(append_value=k), ValueError, "append_value: overlaps append_key"),
        (dict(append_value=q[:, :2]), ValueError, "append_value: overlaps q"),
        (dict(batch_indices=bi.long()), TypeError, "batch_indices: expected dtype torch.int32"),
        (dict(positions=pos[:3]), ValueError, r"positions: expected shape \[4\]"),
        (dict(paged_kv_cache=[cache]), TypeError, "paged_kv_cache: expected a tensor"),
        (dict(paged_kv_cache=None), TypeError, "paged_kv_cache"),
        (dict(kv_layout="DHN"), ValueError, "kv_layout: expected 'NHD' or 'HND'"),
        (dict(kv_indices=torch.tensor([99] + idx.tolist()[1:], dtype=i32, device=device)), ValueError,
         "kv_indices: index 99 at position 0 is outside the pool"),
        (dict(positions=torch.tensor([7, 8, 9, 9], dtype=i32, device=device)), ValueError,
         "positions: entry 3 is 9 but row 1 holds 1 tokens"),
        (dict(rope_positions=rope_pos.float()), TypeError, "rope_positions: expected dtype"),
        (dict(rope_positions=rope_pos[:2]), ValueError, r"rope_positions: expected shape \[4\]"),
        (dict(rope_positions=rope_pos + MAX_POS), ValueError, rf"rope_positions: expected values in \[0, {MAX_POS}\)"),
        (dict(cos_sin_cache=cs[:, :8]), ValueError, "cos_sin_cache: expected shape"),
        (dict(cos_sin_cache=cs.t().contiguous().t()), ValueError, "cos_sin_cache: the last dimension"),
    ]
    names = ("q", "append_key", "append_value", "batch_indices", "positions", "paged_kv_cache", "kv_indices",
             "kv_indptr", "kv_last_page_len", "rope_positions", "cos_sin_cache")
    qkv_before = case.qkv.clone()
    for override, exc, words in cases:
        args = dict(zip(names, case.args()))
        kw = {"kv_layout": override.pop("kv_layout", "NHD")}
        args.update(override)
        with pytest.raises(exc, match=words):
            append_paged_kv_cache_rope(*args.values(), **kw)
        assert bool(case.cache.isnan().all()), words  # nothing launched
        assert torch.equal(_bits(case.qkv), _bits(qkv_before)), words
    odd = torch.full((7, 2, 4, 2, 15), math.nan, device=device)
    kk = torch.zeros(4, 2, 15, device=device)
    with pytest.raises(ValueError, match="q: expected an even head_dim"):
        append_paged_kv_cache_rope(torch.zeros(4, 4, 15, device=device), kk, kk.clone(), bi, pos, odd, idx, indptr,
                                   last, rope_pos, torch.zeros(MAX_POS, 15, device=device))


# ---- the custom op ------------------------------------------------------------------------


def test_custom_op(device):
    case = Case(device, dtype=torch.float16, before=[2, 5], append=[1, 2], pad=1, seed=14)
    q, k, v, bi, pos, cache, idx, indptr, last, rope_pos, cs = case.args()
    torch.library.opcheck(torch.ops.cascadeinfer.append_paged_kv_cache_rope.default,
                          (q.clone(), k.clone(), v.clone(), bi, pos, cache.clone(), None, idx, indptr, last, rope_pos,
                           cs, "NHD"),
                          test_utils=("test_schema", "test_faketensor"))
    want = case.separate()
    torch.ops.cascadeinfer.append_paged_kv_cache_rope(q, k, v, bi, pos, cache, None, idx, indptr, last, rope_pos, cs,
                                                      "NHD", True)
    _assert_same_bits(case, want)
    tuple_case = Case(device, form="tuple", layout="HND", before=[2, 5], append=[1, 2], seed=15)
    want = tuple_case.separate()
    q, k, v, bi, pos, (k_cache, v_cache), idx, indptr, last, rope_pos, cs = tuple_case.args()
    torch.ops.cascadeinfer.append_paged_kv_cache_rope(q, k, v, bi, pos, k_cache, v_cache, idx, indptr, last,
                                                      rope_pos, cs, "HND")
    _assert_same_bits(tuple_case, want)


# ---- the decoder layer's side of the protocol ---------------------------------------------


def _causal(q, k, v):
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = torch.einsum("thd,shd->hts", q.float(), k.float()) * q.shape[-1] ** -0.5
    s = s.masked_fill(torch.ones_like(s[0], dtype=torch.bool).triu(1), -math.inf)
    return torch.einsum("hts,shd->thd", s.softmax(-1), v.float()).to(q.dtype).contiguous()


class _RotatingAttention:
    """An attention that takes the rotation over (as the model runner's do), rotating
    with apply_rope: the same numbers as a layer that rotates before calling it."""

    applies_rope = True

    def __init__(self):
        self.handed = []

    def __call__(self, layer, q, k, v, positions=None, cos_sin=None):
        self.handed.append(positions is not None)
        if positions is not None:
            apply_rope(q, k, positions, cos_sin)
        return _causal(q, k, v)


def test_fused_layer_hands_the_rotation_to_an_attention_that_applies_it(device):
    from cascadeinfer.engine.llama import LlamaForCausalLM  # noqa: PLC0415
    from cascadeinfer.engine.model_loader import ModelConfig  # noqa: PLC0415

    config = ModelConfig(model_type="llama", vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=2,
                         num_qo_heads=4, num_kv_heads=2, head_dim=16)
    model = LlamaForCausalLM(config, dtype=torch.bfloat16, device=device, max_positions=32, fused=True)
    model.init_random_(seed=4, std=0.2)
    ids = torch.randint(0, 64, (7,), generator=torch.Generator().manual_seed(16)).to(device)
    positions = torch.arange(3, 10, device=device)
    rotating = _RotatingAttention()
    with torch.inference_mode():
        handed = model(ids, positions, rotating)
        rotated_first = model(ids, positions, lambda layer, q, k, v: _causal(q, k, v))
        model.fused = False  # op by op: every attention gets q and k rotated
        plain = model(ids, positions, rotating)
    assert rotating.handed == [True, True, False, False]
    assert torch.equal(handed, rotated_first)
    # Op by op differs from the fused kernels only in a unit in the last place now and then.
    torch.testing.assert_close(plain, handed, rtol=1.5e-1, atol=1.5e-1)
