"""References: the definitions every kernel is tested against.

Readable first, fast never. Natural-log LSE; the empty key set gives ``(0, -inf)``.

* Attention states, float64: :func:`attention_state_ref` and :func:`merge_state_ref` are
  the math; the batched references of the paged and ragged launchers
  (:func:`batch_decode_paged_ref`, :func:`batch_prefill_paged_ref`,
  :func:`batch_prefill_ragged_ref`) apply it per request or group, and the many-state
  merges' (:func:`merge_states_ref`, :func:`merge_states_ragged_ref`) per row.
* The fused elementwise ops of :mod:`cascadeinfer.kernels.fused`, float32 and rounded
  where Hugging Face's modules round: :func:`rms_norm_ref`, :func:`fused_add_rms_norm_ref`,
  :func:`silu_and_mul_ref`, :func:`apply_rope_ref`.
* The paged cache after :func:`cascadeinfer.kernels.append.append_paged_kv_cache`, float64:
  :func:`append_paged_kv_cache_ref`, one token at a time.

Each also serves as its launcher's path for plain-CPU tensors (no Triton interpreter).
"""

from __future__ import annotations

import math

import torch

from cascadeinfer.layouts.paged_cache import (
    PagedKV,
    PagedKVCache,
    gather_paged_kv,
    unpack_paged_kv_cache,
)


def attention_state_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    sm_scale: float | None = None,
    causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention state of queries ``q: [n, Hq, D]`` over keys ``k, v: [L, Hkv, D]``.

    ``Hq % Hkv == 0``; query head ``h`` reads kv head ``h // (Hq // Hkv)``. With
    ``causal``, query ``i`` sees keys ``j <= L - n + i`` (the last query is aligned with
    the last key). Returns ``(o [n, Hq, D] float64, lse [n, Hq] float64)``, natural log;
    a query that sees no key gets ``o = 0, lse = -inf``.

    Non-finite input never gives a finite answer that ignores it. A (query, head) gets
    ``(NaN, NaN)`` when a key it sees has a NaN or +inf score (from ``q`` or ``k``) or a
    NaN or inf anywhere in its value — the latter at any weight, as in the kernels, where
    ``0 * inf`` is NaN. A score of -inf is a key of weight 0, so a query whose every
    score is -inf gets ``(0, -inf)``, like one that sees no key. Keys the causal mask
    hides from a query never touch it.
    """
    n, hq, d = q.shape
    length, hkv = k.shape[0], k.shape[1]
    scale = d ** -0.5 if sm_scale is None else sm_scale
    group = hq // hkv
    qd = q.double()
    kd = k.double().repeat_interleave(group, dim=1)  # [L, Hq, D]
    vd = v.double().repeat_interleave(group, dim=1)
    visible = torch.ones((n, length), dtype=torch.bool, device=q.device)
    if causal:
        qpos = torch.arange(n, device=q.device)[:, None] + (length - n)
        visible = torch.arange(length, device=q.device)[None, :] <= qpos
    s = torch.einsum("nhd,lhd->hnl", qd, kd) * scale  # [Hq, n, L]
    s = s.masked_fill(~visible, -math.inf)  # also hides a hidden key's NaN score
    lse = torch.logsumexp(s, dim=-1)  # [Hq, n]; -inf where a row sees nothing; NaN/+inf from such scores
    finite = torch.isfinite(lse)
    p = torch.where(finite[..., None], torch.exp(s - torch.where(finite, lse, 0.0)[..., None]), 0.0)
    v_ok = torch.isfinite(vd).all(dim=-1)  # [L, Hq]
    o = torch.einsum("hnl,lhd->nhd", p, torch.where(v_ok[..., None], vd, 0.0))
    bad_v = torch.einsum("nl,lh->nh", visible.double(), (~v_ok).double()) > 0  # a visible key's v is not finite
    lse = lse.transpose(0, 1)
    bad = bad_v | torch.isnan(lse) | (lse == math.inf)
    return o.masked_fill(bad[..., None], math.nan), lse.masked_fill(bad, math.nan).contiguous()


def merge_state_ref(
    v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two attention states in float64: ``v: [..., D]``, ``s: [...]`` natural-log LSE.

    The empty state ``(0, -inf)`` is the identity (its ``v`` is never read); two empties
    give ``(0, -inf)``. An LSE of NaN or +inf gives ``(NaN, NaN)``; a NaN or inf in the
    ``v`` of a state that is not empty stays in the result, at any weight.
    """
    s_a, s_b = s_a.double(), s_b.double()
    s = torch.logaddexp(s_a, s_b)
    finite = torch.isfinite(s)
    safe = torch.where(finite, s, 0.0)
    w_a = torch.where(finite, torch.exp(s_a - safe), 0.0)[..., None]
    w_b = torch.where(finite, torch.exp(s_b - safe), 0.0)[..., None]
    v = (torch.where((s_a == -math.inf)[..., None], 0.0, w_a * v_a.double())
         + torch.where((s_b == -math.inf)[..., None], 0.0, w_b * v_b.double()))
    bad = torch.isnan(s_a) | torch.isnan(s_b) | (s_a == math.inf) | (s_b == math.inf)
    return v.masked_fill(bad[..., None], math.nan), s.masked_fill(bad, math.nan)


