"""Merge-state kernels against the float64 reference, and the algebra of merging.

On a machine without a GPU the kernels run through the Triton interpreter (conftest.py),
so shapes stay tiny: a few rows, a few heads. The same tests run unchanged on CUDA;
tests marked ``gpu`` add realistic shapes and CUDA-graph capture there.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cascadeinfer.kernels.merge as merge_mod
import cascadeinfer.kernels.merge_many as merge_many_mod
from cascadeinfer.kernels import policy
from cascadeinfer.kernels.merge import (
    launch_merge_two,
    merge_state,
    merge_state_in_place,
)
from cascadeinfer.kernels.merge_many import (
    launch_merge_many,
    merge_states,
    merge_states_ragged,
)
from cascadeinfer.kernels.reference import (
    attention_state_ref,
    merge_state_ref,
    merge_states_ragged_ref,
    merge_states_ref,
)

INF = math.inf
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
HEAD_DIMS = [64, 96, 128, 192, 256, 512]
TOL = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1.5e-2, rtol=1.5e-2),
}
HYPOTHESIS = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


# ----------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------


def random_states(lead, heads, head_dim, dtype, device, seed, *, empty=0.2, extreme=True):
    """Values ``[*lead, H, D]`` and LSEs ``[*lead, H]``: randn, some ±80 jumps, some empties.

    Empty states keep random (non-zero) values: the kernels must ignore them.
    """
    gen = torch.Generator().manual_seed(seed)
    v = torch.randn(*lead, heads, head_dim, generator=gen)
    s = torch.randn(*lead, heads, generator=gen) * 3
    if extreme:
        s = s + 80.0 * torch.randint(-1, 2, s.shape, generator=gen)
    s = torch.where(torch.rand(s.shape, generator=gen) < empty, -INF, s)
    return v.to(dtype).to(device), s.to(device)


def poisoned(shape, dtype, device):
    return torch.full(shape, math.nan, dtype=dtype, device=device)


def assert_state(o, lse, ref_o, ref_lse, dtype, *, scale=1.0):
    """Every element written (outputs were poisoned), NaN exactly where the reference has it,
    -inf exactly where it has it, and the rest within the dtype's tolerance."""
    assert o.dtype == dtype and lse.dtype == torch.float32
    ref_o, ref_lse = ref_o.to(o.device), ref_lse.to(o.device)
    bad = torch.isnan(ref_lse)
    assert torch.equal(torch.isnan(lse), bad)
    assert torch.equal(torch.isnan(o), bad[..., None].expand_as(o))
    assert torch.equal(lse == -INF, ref_lse == -INF)
    assert torch.equal(o[ref_lse == -INF], torch.zeros_like(o[ref_lse == -INF]))
    torch.testing.assert_close(lse[~bad].double(), ref_lse[~bad], atol=1e-5, rtol=2e-6)
    tol = {k: x * scale for k, x in TOL[dtype].items()}
    torch.testing.assert_close(o[~bad].double(), ref_o[~bad], **tol)


def stack_ref(v_a, s_a, v_b, s_b):
    return merge_states_ref(torch.stack([v_a, v_b], 1), torch.stack([s_a, s_b], 1))


def bits(t):
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


# ----------------------------------------------------------------------------------
# each function against the reference
# ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_merge_state(device, dtype, head_dim):
    n, heads = 3, 3
    v_a, s_a = random_states((n,), heads, head_dim, dtype, device, seed=head_dim)
    v_b, s_b = random_states((n,), heads, head_dim, dtype, device, seed=head_dim + 1)
    out, out_lse = poisoned((n, heads, head_dim), dtype, device), poisoned((n, heads), torch.float32, device)
    o, lse = merge_state(v_a, s_a, v_b, s_b, out=out, out_lse=out_lse)
    assert o is out and lse is out_lse
    assert_state(o, lse, *stack_ref(v_a, s_a, v_b, s_b), dtype)
    o2, lse2 = merge_state(v_a, s_a, v_b, s_b)  # allocated outputs
    assert torch.equal(o2, o) and torch.equal(lse2, lse)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_states", [1, 2, 3, 7, 16])
def test_merge_states(device, dtype, num_states):
    n, heads, head_dim = 3, 3, 96
    v, s = random_states((n, num_states), heads, head_dim, dtype, device, seed=num_states)
    out, out_lse = poisoned((n, heads, head_dim), dtype, device), poisoned((n, heads), torch.float32, device)
    o, lse = merge_states(v, s, out=out, out_lse=out_lse)
    assert o is out and lse is out_lse
    assert_state(o, lse, *merge_states_ref(v, s), dtype)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_merge_states_head_dims(device, head_dim):
    dtype = torch.float16
    v, s = random_states((2, 3), 2, head_dim, dtype, device, seed=head_dim)
    assert_state(*merge_states(v, s), *merge_states_ref(v, s), dtype)


