"""Paged decode: one query token per request over its own paged KV (split-KV), with
schedules of the same math.

- **per_request** (:mod:`cascadeinfer.kernels.decode_kernel`): every request is cut into
  the same number of splits. With equal lengths and full waves of programs it is the
  faster schedule.
- **balanced** (:mod:`cascadeinfer.kernels.decode_balanced`): the pages of the whole batch,
  laid end to end, are cut evenly over a fixed grid, so requests of very different lengths
  and grids that would end in a partial wave keep every SM busy. Each request boundary
  inside a program drains its K/V pipeline, which costs 1-5% where the per-request plan
  already fills the machine.
- **shared_pages**: the per-request kernel for requests whose page lists share most of
  their pages (flat decode over a common prefix). Their re-reads come from L2, so the
  kernel's own work per key is the limit, not memory: each 32-key tile is cut into two
  16-key sub-tiles with a softmax state each, one per warp, so no tile exchanges row
  maxima, sums or probabilities between warps (``SUBTILES`` in
  :mod:`cascadeinfer.kernels.decode_kernel`); at head_dim 256, whose sub-tiles would
  spill, 16-key tiles on one warp each. Reading from HBM the default tiles are as
  fast or faster, so nothing picks this schedule from shapes; a caller that knows its
  requests share pages (the cascade planner's flat fallback) asks for it.
- **concurrent**: the per-request kernel for short rows whose level runs beside a
  compute-bound kernel on another stream (the cascade's decode level beside its prefill
  level). Many small programs, each with a shallow pipeline that keeps its partial last
  tile inside the key loop (rows past the end read the row's last key, their scores
  masked), so more of them fit the SMs the other kernel leaves. Nothing picks it from
  shapes; :func:`policy.decode_schedule_beside_prefill` picks it from lengths.
- **all_heads** (:mod:`cascadeinfer.kernels.decode_heads`): one program per (request,
  block of kv heads, split) reads a 16-key tile of all its heads at once (32 KiB of K and
  of V a step at Llama-3-8B's shapes) with the products transposed (keys on M, the query
  group on N), two 8-warp programs an SM. Beside a compute-bound kernel on another stream
  it keeps more bytes in flight on the SMs it gets than the per-request tiles; alone it
  runs near the copy floor like the per-request schedule. Nothing picks it from shapes;
  :func:`policy.decode_schedule_beside_prefill` picks it where it was measured faster.

:func:`batch_decode_paged` takes ``schedule=``; by default :func:`pick_decode_schedule`
chooses from shapes (the per-request plan's wave tail), and a caller that knows the lengths
on the host (the cascade planner, an engine's scheduler) passes them to it as well.

The per-request plan (:func:`pick_decode_config`, :func:`decode_num_splits`) picks the
launch config and the split count from ``batch * num_kv_heads`` and the SM count alone:
one wave of programs with enough K/V loads in flight, and no split at all once there are
1.5x more (request, kv head) pairs than SMs. With splits, an eager call's last split per
(request, kv head) merges them inside the kernel, one launch; a call being captured in a
CUDA graph, or one whose states are too many bytes for one program (16 query heads per
kv head and many splits), merges them with :func:`cascadeinfer.kernels.merge_many.merge_states`'
kernel after (:func:`policy.merge_in_kernel`: inside a graph that kernel is the faster).
"""

from __future__ import annotations

import torch
import triton

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
from cascadeinfer.kernels.decode_heads import all_heads_kernel
from cascadeinfer.kernels.decode_kernel import decode_kernel
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
from cascadeinfer.layouts.page_table import check_pages_in_pool, validate_page_table
from cascadeinfer.layouts.paged_cache import (
    PagedKV,
    PagedKVCache,
    cache_tensors,
    check_layout_fits,
    unpack_paged_kv_cache,
)


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
        num_splits: with ``schedule="per_request"``, ``"shared_pages"`` or ``"concurrent"``, KV splits per
            (request, kv head), with ``"all_heads"`` per (request, head block),
            1..256: each reads ``cdiv(num_pages, num_splits)`` consecutive pages of its
            request and the last split to finish merges them (a merge kernel, past a
            few bytes of states per program). With ``"balanced"``,
            programs per kv head ``P``, 1..4096: the batch's pages laid end to end are
            cut into ``P`` pieces of ``cdiv(kv_indptr[batch] - kv_indptr[0], P)`` pages
            (found on the device) and a second kernel merges the requests a cut runs
            through. None: the schedule's plan from shapes (:func:`decode_num_splits`,
            :func:`balanced_num_programs`).
        schedule: ``"per_request"``, ``"balanced"``, ``"shared_pages"`` (per-request
            programs with tiles for page lists that share most of their pages, e.g. a
            common prefix: see the module docstring), ``"concurrent"`` (per-request
            programs with tiles for short rows decoded beside another stream's
            compute-bound kernel), ``"all_heads"`` (one program reads a key tile of
            several kv heads: see the module docstring), or None: :func:`pick_decode_schedule`
            from shapes (it never reads lengths here; pass ``schedule`` from
            ``pick_decode_schedule(..., seq_lens=...)`` when lengths vary and are known
            on the host), or ``"per_request"`` when ``num_splits`` is given. The answer
            is the same under every schedule, up to rounding.
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
    tensors = (q, *cache, kv_indptr, kv_indices, kv_last_page_len, *given(out, lse))
    # Captured calls merge KV splits in a merge kernel, eager ones in the kernel (policy).
    options = (len(cache), out is None, lse is None, kv_layout, sm_scale, num_splits, schedule, capturing())
    if not validate:
        done = _LAUNCHES.hot(tensors, options)
        if done is not None:
            return done
    rec, key, ptrs = _LAUNCHES.find(tensors, options, lengthless=(len(cache) + 2,), hot=not validate)
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
        limit = balanced.MAX_PROGRAMS if schedule == "balanced" else MAX_SPLITS
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
        elif schedule == "all_heads":
            _launch_all_heads(q, kv, kv_indptr, kv_indices, kv_last_page_len, out, lse, scale, num_splits)
        else:
            _launch_per_request(q, kv, kv_indptr, kv_indices, kv_last_page_len, out, lse, scale, num_splits, config,
                                shared_pages=schedule == "shared_pages", concurrent=schedule == "concurrent")
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


