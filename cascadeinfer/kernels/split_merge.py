"""Split-KV inside one kernel: the last program of a row's KV splits merges their states.

A split-KV launch runs several programs over disjoint key ranges of the same query
rows; each ends with a partial attention state ``(o, lse)``. Rather than a second
kernel that merges them (a second launch, paid on the host by every eager call), each
program stores its partial state, then counts its arrival on the row's counter; the
program that arrives last — it alone sees the count reach ``num_splits - 1`` — reads
every split's state back, merges them into the output and resets the counter to zero
for the next kernel on the stream (:func:`cascadeinfer.kernels.launch.counters`).

Memory order. The partial states are written by every thread of the program, the
arrival by one thread. ``arrive`` first waits for the whole program (a CTA barrier), then
counts with an acquire-release atomic at GPU scope: the release publishes the program's
stores (cumulative through the barrier) before its count, and the acquire of the last
arrival orders every earlier program's stores before its reads; the atomic's result is
broadcast to the program's threads through shared memory behind another barrier. The
reads of the partial states bypass L1 (``.cg``): an SM's L1 is not coherent with other
SMs' writes, and a line of another row's partial states may sit there from an earlier
merge on the same SM.

The merge is the arithmetic of :mod:`cascadeinfer.kernels.merge_many` (natural-log LSEs;
an empty split, ``lse = -inf``, weighs exactly zero; a NaN or ``+inf`` LSE poisons the
row), a tile of splits at a time. The decode launcher merges here only in eager calls and
only while a program's states are few bytes (:func:`cascadeinfer.kernels.policy.merge_in_kernel`):
inside a CUDA graph, and for more bytes, a merge kernel is the faster.
"""

import triton
import triton.language as tl

from cascadeinfer.kernels.constants import KERNEL_LN2, KERNEL_LOG2E


@triton.jit
def arrive(count_ptr, num_splits):
    """Count this program's arrival at ``count_ptr`` (int32, zero before the first of
    ``num_splits`` programs arrives); returns whether it arrived last, and then leaves
    the counter zero. Call after the program's partial state is stored."""
    tl.debug_barrier()  # every thread's stores are issued before the one-thread release below
    arrived = tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu")
    last = arrived == num_splits - 1
    if last:
        tl.store(count_ptr, 0)  # every split has counted: nothing reads it again in this launch
    return last


@triton.jit
def _fold_lses(m, l, bad, s):
    """Pass 1 over a tile of splits' LSEs ``s [S, R]``: the running largest LSE ``m``, the
    sum ``l`` of ``exp(lse - m)`` and whether any was NaN or ``+inf`` (``bad``), per row."""
    bad = tl.maximum(bad, tl.max(((s != s) | (s == float("inf"))).to(tl.int32), axis=0))
    m_new = tl.maximum(m, tl.max(s, axis=0))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # all empty so far: never -inf - -inf
    l = l * tl.exp2((m - m_safe) * KERNEL_LOG2E) + tl.sum(tl.exp2((s - m_safe[None, :]) * KERNEL_LOG2E), axis=0)
    return m_new, l, bad


@triton.jit
def _add_splits(acc, s, v, m_safe, log2_l):
    """``acc + sum_j w_j v_j`` over a tile of splits, ``w_j = exp(s_j - lse)`` final.
    acc: [R, C] float32; s: [S, R] natural-log LSEs; v: [S, R, C] float32."""
    w = tl.exp2((s - m_safe[None, :]) * KERNEL_LOG2E - log2_l[None, :])
    # An empty split weighs exactly zero whatever its o holds; any other split's NaN
    # or inf stays, even where its weight underflows (0 * NaN = NaN), as in float64.
    return acc + tl.sum(tl.where((s == float("-inf"))[:, :, None], 0.0, w[:, :, None] * v), axis=0)


@triton.jit
def merge_splits(
    o_ptrs,  # [R, C] pointers to split 0's partial output (any float dtype)
    lse_ptrs,  # [R] pointers to split 0's natural-log partial LSE (float32)
    o_mask,  # [R, C] which elements exist
    row_mask,  # [R] which rows exist
    stride_o_split,  # elements from one split's output to the next
    stride_lse_split,  # elements from one split's LSE to the next
    num_splits,
    SPLIT_BLOCK: tl.constexpr,  # splits per tile (policy.split_merge_block)
):
    """The merged state of the rows' ``num_splits`` partial states: ``(o [R, C] float32,
    lse [R] float32 natural log)``; ``(0, -inf)`` where every split was empty, ``(NaN,
    NaN)`` where one held a NaN or ``+inf`` LSE. Reads ``SPLIT_BLOCK`` splits per tile:
    one round trip to memory for all of them."""
    u = tl.arange(0, SPLIT_BLOCK).to(tl.int64)
    # The first tile's LSEs and values are loaded together, before pass 1 needs the LSEs:
    # one round trip to memory where every split fits one tile (the common case).
    live = u < num_splits
    s_first = tl.load(lse_ptrs[None, :] + u[:, None] * stride_lse_split, mask=live[:, None] & row_mask[None, :],
                      other=float("-inf"), cache_modifier=".cg")  # [SPLIT_BLOCK, R]
    v_first = tl.load(o_ptrs[None, :, :] + u[:, None, None] * stride_o_split,
                      mask=live[:, None, None] & o_mask[None, :, :], other=0.0, cache_modifier=".cg")

    # Pass 1: m = the largest LSE, l = sum of exp(lse - m), bad = any NaN or +inf.
    m = tl.full(row_mask.shape, float("-inf"), tl.float32)
    l = tl.zeros(row_mask.shape, tl.float32)
    bad = tl.zeros(row_mask.shape, tl.int32)
    m, l, bad = _fold_lses(m, l, bad, s_first)
    for j0 in range(SPLIT_BLOCK, num_splits, SPLIT_BLOCK):
        j = j0 + u
        s = tl.load(lse_ptrs[None, :] + j[:, None] * stride_lse_split,
                    mask=(j < num_splits)[:, None] & row_mask[None, :], other=float("-inf"), cache_modifier=".cg")
        m, l, bad = _fold_lses(m, l, bad, s)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    log2_l = tl.log2(tl.where(l > 0, l, 1.0))  # 0 for empty rows
    lse = tl.where(m == float("-inf"), float("-inf"), m + log2_l * KERNEL_LN2)
    lse = tl.where(bad > 0, float("nan"), lse)

    # Pass 2: o = sum_j w_j o_j with the final weights w_j = exp(lse_j - lse).
    acc = _add_splits(tl.zeros(o_mask.shape, tl.float32), s_first, v_first.to(tl.float32), m_safe, log2_l)
    for j0 in range(SPLIT_BLOCK, num_splits, SPLIT_BLOCK):
        j = j0 + u
        live = j < num_splits
        s = tl.load(lse_ptrs[None, :] + j[:, None] * stride_lse_split, mask=live[:, None] & row_mask[None, :],
                    other=float("-inf"), cache_modifier=".cg")
        v = tl.load(o_ptrs[None, :, :] + j[:, None, None] * stride_o_split,
                    mask=live[:, None, None] & o_mask[None, :, :], other=0.0, cache_modifier=".cg")
        acc = _add_splits(acc, s, v.to(tl.float32), m_safe, log2_l)
    acc = tl.where((bad > 0)[:, None], float("nan"), acc)
    return acc, lse
