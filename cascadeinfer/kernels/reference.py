"""Float64 reference for an attention state: the definition every kernel is tested against.

Readable first, fast never. Natural-log LSE; the empty key set gives ``(0, -inf)``.
"""

from __future__ import annotations

import math

import torch


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