def batch_decode_paged_ref(
    q: torch.Tensor,
    kv: PagedKV,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_last_page_len: torch.Tensor,
    *,
    sm_scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 paged decode, vectorised over the batch (the path for plain-CPU tensors).

    ``q: [batch, Hq, D]``, ``kv`` from :func:`unpack_paged_kv_cache`, page table as in
    :func:`batch_decode_paged` (read on the host). Returns ``(o [batch, Hq, D] float64,
    lse [batch, Hq] float64)``, natural log; rows with no keys give ``(0, -inf)``.
    Non-finite input as in :func:`cascadeinfer.kernels.reference.attention_state_ref`: a
    NaN or +inf score, or a NaN or inf in a value of the request's keys, gives
    ``(NaN, NaN)``; the padding past a request's length never touches it.
    """
    batch, hq, d = q.shape
    hkv, page = kv.num_kv_heads, kv.page_size
    scale = d ** -0.5 if sm_scale is None else sm_scale
    dev = q.device
    indptr = kv_indptr.to(dev, torch.int64)
    num_pages = indptr[1:] - indptr[:-1]
    seq = torch.where(num_pages > 0, (num_pages - 1) * page + kv_last_page_len.to(dev, torch.int64), 0)
    max_len = int(seq.max()) if batch else 0
    o = torch.zeros((batch, hq, d), dtype=torch.float64, device=dev)
    lse = torch.full((batch, hq), -math.inf, dtype=torch.float64, device=dev)
    if max_len == 0:
        return o, lse
    tok = torch.arange(max_len, device=dev)
    valid = tok[None, :] < seq[:, None]  # [batch, L]
    slot_idx = torch.where(valid, indptr[:-1, None] + tok[None, :] // page, 0)
    pages = kv_indices.to(dev, torch.int64)[slot_idx]  # [batch, L]
    slot = (tok % page).expand(batch, -1)
    if kv.kv_layout == "NHD":
        k, v = kv.k[pages, slot], kv.v[pages, slot]  # [batch, L, Hkv, D]
    else:
        k, v = kv.k[pages, :, slot], kv.v[pages, :, slot]  # advanced dims first: [batch, L, Hkv, D]
    qg = q.double().reshape(batch, hkv, hq // hkv, d)
    s = torch.einsum("bhgd,blhd->bhgl", qg, k.double()) * scale
    s = s.masked_fill(~valid[:, None, None, :], -math.inf)  # padding: never its (maybe NaN) score
    lse_g = torch.logsumexp(s, dim=-1)  # [batch, Hkv, G]; NaN/+inf from such scores
    finite = torch.isfinite(lse_g)
    p = torch.where(finite[..., None], torch.exp(s - torch.where(finite, lse_g, 0.0)[..., None]), 0.0)
    v_ok = torch.isfinite(v).all(dim=-1)  # [batch, L, Hkv]
    o = torch.einsum("bhgl,blhd->bhgd", p, torch.where(v_ok[..., None], v.double(), 0.0))
    # a key's non-finite value reaches the row at any weight (0 * inf = NaN); padding's never
    bad = (valid[..., None] & ~v_ok).any(dim=1)[..., None] | torch.isnan(lse_g) | (lse_g == math.inf)
    o = o.masked_fill(bad[..., None], math.nan).reshape(batch, hq, d)
    return o, lse_g.masked_fill(bad, math.nan).reshape(batch, hq)


def batch_prefill_paged_ref(
    q: torch.Tensor,
    qo_indptr: torch.Tensor,
    paged_kv_cache: PagedKVCache,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_last_page_len: torch.Tensor,
    *,
    causal: bool = False,
    kv_layout: str = "NHD",
    sm_scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 ``(o [nnz_qo, Hq, D], lse [nnz_qo, Hq])`` of :func:`batch_prefill_paged`."""
    kv = unpack_paged_kv_cache(paged_kv_cache, kv_layout)
    o = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    lse = torch.full(q.shape[:2], -math.inf, dtype=torch.float64, device=q.device)
    bounds = qo_indptr.tolist()
    for g in range(len(bounds) - 1):
        a, b = bounds[g], bounds[g + 1]
        if b > a:
            k, v = gather_paged_kv(kv, kv_indptr, kv_indices, kv_last_page_len, g)
            o[a:b], lse[a:b] = attention_state_ref(q[a:b], k, v, sm_scale=sm_scale, causal=causal)
    return o, lse


def batch_prefill_ragged_ref(
    q: torch.Tensor,
    qo_indptr: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_indptr: torch.Tensor,
    *,
    causal: bool = False,
    sm_scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 ``(o [nnz_qo, Hq, D], lse [nnz_qo, Hq])`` of :func:`batch_prefill_ragged`."""
    o = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    lse = torch.full(q.shape[:2], -math.inf, dtype=torch.float64, device=q.device)
    qb, kb = qo_indptr.tolist(), kv_indptr.tolist()
    for g in range(len(qb) - 1):
        a, b = qb[g], qb[g + 1]
        if b > a:
            ka, kz = kb[g], kb[g + 1]
            o[a:b], lse[a:b] = attention_state_ref(q[a:b], k[ka:kz], v[ka:kz], sm_scale=sm_scale, causal=causal)
    return o, lse


# ----------------------------------------------------------------------------------
# Merges of many states per row (kernels/merge_many.py), float64
# ----------------------------------------------------------------------------------


def merge_states_ref(v: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 merge of ``v: [n, S, H, D]``, ``s: [n, S, H]`` (natural log) over dim 1.

    Returns ``(v [n, H, D], s [n, H])`` in float64, natural-log LSE, with the merge
    contract (:mod:`cascadeinfer.kernels.merge`): empty rows give ``(0, -inf)``; empty
    states contribute exactly zero, any other state's NaN or inf in ``v`` stays; an LSE
    of ``+inf``/NaN makes its (row, head) ``(NaN, NaN)``.
    """
    s = s.double()
    lse = torch.logsumexp(s, dim=1)  # [n, H]; -inf where every state is empty
    finite = torch.isfinite(lse)
    w = torch.where(finite[:, None], torch.exp(s - torch.where(finite, lse, 0.0)[:, None]), 0.0)
    w = w[..., None]
    o = torch.where((s == -math.inf)[..., None], 0.0, w * v.double()).sum(dim=1)
    bad = (torch.isnan(s) | (s == math.inf)).any(dim=1)
    o = torch.where(bad[..., None], math.nan, o)
    lse = torch.where(bad, math.nan, lse)
    return o, lse


def merge_states_ragged_ref(
    v: torch.Tensor, s: torch.Tensor, indptr: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 merge of row ``i``'s states ``v[indptr[i]:indptr[i+1]]`` (``v: [nnz, H, D]``,
    ``s: [nnz, H]`` natural log). Returns ``(v [n, H, D], s [n, H])`` float64, natural-log
    LSE, as :func:`merge_states_ref` on the rows padded with empty states."""
    indptr = indptr.long()
    counts = indptr[1:] - indptr[:-1]
    width = int(counts.max()) if counts.numel() else 0
    slot = torch.arange(width, device=v.device)
    live = slot[None, :] < counts[:, None]  # [n, width]
    idx = torch.where(live, indptr[:-1, None] + slot[None, :], 0)
    s_pad = torch.where(live[..., None], s.double()[idx], -math.inf)  # [n, width, H]
    v_pad = torch.where(live[..., None, None], v.double()[idx], 0.0)  # [n, width, H, D]
    return merge_states_ref(v_pad, s_pad)


# ----------------------------------------------------------------------------------
# Fused elementwise ops (kernels/fused.py): float32 inside, rounded where HF rounds
# ----------------------------------------------------------------------------------


def _round(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` rounded to ``dtype`` and back to float32 (a rounding HF's code performs)."""
    return t.to(dtype).float()


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x: [T, N]``, ``weight: [N]`` (fp16/bf16/fp32, one dtype) -> ``[T, N]`` in x's
    dtype: HF's LlamaRMSNorm (float32 math, two roundings)."""
    x32 = x.float()
    normed = _round(x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps), x.dtype)
    return (normed * weight.float()).to(x.dtype)


def fused_add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``x, residual: [T, N]``, ``weight: [N]`` -> ``(normed, new_residual)``, both ``[T, N]``
    in x's dtype (the sum rounded before the norm reads it); the inputs are not changed."""
    new_residual = (residual.float() + x.float()).to(x.dtype)
    return rms_norm_ref(new_residual, weight, eps), new_residual


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """``gate_up: [T, 2 * I]`` (gate, then up) -> ``[T, I]`` in its dtype: ``silu(gate)``
    rounded, times ``up``."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (_round(torch.nn.functional.silu(gate), gate_up.dtype) * up).to(gate_up.dtype)


def apply_rope_ref(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                   cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated copies ``(q [T, Hq, D], k [T, Hkv, D])`` in their dtype, by the rows
    ``cos_sin_cache[positions]`` (``[max_positions, D]``: cos of the ``D / 2`` frequencies,
    then their sin; ``positions: [T]`` int); the inputs are not changed."""
    half = q.shape[-1] // 2
    cs = cos_sin_cache.index_select(0, positions.long()).float()[:, None, :]  # [T, 1, D]
    cos, sin = cs[..., :half], cs[..., half:]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().split(half, dim=-1)
        lo = _round(x1 * cos, x.dtype) - _round(x2 * sin, x.dtype)
        hi = _round(x2 * cos, x.dtype) + _round(x1 * sin, x.dtype)
        return torch.cat((lo, hi), dim=-1).to(x.dtype)

    return rotate(q), rotate(k)


def append_paged_kv_cache_ref(
    append_key: torch.Tensor,
    append_value: torch.Tensor,
    batch_indices: torch.Tensor,
    positions: torch.Tensor,
    paged_kv_cache: PagedKVCache,
    kv_indices: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_last_page_len: torch.Tensor,
    *,
    kv_layout: str = "NHD",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: the K and V caches after the append, as new float64 tensors.

    Same arguments as :func:`append_paged_kv_cache`; the input cache is not modified.
    Returns ``(k, v)`` in the layout's per-tensor form (``[num_pages, page_size, Hkv, D]``
    for NHD, ``[num_pages, Hkv, page_size, D]`` for HND), float64 (exact for every input
    dtype). One token at a time, on the host; ``kv_last_page_len`` is not needed.
    """
    kv = unpack_paged_kv_cache(paged_kv_cache, kv_layout)
    k, v = kv.k.double().cpu().clone(), kv.v.double().cpu().clone()
    key, value = append_key.double().cpu(), append_value.double().cpu()
    indptr, indices = kv_indptr.tolist(), kv_indices.tolist()
    for j, (b, p) in enumerate(zip(batch_indices.tolist(), positions.tolist())):
        if b < 0:
            continue
        page = indices[indptr[b] + p // kv.page_size]
        slot = p % kv.page_size
        if kv_layout == "NHD":
            k[page, slot], v[page, slot] = key[j], value[j]
        else:
            k[page, :, slot], v[page, :, slot] = key[j], value[j]
    return k, v
