"""The kernels as PyTorch custom ops, so engines can use them under ``torch.compile``.

Each op writes into caller-provided ``out``/``lse`` buffers (PyTorch custom ops may not
return views of their inputs) and returns nothing; the public Python functions in
:mod:`cascadeinfer.kernels` remain the friendlier entry points for eager code.
``MultiLevelCascadeAttention.run`` calls these ops, so a compiled model that calls
``run`` traces into a handful of opaque kernel calls with ``fullgraph=True``, and the
same calls can be captured in a CUDA graph.

A paged cache is passed as ``(k_cache, v_cache)``: either the single tensor
``[pages, 2, ...]`` with ``v_cache=None``, or the two per-tensor caches. Shapes, dtypes and
devices are always checked. Every op takes a last argument ``validate`` (default False):
True also checks the tensor *contents* (page tables, indptrs, page ids inside the pool)
on the host, like the Python launchers' ``validate=True``. That check runs when the op
executes, never while ``torch.compile`` traces (the fake implementations compute
nothing), and it is skipped while a CUDA graph is being captured (no host reads are
allowed there): inside a captured graph an op never validates.

    torch.ops.cascadeinfer.batch_decode_paged(q, k_cache, v_cache, kv_indptr, kv_indices,
                                              kv_last_page_len, kv_layout, sm_scale, num_splits, out, lse,
                                              schedule=None, validate=False)
"""

from __future__ import annotations

from typing import Optional

import torch

from cascadeinfer.kernels.append import append_paged_kv_cache
from cascadeinfer.kernels.decode import batch_decode_paged
from cascadeinfer.kernels.merge import merge_state
from cascadeinfer.kernels.merge_many import merge_states
from cascadeinfer.kernels.prefill import batch_prefill_paged, batch_prefill_ragged
from cascadeinfer.kernels.rope_append import append_paged_kv_cache_rope


def _cache(k_cache: torch.Tensor, v_cache: Optional[torch.Tensor]):
    return k_cache if v_cache is None else (k_cache, v_cache)


@torch.library.custom_op("cascadeinfer::merge_state", mutates_args=("out", "out_lse"))
def merge_state_op(v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor,
                   out: torch.Tensor, out_lse: torch.Tensor, validate: bool = False) -> None:
    """``merge_state`` into ``out [n, H, D]`` and ``out_lse`` float32 ``[n, H]`` (natural log)."""
    merge_state(v_a, s_a, v_b, s_b, out=out, out_lse=out_lse, validate=validate)


@torch.library.custom_op("cascadeinfer::merge_states", mutates_args=("out", "out_lse"))
def merge_states_op(v: torch.Tensor, s: torch.Tensor, out: torch.Tensor, out_lse: torch.Tensor,
                    validate: bool = False) -> None:
    """``merge_states`` of ``v [n, S, H, D]``, ``s [n, S, H]`` into ``out``/``out_lse``."""
    merge_states(v, s, out=out, out_lse=out_lse, validate=validate)


@torch.library.custom_op("cascadeinfer::batch_decode_paged", mutates_args=("out", "lse"))
def batch_decode_paged_op(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: Optional[torch.Tensor], kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor, kv_last_page_len: torch.Tensor, kv_layout: str, sm_scale: float,
    num_splits: Optional[int], out: torch.Tensor, lse: torch.Tensor, schedule: Optional[str] = None,
    validate: bool = False,
) -> None:
    """``batch_decode_paged`` into ``out [batch, Hq, D]`` and ``lse`` float32 ``[batch, Hq]``."""
    batch_decode_paged(q, _cache(k_cache, v_cache), kv_indptr, kv_indices, kv_last_page_len,
                       kv_layout=kv_layout, sm_scale=sm_scale, num_splits=num_splits, schedule=schedule,
                       out=out, lse=lse, validate=validate)


