"""One engine step's attention over a vLLM-style paged KV cache, planned once for all layers.

This is the device-agnostic core of the vLLM backend and imports nothing of vLLM. A step
is described as vLLM's metadata describes it:

* ``block_table``: int ``[num_reqs, max_blocks]``, row ``r`` the blocks of request ``r``
  in order (read on the host: one small copy per step when it lives on a GPU);
* ``seq_lens``: ``[num_reqs]``, each request's tokens including this step's;
* ``query_start_loc``: ``[num_reqs + 1]``, request ``r``'s query tokens are
  ``[query_start_loc[r], query_start_loc[r + 1])``;
* ``slot_mapping``: int64 ``[>= num_tokens]`` on the device, token ``t``'s cache slot
  ``block * block_size + offset`` (``< 0``: padding, not written).

The leading requests with one query token are decode rows (vLLM puts them first for a
builder whose ``reorder_batch_threshold`` is 1): :func:`group_levels` finds the runs of
blocks they share (one system prompt, several, n > 1 siblings) and cuts them into cascade
levels, and :class:`MultiLevelCascadeAttention`'s planner picks cascade or flat decode.
The other requests (prefill chunks, mixed batches) go to :func:`batch_prefill_paged`,
causal over their blocks. Each layer's cache is vLLM's ``[num_blocks, num_kv_heads,
block_size, 2 * head_size]`` tensor, read in place as the strided ``(k, v)`` views of
:func:`kv_views` (the "HND" layout), never copied.

LSE convention: the kernels' states carry natural-log LSEs; only outputs leave here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from cascadeinfer.cascade import MultiLevelCascadeAttention
from cascadeinfer.cascade.grouping import group_levels
from cascadeinfer.kernels import append_paged_kv_cache, batch_prefill_paged


def kv_views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's per-layer cache ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``
    (K then V along the last dim, any strides) as ``(k, v)`` HND views
    ``[num_blocks, num_kv_heads, block_size, head_size]`` of the same memory."""
    if kv_cache.dim() != 4 or kv_cache.shape[-1] % 2:
        raise ValueError(f"kv_cache: expected [num_blocks, num_kv_heads, block_size, 2 * head_size], "
                         f"got {tuple(kv_cache.shape)}")
    return kv_cache.chunk(2, dim=-1)


@dataclass
class _Prefill:
    start: int  # first query token of the prefill rows
    end: int
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor


@dataclass
class _Append:
    """The step's new tokens as a page table of one single-slot row per token (what
    :func:`append_paged_kv_cache` reads), from the slot mapping, on the device."""

    num_tokens: int
    rows: torch.Tensor
    positions: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor


@dataclass
class StepPlan:
    """What every layer of one step runs: the cache writes, the decode rows' cascade (or
    flat decode) and the prefill rows' paged prefill."""

    num_tokens: int
    num_decodes: int
    order: torch.Tensor | None  # decode query i is token order[i]; None: in token order
    decode: MultiLevelCascadeAttention | None
    prefill: _Prefill | None
    append: _Append

    @property
    def use_cascade(self) -> bool | None:
        return self.decode.use_cascade if self.decode is not None else None


