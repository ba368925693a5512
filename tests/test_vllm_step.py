"""The vLLM backend's device-agnostic core (cascadeinfer.integrations.vllm.step), without
vLLM: a step described as vLLM describes it (block table, sequence lengths, query offsets,
slot mapping; vLLM's [num_blocks, num_kv_heads, block_size, 2 * head_size] cache) must
write every new token's K/V at its slot and give each query token causal attention over
its request's tokens, equal to float64 attention, with the decode rows' cascade forced
on, forced off or chosen by the planner."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cascadeinfer.integrations.vllm.step import kv_views, plan_step, run_step


def _step(seed: int, block_size: int, hq: int, hkv: int, d: int):
    """Requests that share blocks: a long system prompt shared by 4 decode rows (two of them
    n > 1 siblings sharing a further block), a second prompt shared by 2 more, one decode
    row alone, then two prefill rows (a new request and a chunk of a longer one) — as vLLM
    orders them, decodes first. Returns the step's inputs and each row's token count and
    blocks."""
    g = torch.Generator().manual_seed(seed)
    bs = block_size
    free = iter(torch.randperm(200, generator=g).tolist())
    take = lambda n: [next(free) for _ in range(n)]  # noqa: E731
    system_a, system_b = take(3), take(2)
    sibling = take(1)
    rows = [  # (blocks, tokens in the sequence incl. this step, query tokens)
        (system_a + sibling + take(1), 4 * bs + 3, 1),
        (system_a + sibling + take(1), 4 * bs + 3, 1),
        (system_a + take(2), 4 * bs + 1, 1),
        (system_a + take(1), 3 * bs + bs, 1),  # a full last block
        (system_b + take(1), 2 * bs + 5, 1),
        (system_b + take(2), 3 * bs + 2, 1),
        (take(1), 1, 1),  # length 1
        (take(4), 3 * bs + 7, 3 * bs + 7),  # a new request
        (take(3), 2 * bs + 5, bs + 4),  # a chunk of a longer prompt
    ]
    width = max(len(b) for b, _, _ in rows) + 2
    table = np.full((len(rows), width), 10**6, dtype=np.int32)  # garbage past each row's blocks
    for r, (blocks, _, _) in enumerate(rows):
        table[r, :len(blocks)] = blocks
    seq_lens = np.array([n for _, n, _ in rows])
    qsl = np.zeros(len(rows) + 1, dtype=np.int32)
    np.cumsum([q for _, _, q in rows], out=qsl[1:])
    slots = []
    for blocks, n, q in rows:
        slots += [blocks[p // bs] * bs + p % bs for p in range(n - q, n)]
    num_tokens = len(slots)
    slots = torch.tensor(slots + [-1, -1])  # padding past the real tokens
    return rows, table, seq_lens, qsl, slots, num_tokens


@pytest.mark.parametrize("use_cascade", [True, False, None])
@pytest.mark.parametrize("dtype, block_size, hq, hkv, d", [(torch.float32, 16, 4, 2, 32), (torch.float16, 8, 8, 1, 64)])
def test_step_writes_the_cache_and_attends(use_cascade, dtype, block_size, hq, hkv, d, device):
    rows, table, seq_lens, qsl, slots, num_tokens = _step(3, block_size, hq, hkv, d)
    bs = block_size
    num_blocks = 200
    g = torch.Generator().manual_seed(7)
    cache = torch.randn(num_blocks, hkv, bs, 2 * d, generator=g).to(device, dtype)
    # A sequence's tokens before this step are what its blocks hold (rows sharing a block
    # share those tokens); this step's are new.
    kc, vc = (x.cpu() for x in kv_views(cache))
    k_all, v_all = [], []
    for blocks, n, q in rows:
        old = [(blocks[p // bs], p % bs) for p in range(n - q)]
        k_all.append(torch.cat([torch.stack([kc[b, :, o] for b, o in old]) if old else torch.empty(0, hkv, d, dtype=dtype),
                                torch.randn(q, hkv, d, generator=g).to(dtype)]))
        v_all.append(torch.cat([torch.stack([vc[b, :, o] for b, o in old]) if old else torch.empty(0, hkv, d, dtype=dtype),
                                torch.randn(q, hkv, d, generator=g).to(dtype)]))
    key = torch.cat([k[n - q:] for (_, n, q), k in zip(rows, k_all)] + [torch.zeros(2, hkv, d, dtype=dtype)])
    value = torch.cat([v[n - q:] for (_, n, q), v in zip(rows, v_all)] + [torch.zeros(2, hkv, d, dtype=dtype)])
    query = torch.randn(num_tokens + 2, hq, d, generator=g).to(dtype)
    before = cache.clone()
    plan = plan_step(torch.from_numpy(table), torch.from_numpy(seq_lens), torch.from_numpy(qsl), slots.to(device),
                     num_tokens, block_size=bs, num_blocks=num_blocks, num_qo_heads=hq, num_kv_heads=hkv,
                     head_dim=d, dtype=dtype, device=device, use_cascade=use_cascade)
    assert plan.num_decodes == 7 and plan.prefill is not None
    if use_cascade is not None:
        assert plan.use_cascade is use_cascade
    output = torch.full((num_tokens + 2, hq * d), float("nan"), dtype=dtype, device=device)
    run_step(plan, query.to(device), key.to(device), value.to(device), cache, output, d ** -0.5)

    # The cache: every new token at its slot, nothing else changed (padding not written).
    expected = before.clone()
    ke, ve = kv_views(expected)
    for (blocks, n, q), k, v in zip(rows, k_all, v_all):
        for p in range(n - q, n):
            ke[blocks[p // bs], :, p % bs] = k[p].to(device)
            ve[blocks[p // bs], :, p % bs] = v[p].to(device)
    assert torch.equal(cache, expected)

    # The output: causal attention of each request's queries over its tokens, in float64.
    out = output.view(-1, hq, d).cpu().double()
    group = hq // hkv
    tol = 2e-3 if dtype == torch.float32 else 5e-3
    t = 0
    for (_, n, q), k, v in zip(rows, k_all, v_all):
        kk = k.double().repeat_interleave(group, dim=1)
        vv = v.double().repeat_interleave(group, dim=1)
        for j in range(q):
            visible = n - q + j + 1
            s = torch.einsum("hd,nhd->hn", query[t].double(), kk[:visible]) * d ** -0.5
            ref = torch.einsum("hn,nhd->hd", torch.softmax(s, dim=-1), vv[:visible])
            torch.testing.assert_close(out[t], ref, atol=tol, rtol=tol)
            t += 1
    assert torch.isnan(output[num_tokens:]).all()  # padding rows untouched


def test_step_rejects_what_does_not_add_up(device):
    table = torch.zeros(2, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match="query_start_loc"):
        plan_step(table, torch.tensor([3, 3]), torch.tensor([0, 1, 2]), torch.zeros(3, dtype=torch.int64), 3,
                  block_size=4, num_blocks=8, num_qo_heads=2, num_kv_heads=1, head_dim=32, dtype=torch.float32,
                  device=device)
    with pytest.raises(ValueError, match="kv_cache"):
        kv_views(torch.zeros(2, 1, 4, 33))


@pytest.mark.parametrize("where", ["numpy", "cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_block_table_read_is_the_steps_rows_and_columns(where):
    from cascadeinfer.integrations.vllm.step import _host_table  # noqa: PLC0415

    full = torch.randint(0, 100, (5, 9), dtype=torch.int32)
    table = full.numpy() if where == "numpy" else full.to(where)
    got = _host_table(table, 3, 4)
    assert isinstance(got, np.ndarray) and got.shape == (3, 4)
    assert (got == full[:3, :4].numpy()).all()
