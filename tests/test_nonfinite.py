"""Garbage in never gives a plausible answer out: NaN and ±inf in q, K or V.

The contract every kernel and every reference keeps (DESIGN.md's infinity rules, made
exact for non-finite input):

* "empty" means "no keys", decided from the key count: a query that sees no key gets
  ``(0, -inf)`` whatever its q or the cache around it holds;
* a (query, head) that sees a key with a NaN or +inf score (from q or K), or with a NaN
  or inf anywhere in its value, gets ``(NaN, NaN)``;
* a score of -inf is a key of weight 0;
* keys outside a query's range (padding of a last page, pages of other requests, keys
  the causal mask hides) never touch it.

Each case plants one kind of garbage in a few places, runs the Triton kernels (the GPU,
or the interpreter on CPU) and the plain-PyTorch path, and compares both with the
float64 reference per (row, head): NaN exactly where it has NaN, (0, -inf) exactly where
it has that, equal within tolerance everywhere else. The references are checked against
each other too.
"""

from __future__ import annotations

import math

import pytest
import torch

from cascadeinfer.cascade.multi_level import MultiLevelCascadeAttention
from cascadeinfer.kernels import policy
from cascadeinfer.kernels import prefill as P
from cascadeinfer.kernels.decode import batch_decode_paged, batch_decode_paged_ref, decode_with_config
from cascadeinfer.kernels.merge import merge_state, merge_state_in_place
from cascadeinfer.kernels.merge_many import merge_states, merge_states_ragged
from cascadeinfer.kernels.prefill import (
    batch_prefill_paged,
    batch_prefill_ragged,
    shared_prefix_attention,
)
from cascadeinfer.kernels.reference import (
    attention_state_ref,
    merge_state_ref,
    merge_states_ragged_ref,
    merge_states_ref,
)
from cascadeinfer.layouts.indptr import indptr_from_lengths
from cascadeinfer.layouts.page_table import PageTable
from cascadeinfer.layouts.paged_cache import gather_paged_kv, unpack_paged_kv_cache

NAN, INF = math.nan, math.inf
GARBAGE = pytest.mark.parametrize("bad", [NAN, INF, -INF], ids=["nan", "+inf", "-inf"])
SMALL = policy.TileConfig(16, 16, 4, 1)  # many tiles and splits from few tokens (GPU-valid: dot dims >= 16)
# (o, lse) tolerances where the reference is finite; fp32 products are exact fp32.
TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (3e-3, 2e-3), torch.bfloat16: (2e-2, 2e-3)}

# numpy under the interpreter warns on inf - inf, 0 * inf and max over NaN: those are the point here
pytestmark = pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning", "ignore:overflow:RuntimeWarning",
                                        "ignore:All-NaN slice:RuntimeWarning")


# ---------------------------------------------------------------------------- helpers


@pytest.fixture(params=["triton", "torch"])
def path(request, monkeypatch, device):
    """Where the public functions run: the Triton kernels (``device``), or the plain-PyTorch
    path of CPU tensors (the float64 references, vectorised), which the library takes when
    no GPU and no interpreter is present."""
    if request.param == "torch":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        return torch.device("cpu")
    return device


def check(o, lse, ref_o, ref_lse, dtype=torch.float32):
    """Per (row, head): NaN exactly where the reference is NaN (o and lse), (0, -inf)
    exactly where it is that, finite and equal within tolerance everywhere else."""
    o, lse = o.cpu(), lse.cpu()
    ref_o, ref_lse = ref_o.cpu(), ref_lse.cpu()
    bad = torch.isnan(ref_lse)
    assert torch.equal(torch.isnan(lse), bad), (
        f"lse NaN at {torch.isnan(lse).nonzero().tolist()}, reference at {bad.nonzero().tolist()}")
    assert bool(torch.isnan(o[bad]).all()), "a poisoned (row, head) must be NaN in every element of o"
    assert bool(torch.isfinite(o[~bad]).all()), f"non-finite o at {(~torch.isfinite(o)).any(-1).nonzero().tolist()}"
    empty = ref_lse == -INF
    assert torch.equal(lse == -INF, empty), "lse = -inf exactly where the reference has it"
    assert bool((o[empty] == 0).all()), "a row with no keys must have o = 0"
    o_tol, lse_tol = TOL[dtype]
    live = ~bad & ~empty
    torch.testing.assert_close(o[~bad].double(), ref_o[~bad].double(), atol=o_tol, rtol=o_tol)
    torch.testing.assert_close(lse[live].double(), ref_lse[live].double(), atol=lse_tol, rtol=lse_tol)