def _i32(values, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(np.asarray(values, dtype=np.int32)).to(device, non_blocking=True)


def _host_table(block_table: torch.Tensor | np.ndarray, rows: int, cols: int) -> np.ndarray:
    """The first ``rows`` rows and ``cols`` columns of the block table, on the host. From a
    GPU: one copy of just that block into pinned memory (vLLM's table is as wide as the
    longest model length allows; a step needs the columns of its longest request), then a
    wait for it. On an H100 machine a 256 x 512 int32 table takes 57 µs by ``.cpu()`` and
    18 µs this way (benchmarks/RESULTS.md, "vLLM backend")."""
    if not isinstance(block_table, torch.Tensor):
        return np.asarray(block_table)[:rows, :cols]
    part = block_table[:rows, :cols]
    if not part.is_cuda:
        return part.numpy()
    host = torch.empty(part.shape, dtype=part.dtype, pin_memory=True)
    host.copy_(part, non_blocking=True)
    torch.cuda.current_stream(part.device).synchronize()
    return host.numpy()


def plan_step(
    block_table: torch.Tensor | np.ndarray,
    seq_lens: torch.Tensor | np.ndarray,
    query_start_loc: torch.Tensor | np.ndarray,
    slot_mapping: torch.Tensor,
    num_tokens: int,
    *,
    block_size: int,
    num_blocks: int | None,
    num_qo_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    num_levels: int = 2,
    use_cascade: bool | None = None,
) -> StepPlan:
    """Plan one step (host work, once for all layers); see the module docstring for the
    inputs. ``num_tokens``: the step's real query tokens (the rest of ``slot_mapping``
    and of the layers' inputs is padding). ``num_blocks``: the cache's blocks, to check
    the decode rows' blocks against (None: not checked). ``use_cascade`` forces the decode
    rows' cascade (True) or flat decode (False); None lets the planner choose."""
    qsl = np.asarray(query_start_loc.cpu() if isinstance(query_start_loc, torch.Tensor) else query_start_loc,
                     dtype=np.int64)
    lens = np.asarray(seq_lens.cpu() if isinstance(seq_lens, torch.Tensor) else seq_lens, dtype=np.int64)
    num_reqs = qsl.size - 1
    if lens.size < num_reqs or block_table.shape[0] < num_reqs:
        raise ValueError(f"seq_lens/block_table: {lens.size}/{block_table.shape[0]} rows for {num_reqs} requests")
    table = _host_table(block_table, num_reqs, -(-int(lens[:num_reqs].max(initial=0)) // block_size))
    qlens = np.diff(qsl)
    if qsl[-1] != num_tokens:
        raise ValueError(f"query_start_loc: ends at {qsl[-1]}, but the step has {num_tokens} tokens")
    not_one = np.flatnonzero(qlens != 1)
    num_decodes = int(not_one[0]) if not_one.size else num_reqs
    pages = -(-lens[:num_reqs] // block_size)
    last = lens[:num_reqs] - (pages - 1) * block_size

    decode, order = None, None
    if num_decodes:
        page_lists = [table[r, :pages[r]].tolist() for r in range(num_decodes)]
        rows, levels = group_levels(page_lists, last[:num_decodes].tolist(), num_levels, block_size)
        decode = MultiLevelCascadeAttention(len(levels), kv_layout="HND", device=device)
        decode.plan([lv.qo_indptr for lv in levels], [lv.kv_indptr for lv in levels],
                    [lv.kv_indices for lv in levels], [lv.kv_last_page_len for lv in levels],
                    num_qo_heads, num_kv_heads, head_dim, block_size, num_pages=num_blocks, dtype=dtype,
                    use_cascade=use_cascade if len(levels) > 1 else None)
        if rows != list(range(num_decodes)):
            order = torch.as_tensor(np.asarray(rows, dtype=np.int64)).to(device, non_blocking=True)

    prefill = None
    if num_decodes < num_reqs:
        r = slice(num_decodes, num_reqs)
        kv_indptr = np.zeros(num_reqs - num_decodes + 1, dtype=np.int64)
        np.cumsum(pages[r], out=kv_indptr[1:])
        indices = np.concatenate([table[i, :pages[i]] for i in range(num_decodes, num_reqs)])
        start = int(qsl[num_decodes])
        prefill = _Prefill(start, num_tokens, _i32(qsl[num_decodes:] - start, device), _i32(kv_indptr, device),
                           _i32(indices, device), _i32(last[r], device))

    slots = slot_mapping[:num_tokens].long()
    token = torch.arange(num_tokens, device=slots.device)
    offsets = (slots % block_size).int()
    append = _Append(
        num_tokens,
        rows=torch.where(slots >= 0, token, -1).int(),
        positions=offsets,
        kv_indptr=torch.arange(num_tokens + 1, dtype=torch.int32, device=slots.device),
        kv_indices=(slots.clamp(min=0) // block_size).int(),
        kv_last_page_len=offsets + 1,
    )
    return StepPlan(num_tokens, num_decodes, order, decode, prefill, append)


def run_step(
    plan: StepPlan,
    query: torch.Tensor,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    kv_cache: torch.Tensor,
    output: torch.Tensor,
    sm_scale: float,
) -> torch.Tensor:
    """One layer of a planned step: write ``key``/``value`` (``[>= num_tokens, Hkv, D]``;
    None: a layer that shares another's cache writes nothing) into ``kv_cache`` at the
    slot mapping, then attend ``query`` ``[>= num_tokens, Hq, D]`` into ``output``
    (``[>= num_tokens, Hq, D]``, or ``[>= num_tokens, Hq * D]``). Returns ``output``."""
    n = plan.num_tokens
    k_cache, v_cache = kv_views(kv_cache)
    cache = (k_cache, v_cache)
    if key is not None and n:
        a = plan.append
        append_paged_kv_cache(key[:n], value[:n], a.rows, a.positions, cache, a.kv_indices, a.kv_indptr,
                              a.kv_last_page_len, kv_layout="HND", validate=False)
    out = output.view(output.shape[0], query.shape[1], query.shape[2])
    nd = plan.num_decodes
    if plan.decode is not None:
        if plan.order is None:
            plan.decode.run(query[:nd], cache, out=out[:nd], sm_scale=sm_scale)
        else:
            o = plan.decode.run(query.index_select(0, plan.order), cache, sm_scale=sm_scale)
            out[:nd].index_copy_(0, plan.order, o)
    p = plan.prefill
    if p is not None:
        batch_prefill_paged(query[p.start:p.end], p.qo_indptr, cache, p.kv_indptr, p.kv_indices,
                            p.kv_last_page_len, causal=True, kv_layout="HND", sm_scale=sm_scale,
                            out=out[p.start:p.end], validate=False)
    return output
