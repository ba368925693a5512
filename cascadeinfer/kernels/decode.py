"""Paged decode: one query token per request over its own paged KV (split-KV), with two
schedules of the same math.

- **per_request** (this module's kernel): every request is cut into the same number of
  splits. With equal lengths and full waves of programs it is the faster schedule.
- **balanced** (:mod:`cascadeinfer.kernels.decode_balanced`): the pages of the whole batch,
  laid end to end, are cut evenly over a fixed grid, so requests of very different lengths
  and grids that would end in a partial wave keep every SM busy. Each request boundary
  inside a program drains its K/V pipeline, which costs 1-5% where the per-request plan
  already fills the machine.

:func:`batch_decode_paged` takes ``schedule=``; by default :func:`pick_decode_schedule`
chooses from shapes (the per-request plan's wave tail), and a caller that knows the lengths
on the host (the cascade planner, an engine's scheduler) passes them to it as well.

The per-request schedule. Stage 1 (``_decode_kernel``) runs one program per (request, kv
head, split). The query heads that share a kv head are packed into the M dimension of a
``tl.dot`` (padded to 16 rows and masked), so each K/V tile is read from memory once for
the whole group and the products run on tensor cores. A split owns a contiguous range of its request's pages,
``cdiv(num_pages, num_splits)`` of them, computed inside the kernel from the page table;
the grid comes from shapes only (``batch * num_kv_heads * num_splits`` programs), so the
launch never reads the page table on the host and can be captured in a CUDA graph.

With one split the kernel writes the output and the natural-log LSE directly. With more,
each split writes its attention state (normalised fp32 output, natural-log LSE; an empty
range gives ``(0, -inf)``) to scratch, and the last split of each (request, kv head) to
finish merges them straight into the output in q's dtype
(:mod:`cascadeinfer.kernels.split_merge`): one launch either way. Only where the states
are too many bytes for one program to merge fast (:func:`policy.merge_in_kernel`; 16
query heads per kv head and many splits) does the kernel of
:func:`cascadeinfer.kernels.merge_many.merge_states` merge them after. The default plan (:func:`pick_decode_config`, :func:`decode_num_splits`) picks
the launch config and the split count from ``batch * num_kv_heads`` and the SM count
alone: one wave of programs with enough K/V loads in flight, and no split at all once
there are 1.5x more (request, kv head) pairs than SMs.

Inside the kernel scores are kept in base 2: ``log2(e) * sm_scale`` is folded into one
scale and the softmax uses ``exp2``; the LSE is turned back into a natural log at the store.

fp32 inputs use ``input_precision="ieee"`` for both products (exact fp32 on the GPU, no
tf32 rounding); fp16/bf16 inputs run the products on tensor cores with the probabilities
rounded to the input dtype before ``p @ v`` (the usual flash-attention trade: error about
one unit of the input precision).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cascadeinfer._checks import (
    FLOAT_DTYPES,
    check_int32_vector,
    check_last_dim_contiguous,
    check_tensor,
    default_sm_scale,
    same_device,
)
from cascadeinfer._device import capturing, next_power_of_2, use_triton
from cascadeinfer.kernels import decode_balanced as balanced
from cascadeinfer.kernels import merge_many, policy
from cascadeinfer.kernels.constants import LOG2E
from cascadeinfer.kernels.decode_balanced import attend_tile
from cascadeinfer.kernels.launch import (
    LaunchCache,
    counters,
    given,
    launch,
    recorded,
    recording_active,
    scratch,
    unrecorded,
)
from cascadeinfer.kernels.policy import (
    MAX_SPLITS,
    SCHEDULES,
    DecodeConfig,
    balanced_num_programs,
    decode_num_splits,
    pick_balanced_config,
    pick_decode_config,
    pick_decode_schedule,
)
from cascadeinfer.kernels.reference import batch_decode_paged_ref
from cascadeinfer.kernels.softmax import finish_state
from cascadeinfer.kernels.split_merge import arrive, merge_splits
from cascadeinfer.layouts.page_table import check_pages_in_pool, validate_page_table
from cascadeinfer.layouts.paged_cache import (
    PagedKV,
    PagedKVCache,
    cache_tensors,
    check_layout_fits,
    unpack_paged_kv_cache,
)


@triton.jit
def _decode_tile(
    acc, l_i, m_i,  # running state: [BLOCK_H, BLOCK_D] fp32, [BLOCK_H] fp32, [BLOCK_H] fp32 (base 2)
    q,  # [BLOCK_H, BLOCK_D] the packed query heads, input dtype
    k_ptr,  # K pool, already offset to this kv head
    v_ptr,  # V pool, already offset to this kv head
    page_ptr,  # [num_pages_of_request] int32: kv_indices + kv_indptr[request]
    t,  # first token of this tile (position inside the request)
    t_end,  # one past the last token this program reads
    stride_page, stride_token,
    qk_scale,  # sm_scale * log2(e)
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MASKED: tl.constexpr,  # the tile may reach past t_end (the tail tile)
    DOT_PRECISION: tl.constexpr,  # "ieee" for float32 inputs: exact fp32 products
):
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    tok = t + offs_n  # [BLOCK_N]
    if PAGE_SIZE % BLOCK_N == 0:
        # The whole tile lies inside one page (t is a multiple of BLOCK_N): one index load.
        page = tl.load(page_ptr + t // PAGE_SIZE).to(tl.int64)
        rows = page * stride_page + (tok % PAGE_SIZE).to(tl.int64) * stride_token
    else:
        # Small pages: look up each token's page (BLOCK_N // PAGE_SIZE distinct indices).
        if MASKED:
            page = tl.load(page_ptr + tok // PAGE_SIZE, mask=tok < t_end, other=0)
        else:
            page = tl.load(page_ptr + tok // PAGE_SIZE)
        rows = page.to(tl.int64) * stride_page + (tok % PAGE_SIZE).to(tl.int64) * stride_token
    offs = rows[:, None] + offs_d[None, :]  # [BLOCK_N, BLOCK_D] int64

    # K and V stay in the input dtype: they only feed tl.dot (no elementwise math on them).
    if MASKED:
        mask_n = tok < t_end
        if BLOCK_D == HEAD_DIM:
            mask = mask_n[:, None]  # broadcast over head_dim by tl.load
        else:
            mask = mask_n[:, None] & (offs_d < HEAD_DIM)[None, :]
        k = tl.load(k_ptr + offs, mask=mask, other=0.0)
        v = tl.load(v_ptr + offs, mask=mask, other=0.0)
    elif BLOCK_D == HEAD_DIM:
        k = tl.load(k_ptr + offs)
        v = tl.load(v_ptr + offs)
    else:
        mask = (offs_n < BLOCK_N)[:, None] & (offs_d < HEAD_DIM)[None, :]
        k = tl.load(k_ptr + offs, mask=mask, other=0.0)
        v = tl.load(v_ptr + offs, mask=mask, other=0.0)

    return attend_tile(acc, l_i, m_i, q, k, v, qk_scale, tok < t_end, MASKED, DOT_PRECISION)


@triton.jit(do_not_specialize=["num_kv_heads", "num_splits"])
def _decode_kernel(
    q_ptr,  # [batch, num_qo_heads, head_dim], strides (stride_qb, stride_qh, 1)
    k_ptr,  # K pool: page/token/head strides below, head_dim stride 1
    v_ptr,  # V pool: same strides as K
    kv_indptr_ptr,  # [batch + 1] int32
    kv_indices_ptr,  # [>= kv_indptr[batch]] int32 page ids
    kv_last_page_len_ptr,  # [batch] int32
    o_ptr,  # [batch, num_qo_heads, head_dim] out, q's dtype, strides (stride_ob, stride_oh, 1)
    lse_ptr,  # [batch, num_qo_heads] float32 natural log, strides (stride_lb, stride_lh)
    part_o_ptr,  # [batch, num_splits, num_qo_heads, head_dim] float32 partial outputs (SPLIT)
    part_lse_ptr,  # [batch, num_splits, num_qo_heads] float32 natural-log partial LSEs (SPLIT)
    count_ptr,  # [batch * num_kv_heads] int32 arrival counters, zero (MERGE; left zero)
    qk_scale,  # sm_scale * log2(e)
    num_kv_heads,
    num_splits,
    stride_qb, stride_qh,
    stride_page, stride_token, stride_head,
    stride_ob, stride_oh,
    stride_lb, stride_lh,
    stride_pb, stride_ps, stride_ph,
    stride_plb, stride_pls, stride_plh,
    GROUP: tl.constexpr,  # num_qo_heads // num_kv_heads
    BLOCK_H: tl.constexpr,  # GROUP padded to a power of two >= 16
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # HEAD_DIM padded to a power of two >= 16
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,  # keys per tile
    NUM_STAGES: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SPLIT: tl.constexpr,  # False: one split, write out and lse; True: write this split's partial state
    MERGE: tl.constexpr,  # SPLIT: the last split merges the partial states into out and lse
    BLOCK_G: tl.constexpr,  # MERGE: GROUP padded to a power of two
    SPLIT_BLOCK: tl.constexpr,  # MERGE: splits per tile of the merge
):
    pid = tl.program_id(0)
    kv_head = pid % num_kv_heads
    rest = pid // num_kv_heads
    split = rest % num_splits
    req = rest // num_splits

    # This split's token range: pages [split * per, (split + 1) * per) of the request.
    row_start = tl.load(kv_indptr_ptr + req)
    num_pages = tl.load(kv_indptr_ptr + req + 1) - row_start
    last_len = tl.load(kv_last_page_len_ptr + req)
    seq_len = tl.where(num_pages > 0, (num_pages - 1) * PAGE_SIZE + last_len, 0)
    per_split = tl.cdiv(num_pages, num_splits)
    t_begin = split * per_split * PAGE_SIZE
    t_end = tl.minimum((split + 1) * per_split * PAGE_SIZE, seq_len)  # never past the row's pages
    t_full = t_begin + tl.maximum(t_end - t_begin, 0) // BLOCK_N * BLOCK_N

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + offs_h  # [BLOCK_H] query heads of this kv head
    mask_h = offs_h < GROUP
    mask_q = mask_h[:, None] & (offs_d < HEAD_DIM)[None, :]
    q_offs = req.to(tl.int64) * stride_qb + heads.to(tl.int64)[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr + q_offs, mask=mask_q, other=0.0)  # input dtype: feeds tl.dot only

    head_off = kv_head.to(tl.int64) * stride_head
    k_head = k_ptr + head_off
    v_head = v_ptr + head_off
    page_ptr = kv_indices_ptr + row_start

    acc = tl.zeros((BLOCK_H, BLOCK_D), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_H,), dtype=tl.float32)
    m_i = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
    for t in tl.range(t_begin, t_full, BLOCK_N, num_stages=NUM_STAGES):
        acc, l_i, m_i = _decode_tile(
            acc, l_i, m_i, q, k_head, v_head, page_ptr, t, t_end, stride_page, stride_token,
            qk_scale, PAGE_SIZE, BLOCK_N, HEAD_DIM, BLOCK_D, False, DOT_PRECISION,
        )
    if t_full < t_end:
        acc, l_i, m_i = _decode_tile(
            acc, l_i, m_i, q, k_head, v_head, page_ptr, t_full, t_end, stride_page, stride_token,
            qk_scale, PAGE_SIZE, BLOCK_N, HEAD_DIM, BLOCK_D, True, DOT_PRECISION,
        )

    # Emptiness comes from the range, never from l: a NaN key leaves l = NaN, which must
    # reach the output, not pass for "no keys". finish_state changes the base: m and
    # log2(l) are base 2, the stored LSE is natural log.
    o, lse = finish_state(acc, l_i, m_i, t_end > t_begin)

    heads64 = heads.to(tl.int64)
    req64 = req.to(tl.int64)
    if SPLIT:
        p_offs = req64 * stride_pb + split.to(tl.int64) * stride_ps + heads64[:, None] * stride_ph + offs_d[None, :]
        tl.store(part_o_ptr + p_offs, o, mask=mask_q)
        p_lse_offs = req64 * stride_plb + split.to(tl.int64) * stride_pls + heads64 * stride_plh
        tl.store(part_lse_ptr + p_lse_offs, lse, mask=mask_h)
        if MERGE:
            # The last split of (request, kv head) to finish merges all of them into out
            # and lse (cascadeinfer.kernels.split_merge), over the GROUP real heads only.
            if arrive(count_ptr + req * num_kv_heads + kv_head, num_splits):
                offs_g = tl.arange(0, BLOCK_G)
                g_ok = offs_g < GROUP
                g_mask = g_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
                g_heads = (kv_head * GROUP + offs_g).to(tl.int64)
                o_all, lse_all = merge_splits(  # [BLOCK_G, BLOCK_D], [BLOCK_G]: new names, new shapes
                    part_o_ptr + req64 * stride_pb + g_heads[:, None] * stride_ph + offs_d[None, :],
                    part_lse_ptr + req64 * stride_plb + g_heads * stride_plh,
                    g_mask, g_ok, stride_ps, stride_pls, num_splits, SPLIT_BLOCK)
                o_offs = req64 * stride_ob + g_heads[:, None] * stride_oh + offs_d[None, :]
                tl.store(o_ptr + o_offs, o_all.to(o_ptr.dtype.element_ty), mask=g_mask)
                tl.store(lse_ptr + req64 * stride_lb + g_heads * stride_lh, lse_all, mask=g_ok)
    else:
        o_offs = req64 * stride_ob + heads64[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptr + o_offs, o.to(o_ptr.dtype.element_ty), mask=mask_q)
        tl.store(lse_ptr + req64 * stride_lb + heads64 * stride_lh, lse, mask=mask_h)


# --------------------------------------------------------------------------- launcher


def _check_page_table(
    kv: PagedKV, kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_last_page_len: torch.Tensor
) -> None:
    """Content checks (one host sync): the library's page-table rule against this pool."""
    validate_page_table(kv_indptr, kv_indices, kv_last_page_len, kv.page_size, kv.num_pages)