def check_references_agree(a, b):
    """Two float64 references: the same NaN and -inf, the same values elsewhere."""
    (o_a, lse_a), (o_b, lse_b) = a, b
    assert torch.equal(torch.isnan(lse_a), torch.isnan(lse_b))
    assert torch.equal(torch.isnan(o_a), torch.isnan(o_b))
    assert torch.equal(lse_a == -INF, lse_b == -INF)
    torch.testing.assert_close(o_a, o_b, equal_nan=True)
    torch.testing.assert_close(lse_a, lse_b, equal_nan=True)


def paged_case(lens, page_size, hkv, head_dim, dtype, device, *, seed, spare_pages=2):
    """A random NHD pool (``spare_pages`` owned by no row) and a shuffled CSR page table."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // page_size) for n in lens]
    num_pages = sum(need) + spare_pages
    perm = torch.randperm(num_pages, generator=gen).tolist()
    lists, at = [], 0
    for k in need:
        lists.append(perm[at:at + k])
        at += k
    table = PageTable.from_page_lists(lists, lens, page_size, num_pages=num_pages, device=device)
    cache = torch.randn((num_pages, 2, page_size, hkv, head_dim), generator=gen).to(device, dtype)
    spare = perm[at:]
    return cache, table, lists, spare


def token_slot(lists, page_size, row, token):
    """(page, slot) of ``token`` of ``row``."""
    return lists[row][token // page_size], token % page_size


def plant_outside(cache, lists, lens, spare, page_size, bad):
    """Garbage where no row may look: the padding of a partial last page and a spare page."""
    for row, n in enumerate(lens):
        if n % page_size:
            cache[lists[row][-1], :, n % page_size:] = bad
            break
    cache[spare[0]] = bad


# ---------------------------------------------------------------------------- decode

DECODE_LENS = [7, 5, 9, 0, 6]  # pages of 4: 2, 2, 3, 0, 2 (request 3 has no keys)
SCHEDULES = pytest.mark.parametrize("schedule,num_splits", [
    ("per_request", 1),
    ("per_request", 3),  # split states merged by merge_states' kernel, some splits empty
    ("balanced", 9),  # one page per program: every request of 2+ pages goes through stage 2
    ("all_heads", 1),
    ("all_heads", 3),  # the last key re-read past the end, split states merged
], ids=["one-split", "splits", "balanced", "all-heads", "all-heads-splits"])


def decode_case(bad, dtype, device, seed=0, d=16):
    page_size, hkv, group = 4, 2, 2
    cache, table, lists, spare = paged_case(DECODE_LENS, page_size, hkv, d, dtype, device, seed=seed)
    q = torch.randn((len(DECODE_LENS), hkv * group, d), generator=torch.Generator().manual_seed(seed + 1))
    q = q.to(device, dtype)
    page, slot = token_slot(lists, page_size, 0, 2)
    cache[page, 0, slot, 0, 3] = bad  # K of request 0, kv head 0
    page, slot = token_slot(lists, page_size, 1, 4)
    cache[page, 1, slot, 1, 5] = bad  # V of request 1, kv head 1
    page, slot = token_slot(lists, page_size, 2, 8)
    cache[page, 1, slot, 0, 0] = bad  # V of request 2's last key (the balanced kernel re-reads it past the end)
    q[4, 3, 7] = bad  # request 4, query head 3
    q[3] = bad  # request 3 has no keys: (0, -inf) whatever its q holds
    plant_outside(cache, lists, DECODE_LENS, spare, page_size, bad)
    return q, cache, table


def decode_reference(q, cache, table):
    """The definition (attention_state_ref on each request's gathered keys), checked
    against the vectorised reference."""
    kv = unpack_paged_kv_cache(cache.cpu(), "NHD")  # the references run on the host
    q = q.cpu()
    indptr, indices, last = (t.cpu() for t in (table.kv_indptr, table.kv_indices, table.kv_last_page_len))
    rows = [attention_state_ref(q[b:b + 1], *gather_paged_kv(kv, indptr, indices, last, b))
            for b in range(q.shape[0])]
    ref = torch.cat([o for o, _ in rows]), torch.cat([s for _, s in rows])
    check_references_agree(batch_decode_paged_ref(q, kv, indptr, indices, last), ref)
    return ref


@GARBAGE
@SCHEDULES
def test_decode(device, bad, schedule, num_splits):
    q, cache, table = decode_case(bad, torch.float32, device)
    ref = decode_reference(q, cache, table)
    lse_ref = ref[1]
    assert bool(torch.isnan(lse_ref[1, 2:]).all()), "V garbage poisons its kv head's query heads"
    assert bool(torch.isnan(lse_ref[4, 3])) and bool((lse_ref[3] == -INF).all())
    assert bool(torch.isfinite(lse_ref[0, 2:]).all()), "the other kv head is untouched"
    if bad == INF:
        assert bool(torch.isnan(lse_ref[0, :2]).any()), "a +inf key gives NaN, never an answer that ignores it"
    o, lse = batch_decode_paged(q, cache, table.kv_indptr, table.kv_indices, table.kv_last_page_len,
                                schedule=schedule, num_splits=num_splits)
    check(o, lse, *ref)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@SCHEDULES
def test_decode_16_bit(device, dtype, schedule, num_splits):
    q, cache, table = decode_case(INF, dtype, device, seed=2)
    o, lse = batch_decode_paged(q, cache, table.kv_indptr, table.kv_indices, table.kv_last_page_len,
                                schedule=schedule, num_splits=num_splits)
    check(o, lse, *decode_reference(q, cache, table), dtype)


@GARBAGE
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("variant,head_dim,seed", [("n32_w2_s5_x2", 16, 3), ("n16_w1_s5_p4", 256, 4),
                                                    ("plain", 256, 5), ("n16_w1_s4_c", 16, 6)],
                         ids=["subtiles", "one-warp-d256", "plain-d256", "clamped-tail"])
def test_decode_tile_variants(device, bad, num_splits, variant, head_dim, seed):
    """The "shared_pages" schedule's tiles: the sub-tiled ones (a softmax state per 16-key
    sub-tile, folded together after the key loop) and, at head_dim 256, one warp per 16
    keys; beside them the plain rule's head_dim 256 tiles (32 keys over 4 warps) and the
    "concurrent" schedule's (the partial last tile's rows clamped to the last key, which
    holds garbage in request 2). Garbage poisons exactly the heads it reaches, an empty
    row stays (0, -inf), even where a sub-tile sees only masked keys."""
    q, cache, table = decode_case(bad, torch.bfloat16, device, seed=seed, d=head_dim)
    config = (policy.pick_decode_config(head_dim, torch.bfloat16, 16, work=8) if variant == "plain"
              else policy.DECODE_VARIANTS[variant])
    o, lse = decode_with_config(
        q, cache, table.kv_indptr, table.kv_indices, table.kv_last_page_len, kv_layout="NHD", sm_scale=None,
        num_splits=num_splits, schedule="per_request", out=None, lse=None, validate=True, config=config)
    check(o, lse, *decode_reference(q, cache, table), torch.bfloat16)


@GARBAGE
def test_decode_torch_path(path, bad):
    q, cache, table = decode_case(bad, torch.float32, path)
    o, lse = batch_decode_paged(q, cache, table.kv_indptr, table.kv_indices, table.kv_last_page_len)
    check(o, lse, *decode_reference(q, cache, table))


def test_decode_one_nan_key(path):
    """One NaN in a request's keys: that request's heads are NaN, not an answer over the others."""
    gen = torch.Generator().manual_seed(0)
    i32 = dict(dtype=torch.int32, device=path)
    cache = torch.randn(9, 2, 4, 2, 16, generator=gen).to(path)
    cache[0, 0, 1, 0, 0] = NAN
    q = torch.randn(3, 4, 16, generator=gen).to(path)
    indptr, indices, last = (torch.tensor(x, **i32) for x in ([0, 3, 6, 8], list(range(8)), [1, 4, 2]))
    o, lse = batch_decode_paged(q, cache, indptr, indices, last)
    assert bool(torch.isnan(lse[0, :2]).all()) and bool(torch.isnan(o[0, :2]).all())
    assert bool(torch.isfinite(lse[0, 2:]).all()) and bool(torch.isfinite(lse[1:]).all())


# ---------------------------------------------------------------------------- prefill

# group 0: 3 queries over 7 keys; group 1: 4 queries over 2 keys (causal: rows 0, 1 see
# nothing); group 2: 2 queries, no keys.
QO_LENS, KV_LENS = [3, 4, 2], [7, 2, 0]
FORCED = pytest.mark.parametrize("forced", [False, True], ids=["default", "splits"])


def plant_prefill(q, put_k, put_v, bad):
    """Garbage in group 0 (K at key 5: causal row 0 does not see it; V at key 0, which
    every row sees), in group 1's V at key 0 (rows that see no key must stay empty), and
    in q (group 0's second query, head 2)."""
    put_k(0, 5, 0, 3, bad)
    put_v(0, 0, 1, 1, bad)
    put_v(1, 0, 0, 2, bad)
    q[1, 2, 4] = bad


def run_prefill(fn_default, q, qo_indptr, source, forced, causal):
    if not forced:
        return fn_default()
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], device=q.device)
    return P.run_prefill(q, qo_indptr, source, out, lse, causal=causal, sm_scale=q.shape[2] ** -0.5, num_splits=2,
                  config=SMALL)


