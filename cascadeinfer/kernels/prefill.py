"""Tensor-core prefill attention: ragged queries against paged or ragged KV.

One kernel serves three public entry points:

* :func:`batch_prefill_paged` — group ``g``'s queries ``q[qo_indptr[g]:qo_indptr[g+1]]``
  attend to group ``g``'s pages of a paged cache (CSR page table). Every cascade level
  above the last runs through it; the shared-prefix level is ONE group holding every
  query of the batch against a long prefix.
* :func:`batch_prefill_ragged` — the same against contiguous ragged K/V (new prompts).
* :func:`shared_prefix_attention` — every query against one contiguous prefix.

The kernel itself, and how it is laid out (GQA packing, the sync-free tile map, split-KV,
the pipelined page gather), is in :mod:`cascadeinfer.kernels.prefill_kernel`. This module
checks arguments, picks tiles and KV splits from shapes (:mod:`cascadeinfer.kernels.policy`),
launches, and merges the splits' states.

LSE is natural log at every boundary; ``(0, -inf)`` is the state of a query that sees no key.

Below the three entry points, without their checks, for tuning tools and benchmarks that
force a tile config, split count or address path: :func:`run_prefill` (tiles and splits
from shapes unless given, the launch, the merge of the splits), :func:`launch_prefill`
(one launch into per-split destinations) and the KV sides they take
(:class:`KVSource`, from :func:`paged_source` or :func:`ragged_source`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cascadeinfer._checks import (
    FLOAT_DTYPES,
    check_int32_vector,
    check_last_dim_contiguous,
    check_tensor,
    default_sm_scale,
    same_device,
)
from cascadeinfer._device import capturing, use_triton
from cascadeinfer.kernels.backend import (
    HOPPER_PREFILL_REGS,
    HOPPER_PREFILL_TILES,
    check_backend,
    hopper_refused,
    hopper_unavailable,
    pick_prefill_backend,
    tma_rows,
)
from cascadeinfer.kernels.constants import LOG2E
from cascadeinfer.kernels.launch import LaunchCache, given, launch, recorded, scratch
from cascadeinfer.kernels.merge_many import merge_states
from cascadeinfer.kernels.policy import (
    AddressPath,
    TileConfig,
    default_address_path,
    default_num_splits,
    exact_address_path,
    groups_tile_config,
    num_m_tiles,
    padded_head_dim,
)
from cascadeinfer.kernels.prefill_kernel import prefill_kernel
from cascadeinfer.kernels.reference import (
    attention_state_ref,
    batch_prefill_paged_ref,
    batch_prefill_ragged_ref,
)
from cascadeinfer.layouts.indptr import validate_indptr
from cascadeinfer.layouts.page_table import check_pages_in_pool, validate_page_table
from cascadeinfer.layouts.paged_cache import (
    PagedKV,
    PagedKVCache,
    cache_tensors,
    check_layout_fits,
    unpack_paged_kv_cache,
)

# --------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------

MAX_HEAD_DIM = 256


@dataclass(frozen=True, slots=True)
class KVSource:
    """The KV side as the kernel sees it: base tensors, (page, token, head) strides and,
    for a paged cache, the CSR page table (``None`` where the kernel reads none)."""

    k: torch.Tensor
    v: torch.Tensor
    paged: bool
    page_size: int  # 1 for ragged KV (not read)
    num_kv_heads: int
    k_strides: tuple[int, int, int]  # (page, token, head); page stride 0 for ragged
    v_strides: tuple[int, int, int]
    indptr: torch.Tensor | None  # pages (paged) or tokens (ragged) per group; None: one group
    indices: torch.Tensor | None = None  # page ids (paged)
    last_page_len: torch.Tensor | None = None  # (paged)

    @property
    def max_kv_len(self) -> int:
        """Upper bound on one group's KV length, from shapes."""
        return self.indices.shape[0] * self.page_size if self.paged else self.k.shape[0]


