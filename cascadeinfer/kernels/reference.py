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
    """
    n, hq, d = q.shape
    length, hkv = k.shape[0], k.shape[1]
    scale = d ** -0.5 if sm_scale is None else sm_scale
    group = hq // hkv
    qd = q.double()
    kd = k.double().repeat_interleave(group, dim=1)  # [L, Hq, D]
    vd = v.double().repeat_interleave(group, dim=1)
    s = torch.einsum("nhd,lhd->hnl", qd, kd) * scale  # [Hq, n, L]
    if causal:
        qpos = torch.arange(n, device=q.device)[:, None] + (length - n)
        kpos = torch.arange(length, device=q.device)[None, :]
        s = s.masked_fill(kpos > qpos, -math.inf)
    lse = torch.logsumexp(s, dim=-1)  # [Hq, n]; -inf where a row sees nothing
    finite = torch.isfinite(lse)
    p = torch.where(finite[..., None], torch.exp(s - torch.where(finite, lse, 0.0)[..., None]), 0.0)
    o = torch.einsum("hnl,lhd->nhd", p, vd)
    return o, lse.transpose(0, 1).contiguous()


def merge_state_ref(
    v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two attention states in float64: ``v: [..., D]``, ``s: [...]`` natural-log LSE.

    The empty state ``(0, -inf)`` is the identity; two empties give ``(0, -inf)``.
    """
    s_a, s_b = s_a.double(), s_b.double()
    s = torch.logaddexp(s_a, s_b)
    finite = torch.isfinite(s)
    safe = torch.where(finite, s, 0.0)
    w_a = torch.where(finite, torch.exp(s_a - safe), 0.0)
    w_b = torch.where(finite, torch.exp(s_b - safe), 0.0)
    v = v_a.double() * w_a[..., None] + v_b.double() * w_b[..., None]
    return v, s