def prefill_expectations(ref_lse, causal):
    bad = torch.isnan(ref_lse)
    assert bool(bad[:3, 2:].all()), "group 0's V garbage poisons kv head 1's query heads"
    assert bool(bad[1, 2]), "q garbage poisons its own (row, head)"
    if causal:
        assert bool((ref_lse[3:5] == -INF).all()), "group 1's first rows see no key, garbage or not"
        assert bool(bad[5:7, :2].all())
    else:
        assert bool(bad[3:7, :2].all())
    assert bool((ref_lse[7:] == -INF).all())


@GARBAGE
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@FORCED
def test_prefill_paged(device, bad, causal, forced):
    page_size, hkv, group, d = 4, 2, 2, 16
    cache, table, lists, spare = paged_case(KV_LENS, page_size, hkv, d, torch.float32, device, seed=3)
    q = torch.randn((sum(QO_LENS), hkv * group, d), generator=torch.Generator().manual_seed(4)).to(device)

    def put(which):
        def put_at(row, token, head, dim, value):
            page, slot = token_slot(lists, page_size, row, token)
            cache[page, which, slot, head, dim] = value
        return put_at

    plant_prefill(q, put(0), put(1), bad)
    plant_outside(cache, lists, KV_LENS, spare, page_size, bad)
    qo_indptr = indptr_from_lengths(QO_LENS, device=device)
    args = (q, qo_indptr, cache, table.kv_indptr, table.kv_indices, table.kv_last_page_len)
    ref = P.batch_prefill_paged_ref(*args, causal=causal)
    prefill_expectations(ref[1], causal)
    source = P.paged_source(unpack_paged_kv_cache(cache, "NHD"), *args[3:])
    o, lse = run_prefill(lambda: batch_prefill_paged(*args, causal=causal), q, qo_indptr, source, forced, causal)
    check(o, lse, *ref)


