"""NHD / HND paged KV caches, in both forms, seen through one strided view.

A paged cache is either one tensor holding K and V, or a ``(k, v)`` tuple:

    NHD: [num_pages, 2, page_size, num_kv_heads, head_dim]  or  ([num_pages, page_size, num_kv_heads, head_dim],) * 2
    HND: [num_pages, 2, num_kv_heads, page_size, head_dim]  or  ([num_pages, num_kv_heads, page_size, head_dim],) * 2

Kernels do not care which: they take the K and V base pointers and four strides
(page, token within the page, head, dim). :func:`unpack_paged_kv_cache` produces them as
views, never copies.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cascadeinfer._checks import FLOAT_DTYPES, check_tensor

KV_LAYOUTS = ("NHD", "HND")

PagedKVCache = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


def check_kv_layout(kv_layout: object) -> str:
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout: expected 'NHD' or 'HND', got {kv_layout!r}")
    return kv_layout


@dataclass(frozen=True, slots=True)
class PagedKV:
    """K and V views of a paged cache, with the geometry kernels need.

    ``k`` and ``v`` are views of the caller's storage shaped like the layout's per-tensor
    form. Strides are in elements; ``stride_token`` steps one slot inside a page and
    ``stride_head`` one KV head, whatever the layout.
    """

    k: torch.Tensor
    v: torch.Tensor
    kv_layout: str
    num_pages: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    stride_page: int
    stride_token: int
    stride_head: int

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype

    @property
    def device(self) -> torch.device:
        return self.k.device


def unpack_paged_kv_cache(paged_kv_cache: PagedKVCache, kv_layout: str = "NHD") -> PagedKV:
    """Split a paged cache (single tensor or ``(k, v)`` tuple) into strided K/V views.

    The last dimension (head_dim) must have stride 1; every other stride is honoured.
    In the tuple form K and V must have the same shape, dtype, device and strides.
    Raises ``ValueError``/``TypeError`` naming ``paged_kv_cache`` otherwise.
    """
    check_kv_layout(kv_layout)
    if isinstance(paged_kv_cache, torch.Tensor):
        check_tensor("paged_kv_cache", paged_kv_cache, ndim=5, dtypes=FLOAT_DTYPES)
        if paged_kv_cache.shape[1] != 2:
            raise ValueError(
                f"paged_kv_cache: expected shape [num_pages, 2, ...] with K and V in dim 1, "
                f"got {list(paged_kv_cache.shape)}"
            )
        k, v = paged_kv_cache[:, 0], paged_kv_cache[:, 1]
    elif isinstance(paged_kv_cache, (tuple, list)) and len(paged_kv_cache) == 2:
        k, v = paged_kv_cache
        check_tensor("paged_kv_cache[0] (k)", k, ndim=4, dtypes=FLOAT_DTYPES)
        check_tensor("paged_kv_cache[1] (v)", v, ndim=4, dtypes=(k.dtype,), device=k.device, shape=tuple(k.shape))
        if k.stride() != v.stride():
            raise ValueError(
                f"paged_kv_cache: k and v must have the same strides, got {k.stride()} and {v.stride()}"
            )
    else:
        raise TypeError(
            "paged_kv_cache: expected a tensor [num_pages, 2, ...] or a (k, v) tuple of "
            f"[num_pages, ...] tensors, got {type(paged_kv_cache).__name__}"
        )
    if k.shape[-1] > 1 and k.stride(-1) != 1:
        raise ValueError(f"paged_kv_cache: head_dim must have stride 1, got strides {tuple(k.stride())}")
    num_pages = k.shape[0]
    if kv_layout == "NHD":
        page_size, num_kv_heads = k.shape[1], k.shape[2]
        stride_token, stride_head = k.stride(1), k.stride(2)
    else:
        num_kv_heads, page_size = k.shape[1], k.shape[2]
        stride_head, stride_token = k.stride(1), k.stride(2)
    if page_size < 1 or num_kv_heads < 1 or k.shape[3] < 1:
        raise ValueError(f"paged_kv_cache: page_size, num_kv_heads and head_dim must be positive, got {list(k.shape)}")
    return PagedKV(
        k=k, v=v, kv_layout=kv_layout, num_pages=num_pages, page_size=page_size,
        num_kv_heads=num_kv_heads, head_dim=k.shape[3], stride_page=k.stride(0),
        stride_token=stride_token, stride_head=stride_head,
    )


def cache_tensors(paged_kv_cache: PagedKVCache) -> tuple[torch.Tensor, ...]:
    """The tensors of a paged cache: ``(cache,)`` for the single tensor, ``(k, v)`` for the
    tuple (or list) form, ``()`` for anything that is neither, so that a launcher keying
    its call on them misses every recording and its checks name the argument."""
    if isinstance(paged_kv_cache, torch.Tensor):
        return (paged_kv_cache,)
    if (isinstance(paged_kv_cache, (tuple, list)) and len(paged_kv_cache) == 2
            and all(isinstance(t, torch.Tensor) for t in paged_kv_cache)):
        return tuple(paged_kv_cache)
    return ()


def check_layout_fits(
    kv: PagedKV,
    *,
    num_qo_heads: int | None = None,
    num_kv_heads: int | None = None,
    page_size: int | None = None,
    kv_last_page_len: torch.Tensor | None = None,
) -> None:
    """Raise a ``ValueError`` naming ``kv_layout`` when the cache fits the other layout.

    A cache of one layout read as the other has its page_size and num_kv_heads swapped,
    and the first check to notice would blame an unrelated argument (``q``'s head count,
    ``kv_last_page_len``). The other arguments tell the two readings apart:
    ``num_qo_heads`` is a multiple of the kv head count, a plan fixes ``num_kv_heads``
    and ``page_size``, and ``kv_last_page_len`` never exceeds the page size (read on the
    host: pass it only where a sync is allowed). When this reading breaks one of these
    facts and the swapped one breaks none, the error says so. Otherwise nothing is
    raised and the callers' own checks report what is wrong (an argument of the wrong
    type here is left to them too).
    """
    if kv.page_size == kv.num_kv_heads:
        return
    longest = None
    if (isinstance(kv_last_page_len, torch.Tensor) and kv_last_page_len.numel()
            and kv_last_page_len.device.type != "meta"
            and not kv_last_page_len.dtype.is_floating_point and kv_last_page_len.dtype != torch.bool):
        longest = int(kv_last_page_len.max())

    def broken(pages: int, heads: int) -> list[str]:
        why = []
        if num_qo_heads is not None and num_qo_heads % heads:
            why.append(f"num_qo_heads {num_qo_heads} is not a multiple of num_kv_heads {heads}")
        if num_kv_heads is not None and num_kv_heads != heads:
            why.append(f"num_kv_heads {heads} is not the expected {num_kv_heads}")
        if page_size is not None and page_size != pages:
            why.append(f"page_size {pages} is not the expected {page_size}")
        if longest is not None and longest > pages:
            why.append(f"kv_last_page_len holds {longest} > page_size {pages}")
        return why

    why = broken(kv.page_size, kv.num_kv_heads)
    if why and not broken(kv.num_kv_heads, kv.page_size):
        other = "HND" if kv.kv_layout == "NHD" else "NHD"
        raise ValueError(
            f"paged_kv_cache: read as kv_layout={kv.kv_layout!r} it has page_size {kv.page_size} and "
            f"num_kv_heads {kv.num_kv_heads}, but {'; '.join(why)}; read as {other!r} everything fits: "
            f"is it an {other} cache? Then pass kv_layout={other!r}."
        )


def page_tokens(kv: PagedKV, which: str, pages: torch.Tensor) -> torch.Tensor:
    """K or V of ``pages`` as ``[len(pages) * page_size, num_kv_heads, head_dim]`` (a copy)."""
    t = (kv.k if which == "k" else kv.v)[pages.long()]
    if kv.kv_layout == "HND":
        t = t.transpose(1, 2)
    return t.reshape(-1, kv.num_kv_heads, kv.head_dim)


def gather_paged_kv(
    kv: PagedKV,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_last_page_len: torch.Tensor,
    row: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values of page-table row ``row``, in order: ``[len, Hkv, D]`` each.

    Host-side helper for references and tests (it reads the metadata on the host).
    """
    start, end = int(kv_indptr[row]), int(kv_indptr[row + 1])
    if end == start:
        empty = kv.k.new_empty((0, kv.num_kv_heads, kv.head_dim))
        return empty, empty
    pages = kv_indices[start:end]
    length = (end - start - 1) * kv.page_size + int(kv_last_page_len[row])
    return page_tokens(kv, "k", pages)[:length], page_tokens(kv, "v", pages)[:length]