def batch_decode_paged(
    q: torch.Tensor,
    paged_kv_cache: PagedKVCache,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_last_page_len: torch.Tensor,
    *,
    kv_layout: str = "NHD",
    sm_scale: float | None = None,
    num_splits: int | None = None,
    schedule: str | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention: request ``i``'s single query token over request ``i``'s paged KV.

    Args:
        q: ``[batch, num_qo_heads, head_dim]`` fp16/bf16/fp32; any strides with the last
            dimension contiguous. Query head ``h`` reads kv head ``h // (num_qo_heads // num_kv_heads)``.
        paged_kv_cache: the paged cache (single tensor or ``(k, v)`` tuple, see
            :mod:`cascadeinfer.layouts.paged_cache`), same dtype and device as ``q``.
        kv_indptr: int32 ``[batch + 1]``, non-decreasing; request ``i`` owns pages
            ``kv_indices[kv_indptr[i]:kv_indptr[i + 1]]`` (a request with none sees no key).
        kv_indices: int32 page ids (at least ``kv_indptr[batch]`` entries; later ones are ignored).
        kv_last_page_len: int32 ``[batch]``, tokens in each request's last page, in ``[1, page_size]``.
        kv_layout: ``"NHD"`` or ``"HND"``.
        sm_scale: softmax scale, default ``head_dim ** -0.5``.
        num_splits: with ``schedule="per_request"``, KV splits per (request, kv head),
            1..256: each reads ``cdiv(num_pages, num_splits)`` consecutive pages of its
            request and the last split to finish merges them (a merge kernel, past a
            few bytes of states per program). With ``"balanced"``,
            programs per kv head ``P``, 1..4096: the batch's pages laid end to end are
            cut into ``P`` pieces of ``cdiv(kv_indptr[batch] - kv_indptr[0], P)`` pages
            (found on the device) and a second kernel merges the requests a cut runs
            through. None: the schedule's plan from shapes (:func:`decode_num_splits`,
            :func:`balanced_num_programs`).
        schedule: ``"per_request"``, ``"balanced"``, or None: :func:`pick_decode_schedule`
            from shapes (it never reads lengths here; pass ``schedule`` from
            ``pick_decode_schedule(..., seq_lens=...)`` when lengths vary and are known
            on the host), or ``"per_request"`` when ``num_splits`` is given.
        out: optional ``[batch, num_qo_heads, head_dim]`` output buffer (dtype of ``q``,
            last dimension contiguous).
        lse: optional float32 ``[batch, num_qo_heads]`` buffer for the LSE.
        validate: check the page table's contents (one host sync; skipped while a CUDA
            graph is being captured).

    Returns:
        ``(o, lse)``: ``o`` ``[batch, num_qo_heads, head_dim]`` in ``q``'s dtype and
        ``lse`` float32 ``[batch, num_qo_heads]``, the NATURAL-log sum of exp of the
        scaled scores. A request with no keys gets ``o = 0``, ``lse = -inf``.

    The launch reads nothing from the device (grid from shapes only), so the call can be
    captured in a CUDA graph and replayed after the page table is changed in place (the
    balanced schedule: any lengths and total, as long as ``kv_indices`` is long enough).

    Host cost: the first call with a given signature (shapes, strides, dtypes, alignment,
    options) checks every argument, plans and launches; later calls with that signature
    replay its launches directly (:mod:`cascadeinfer.kernels.launch`), with
    ``validate=False`` the hot path an engine takes.
    """
    cache = cache_tensors(paged_kv_cache)
    rec, key, ptrs = _LAUNCHES.find(
        (q, *cache, kv_indptr, kv_indices, kv_last_page_len, *given(out, lse)),
        # Captured calls merge KV splits in a merge kernel, eager ones in the kernel (policy).
        (len(cache), out is None, lse is None, kv_layout, sm_scale, num_splits, schedule, capturing()),
        lengthless=(len(cache) + 2,))
    if rec is None:
        return decode_with_config(
            q, paged_kv_cache, kv_indptr, kv_indices, kv_last_page_len, kv_layout=kv_layout,
            sm_scale=sm_scale, num_splits=num_splits, schedule=schedule, out=out, lse=lse, validate=validate,
            config=None, key=key,
        )
    # The recorded call had this signature, so every shape, dtype and device check passed.
    out, lse = rec.outputs(out, lse, len(cache) + 4)
    if validate and not capturing():
        _check_page_table(unpack_paged_kv_cache(paged_kv_cache, kv_layout), kv_indptr, kv_indices, kv_last_page_len)
    rec.replay((q, *cache, kv_indptr, kv_indices, kv_last_page_len, out, lse), known=ptrs[:len(cache) + 4])
    return out, lse


# Recordings of batch_decode_paged's calls, by signature (see cascadeinfer.kernels.launch).
_LAUNCHES = LaunchCache()


def decode_with_config(
    q, paged_kv_cache, kv_indptr, kv_indices, kv_last_page_len, *, kv_layout, sm_scale,
    num_splits, schedule, out, lse, validate, config: DecodeConfig | None, key=None,
):
    """:func:`batch_decode_paged` with every check and the launch parameters given:
    ``num_splits`` and ``schedule`` as there, ``config`` the stage-1 tile config (None: the
    default of :mod:`cascadeinfer.kernels.policy`), every argument required. Returns the
    same ``(o, lse)`` (natural-log LSE). For tuning tools; with ``key``, its launches are
    recorded under that key (the public launcher's cache)."""
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    check_last_dim_contiguous("q", q)
    kv = unpack_paged_kv_cache(paged_kv_cache, kv_layout)
    batch, num_qo_heads, head_dim = q.shape
    check_layout_fits(kv, num_qo_heads=num_qo_heads,
                      kv_last_page_len=kv_last_page_len if validate and not capturing() else None)
    if kv.dtype != q.dtype:
        raise TypeError(f"paged_kv_cache: expected dtype {q.dtype} (the dtype of q), got {kv.dtype}")
    device = same_device(("q", q), ("paged_kv_cache", kv.k))
    if kv.head_dim != head_dim:
        raise ValueError(f"paged_kv_cache: expected head_dim {head_dim} (like q), got {kv.head_dim}")
    if num_qo_heads % kv.num_kv_heads != 0:
        raise ValueError(
            f"q: num_qo_heads ({num_qo_heads}) must be a multiple of the cache's num_kv_heads ({kv.num_kv_heads})"
        )
    check_int32_vector("kv_indptr", kv_indptr, device, batch + 1)
    check_int32_vector("kv_indices", kv_indices, device)
    check_int32_vector("kv_last_page_len", kv_last_page_len, device, batch)
    if schedule is not None and schedule not in SCHEDULES:
        raise ValueError(f"schedule: expected one of {SCHEDULES} or None, got {schedule!r}")
    if schedule is None:
        schedule = "per_request" if num_splits is not None else pick_decode_schedule(
            batch, kv.num_kv_heads, device, head_dim=head_dim, dtype=q.dtype)
    if num_splits is not None:
        limit = MAX_SPLITS if schedule == "per_request" else balanced.MAX_PROGRAMS
        if not isinstance(num_splits, int) or isinstance(num_splits, bool) or not 1 <= num_splits <= limit:
            raise ValueError(f"num_splits: expected an int in [1, {limit}] for schedule {schedule!r} "
                             f"or None, got {num_splits!r}")
    scale = default_sm_scale(head_dim, sm_scale)
    if out is None:
        out = torch.empty((batch, num_qo_heads, head_dim), dtype=q.dtype, device=device)
    else:
        check_tensor("out", out, dtypes=(q.dtype,), device=device, shape=(batch, num_qo_heads, head_dim))
        check_last_dim_contiguous("out", out)
    if lse is None:
        lse = torch.empty((batch, num_qo_heads), dtype=torch.float32, device=device)
    else:
        check_tensor("lse", lse, dtypes=(torch.float32,), device=device, shape=(batch, num_qo_heads))
    if validate and not capturing():
        _check_page_table(kv, kv_indptr, kv_indices, kv_last_page_len)
    if not use_triton(device):
        check_pages_in_pool(kv_indptr.cpu(), kv_indices.cpu(), kv.num_pages)
        if batch:
            o_ref, lse_ref = batch_decode_paged_ref(q, kv, kv_indptr, kv_indices, kv_last_page_len, sm_scale=scale)
            out.copy_(o_ref)
            lse.copy_(lse_ref)
        return out, lse
    roots = (q, *cache_tensors(paged_kv_cache), kv_indptr, kv_indices, kv_last_page_len, out, lse)
    with recorded(_LAUNCHES, key, roots):
        if batch == 0:
            pass
        elif schedule == "balanced":
            _launch_balanced(q, kv, kv_indptr, kv_indices, kv_last_page_len, out, lse, scale, num_splits, config)
        else:
            _launch_per_request(q, kv, kv_indptr, kv_indices, kv_last_page_len, out, lse, scale, num_splits, config)
    return out, lse


def _launch_balanced(q, kv: PagedKV, kv_indptr, kv_indices, kv_last_page_len, out, lse, scale: float,
                     num_splits: int | None, config: DecodeConfig | None) -> None:
    """The balanced schedule (:mod:`cascadeinfer.kernels.decode_balanced`), checked inputs."""
    device = q.device
    cfg = config if config is not None else pick_balanced_config(
        q.shape[2], q.dtype, num_kv_heads=kv.num_kv_heads, num_sms=policy.planning_sms(device))
    if num_splits is None:
        programs = balanced_num_programs(kv.num_kv_heads, device, programs_per_sm=cfg.programs_per_sm)
        min_pages = triton.cdiv(cfg.min_tokens, kv.page_size)
    else:
        programs, min_pages = num_splits, 1
    balanced.launch_balanced(
        q, kv, kv_indptr, kv_indices, kv_last_page_len, out, lse, qk_scale=scale * LOG2E, programs=programs,
        min_pages=min_pages, block_n=cfg.block_n, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        pdl=cfg.pdl and balanced.has_pdl(device))


def _launch_per_request(q, kv: PagedKV, kv_indptr, kv_indices, kv_last_page_len, out, lse, scale: float,
                        num_splits: int | None, config: DecodeConfig | None) -> None:
    """The per-request schedule (this module's kernel; with splits, its last split per
    (request, kv head) merges them, or merge_states' kernel after it)."""
    device = q.device
    batch, num_qo_heads, head_dim = q.shape
    cfg = config if config is not None else pick_decode_config(
        head_dim, q.dtype, kv.page_size, work=batch * kv.num_kv_heads, num_sms=policy.planning_sms(device),
        group_size=num_qo_heads // kv.num_kv_heads)
    if num_splits is None:
        num_splits = decode_num_splits(batch, kv.num_kv_heads, device, programs_per_sm=cfg.programs_per_sm)
    merge = num_splits > 1 and policy.merge_in_kernel(num_splits, num_qo_heads // kv.num_kv_heads, head_dim,
                                                      capturing=capturing())
    if merge and q.is_cuda and recording_active():
        # A CUDA-graph capture of this signature merges in a merge kernel instead (the
        # policy): while its eager form is recorded, run that form once too, unrecorded,
        # so that its kernels are compiled and loaded before any capture (no module can
        # be loaded while a stream is captured).
        with unrecorded():
            _launch_splits(q, kv, kv_indptr, kv_indices, kv_last_page_len, out, lse, scale, num_splits, cfg, False)
    _launch_splits(q, kv, kv_indptr, kv_indices, kv_last_page_len, out, lse, scale, num_splits, cfg, merge)


def _launch_splits(q, kv: PagedKV, kv_indptr, kv_indices, kv_last_page_len, out, lse, scale: float,
                   num_splits: int, cfg: DecodeConfig, merge: bool) -> None:
    """The per-request kernel with ``num_splits`` splits; with more than one, ``merge``:
    its last split per (request, kv head) merges them, else merge_states' kernel after."""
    device = q.device
    batch, num_qo_heads, head_dim = q.shape
    group = num_qo_heads // kv.num_kv_heads
    split = num_splits > 1
    block_d = max(16, next_power_of_2(head_dim))
    meta = dict(
        GROUP=group,
        BLOCK_H=max(16, next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        PAGE_SIZE=kv.page_size,
        BLOCK_N=cfg.block_n,
        NUM_STAGES=cfg.num_stages,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        SPLIT=split,
        MERGE=merge,
        BLOCK_G=next_power_of_2(group),
        SPLIT_BLOCK=policy.split_merge_block(next_power_of_2(group), block_d) if merge else 1,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    grid = (batch * kv.num_kv_heads * num_splits,)
    if split:
        # fp32 partial states, merged straight into out (cast at the store): by the last
        # split of each (request, kv head), counting arrivals in count, or by merge_states'
        # kernel.
        part_o = scratch((batch, num_splits, num_qo_heads, head_dim), torch.float32, device)
        part_lse = scratch((batch, num_splits, num_qo_heads), torch.float32, device)
        count = counters(batch * kv.num_kv_heads, device) if merge else lse
        part_strides = (*part_o.stride()[:3], *part_lse.stride())
    else:
        part_o, part_lse, count = out, lse, lse  # not touched
        part_strides = (0, 0, 0, 0, 0, 0)
    launch(
        _decode_kernel, grid,
        q, kv.k, kv.v, kv_indptr, kv_indices, kv_last_page_len, out, lse, part_o, part_lse, count,
        scale * LOG2E, kv.num_kv_heads, num_splits,
        q.stride(0), q.stride(1),
        kv.stride_page, kv.stride_token, kv.stride_head,
        out.stride(0), out.stride(1),
        lse.stride(0), lse.stride(1),
        *part_strides,
        **meta,
    )
    if split and not merge:
        merge_many.merge_states_unchecked(part_o, part_lse, out, lse)  # inputs checked here already