@GARBAGE
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@FORCED
def test_prefill_ragged(device, bad, causal, forced):
    hkv, group, d = 2, 2, 16
    gen = torch.Generator().manual_seed(5)
    k, v = (torch.randn((sum(KV_LENS), hkv, d), generator=gen).to(device) for _ in range(2))
    q = torch.randn((sum(QO_LENS), hkv * group, d), generator=gen).to(device)
    starts = [0, KV_LENS[0], KV_LENS[0] + KV_LENS[1]]

    def put(t):
        def put_at(row, token, head, dim, value):
            t[starts[row] + token, head, dim] = value
        return put_at

    plant_prefill(q, put(k), put(v), bad)
    qo_indptr = indptr_from_lengths(QO_LENS, device=device)
    kv_indptr = indptr_from_lengths(KV_LENS, device=device)
    ref = P.batch_prefill_ragged_ref(q, qo_indptr, k, v, kv_indptr, causal=causal)
    prefill_expectations(ref[1], causal)
    source = P.ragged_source(q, k, v, kv_indptr)
    o, lse = run_prefill(lambda: batch_prefill_ragged(q, qo_indptr, k, v, kv_indptr, causal=causal),
                         q, qo_indptr, source, forced, causal)
    check(o, lse, *ref)


@GARBAGE
def test_prefill_torch_path(path, bad):
    """The plain-PyTorch path gives the same as the kernels, causal and not."""
    hkv, group, d = 2, 2, 16
    gen = torch.Generator().manual_seed(6)
    k, v = (torch.randn((sum(KV_LENS), hkv, d), generator=gen).to(path) for _ in range(2))
    q = torch.randn((sum(QO_LENS), hkv * group, d), generator=gen).to(path)
    starts = [0, KV_LENS[0], KV_LENS[0] + KV_LENS[1]]
    plant_prefill(q, lambda r, t, h, x, val: k.__setitem__((starts[r] + t, h, x), val),
                  lambda r, t, h, x, val: v.__setitem__((starts[r] + t, h, x), val), bad)
    qo_indptr = indptr_from_lengths(QO_LENS, device=path)
    kv_indptr = indptr_from_lengths(KV_LENS, device=path)
    for causal in (False, True):
        ref = P.batch_prefill_ragged_ref(q, qo_indptr, k, v, kv_indptr, causal=causal)
        check(*batch_prefill_ragged(q, qo_indptr, k, v, kv_indptr, causal=causal), *ref)