RAGGED_CASES = {
    "mixed": [0, 1, 6, 6, 8, 17, 17],  # empty rows in the middle and at the end
    "empty-first": [0, 0, 3, 4],
    "offset": [2, 5, 5, 9],  # states before indptr[0] and after indptr[-1] are not read
    "all-empty": [0, 0, 0],
    "no-rows": [0],
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(RAGGED_CASES))
def test_merge_states_ragged(device, dtype, case):
    indptr_list = RAGGED_CASES[case]
    nnz, heads, head_dim = max(indptr_list) + 1, 3, 80
    v, s = random_states((nnz,), heads, head_dim, dtype, device, seed=len(indptr_list))
    indptr = torch.tensor(indptr_list, dtype=torch.int32, device=device)
    n = len(indptr_list) - 1
    out, out_lse = poisoned((n, heads, head_dim), dtype, device), poisoned((n, heads), torch.float32, device)
    o, lse = merge_states_ragged(v, s, indptr, out=out, out_lse=out_lse)
    assert o is out and lse is out_lse
    assert_state(o, lse, *merge_states_ragged_ref(v, s, indptr), dtype)


def test_ragged_without_states(device):
    """nnz = 0: every row is empty and gives (0, -inf)."""
    v = torch.empty(0, 2, 64, dtype=torch.bfloat16, device=device)
    s = torch.empty(0, 2, device=device)
    indptr = torch.zeros(4, dtype=torch.int32, device=device)
    out, out_lse = poisoned((3, 2, 64), torch.bfloat16, device), poisoned((3, 2), torch.float32, device)
    o, lse = merge_states_ragged(v, s, indptr, out=out, out_lse=out_lse)
    assert torch.equal(o, torch.zeros_like(o)) and bool((lse == -INF).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merge_state_in_place(device, dtype):
    n, heads, head_dim = 4, 3, 64
    v, s = random_states((n,), heads, head_dim, dtype, device, seed=1)
    v_o, s_o = random_states((n,), heads, head_dim, dtype, device, seed=2)
    ref = stack_ref(v, s, v_o, s_o)
    assert merge_state_in_place(v, s, v_o, s_o) is None
    assert_state(v, s, *ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_merge_state_in_place_mask(device, dtype):
    """Marked rows merge; unmarked rows are untouched bit for bit (NaN payloads included)."""
    n, heads, head_dim = 5, 2, 48
    v, s = random_states((n,), heads, head_dim, dtype, device, seed=3)
    v_o, s_o = random_states((n,), heads, head_dim, dtype, device, seed=4)
    mask = torch.tensor([True, False, True, False, False], device=device)
    v[1, 0, 5] = math.nan
    s[3, 1] = math.nan
    before_v, before_s = v.clone(), s.clone()
    ref_o, ref_lse = stack_ref(v, s, v_o, s_o)
    merge_state_in_place(v, s, v_o, s_o, mask=mask)
    assert torch.equal(bits(v[~mask]), bits(before_v[~mask]))
    assert torch.equal(bits(s[~mask]), bits(before_s[~mask]))
    assert_state(v[mask], s[mask], ref_o[mask.cpu()], ref_lse[mask.cpu()], dtype)


def test_large_head_dim_is_tiled(device):
    """head_dim 2304 in fp32 spans three 1024-wide chunks (the last one partial)."""
    dtype, head_dim = torch.float32, 2304
    v, s = random_states((2, 3), 1, head_dim, dtype, device, seed=5)
    assert_state(*merge_states(v, s), *merge_states_ref(v, s), dtype)
    assert_state(*merge_state(v[:, 0], s[:, 0], v[:, 1], s[:, 1]),
                 *stack_ref(v[:, 0], s[:, 0], v[:, 1], s[:, 1]), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiling_paths(device, dtype):
    """Explicit small tiles: partial head blocks, several head-dim chunks (the last one
    partial), whole UNROLL groups plus a masked last group (7 states by 2, rows of 5 and
    7 states by 4)."""
    n, heads, head_dim = 2, 5, 160
    config = (2, 64, 1)  # BLOCK_H, BLOCK_D, num_warps
    v_a, s_a = random_states((n,), heads, head_dim, dtype, device, seed=6)
    v_b, s_b = random_states((n,), heads, head_dim, dtype, device, seed=7)
    out, out_lse = poisoned((n, heads, head_dim), dtype, device), poisoned((n, heads), torch.float32, device)
    mask = torch.tensor([True, True], device=device)
    launch_merge_two(v_a, s_a, v_b, s_b, out, out_lse, mask, config=config)
    assert_state(out, out_lse, *stack_ref(v_a, s_a, v_b, s_b), dtype)

    v, s = random_states((n, 7), heads, head_dim, dtype, device, seed=8)
    out, out_lse = poisoned((n, heads, head_dim), dtype, device), poisoned((n, heads), torch.float32, device)
    launch_merge_many(v, s, None, out, out_lse, config=config, unroll=2)
    assert_state(out, out_lse, *merge_states_ref(v, s), dtype)

    indptr = torch.tensor([0, 5, 12], dtype=torch.int32, device=device)
    flat_v, flat_s = v.reshape(14, heads, head_dim), s.reshape(14, heads)
    out, out_lse = poisoned((n, heads, head_dim), dtype, device), poisoned((n, heads), torch.float32, device)
    launch_merge_many(flat_v, flat_s, indptr, out, out_lse, config=config, unroll=4)
    assert_state(out, out_lse, *merge_states_ragged_ref(flat_v, flat_s, indptr), dtype)


def test_plan_follows_planning_sms(monkeypatch):
    """CPU tensors get a GPU's merge plan (policy.planning_sms), as in every kernel family,
    and a patched SM count reaches it."""
    cpu = torch.device("cpu")
    assert policy.merge_min_programs(cpu) == 4 * policy.REFERENCE_SMS
    monkeypatch.setattr(policy, "planning_sms", lambda *args: 4)
    assert policy.merge_min_programs(cpu) == 16
    # bf16 D=128, 8 heads: 64 rows fill 16 programs with whole head blocks; 2 rows need
    # one head per program.
    assert policy.merge_tile_config(64, 8, 128, 2, cpu, policy.MERGE_TWO_TILE)[0] == 8
    assert policy.merge_tile_config(2, 8, 128, 2, cpu, policy.MERGE_TWO_TILE)[0] == 1


# ----------------------------------------------------------------------------------
# infinities, NaN, empties
# ----------------------------------------------------------------------------------


def test_empties_are_the_identity(device):
    n, heads, head_dim = 2, 2, 64
    v_e = torch.randn(n, heads, head_dim, device=device)
    v_e[0, 0, 3] = math.nan  # an empty state's v is never looked at
    s_e = torch.full((n, heads), -INF, device=device)
    o, lse = merge_state(v_e, s_e, v_e.flip(0), s_e)
    assert torch.equal(o, torch.zeros_like(o)) and bool((lse == -INF).all())

    v, s = random_states((n,), heads, head_dim, torch.float32, device, seed=9, empty=0.0)
    o, lse = merge_state(v, s, v_e, s_e)
    assert torch.equal(o, v) and torch.equal(lse, s)
    o, lse = merge_states(torch.stack([v_e, v, v_e], 1), torch.stack([s_e, s, s_e], 1))
    assert torch.equal(o, v) and torch.equal(lse, s)

    o, lse = merge_states(v_e[:, None], s_e[:, None])
    assert torch.equal(o, torch.zeros_like(o)) and bool((lse == -INF).all())
    o, lse = merge_states(torch.empty(n, 0, heads, head_dim, device=device), torch.empty(n, 0, heads, device=device))
    assert torch.equal(o, torch.zeros_like(o)) and bool((lse == -INF).all())


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # numpy under the interpreter: inf - inf
def test_inf_and_nan_lse_poison_only_their_row_and_head(device):
    """+inf or NaN LSE: (NaN, NaN) in that (row, head), every other one exact as usual."""
    n, heads, head_dim, dtype = 3, 3, 64, torch.bfloat16
    v, s = random_states((n, 3), heads, head_dim, dtype, device, seed=10)
    s[0, 1, 2] = math.nan
    s[2, 0, 0] = INF
    v[1, 2, 1, 0] = math.inf  # a v of a state with positive weight poisons its own (row, head) only
    s[1, 2, 1] = 0.0
    ref_o, ref_lse = merge_states_ref(v, s)
    assert torch.isnan(ref_lse[0, 2]) and torch.isnan(ref_lse[2, 0]) and int(torch.isnan(ref_lse).sum()) == 2
    assert_state(*merge_states(v, s), ref_o, ref_lse, dtype)
    assert bool(torch.isinf(merge_states(v, s)[0][1, 1, 0]))
    assert_state(*merge_states_ragged(v.flatten(0, 1), s.flatten(0, 1),
                                      torch.arange(0, 3 * n + 1, 3, dtype=torch.int32, device=device)),
                 ref_o, ref_lse, dtype)
    # two-state merge: +inf in s_a (row 2), NaN in s_b (row 0)
    ref2 = stack_ref(v[:, 0], s[:, 0], v[:, 1], s[:, 1])
    assert int(torch.isnan(ref2[1]).sum()) == 2
    assert_state(*merge_state(v[:, 0], s[:, 0], v[:, 1], s[:, 1]), *ref2, dtype)
    v_in, s_in = v[:, 0].clone(), s[:, 0].clone()
    merge_state_in_place(v_in, s_in, v[:, 1], s[:, 1])
    assert_state(v_in, s_in, *ref2, dtype)


def test_reference_agrees_with_pairwise_reference(device):
    """merge_states_ref folds like reference.merge_state_ref on valid states."""
    v, s = random_states((3, 4), 2, 16, torch.float64, "cpu", seed=11)
    v = torch.where((s == -INF)[..., None], 0.0, v)  # valid empty states are (0, -inf)
    o, lse = v[:, 0], s[:, 0]
    for j in range(1, 4):
        o, lse = merge_state_ref(o, lse, v[:, j], s[:, j])
    ref_o, ref_lse = merge_states_ref(v, s)
    torch.testing.assert_close(o, ref_o)
    torch.testing.assert_close(lse, ref_lse)


# ----------------------------------------------------------------------------------
# strides and aliasing
# ----------------------------------------------------------------------------------


def test_non_contiguous_inputs_and_outputs(device):
    n, heads, head_dim, dtype = 3, 4, 64, torch.float16
    big_v, big_s = random_states((n, 2), 2 * heads, 2 * head_dim, dtype, device, seed=12)
    v_a, v_b = big_v[:, 0, ::2, :head_dim], big_v[:, 1, 1::2, head_dim:]  # strided heads and rows
    s_a = big_s[:, 0, ::2]
    s_b = big_s[:, 1, 1::2].t().contiguous().t()  # column-major
    out_buf = poisoned((heads, n, 2 * head_dim), dtype, device)
    out = out_buf[:, :, 3:3 + head_dim].transpose(0, 1)  # [n, heads, head_dim], odd offset
    lse_buf = poisoned((heads, n), torch.float32, device)
    out_lse = lse_buf.t()
    merge_state(v_a, s_a, v_b, s_b, out=out, out_lse=out_lse)
    assert_state(out, out_lse, *stack_ref(v_a, s_a, v_b, s_b), dtype)

    # a broadcast (stride 0) input: one shared state merged into every row
    v_shared = v_a[:1].expand(n, heads, head_dim)
    s_shared = s_a[:1].expand(n, heads)
    assert_state(*merge_state(v_shared, s_shared, v_b, s_b), *stack_ref(v_shared, s_shared, v_b, s_b), dtype)

    v4, s4 = big_v[:, :, 1::2, :head_dim], big_s[:, :, 1::2]  # [n, 2, heads, head_dim]
    assert_state(*merge_states(v4, s4), *merge_states_ref(v4, s4), dtype)
    vr, sr = big_v.flatten(0, 1)[:, ::2, head_dim:], big_s.flatten(0, 1)[:, ::2]
    indptr = torch.tensor([0, 2, 2, 6], dtype=torch.int32, device=device)
    assert_state(*merge_states_ragged(vr, sr, indptr), *merge_states_ragged_ref(vr, sr, indptr), dtype)

    v_ip, s_ip = v_a.clone(), s_a.t().contiguous().t()
    v_ip = torch.empty_strided(v_ip.shape, (heads * head_dim * 2, head_dim, 1), dtype=dtype, device=device).copy_(v_ip)
    ref = stack_ref(v_ip, s_ip, v_b, s_b)
    merge_state_in_place(v_ip, s_ip, v_b, s_b, mask=torch.ones(2 * n, dtype=torch.bool, device=device)[::2])
    assert_state(v_ip, s_ip, *ref, dtype)


def test_aliasing(device):
    n, heads, head_dim, dtype = 3, 2, 64, torch.bfloat16
    v, s = random_states((n, 3), heads, head_dim, dtype, device, seed=13)
    ref_ab = stack_ref(v[:, 0], s[:, 0], v[:, 1], s[:, 1])
    for target in (0, 1):
        vv, ss = v.clone(), s.clone()
        o, lse = merge_state(vv[:, 0], ss[:, 0], vv[:, 1], ss[:, 1], out=vv[:, target], out_lse=ss[:, target])
        assert o.data_ptr() == vv[:, target].data_ptr()
        assert_state(vv[:, target], ss[:, target], *ref_ab, dtype)

    vv, ss = v.clone(), s.clone()
    merge_states(vv, ss, out=vv[:, 2], out_lse=ss[:, 2])
    assert_state(vv[:, 2], ss[:, 2], *merge_states_ref(v, s), dtype)

    # merging a state with itself: same v, lse + log 2
    vv, ss = v[:, 0].clone(), s[:, 0].clone()
    merge_state_in_place(vv, ss, vv, ss)
    assert_state(vv, ss, *stack_ref(v[:, 0], s[:, 0], v[:, 0], s[:, 0]), dtype)


def test_aliasing_two_state_route(device):
    """merge_states with 2 states runs the two-state kernel: out = v[:, j] still allowed."""
    n, heads, head_dim, dtype = 3, 2, 64, torch.float16
    v, s = random_states((n, 2), heads, head_dim, dtype, device, seed=15)
    ref = merge_states_ref(v, s)
    for j in (0, 1):
        vv, ss = v.clone(), s.clone()
        merge_states(vv, ss, out=vv[:, j], out_lse=ss[:, j])
        assert_state(vv[:, j], ss[:, j], *ref, dtype)


@pytest.mark.parametrize("num_states", [2, 3, 9])
@pytest.mark.parametrize(("v_dtype", "out_dtype"), [(torch.float32, torch.bfloat16), (torch.float32, torch.float16),
                                                    (torch.bfloat16, torch.float32)])
def test_out_of_another_float_dtype(device, num_states, v_dtype, out_dtype):
    """merge_states / merge_states_ragged cast at the store (fp32 partials straight into a
    bf16 output, as decode's stage 2 does); every element written."""
    n, heads, head_dim = 3, 3, 80
    v, s = random_states((n, num_states), heads, head_dim, v_dtype, device, seed=16 + num_states)
    ref_o, ref_lse = merge_states_ref(v, s)
    out, out_lse = poisoned((n, heads, head_dim), out_dtype, device), poisoned((n, heads), torch.float32, device)
    o, lse = merge_states(v, s, out=out, out_lse=out_lse)
    assert o is out
    assert_state(o, lse, ref_o, ref_lse, out_dtype)
    indptr = torch.arange(0, n * num_states + 1, num_states, dtype=torch.int32, device=device)
    out.fill_(math.nan)
    out_lse.fill_(math.nan)
    merge_states_ragged(v.flatten(0, 1), s.flatten(0, 1), indptr, out=out, out_lse=out_lse)
    assert_state(out, out_lse, ref_o, ref_lse, out_dtype)


def test_out_of_another_dtype_may_not_alias(device):
    """Only an output of v's own dtype may be one of the input states."""
    n, heads, head_dim = 2, 2, 32
    v, s = random_states((n, 3), heads, head_dim, torch.float32, device, seed=17)
    bf16_over_v = v.view(-1).view(torch.bfloat16)[: n * heads * head_dim].view(n, heads, head_dim)
    with pytest.raises(ValueError, match="^out: "):
        merge_states(v, s, out=bf16_over_v)


def test_cpu_fallback_path(device, monkeypatch):
    """Without Triton (plain CPU) every function takes the float64 reference path."""
    monkeypatch.setattr(merge_mod, "use_triton", lambda _device: False)
    monkeypatch.setattr(merge_many_mod, "use_triton", lambda _device: False)
    dtype = torch.bfloat16
    v, s = random_states((3, 4), 2, 32, dtype, "cpu", seed=14)
    assert_state(*merge_states(v, s), *merge_states_ref(v, s), dtype)
    indptr = torch.tensor([0, 3, 3, 12], dtype=torch.int32)
    flat = v.flatten(0, 1), s.flatten(0, 1)
    assert_state(*merge_states_ragged(*flat, indptr), *merge_states_ragged_ref(*flat, indptr), dtype)
    ref = stack_ref(v[:, 0], s[:, 0], v[:, 1], s[:, 1])
    assert_state(*merge_state(v[:, 0], s[:, 0], v[:, 1], s[:, 1]), *ref, dtype)
    mask = torch.tensor([True, False, True])
    vv, ss = v[:, 0].clone(), s[:, 0].clone()
    merge_state_in_place(vv, ss, v[:, 1], s[:, 1], mask=mask)
    assert_state(vv[mask], ss[mask], ref[0][mask], ref[1][mask], dtype)
    assert torch.equal(bits(vv[~mask]), bits(v[:, 0][~mask]))


# ----------------------------------------------------------------------------------
# bad input: the right exception, naming the argument, before any launch
# ----------------------------------------------------------------------------------


def _bad_cases(device):
    n, h, d, dt = 2, 2, 16, torch.float16
    v = torch.randn(n, h, d, dtype=dt, device=device)
    s = torch.randn(n, h, device=device)
    v4 = torch.randn(n, 3, h, d, dtype=dt, device=device)
    s4 = torch.randn(n, 3, h, device=device)
    ip = torch.tensor([0, 1, 2], dtype=torch.int32, device=device)
    buf = torch.randn(n + 1, h, d, dtype=dt, device=device)
    sbuf = torch.randn(n + 1, h, device=device)
    fbuf = torch.randn(n * h * d + 1, device=device)
    meta = torch.randn(n, h, device="meta")
    wide = torch.randn(n, h, 2 * d, dtype=dt, device=device)[:, :, ::2]
    return {
        "v_a not a tensor": (lambda: merge_state(v.tolist(), s, v, s), TypeError, "v_a"),
        "v_a int": (lambda: merge_state(v.int(), s, v, s), TypeError, "v_a"),
        "v_a 2-D": (lambda: merge_state(v[0], s, v, s), ValueError, "v_a"),
        "v_a last stride": (lambda: merge_state(wide, s, wide, s), ValueError, "v_a"),
        "s_a fp16": (lambda: merge_state(v, s.half(), v, s), TypeError, "s_a"),
        "s_a shape": (lambda: merge_state(v, s[:1], v, s), ValueError, "s_a"),
        "v_b dtype": (lambda: merge_state(v, s, v.float(), s), TypeError, "v_b"),
        "v_b shape": (lambda: merge_state(v, s, v[:1], s[:1]), ValueError, "v_b"),
        "s_b device": (lambda: merge_state(v, s, v, meta), ValueError, "s_b"),
        "out dtype": (lambda: merge_state(v, s, v, s, out=v.float()), TypeError, "out"),
        "out shape": (lambda: merge_state(v, s, v, s, out=v[:1]), ValueError, "out"),
        "out expanded": (lambda: merge_state(v, s, v, s, out=torch.empty_like(v[:1]).expand(n, h, d)),
                         ValueError, "out"),
        "out partial overlap": (lambda: merge_state(buf[:n], s, v, s, out=buf[1:]), ValueError, "out"),
        "out_lse dtype": (lambda: merge_state(v, s, v, s, out_lse=s.half()), TypeError, "out_lse"),
        "out_lse overlaps s_b": (lambda: merge_state(v, s, v, sbuf[:n], out_lse=sbuf[1:]), ValueError, "out_lse"),
        "out overlaps out_lse": (lambda: merge_state(v.float(), s, v.float(), s, out=fbuf[:n * h * d].view(n, h, d),
                                                     out_lse=fbuf[-n * h:].view(n, h)), ValueError, "out"),
        "in-place v_other dtype": (lambda: merge_state_in_place(v, s, v.float(), s), TypeError, "v_other"),
        "in-place s_other shape": (lambda: merge_state_in_place(v, s, v, s[:, :1]), ValueError, "s_other"),
        "in-place v expanded": (lambda: merge_state_in_place(v[:1].expand(n, h, d), s, v.clone(), s.clone()),
                                ValueError, "v"),
        "in-place mask dtype": (lambda: merge_state_in_place(v, s, v.clone(), s.clone(), mask=ip[:n]),
                                TypeError, "mask"),
        "in-place mask shape": (lambda: merge_state_in_place(v, s, v.clone(), s.clone(),
                                                             mask=torch.ones(n + 1, dtype=torch.bool, device=device)),
                                ValueError, "mask"),
        "states v 3-D": (lambda: merge_states(v, s), ValueError, "v"),
        "states s shape": (lambda: merge_states(v4, s4[:, :2]), ValueError, "s"),
        "states out partial overlap": (lambda: merge_states(v4, s4, out=v4.flatten(0, 2)[1:n * h + 1].view(n, h, d)),
                                       ValueError, "out"),
        "states out_lse overlap": (lambda: merge_states(v4, s4, out_lse=s4.flatten()[1:n * h + 1].view(n, h)),
                                   ValueError, "out_lse"),
        "ragged indptr int64": (lambda: merge_states_ragged(v, s, ip.long()), TypeError, "indptr"),
        "ragged indptr 2-D": (lambda: merge_states_ragged(v, s, ip[None]), ValueError, "indptr"),
        "ragged indptr empty": (lambda: merge_states_ragged(v, s, ip[:0]), ValueError, "indptr"),
        "ragged indptr strided": (lambda: merge_states_ragged(v, s, ip.repeat_interleave(2)[::2]),
                                  ValueError, "indptr"),
        "ragged indptr decreasing": (lambda: merge_states_ragged(v, s, ip.flip(0)), ValueError, "indptr"),
        "ragged indptr past nnz": (lambda: merge_states_ragged(v, s, ip + 1), ValueError, "indptr"),
        "ragged indptr negative": (lambda: merge_states_ragged(v, s, ip - 1), ValueError, "indptr"),
        "ragged out overlaps v": (lambda: merge_states_ragged(v, s, ip, out=v), ValueError, "out"),
        "ragged s dtype": (lambda: merge_states_ragged(v, s.double(), ip), TypeError, "s"),
    }


@pytest.mark.parametrize("case", list(_bad_cases(torch.device("cpu"))))
def test_bad_input(device, case):
    fn, exc, name = _bad_cases(device)[case]
    with pytest.raises(exc, match=rf"^{name}: "):
        fn()


# ----------------------------------------------------------------------------------
# properties: any cut of a KV set, merged in any order and grouping, is the whole
# ----------------------------------------------------------------------------------


def _merge_tree(states, data, device):
    """Merge ``states`` (a list of (o [n, H, D], lse [n, H])) by a random tree of kernels."""
    if len(states) == 1:
        return states[0]
    how = data.draw(st.sampled_from(["pair", "in-place", "dense", "ragged"]))
    if how in ("pair", "in-place"):
        cut = data.draw(st.integers(1, len(states) - 1))
        a = _merge_tree(states[:cut], data, device)
        b = _merge_tree(states[cut:], data, device)
        if how == "pair":
            return merge_state(*a, *b)
        o, lse = a[0].clone(), a[1].clone()
        merge_state_in_place(o, lse, *b)
        return o, lse
    groups = data.draw(st.integers(2, len(states)))
    cuts = sorted(data.draw(st.lists(st.integers(1, len(states) - 1), min_size=groups - 1, max_size=groups - 1,
                                     unique=True)))
    bounds = [0, *cuts, len(states)]
    subs = [_merge_tree(states[a:b], data, device) for a, b in zip(bounds, bounds[1:])]
    v = torch.stack([o for o, _ in subs], 1)  # [n, groups, H, D]
    s = torch.stack([lse for _, lse in subs], 1)
    if how == "dense":
        return merge_states(v, s)
    # ragged: every row gets its states plus 0-2 extra empty ones, shuffled within the row
    n = v.shape[0]
    extra = data.draw(st.lists(st.integers(0, 2), min_size=n, max_size=n))
    rows_v, rows_s, indptr = [], [], [0]
    for i in range(n):
        vi = torch.cat([v[i], torch.full_like(v[i][:1], math.nan).expand(extra[i], -1, -1)])
        si = torch.cat([s[i], torch.full_like(s[i][:1], -INF).expand(extra[i], -1)])
        perm = torch.tensor(data.draw(st.permutations(range(len(si)))), device=device)
        rows_v.append(vi[perm])
        rows_s.append(si[perm])
        indptr.append(indptr[-1] + len(si))
    indptr = torch.tensor(indptr, dtype=torch.int32, device=device)
    return merge_states_ragged(torch.cat(rows_v), torch.cat(rows_s), indptr)


@settings(max_examples=80, **HYPOTHESIS)
@given(data=st.data())
def test_any_cut_any_tree_is_whole_attention(device, data):
    length = data.draw(st.integers(0, 24), label="keys")
    pieces = data.draw(st.integers(1, 6), label="pieces")
    cuts = sorted(data.draw(st.lists(st.integers(0, length), min_size=pieces - 1, max_size=pieces - 1)))
    bounds = [0, *cuts, length]  # repeated cut points make empty pieces
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    head_dim = data.draw(st.sampled_from([16, 40, 64]), label="head_dim")
    seed = data.draw(st.integers(0, 2**31 - 1), label="seed")
    n, hq, hkv = 2, 2, 1
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n, hq, head_dim, generator=gen) * 2
    k = torch.randn(length, hkv, head_dim, generator=gen)
    v = torch.randn(length, hkv, head_dim, generator=gen)
    states = []
    for a, b in zip(bounds, bounds[1:]):
        o, lse = attention_state_ref(q, k[a:b], v[a:b])
        states.append((o.to(dtype).to(device), lse.float().to(device)))
    order = data.draw(st.permutations(range(len(states))), label="order")
    o, lse = _merge_tree([states[i] for i in order], data, device)
    ref_o, ref_lse = attention_state_ref(q, k, v)
    assert_state(o, lse, ref_o, ref_lse, dtype, scale=3.0)


@settings(max_examples=40, **HYPOTHESIS)
@given(data=st.data())
def test_merge_algebra(device, data):
    """Commutative (LSE bit for bit), associative, and (0, -inf) is the identity (bit for bit)."""
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    heads = data.draw(st.integers(1, 3), label="heads")
    head_dim = data.draw(st.sampled_from([8, 24, 64]), label="head_dim")
    seed = data.draw(st.integers(0, 2**31 - 1), label="seed")
    v, s = random_states((2, 3), heads, head_dim, dtype, device, seed)
    v = torch.where((s == -INF)[..., None], 0.0, v.float()).to(dtype)  # valid states: empty is (0, -inf)
    a, b, c = [(v[:, j], s[:, j]) for j in range(3)]

    ab, ba = merge_state(*a, *b), merge_state(*b, *a)
    assert torch.equal(ab[1], ba[1])
    # a GPU build may fuse either product into an FMA: allow one rounding step in v
    torch.testing.assert_close(ab[0], ba[0], atol=0.0, rtol=torch.finfo(dtype).eps)

    empty = (torch.zeros_like(a[0]), torch.full_like(a[1], -INF))
    for got in (merge_state(*a, *empty), merge_state(*empty, *a),
                merge_states(torch.stack([empty[0], a[0]], 1), torch.stack([empty[1], a[1]], 1))):
        assert torch.equal(got[0], a[0]) and torch.equal(got[1], a[1])

    left = merge_state(*ab, *c)
    right = merge_state(*a, *merge_state(*b, *c))
    flat = merge_states(v, s)
    ref = merge_states_ref(v, s)
    for got in (left, right, flat):
        assert_state(*got, *ref, dtype, scale=3.0)


# ----------------------------------------------------------------------------------
# GPU only: realistic shapes, CUDA-graph capture
# ----------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_realistic_shapes(dtype):
    device = torch.device("cuda")
    n, heads, head_dim = 2048, 32, 128
    v_a, s_a = random_states((n,), heads, head_dim, dtype, device, seed=20)
    v_b, s_b = random_states((n,), heads, head_dim, dtype, device, seed=21)
    assert_state(*merge_state(v_a, s_a, v_b, s_b), *stack_ref(v_a, s_a, v_b, s_b), dtype)
    for num_states in (2, 5, 16):
        v, s = random_states((n // 4, num_states), heads, head_dim, dtype, device, seed=num_states)
        assert_state(*merge_states(v, s), *merge_states_ref(v, s), dtype)
    counts = torch.randint(0, 9, (n // 4,), generator=torch.Generator().manual_seed(22))
    indptr = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]).to(torch.int32).to(device)
    v, s = random_states((int(counts.sum()),), heads, head_dim, dtype, device, seed=23)
    assert_state(*merge_states_ragged(v, s, indptr), *merge_states_ragged_ref(v, s, indptr), dtype)
    for head_dim in (64, 96, 192, 256, 512):
        v, s = random_states((256, 4), 8, head_dim, dtype, device, seed=head_dim)
        assert_state(*merge_states(v, s), *merge_states_ref(v, s), dtype)


@pytest.mark.gpu
def test_gpu_cuda_graph_capture():
    """All launches are sync-free: capture them in a graph, change the inputs, replay."""
    device, dtype = torch.device("cuda"), torch.bfloat16
    n, heads, head_dim = 64, 8, 128
    v, s = random_states((n, 4), heads, head_dim, dtype, device, seed=30)
    indptr = torch.arange(0, 4 * n + 1, 4, dtype=torch.int32, device=device)
    mask = torch.arange(n, device=device) % 3 != 0
    acc_v, acc_s = v[:, 0].clone(), s[:, 0].clone()
    outs = [torch.empty(n, heads, head_dim, dtype=dtype, device=device) for _ in range(3)]
    lses = [torch.empty(n, heads, device=device) for _ in range(3)]

    def run():
        merge_states(v, s, out=outs[0], out_lse=lses[0])
        merge_states_ragged(v.flatten(0, 1), s.flatten(0, 1), indptr, out=outs[1], out_lse=lses[1])
        merge_state(v[:, 1], s[:, 1], v[:, 2], s[:, 2], out=outs[2], out_lse=lses[2])
        merge_state_in_place(acc_v, acc_s, v[:, 3], s[:, 3], mask=mask)

    run()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    new_v, new_s = random_states((n, 4), heads, head_dim, dtype, device, seed=31)
    v.copy_(new_v)
    s.copy_(new_s)
    acc_v.copy_(v[:, 0])
    acc_s.copy_(s[:, 0])
    graph.replay()
    torch.cuda.synchronize()
    ref = merge_states_ref(v, s)
    assert_state(outs[0], lses[0], *ref, dtype)
    assert_state(outs[1], lses[1], *ref, dtype)
    assert_state(outs[2], lses[2], *stack_ref(v[:, 1], s[:, 1], v[:, 2], s[:, 2]), dtype)
    ref3 = stack_ref(v[:, 0], s[:, 0], v[:, 3], s[:, 3])
    assert_state(acc_v[mask], acc_s[mask], ref3[0][mask], ref3[1][mask], dtype)
    assert torch.equal(acc_v[~mask], v[:, 0][~mask])