@torch.library.custom_op("cascadeinfer::batch_prefill_paged", mutates_args=("out", "lse"))
def batch_prefill_paged_op(
    q: torch.Tensor, qo_indptr: torch.Tensor, k_cache: torch.Tensor, v_cache: Optional[torch.Tensor],
    kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_last_page_len: torch.Tensor, causal: bool,
    kv_layout: str, sm_scale: float, num_splits: Optional[int], out: torch.Tensor, lse: torch.Tensor,
    validate: bool = False, backend: Optional[str] = None,
) -> None:
    """``batch_prefill_paged`` into ``out [nnz_qo, Hq, D]`` and ``lse`` float32 ``[nnz_qo, Hq]``."""
    batch_prefill_paged(q, qo_indptr, _cache(k_cache, v_cache), kv_indptr, kv_indices, kv_last_page_len,
                        causal=causal, kv_layout=kv_layout, sm_scale=sm_scale, out=out, lse=lse, validate=validate,
                        num_splits=num_splits, backend=backend)


@torch.library.custom_op("cascadeinfer::batch_prefill_ragged", mutates_args=("out", "lse"))
def batch_prefill_ragged_op(
    q: torch.Tensor, qo_indptr: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_indptr: torch.Tensor,
    causal: bool, sm_scale: float, out: torch.Tensor, lse: torch.Tensor, validate: bool = False,
) -> None:
    """``batch_prefill_ragged`` into ``out [nnz_qo, Hq, D]`` and ``lse`` float32 ``[nnz_qo, Hq]``."""
    batch_prefill_ragged(q, qo_indptr, k, v, kv_indptr, causal=causal, sm_scale=sm_scale,
                         out=out, lse=lse, validate=validate)


@torch.library.custom_op("cascadeinfer::append_paged_kv_cache", mutates_args=("k_cache", "v_cache"))
def append_paged_kv_cache_op(
    append_key: torch.Tensor, append_value: torch.Tensor, batch_indices: torch.Tensor, positions: torch.Tensor,
    k_cache: torch.Tensor, v_cache: Optional[torch.Tensor], kv_indices: torch.Tensor, kv_indptr: torch.Tensor,
    kv_last_page_len: torch.Tensor, kv_layout: str, validate: bool = False,
) -> None:
    """``append_paged_kv_cache`` (mutates the cache; ``v_cache=None`` for the single-tensor form)."""
    append_paged_kv_cache(append_key, append_value, batch_indices, positions, _cache(k_cache, v_cache),
                          kv_indices, kv_indptr, kv_last_page_len, kv_layout=kv_layout, validate=validate)


@torch.library.custom_op("cascadeinfer::append_paged_kv_cache_rope",
                         mutates_args=("q", "append_key", "k_cache", "v_cache"))
def append_paged_kv_cache_rope_op(
    q: torch.Tensor, append_key: torch.Tensor, append_value: torch.Tensor, batch_indices: torch.Tensor,
    positions: torch.Tensor, k_cache: torch.Tensor, v_cache: Optional[torch.Tensor], kv_indices: torch.Tensor,
    kv_indptr: torch.Tensor, kv_last_page_len: torch.Tensor, rope_positions: torch.Tensor,
    cos_sin_cache: torch.Tensor, kv_layout: str, validate: bool = False,
) -> None:
    """``append_paged_kv_cache_rope`` (rotates ``q`` and ``append_key`` in place, mutates the cache)."""
    append_paged_kv_cache_rope(q, append_key, append_value, batch_indices, positions, _cache(k_cache, v_cache),
                               kv_indices, kv_indptr, kv_last_page_len, rope_positions, cos_sin_cache,
                               kv_layout=kv_layout, validate=validate)


# Every op only writes into its mutated arguments, so the fake (meta) implementations
# have nothing to compute.
for _op in (merge_state_op, merge_states_op, batch_decode_paged_op, batch_prefill_paged_op,
            batch_prefill_ragged_op, append_paged_kv_cache_op, append_paged_kv_cache_rope_op):
    _op.register_fake(lambda *args, **kwargs: None)


def split_cache(paged_kv_cache) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``(k_cache, v_cache)`` arguments of the ops for a cache in either form."""
    if isinstance(paged_kv_cache, (tuple, list)):
        return paged_kv_cache[0], paged_kv_cache[1]
    return paged_kv_cache, None
