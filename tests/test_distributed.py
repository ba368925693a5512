"""merge_states_across over torch.distributed with the gloo backend: 2 CPU processes.

Each test body runs in every rank (``run_ranks``); an assertion failing in a rank fails
the test. The ranks inherit the test run's kernel path (the Triton interpreter on a CPU)
and apply the same interpreter patches as this process (conftest).
"""

from __future__ import annotations

import math
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cascadeinfer.distributed import merge_states_across
from cascadeinfer.kernels.reference import attention_state_ref

WORLD = 2


def _rank_main(rank: int, world: int, init_file: str, body, args) -> None:
    import conftest  # noqa: F401, PLC0415 - the interpreter patches, as in the parent

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        body(rank, world, *args)
    finally:
        dist.destroy_process_group()


def run_ranks(body, *args, world: int = WORLD) -> None:
    """Run ``body(rank, world, *args)`` in ``world`` fresh processes joined by gloo."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank_main, args=(world, os.path.join(tmp, "init"), body, args), nprocs=world, join=True)


def _split_keys(seed: int, rank: int, world: int, n: int, hq: int, hkv: int, d: int, dtype: torch.dtype):
    """Every rank draws the same rows and keys, then takes its own share of each row's keys:
    a random owner per key, with rows wholly on one rank (the others' parts are empty) and a
    row with no key at all. Returns q, this rank's state, and the state over all keys."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, hq, d, generator=g)
    o_part = torch.empty(n, hq, d, dtype=dtype)
    lse_part = torch.empty(n, hq)
    o_all = torch.empty(n, hq, d, dtype=torch.float64)
    lse_all = torch.empty(n, hq, dtype=torch.float64)
    for row in range(n):
        length = 0 if row == 0 else int(torch.randint(1, 40, (1,), generator=g))
        k = torch.randn(length, hkv, d, generator=g)
        v = torch.randn(length, hkv, d, generator=g)
        owner = torch.randint(0, world, (length,), generator=g)
        if row % 3 == 1:
            owner.fill_(row % world)  # the whole row on one rank
        mine = owner == rank
        o, lse = attention_state_ref(q[row:row + 1], k[mine], v[mine])
        o_part[row], lse_part[row] = o[0].to(dtype), lse[0].float()
        o, lse = attention_state_ref(q[row:row + 1], k, v)
        o_all[row], lse_all[row] = o[0], lse[0]
    return o_part, lse_part, o_all, lse_all


def _body_equals_attention_over_all_keys(rank, world, seed, dtype):
    o_part, lse_part, o_ref, lse_ref = _split_keys(seed, rank, world, 7, 4, 2, 32, dtype)
    out = torch.full_like(o_part, float("nan"))
    out_lse = torch.full_like(lse_part, float("nan"))
    o, lse = merge_states_across(o_part, lse_part, out=out, out_lse=out_lse)
    assert o is out and lse is out_lse
    tol = 2e-3 if dtype == torch.float32 else 5e-3
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    torch.testing.assert_close(o.double(), o_ref, atol=tol, rtol=tol)
    assert torch.isneginf(lse[0]).all() and (o[0] == 0).all()  # no rank saw a key of row 0
    torch.testing.assert_close(lse[1:].double(), lse_ref[1:], atol=1e-4, rtol=1e-4)
    # every rank holds the same bits
    gathered = [torch.empty_like(o) for _ in range(world)]
    dist.all_gather(gathered, o)
    assert all(torch.equal(x, o) for x in gathered)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_merge_states_across_equals_attention_over_all_keys(dtype):
    run_ranks(_body_equals_attention_over_all_keys, 11, dtype)


def _body_lse_gaps(rank, world):
    """States 80 apart in LSE (either way) merge without overflow or NaN, to float64's merge."""
    g = torch.Generator().manual_seed(5)
    n, h, d = 6, 3, 16
    o_all = torch.randn(world, n, h, d, generator=g)
    lse_all = torch.randn(world, n, h, generator=g)
    lse_all[1] += 80.0 * torch.sign(torch.randn(n, h, generator=g))
    lse_all[0, 2] = -math.inf  # rank 0 saw none of row 2's keys
    o_all[0, 2] = 0.0
    o, lse = merge_states_across(o_all[rank].clone(), lse_all[rank].clone())
    m = lse_all.double().max(dim=0).values
    w = torch.exp(lse_all.double() - m)
    lse_ref = m + torch.log(w.sum(0))
    o_ref = (w[..., None] * o_all.double()).sum(0) / w.sum(0)[..., None]
    assert torch.isfinite(o).all() and torch.isfinite(lse).all()
    torch.testing.assert_close(o.double(), o_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), lse_ref, atol=1e-5, rtol=1e-6)


def test_merge_states_across_lse_gaps():
    run_ranks(_body_lse_gaps)


def test_merge_states_across_one_rank_and_bad_input():
    o, lse = torch.randn(3, 2, 8), torch.randn(3, 2)
    with pytest.raises(RuntimeError, match="init_process_group"):
        merge_states_across(o, lse)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'init')}", rank=0, world_size=1)
        try:
            merged, merged_lse = merge_states_across(o, lse)
            torch.testing.assert_close(merged, o)
            torch.testing.assert_close(merged_lse, lse)
            with pytest.raises(ValueError, match="lse"):
                merge_states_across(o, lse[:2])
            with pytest.raises(TypeError, match="lse"):
                merge_states_across(o, lse.double())
            with pytest.raises(ValueError, match="o"):
                merge_states_across(o[0], lse)
        finally:
            dist.destroy_process_group()