def _launch_all_heads(q, kv: PagedKV, kv_indptr, kv_indices, kv_last_page_len, out, lse, scale: float,
                      num_splits: int | None) -> None:
    """The "all_heads" schedule (:mod:`cascadeinfer.kernels.decode_heads`), checked inputs;
    with splits, merge_states' kernel after it."""
    batch, num_qo_heads, head_dim = q.shape
    group = num_qo_heads // kv.num_kv_heads
    cfg = policy.all_heads_config(kv.num_kv_heads, group, head_dim, q.dtype)
    if num_splits is None:
        num_splits = policy.all_heads_num_splits(batch, kv.num_kv_heads, group, head_dim, q.dtype, q.device)
    blocks = triton.cdiv(kv.num_kv_heads, cfg.heads)
    if num_splits > 1:  # fp32 states per split, merged into out and lse after
        o_dst = scratch((batch, num_splits, num_qo_heads, head_dim), torch.float32, q.device)
        lse_dst = scratch((batch, num_splits, num_qo_heads), torch.float32, q.device)
        dst_strides = (*o_dst.stride()[:3], *lse_dst.stride())
    else:
        o_dst, lse_dst = out, lse
        dst_strides = (out.stride(0), 0, out.stride(1), lse.stride(0), 0, lse.stride(1))
    launch(
        all_heads_kernel, (batch * blocks * num_splits,),
        q, kv.k, kv.v, kv_indptr, kv_indices, kv_last_page_len, o_dst, lse_dst,
        scale * LOG2E, kv.num_kv_heads, blocks, num_splits,
        q.stride(0), q.stride(1), kv.stride_page, kv.stride_token, kv.stride_head, *dst_strides,
        GROUP=group, BLOCK_G=next_power_of_2(group), HEADS=cfg.heads, PAD_HEADS=kv.num_kv_heads % cfg.heads != 0,
        HEAD_DIM=head_dim, BLOCK_D=max(16, next_power_of_2(head_dim)), PAGE_SIZE=kv.page_size,
        BLOCK_N=cfg.block_n, NUM_STAGES=cfg.num_stages,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **({"maxnreg": cfg.maxnreg} if cfg.maxnreg else {}),
    )
    if num_splits > 1:
        merge_many.merge_states_unchecked(o_dst, lse_dst, out, lse)  # inputs checked here already


def _launch_per_request(q, kv: PagedKV, kv_indptr, kv_indices, kv_last_page_len, out, lse, scale: float,
                        num_splits: int | None, config: DecodeConfig | None, *, shared_pages: bool = False,
                        concurrent: bool = False) -> None:
    """The per-request schedule (this module's kernel; with splits, its last split per
    (request, kv head) merges them, or merge_states' kernel after it); ``shared_pages``:
    the tiles for page lists that share their pages; ``concurrent``: for short rows
    beside another stream's kernel."""
    device = q.device
    batch, num_qo_heads, head_dim = q.shape
    cfg = config if config is not None else pick_decode_config(
        head_dim, q.dtype, kv.page_size, work=batch * kv.num_kv_heads, num_sms=policy.planning_sms(device),
        group_size=num_qo_heads // kv.num_kv_heads, shared_pages=shared_pages, concurrent=concurrent)
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
        SUBTILES=cfg.subtiles,
        CLAMP_TAIL=cfg.clamp_tail,
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
        decode_kernel, grid,
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