@GARBAGE
@pytest.mark.parametrize("where", ["k", "v", "q"])
@FORCED
def test_shared_prefix(device, bad, where, forced):
    n, length, hkv, group, d = 3, 20, 2, 2, 16
    gen = torch.Generator().manual_seed(7)
    k, v = (torch.randn((length, hkv, d), generator=gen).to(device) for _ in range(2))
    q = torch.randn((n, hkv * group, d), generator=gen).to(device)
    {"k": k, "v": v, "q": q}[where][1, 0, 2] = bad  # k/v: key 1, kv head 0; q: query 1, head 0
    ref = attention_state_ref(q, k, v)
    poisoned = torch.isnan(ref[1])
    if where == "v" or bad != -INF:
        assert bool(poisoned.any()) and bool((~poisoned).any())
    if where == "v":
        assert bool(poisoned[:, :2].all())
    source = P.ragged_source(q, k, v, None)
    o, lse = run_prefill(lambda: shared_prefix_attention(q, k, v), q, None, source, forced, False)
    check(o, lse, *ref)


def test_shared_prefix_one_nan_key(path):
    """One NaN key: NaN where that kv head's scores are NaN, and only there — never
    lse = -inf with a NaN output."""
    gen = torch.Generator().manual_seed(8)
    q = torch.randn(3, 2, 16, generator=gen).to(path)
    k, v = (torch.randn(5, 1, 16, generator=gen).to(path) for _ in range(2))
    k[2, 0, 0] = NAN
    o, lse = shared_prefix_attention(q, k, v)
    assert bool(torch.isnan(lse).all()) and bool(torch.isnan(o).all())


def test_causal_rows_see_only_their_keys(device):
    """K garbage at a key the causal mask hides from the early rows leaves them exact."""
    hkv, group, d, n, length = 1, 2, 16, 6, 6
    gen = torch.Generator().manual_seed(9)
    k, v = (torch.randn((length, hkv, d), generator=gen).to(device) for _ in range(2))
    q = torch.randn((n, hkv * group, d), generator=gen).to(device)
    k[4] = NAN  # rows 4 and 5 see key 4
    indptr = indptr_from_lengths([n], device=device)
    ref = P.batch_prefill_ragged_ref(q, indptr, k, v, indptr, causal=True)
    assert bool(torch.isnan(ref[1][4:]).all()) and bool(torch.isfinite(ref[1][:4]).all())
    check(*batch_prefill_ragged(q, indptr, k, v, indptr, causal=True), *ref)


