"""The online softmax every attention kernel runs: one key tile's update, and the finish.

A row's running state over the keys seen so far is ``(acc, l, m)``: ``m`` the largest
score in base 2 (``score * sm_scale * log2(e)``), ``l`` the sum of ``exp2(score - m)``
and ``acc`` the same weights times the values, all float32. :func:`online_softmax_step`
folds one key tile in; :func:`finish_state` turns the state into the package's
``(o, lse)`` with the natural-log LSE (docs/DESIGN.md). Prefill (tensor-core M tiles of
packed query rows) and decode (the query heads of one KV head) call the same two.
"""

import triton
import triton.language as tl

from cascadeinfer.kernels.constants import KERNEL_LN2


@triton.jit
def online_softmax_step(
    acc,  # [R, D] float32 running weighted sum of values
    l_i,  # [R] float32 running sum of weights
    m_i,  # [R] float32 running max score, base 2
    s,  # [R, N] float32 raw scores q·k of the tile (keys a row does not see: -inf)
    v,  # [N, D] the tile's values, storage dtype
    qk_scale,  # sm_scale * log2(e), > 0
    EMPTY_ROWS: tl.constexpr,  # may a row have seen only -inf scores so far?
    DOT_PRECISION: tl.constexpr,  # "ieee" for float32 inputs, "tf32" otherwise (unused by fp16/bf16 dots)
):
    """One key tile's update of ``(acc, l, m)``; returns the new state."""
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)  # qk_scale > 0 keeps the max
    if EMPTY_ROWS:
        # A row that has seen no key yet keeps m = -inf; subtract 0 there so that
        # exp2(-inf - 0) = 0 instead of exp2(-inf - -inf) = NaN.
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        # Every row saw a finite score: m_new is finite — unless non-finite input made
        # every score a row has seen -inf; that row then comes out NaN where the float64
        # reference gives those keys weight 0. A loud answer to garbage, which a hot loop
        # of unmasked tiles does not pay a per-tile guard to avoid.
        m_sub = m_new
    p = tl.math.exp2(s * qk_scale - m_sub[:, None])  # one FMA per score
    alpha = tl.math.exp2(m_i - m_sub)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return acc, l_i, m_new


@triton.jit
def finish_state(acc, l, m, has_keys):
    """The attention state ``(o, lse)`` of a finished online softmax (every attention kernel).

    acc: [R, D] fp32 un-normalised output; l: [R] fp32 sum of exp2(score - m); m: [R] fp32
    running max score, base 2; has_keys: [R] or scalar, whether the row read any key — a
    count the caller knows, never inferred from l, because a NaN or +inf score leaves
    l = NaN and "l > 0" would pass it for an empty row that every merge then drops.
    Returns ``o`` [R, D] fp32 and the natural-log ``lse`` [R]: ``(0, -inf)`` for a row with
    no keys; ``(NaN, NaN)`` for a row whose keys held a NaN or inf anywhere (a NaN or +inf
    score gives l = NaN; a non-finite value leaves acc non-finite even at weight 0, as
    0 * inf = NaN). The whole row is poisoned, LSE included, so that the merges, which
    check only the LSE, carry it on. Runs once per row, after the key loop.
    """
    l_safe = tl.where(l == 0.0, 1.0, l)  # 0: every score was -inf (then m = -inf too); NaN stays NaN
    o = acc / l_safe[:, None]
    lse = (m + tl.log2(l_safe)) * KERNEL_LN2  # base change: log2 units -> natural log
    finite = (tl.min((tl.abs(o) < float("inf")).to(tl.int32), 1) > 0) & (lse == lse)  # NaN fails both compares
    lse = tl.where(finite, lse, float("nan"))
    lse = tl.where(has_keys, lse, float("-inf"))
    o = tl.where(finite[:, None], o, float("nan"))
    o = tl.where((lse == float("-inf"))[:, None], 0.0, o)  # no keys, or only -inf scores: v is 0
    return o, lse