def paged_source(kv: PagedKV, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                 kv_last_page_len: torch.Tensor) -> KVSource:
    """A paged cache and its CSR page table (int32 ``[groups + 1]``, ``[pages]``,
    ``[groups]``) as the kernel's KV side. Checks nothing: the launchers check first."""
    strides = (kv.stride_page, kv.stride_token, kv.stride_head)  # K and V views share strides
    return KVSource(kv.k, kv.v, True, kv.page_size, kv.num_kv_heads, strides, strides,
                     kv_indptr, kv_indices, kv_last_page_len)


def _grid_tiles(q: torch.Tensor, qo_indptr: torch.Tensor | None, kv: KVSource, config: TileConfig) -> tuple[int, int]:
    """``(num_groups, M tiles of the grid)``; ``qo_indptr is None`` is one group."""
    num_groups = 1 if qo_indptr is None else qo_indptr.shape[0] - 1
    return num_groups, num_m_tiles(q.shape[0], num_groups, q.shape[1] // kv.num_kv_heads, config.block_m)


def launch_prefill(
    q: torch.Tensor,
    qo_indptr: torch.Tensor | None,
    kv: KVSource,
    o_dest: torch.Tensor,
    lse_dest: torch.Tensor,
    *,
    causal: bool,
    sm_scale: float,
    config: TileConfig,
    address: AddressPath | None = None,
    backend: str = "portable",
) -> None:
    """Run the kernel into ``o_dest [nnz_qo, S, Hq, D]`` and ``lse_dest [nnz_qo, S, Hq]``.

    ``S = o_dest.shape[1]`` is the number of KV splits; with ``S == 1`` the destinations
    may be views of the caller's ``out``/``lse``. ``qo_indptr is None`` means one group of
    all queries against all of ``kv`` (ragged, starting at token 0). ``address``: the
    address switches (default: :func:`default_address_path`); a forced one is checked
    against the same bounds, so the int32 path never runs where it could wrap.
    ``backend``: ``"hopper"`` runs the warp-specialised kernel instead (the caller checked
    :func:`cascadeinfer.kernels.backend.prefill_declines`; ``address`` does not apply).
    """
    nnz_qo, num_qo_heads, head_dim = q.shape
    num_groups, num_tiles = _grid_tiles(q, qo_indptr, kv, config)
    num_splits = o_dest.shape[1]
    if nnz_qo == 0 or num_groups == 0 or num_tiles == 0:
        return
    if backend == "hopper":
        _launch_hopper(q, qo_indptr, kv, o_dest, lse_dest, sm_scale, num_groups, num_tiles)
        return
    one_group = qo_indptr is None
    dummy = kv.k  # stands in for pointers the kernel does not read
    if kv.paged and kv.k_strides[:2] != kv.v_strides[:2]:
        raise AssertionError("paged K and V views must share page and token strides")  # paged_source's promise
    safe = exact_address_path(kv, config)
    if address is None:
        address = default_address_path(kv, config)
    elif (address.offsets_32 and not safe.offsets_32) or (address.aligned_pages and not safe.aligned_pages):
        raise ValueError(f"address: {address} is not exact for these shapes (allowed at most {safe})")
    grid = (num_tiles, kv.num_kv_heads, num_splits)
    launch(
        prefill_kernel, grid,
        q, kv.k, kv.v, o_dest, lse_dest,
        dummy if one_group else qo_indptr,
        dummy if one_group else kv.indptr,
        kv.indices if kv.paged else dummy,
        kv.last_page_len if kv.paged else dummy,
        (num_groups - 1).bit_length(), num_groups,
        nnz_qo, kv.k.shape[0] if one_group else 0,
        q.stride(0), q.stride(1),
        *kv.k_strides, *kv.v_strides[1:],  # V's page stride is K's (checked above)
        o_dest.stride(0), o_dest.stride(1), o_dest.stride(2),
        lse_dest.stride(0), lse_dest.stride(1), lse_dest.stride(2),
        sm_scale * LOG2E,
        GROUP_SIZE=num_qo_heads // kv.num_kv_heads,
        PAGE_SIZE=kv.page_size,
        HEAD_DIM=head_dim,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_D=padded_head_dim(head_dim),
        PAGED=kv.paged,
        CAUSAL=causal,
        ONE_GROUP=one_group,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        OFFSETS_32=address.offsets_32,
        ALIGNED_PAGES=address.aligned_pages,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


def _launch_hopper(q, qo_indptr, kv: KVSource, o_dest, lse_dest, sm_scale: float, num_groups: int,
                   num_tiles: int) -> None:
    """The Hopper kernel on the portable kernel's grid (128-row tiles, same splits). Its
    TMA descriptors hold the cache's address: a recording keeps their shape and re-points
    them at each replay's cache, through Triton's launcher (which encodes them per launch)
    rather than the direct one."""
    # Imported on first use: Gluon, GPU only.
    from triton.experimental.gluon.language import NVMMASharedLayout, bfloat16, float16  # noqa: PLC0415
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: PLC0415

    from cascadeinfer.kernels.prefill_kernel_hopper import prefill_kernel_hopper  # noqa: PLC0415

    if qo_indptr is None:
        raise AssertionError("the Hopper kernel reads paged groups (prefill_declines' promise)")
    head_dim = q.shape[2]
    block_n, k_stages, v_stages = HOPPER_PREFILL_TILES[head_dim]
    rows, stride_token = tma_rows(kv), kv.k_strides[1]
    gluon_dtype = {torch.bfloat16: bfloat16, torch.float16: float16}[q.dtype]
    box = NVMMASharedLayout.get_default_for([kv.page_size, head_dim], gluon_dtype)
    k_desc, v_desc = (TensorDescriptor(t, [rows, stride_token], [stride_token, 1], [kv.page_size, head_dim], box)
                      for t in (kv.k, kv.v))
    launch(
        prefill_kernel_hopper, (num_tiles, kv.num_kv_heads, o_dest.shape[1]),
        q, kv.k, kv.v, k_desc, v_desc, o_dest, lse_dest, qo_indptr, kv.indptr, kv.indices, kv.last_page_len,
        (num_groups - 1).bit_length(), num_groups,
        q.stride(0), q.stride(1), *kv.k_strides,
        o_dest.stride(0), o_dest.stride(1), o_dest.stride(2),
        lse_dest.stride(0), lse_dest.stride(1), lse_dest.stride(2),
        sm_scale * LOG2E,
        GROUP_SIZE=q.shape[1] // kv.num_kv_heads,
        PAGE_SIZE=kv.page_size,
        HEAD_DIM=head_dim,
        BLOCK_N=block_n,
        K_STAGES=k_stages,
        V_STAGES=v_stages,
        PRODUCER_REGS=HOPPER_PREFILL_REGS[0],
        CONSUMER_REGS=HOPPER_PREFILL_REGS[1],
        num_warps=4,
    )


def run_prefill(
    q: torch.Tensor,
    qo_indptr: torch.Tensor | None,
    kv: KVSource,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    causal: bool,
    sm_scale: float,
    num_splits: int | None = None,
    config: TileConfig | None = None,
    address: AddressPath | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick tiles, splits and the backend (:mod:`cascadeinfer.kernels.backend`) from
    shapes, launch, merge the splits into ``out``/``lse``. A forced ``config`` or
    ``address`` (the portable kernel's knobs) with ``backend=None`` runs the portable kernel."""
    nnz_qo, num_qo_heads, head_dim = q.shape
    num_groups = 1 if qo_indptr is None else qo_indptr.shape[0] - 1
    if backend is None and (config is not None or address is not None):
        backend = "portable"
    if config is None:
        config = groups_tile_config(nnz_qo, num_groups, num_qo_heads // kv.num_kv_heads, head_dim, q.dtype)
    backend = pick_prefill_backend(backend, q, kv, causal, config.block_m, num_groups)
    if num_splits is None:
        num_splits = default_num_splits(_grid_tiles(q, qo_indptr, kv, config)[1], kv.num_kv_heads, kv.max_kv_len,
                                        q.device)
    if num_splits == 1:
        launch_prefill(q, qo_indptr, kv, out.unsqueeze(1), lse.unsqueeze(1), causal=causal, sm_scale=sm_scale,
                       config=config, address=address, backend=backend)
        return out, lse
    # One partial state per split (o in q's dtype, as merge_states takes one dtype; LSE
    # float32). Every (row, split) is written, an empty split as the identity (0, -inf).
    part_o = scratch((nnz_qo, num_splits, num_qo_heads, head_dim), q.dtype, q.device)
    part_lse = scratch((nnz_qo, num_splits, num_qo_heads), torch.float32, q.device)
    launch_prefill(q, qo_indptr, kv, part_o, part_lse, causal=causal, sm_scale=sm_scale, config=config,
                   address=address, backend=backend)
    merge_states(part_o, part_lse, out=out, out_lse=lse)
    return out, lse


# ---- argument checks shared by the three entry points


def _check_q(q: object) -> torch.Tensor:
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    check_last_dim_contiguous("q", q)
    if q.shape[2] > MAX_HEAD_DIM:
        raise ValueError(f"q: head_dim {q.shape[2]} is not supported (at most {MAX_HEAD_DIM})")
    return q


def _check_kv_matches_q(q: torch.Tensor, kv_name: str, dtype: torch.dtype, num_kv_heads: int, head_dim: int) -> None:
    if dtype != q.dtype:
        raise TypeError(f"{kv_name}: expected dtype {q.dtype} (like q), got {dtype}")
    if head_dim != q.shape[2]:
        raise ValueError(f"{kv_name}: head_dim {head_dim} does not match q's head_dim {q.shape[2]}")
    if q.shape[1] % num_kv_heads != 0:
        raise ValueError(
            f"q: num_qo_heads {q.shape[1]} is not a multiple of num_kv_heads {num_kv_heads} of {kv_name}"
        )


def _outputs(q: torch.Tensor, out: torch.Tensor | None, lse: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The caller's ``out``/``lse`` after checks, or fresh ones: o like q, lse float32
    [nnz_qo, Hq] (a replayed call takes :meth:`Recording.outputs` instead)."""
    nnz_qo, num_qo_heads, _ = q.shape
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    else:
        check_tensor("out", out, ndim=3, dtypes=(q.dtype,), device=q.device, shape=tuple(q.shape))
        check_last_dim_contiguous("out", out)
    if lse is None:
        lse = torch.empty((nnz_qo, num_qo_heads), dtype=torch.float32, device=q.device)
    else:
        check_tensor("lse", lse, ndim=2, dtypes=(torch.float32,), device=q.device, shape=(nnz_qo, num_qo_heads))
    return out, lse


def _check_qo_indptr(qo_indptr: object, device: torch.device) -> None:
    check_int32_vector("qo_indptr", qo_indptr, device)
    if qo_indptr.shape[0] < 1:
        raise ValueError("qo_indptr: expected [num_groups + 1] entries, got none")


def _check_flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected a bool, got {type(value).__name__}")
    return value


def _store(out: torch.Tensor, lse: torch.Tensor, o64: torch.Tensor, lse64: torch.Tensor):
    """The plain-CPU path: the float64 reference, cast into the caller's buffers."""
    out.copy_(o64)
    lse.copy_(lse64)
    return out, lse


# ---- public entry points


def batch_prefill_paged(
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
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    validate: bool = True,
    num_splits: int | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ragged query groups over their pages of a paged KV cache.

    Args:
        q: ``[nnz_qo, num_qo_heads, head_dim]`` fp16 / bf16 / fp32, last dim stride 1
            (other strides honoured).
        qo_indptr: int32 ``[num_groups + 1]``; group ``g`` owns queries
            ``q[qo_indptr[g]:qo_indptr[g + 1]]`` (starts at 0, ends at ``nnz_qo``).
        paged_kv_cache: NHD ``[num_pages, 2, page_size, Hkv, D]`` or HND
            ``[num_pages, 2, Hkv, page_size, D]``, or a ``(k, v)`` tuple of the per-tensor
            form; q's dtype; any positive page_size.
        kv_indptr: int32 ``[num_groups + 1]``; group ``g`` owns the pages
            ``kv_indices[kv_indptr[g]:kv_indptr[g + 1]]``.
        kv_indices: int32 ``[>= kv_indptr[-1]]`` page ids.
        kv_last_page_len: int32 ``[num_groups]``, in ``1..page_size`` for groups with pages;
            a group's KV length is ``(pages - 1) * page_size + last_page_len`` (0 without pages).
        causal: query ``j`` of a group of ``n`` queries and ``L`` keys sees keys
            ``<= L - n + j`` (the last query is aligned with the last key).
        kv_layout: ``"NHD"`` or ``"HND"``.
        sm_scale: softmax scale, default ``head_dim ** -0.5``.
        out: optional output buffer like ``q`` (shape, dtype; last dim stride 1).
        lse: optional float32 ``[nnz_qo, num_qo_heads]`` buffer.
        validate: read the index tensors on the host to check their contents (skipped
            while a CUDA graph is being captured). Pass False once they are known good.
        num_splits: KV splits per group (their states merged into ``out``); None: as
            many as fill one wave of programs (:func:`default_num_splits`, from shapes).
            Fewer leave SMs free for work on another stream (the cascade's suffix decode).
        backend: ``None`` (the Hopper kernel where it runs and is measured >= 10% faster:
            one group of >= 256 packed rows and >= 2^23 packed rows x keys or >= 512 rows
            and >= 2^22, from 256 rows and 2^25 at head_dim 64; else the portable kernel),
            ``"portable"`` or ``"hopper"`` (the warp-specialised TMA kernel on compute
            capability 9.0, 1.09-1.23x faster at >= 128 queries over >= 8K shared keys; a
            ``ValueError`` where it cannot run): :mod:`cascadeinfer.kernels.backend`.

    Returns:
        ``(o, lse)``: ``o`` like ``q``; ``lse`` float32 ``[nnz_qo, num_qo_heads]``, NATURAL
        log. A query that sees no key (a group without pages, a causal row before the
        first key) gets ``o = 0, lse = -inf``.

    ``num_qo_heads`` must be a multiple of ``num_kv_heads``. No host reads on the launch
    path (with ``validate=False``), so the call can be captured in a CUDA graph.
    """
    cache = cache_tensors(paged_kv_cache)
    tensors = (q, qo_indptr, *cache, kv_indptr, kv_indices, kv_last_page_len, *given(out, lse))
    options = (len(cache), out is None, lse is None, causal, kv_layout, sm_scale, num_splits, backend)
    if not validate:
        done = _PAGED.hot(tensors, options)
        if done is not None:
            return done
    rec, key, ptrs = _PAGED.find(tensors, options, lengthless=(len(cache) + 3,), hot=not validate)
    if rec is not None:  # a call of this signature passed every shape check already
        out, lse = rec.outputs(out, lse, len(cache) + 5)
        if validate and not capturing():
            _check_paged_contents(q, qo_indptr, unpack_paged_kv_cache(paged_kv_cache, kv_layout), kv_indptr,
                                  kv_indices, kv_last_page_len)
        rec.replay((q, qo_indptr, *cache, kv_indptr, kv_indices, kv_last_page_len, out, lse),
                   known=ptrs[:len(cache) + 5])
        return out, lse
    _check_q(q)
    _check_flag("causal", causal)
    check_backend(backend)
    if num_splits is not None and (not isinstance(num_splits, int) or isinstance(num_splits, bool) or num_splits < 1):
        raise ValueError(f"num_splits: expected a positive int or None, got {num_splits!r}")
    kv = unpack_paged_kv_cache(paged_kv_cache, kv_layout)
    check_layout_fits(kv, num_qo_heads=q.shape[1],
                      kv_last_page_len=kv_last_page_len if validate and not capturing() else None)
    device = same_device(("q", q), ("paged_kv_cache", kv.k))
    _check_qo_indptr(qo_indptr, device)
    check_tensor("kv_indptr", kv_indptr, device=device, shape=(qo_indptr.shape[0],))
    _check_kv_matches_q(q, "paged_kv_cache", kv.dtype, kv.num_kv_heads, kv.head_dim)
    scale = default_sm_scale(q.shape[2], sm_scale)
    out, lse = _outputs(q, out, lse)
    if validate and not capturing():
        _check_paged_contents(q, qo_indptr, kv, kv_indptr, kv_indices, kv_last_page_len)
    else:
        validate_page_table(kv_indptr, kv_indices, kv_last_page_len, kv.page_size, kv.num_pages, contents=False)
    if not use_triton(device):
        if backend == "hopper":
            raise hopper_refused(hopper_unavailable(device))
        check_pages_in_pool(kv_indptr.cpu(), kv_indices.cpu(), kv.num_pages)
        o64, lse64 = batch_prefill_paged_ref(
            q, qo_indptr, paged_kv_cache, kv_indptr, kv_indices, kv_last_page_len,
            causal=causal, kv_layout=kv_layout, sm_scale=scale,
        )
        return _store(out, lse, o64, lse64)
    source = paged_source(kv, kv_indptr, kv_indices, kv_last_page_len)
    roots = (q, qo_indptr, *cache_tensors(paged_kv_cache), kv_indptr, kv_indices, kv_last_page_len, out, lse)
    with recorded(_PAGED, key, roots):
        run_prefill(q, qo_indptr, source, out, lse, causal=causal, sm_scale=scale, num_splits=num_splits,
                    backend=backend)
    return out, lse


def _check_paged_contents(q, qo_indptr, kv: PagedKV, kv_indptr, kv_indices, kv_last_page_len) -> None:
    """The content checks of :func:`batch_prefill_paged` (a host read): the page-table rule
    against this pool, and ``qo_indptr`` splitting exactly the ``nnz_qo`` queries."""
    validate_page_table(kv_indptr, kv_indices, kv_last_page_len, kv.page_size, kv.num_pages)
    validate_indptr("qo_indptr", qo_indptr, total=q.shape[0])


# Recordings of the public prefill launchers' calls, by signature (cascadeinfer.kernels.launch).
_PAGED, _RAGGED, _SHARED = LaunchCache(), LaunchCache(), LaunchCache()


def ragged_source(q: torch.Tensor, k: object, v: object, kv_indptr: torch.Tensor | None) -> KVSource:
    """Contiguous ragged ``k``, ``v`` ``[nnz_kv, Hkv, D]`` (checked against ``q``) and their
    int32 ``kv_indptr`` ``[groups + 1]`` (None: one group of all keys) as the KV side."""
    check_tensor("k", k, ndim=3, dtypes=FLOAT_DTYPES, device=q.device)
    check_tensor("v", v, ndim=3, dtypes=(k.dtype,), device=q.device, shape=tuple(k.shape))
    check_last_dim_contiguous("k", k)
    check_last_dim_contiguous("v", v)
    _check_kv_matches_q(q, "k", k.dtype, k.shape[1], k.shape[2])
    return KVSource(k, v, False, 1, k.shape[1], (0, k.stride(0), k.stride(1)), (0, v.stride(0), v.stride(1)),
                     kv_indptr)


def batch_prefill_ragged(
    q: torch.Tensor,
    qo_indptr: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_indptr: torch.Tensor,
    *,
    causal: bool = False,
    sm_scale: float | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ragged query groups over ragged contiguous K/V (prefill of new prompts).

    Args:
        q: ``[nnz_qo, num_qo_heads, head_dim]`` fp16 / bf16 / fp32, last dim stride 1.
        qo_indptr: int32 ``[num_groups + 1]`` (starts at 0, ends at ``nnz_qo``).
        k, v: ``[nnz_kv, num_kv_heads, head_dim]``, q's dtype, last dim stride 1 (other
            strides honoured, and may differ between k and v).
        kv_indptr: int32 ``[num_groups + 1]``; group ``g`` owns keys
            ``k[kv_indptr[g]:kv_indptr[g + 1]]`` (starts at 0, ends at most at ``nnz_kv``).
        causal, sm_scale, out, lse, validate: as in :func:`batch_prefill_paged`.

    Returns:
        ``(o, lse)``: ``o`` like ``q``; ``lse`` float32 ``[nnz_qo, num_qo_heads]``, natural
        log; ``(0, -inf)`` for a query that sees no key.
    """
    tensors = (q, qo_indptr, k, v, kv_indptr, *given(out, lse))
    options = (out is None, lse is None, causal, sm_scale)
    if not validate:
        done = _RAGGED.hot(tensors, options)
        if done is not None:
            return done
    rec, key, ptrs = _RAGGED.find(tensors, options, hot=not validate)
    if rec is None:
        _check_q(q)
        _check_flag("causal", causal)
        source = ragged_source(q, k, v, kv_indptr)
        _check_qo_indptr(qo_indptr, q.device)
        check_int32_vector("kv_indptr", kv_indptr, q.device, length=qo_indptr.shape[0])
        scale = default_sm_scale(q.shape[2], sm_scale)
    out, lse = _outputs(q, out, lse) if rec is None else rec.outputs(out, lse, 5)
    if validate and not capturing():
        validate_indptr("qo_indptr", qo_indptr, total=q.shape[0])
        validate_indptr("kv_indptr", kv_indptr)
        if kv_indptr[-1].item() > k.shape[0]:
            raise ValueError(f"kv_indptr: last entry {kv_indptr[-1].item()} exceeds nnz_kv = {k.shape[0]} keys in k")
    roots = (q, qo_indptr, k, v, kv_indptr, out, lse)
    if rec is not None:
        rec.replay(roots, known=ptrs[:5])
        return out, lse
    if not use_triton(q.device):
        o64, lse64 = batch_prefill_ragged_ref(q, qo_indptr, k, v, kv_indptr, causal=causal, sm_scale=scale)
        return _store(out, lse, o64, lse64)
    with recorded(_RAGGED, key, roots):
        run_prefill(q, qo_indptr, source, out, lse, causal=causal, sm_scale=scale)
    return out, lse


def shared_prefix_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    sm_scale: float | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every query attends to all of one contiguous prefix (non-causal).

    Args:
        q: ``[n, num_qo_heads, head_dim]`` fp16 / bf16 / fp32, last dim stride 1.
        k, v: ``[L, num_kv_heads, head_dim]``, q's dtype, last dim stride 1 (other strides
            honoured). ``L = 0`` gives ``(0, -inf)`` everywhere.
        sm_scale, out, lse: as in :func:`batch_prefill_paged`.

    Returns:
        ``(o, lse)``: ``o`` like ``q``; ``lse`` float32 ``[n, num_qo_heads]``, natural log.

    Reads no index tensor at all: the KV split count and the grid come from the shapes.
    """
    tensors = (q, k, v, *given(out, lse))
    options = (out is None, lse is None, sm_scale)
    done = _SHARED.hot(tensors, options)  # no contents to validate: the shapes say everything
    if done is not None:
        return done
    rec, key, ptrs = _SHARED.find(tensors, options, hot=True)
    if rec is not None:
        out, lse = rec.outputs(out, lse, 3)
        rec.replay((q, k, v, out, lse), known=ptrs[:3])
        return out, lse
    _check_q(q)
    source = ragged_source(q, k, v, None)
    scale = default_sm_scale(q.shape[2], sm_scale)
    out, lse = _outputs(q, out, lse)
    if not use_triton(q.device):
        o64, lse64 = attention_state_ref(q, k, v, sm_scale=scale)
        return _store(out, lse, o64, lse64)
    with recorded(_SHARED, key, (q, k, v, out, lse)):
        run_prefill(q, None, source, out, lse, causal=False, sm_scale=scale)
    return out, lse