@GARBAGE
@pytest.mark.parametrize("layout", ["ragged", "paged"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@FORCED
def test_causal_hidden_values(device, bad, layout, dtype, forced):
    """V garbage at keys the causal mask hides from the early rows of the same tile (and
    of the same packed GQA rows): exactly the rows that see them are poisoned."""
    hkv, group, d, page_size = 1, 2, 16, 4
    qo_lens, kv_lens = [6, 5], [6, 3]  # group 1: rows 0, 1 see nothing, row i >= 2 keys < i - 1
    gen = torch.Generator().manual_seed(15)
    q = torch.randn((sum(qo_lens), hkv * group, d), generator=gen).to(device, dtype)
    qo_indptr = indptr_from_lengths(qo_lens, device=device)
    if layout == "ragged":
        k, v = (torch.randn((sum(kv_lens), hkv, d), generator=gen).to(device, dtype) for _ in range(2))
        v[4, 0, 3] = bad  # group 0 key 4: rows 4, 5 see it
        v[6 + 2, 0, 0] = bad  # group 1 key 2: only row 4 sees it
        kv_indptr = indptr_from_lengths(kv_lens, device=device)
        ref = P.batch_prefill_ragged_ref(q, qo_indptr, k, v, kv_indptr, causal=True)
        source = P.ragged_source(q, k, v, kv_indptr)
        call = lambda: batch_prefill_ragged(q, qo_indptr, k, v, kv_indptr, causal=True)  # noqa: E731
    else:
        cache, table, lists, _ = paged_case(kv_lens, page_size, hkv, d, dtype, device, seed=16)
        page, slot = token_slot(lists, page_size, 0, 4)
        cache[page, 1, slot, 0, 3] = bad
        page, slot = token_slot(lists, page_size, 1, 2)
        cache[page, 1, slot, 0, 0] = bad
        args = (q, qo_indptr, cache, table.kv_indptr, table.kv_indices, table.kv_last_page_len)
        ref = P.batch_prefill_paged_ref(*args, causal=True)
        source = P.paged_source(unpack_paged_kv_cache(cache, "NHD"), *args[3:])
        call = lambda: batch_prefill_paged(*args, causal=True)  # noqa: E731
    poisoned = torch.isnan(ref[1]).all(-1)
    assert poisoned.tolist() == [False] * 4 + [True] * 2 + [False] * 4 + [True]
    assert bool((ref[1][6:8] == -INF).all())
    check(*run_prefill(call, q, qo_indptr, source, forced, True), *ref, dtype)


# ---------------------------------------------------------------------------- merges


def merge_inputs(device, dtype=torch.float32):
    """Three states per row, 2 heads: row 0 an LSE of NaN, row 1 an LSE of +inf, row 2 a
    NaN in v at a weight that underflows in float32 (but not in float64), row 3 an inf in
    v at a positive weight, row 4 an empty state holding NaN (the identity), row 5 only
    empties with NaN values (0, -inf), row 6 clean. Head 1 is clean everywhere."""
    gen = torch.Generator().manual_seed(10)
    v = torch.randn((7, 3, 2, 8), generator=gen)
    s = torch.randn((7, 3, 2), generator=gen)
    s[0, 1, 0] = NAN
    s[1, 2, 0] = INF
    s[2, 0, 0], s[2, 1, 0], v[2, 1, 0, 3] = 0.0, -200.0, NAN
    v[3, 2, 0, 5] = INF
    s[4, 0, 0], v[4, 0, 0] = -INF, NAN
    s[5, :, 0], v[5, :, 0] = -INF, NAN
    return v.to(device, dtype), s.to(device)


def check_merge(o, lse, ref_o, ref_lse):
    """Element-wise: non-finite exactly where the reference is, NaN LSE exactly where it is."""
    o, lse, ref_o, ref_lse = o.cpu(), lse.cpu(), ref_o.cpu(), ref_lse.cpu()
    assert torch.equal(torch.isnan(lse), torch.isnan(ref_lse))
    assert torch.equal(torch.isfinite(o), torch.isfinite(ref_o))
    assert torch.equal(lse == -INF, ref_lse == -INF)
    fin = torch.isfinite(ref_o)
    torch.testing.assert_close(o[fin].double(), ref_o[fin], atol=1e-5, rtol=1e-5)
    fin = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[fin].double(), ref_lse[fin], atol=1e-5, rtol=1e-5)


def test_merge_references_agree():
    v, s = merge_inputs("cpu", torch.float64)
    ref = merge_states_ref(v, s)
    o, lse = v[:, 0], s[:, 0]
    for j in (1, 2):
        o, lse = merge_state_ref(o, lse, v[:, j], s[:, j])
    check_merge(o, lse, *ref)
    lse_ref = ref[1]
    assert bool(torch.isnan(lse_ref[:2, 0]).all()) and bool(torch.isfinite(lse_ref[2:5]).all())
    assert bool(torch.isnan(ref[0][2, 0, 3])) and bool(torch.isinf(ref[0][3, 0, 5]))
    assert bool((lse_ref[5, 0] == -INF)) and bool((ref[0][5, 0] == 0).all())
    assert int((~torch.isfinite(ref[0])).any(-1).sum()) == 4  # rows 0-3, head 0


def test_merge_references_agree_with_attention():
    """Attention over a key set equals the merge of its pieces' states, garbage included."""
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(4, 2, 16, generator=gen)
    k, v = torch.randn(12, 1, 16, generator=gen), torch.randn(12, 1, 16, generator=gen)
    k[3, 0, 1], v[9, 0, 4], q[0, 1, 2] = INF, NAN, -INF
    k[6:8] = -INF  # scores of ±inf: a piece of only -inf scores is (0, -inf)
    whole = attention_state_ref(q, k, v)
    pieces = [attention_state_ref(q, k[a:b], v[a:b]) for a, b in ((0, 3), (3, 6), (6, 8), (8, 12))]
    check_references_agree(merge_states_ref(torch.stack([o for o, _ in pieces], 1),
                                            torch.stack([s for _, s in pieces], 1)), whole)


def test_merge_kernels(path):
    v, s = merge_inputs(path)
    ref = merge_states_ref(v, s)
    check_merge(*merge_states(v, s), *ref)
    nnz = v.shape[0] * v.shape[1]
    indptr = torch.arange(0, nnz + 1, 3, dtype=torch.int32, device=path)
    check_merge(*merge_states_ragged(v.flatten(0, 1), s.flatten(0, 1), indptr), *ref)
    check_merge(*merge_states_ragged(v.flatten(0, 1), s.flatten(0, 1), indptr),
                *merge_states_ragged_ref(v.flatten(0, 1), s.flatten(0, 1), indptr))
    ref2 = merge_state_ref(v[:, 0], s[:, 0], v[:, 1], s[:, 1])
    check_merge(*merge_state(v[:, 0], s[:, 0], v[:, 1], s[:, 1]), *ref2)
    v_in, s_in = v[:, 0].clone(), s[:, 0].clone()
    merge_state_in_place(v_in, s_in, v[:, 1], s[:, 1])
    check_merge(v_in, s_in, *ref2)


# ---------------------------------------------------------------------------- cascade


@GARBAGE
@pytest.mark.parametrize("where", ["prefix_k", "prefix_v", "suffix_k", "suffix_v", "q"])
def test_two_level_cascade(path, bad, where):
    """A forced two-level cascade (shared prefix, then each request's suffix) against
    attention over each request's whole sequence."""
    batch, page_size, hq, hkv, d = 3, 4, 4, 2, 16
    prefix_pages, suffix_lens = 3, [5, 2, 7]
    suffix_pages = [-(-n // page_size) for n in suffix_lens]
    num_pages = prefix_pages + sum(suffix_pages)
    gen = torch.Generator().manual_seed(12)
    cache = torch.randn((num_pages, 2, page_size, hkv, d), generator=gen).to(path)
    q = torch.randn((batch, hq, d), generator=gen).to(path)
    i32 = dict(dtype=torch.int32, device=path)
    first = [prefix_pages + sum(suffix_pages[:r]) for r in range(batch)]
    tables = ([torch.tensor([0, batch], **i32), torch.arange(batch + 1, **i32)],
              [torch.tensor([0, prefix_pages], **i32),
               torch.tensor([0, *torch.tensor(suffix_pages).cumsum(0).tolist()], **i32)],
              [torch.arange(prefix_pages, **i32), torch.arange(prefix_pages, num_pages, **i32)],
              [torch.tensor([page_size], **i32), torch.tensor([(n - 1) % page_size + 1 for n in suffix_lens], **i32)])
    if where == "prefix_k":
        cache[1, 0, 2, 0, 3] = bad  # every request's kv head 0
    elif where == "prefix_v":
        cache[2, 1, 0, 1, 5] = bad  # every request's kv head 1
    elif where == "suffix_k":
        cache[first[2] + 1, 0, 1, 1, 0] = bad  # request 2, kv head 1
    elif where == "suffix_v":
        cache[first[0], 1, 3, 0, 2] = bad  # request 0, kv head 0
    else:
        q[1, 2, 6] = bad
    cache[first[1], :, 2:] = bad  # request 1's padding (2 tokens in its page of 4): never read

    attn = MultiLevelCascadeAttention(2, device=path)
    attn.plan(*tables, hq, hkv, d, page_size, use_cascade=True)
    o, lse = attn.run(q, cache, return_lse=True)

    rows = []
    for r in range(batch):
        pages = list(range(prefix_pages)) + list(range(first[r], first[r] + suffix_pages[r]))
        n = prefix_pages * page_size + suffix_lens[r]
        k = cache[pages, 0].reshape(-1, hkv, d)[:n]
        v = cache[pages, 1].reshape(-1, hkv, d)[:n]
        rows.append(attention_state_ref(q[r:r + 1], k, v))
    ref_o, ref_lse = torch.cat([x for x, _ in rows]), torch.cat([x for _, x in rows])
    poisoned = torch.isnan(ref_lse)
    if where == "prefix_v":
        assert bool(poisoned[:, 2:].all()) and not bool(poisoned[:, :2].any())
    if where == "suffix_v":
        assert bool(poisoned[0, :2].all()) and int(poisoned.sum()) == 2
    if bad == INF and where in ("prefix_k", "suffix_k"):
        assert bool(poisoned.any()), "a +inf key gives NaN, never an answer that ignores it"
    check(o, lse, ref_o, ref_lse)


# ---------------------------------------------------------------------------- GPU shapes


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", ["per_request", "balanced", None])
def test_decode_default_plans_on_gpu(device, schedule):
    """Real tile sizes and pipelines (bf16, 128-key tiles, default splits): garbage in one
    request's K and another's V, the rest exact."""
    lens = [4096, 17, 700, 0, 2048, 1]
    page_size, hkv, group, d = 16, 8, 4, 128
    cache, table, lists, spare = paged_case(lens, page_size, hkv, d, torch.bfloat16, device, seed=13)
    q = torch.randn((len(lens), hkv * group, d), device=device, dtype=torch.bfloat16)
    page, slot = token_slot(lists, page_size, 0, 3000)
    cache[page, 0, slot, 2, 17] = NAN
    page, slot = token_slot(lists, page_size, 2, 699)
    cache[page, 1, slot, 5, 0] = INF
    plant_outside(cache, lists, lens, spare, page_size, NAN)
    o, lse = batch_decode_paged(q, cache, table.kv_indptr, table.kv_indices, table.kv_last_page_len,
                                schedule=schedule)
    ref = batch_decode_paged_ref(q, unpack_paged_kv_cache(cache, "NHD"), table.kv_indptr, table.kv_indices,
                                 table.kv_last_page_len)
    assert bool(torch.isnan(ref[1][0, 8:12]).all()) and bool(torch.isnan(ref[1][2, 20:24]).all())
    check(o, lse, *ref, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_prefill_default_tiles_on_gpu(device, causal):
    """128-row tiles, int32 row offsets and pipelined page gathers (bf16): K and V garbage."""
    qo_lens, kv_lens = [300, 64], [1000, 64]
    page_size, hkv, group, d = 16, 4, 4, 128
    cache, table, lists, spare = paged_case(kv_lens, page_size, hkv, d, torch.bfloat16, device, seed=14)
    q = torch.randn((sum(qo_lens), hkv * group, d), device=device, dtype=torch.bfloat16)
    page, slot = token_slot(lists, page_size, 0, 10)
    cache[page, 0, slot, 1, 3] = NAN  # seen by every row of group 0, causal or not
    page, slot = token_slot(lists, page_size, 1, 0)
    cache[page, 1, slot, 3, 9] = -INF
    plant_outside(cache, lists, kv_lens, spare, page_size, NAN)
    qo_indptr = indptr_from_lengths(qo_lens, device=device)
    args = (q, qo_indptr, cache, table.kv_indptr, table.kv_indices, table.kv_last_page_len)
    ref = P.batch_prefill_paged_ref(*args, causal=causal)
    check(*batch_prefill_paged(*args, causal=causal), *ref, torch.bfloat16)
