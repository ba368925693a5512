"""Copy whole pages of a multi-layer paged KV cache: ``copy_pages`` (kernel + launcher).

What :class:`~cascadeinfer.layouts.pool.PagedKVPool`'s copy-on-write needs on the device:
page ``src[c]`` onto page ``dst[c]`` in every layer, K and V, for all copies in one launch
(a program per (copy, layer, chunk of the page)). The engine hands this launcher to its
pool; the pool's own default is a plain torch gather and scatter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cascadeinfer._checks import FLOAT_DTYPES, check_int32_vector, check_tensor
from cascadeinfer._device import capturing, next_power_of_2, use_triton


@triton.jit
def _copy_pages_kernel(
    cache_ptr,  # [num_layers, num_pages, page_numel]: every page contiguous inside its layer
    src_ptr,  # [num_copies] int32: page to read
    dst_ptr,  # [num_copies] int32: page to write
    stride_layer,  # elements between layers
    stride_page,  # elements between pages
    page_numel,  # elements of one page (K and V together)
    BLOCK: tl.constexpr,
):
    copy = tl.program_id(0)
    layer = tl.program_id(1)
    chunk = tl.program_id(2)
    src = tl.load(src_ptr + copy).to(tl.int64)
    dst = tl.load(dst_ptr + copy).to(tl.int64)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < page_numel
    base = layer.to(tl.int64) * stride_layer
    # A plain copy: no arithmetic, so no float32 upcast; the bits move unchanged.
    x = tl.load(cache_ptr + base + src * stride_page + offs, mask=mask)
    tl.store(cache_ptr + base + dst * stride_page + offs, x, mask=mask)


def copy_pages(
    cache: torch.Tensor,
    src_pages: torch.Tensor,
    dst_pages: torch.Tensor,
    *,
    validate: bool = True,
) -> None:
    """Copy page ``src_pages[c]`` onto page ``dst_pages[c]`` in every layer, in one launch.

    ``cache``: ``[num_layers, num_pages, *page_shape]`` float16/bfloat16/float32, each
    page contiguous within its layer (true of :class:`PagedKVPool`'s cache in both
    layouts). ``src_pages``, ``dst_pages``: int32 ``[num_copies]`` on the cache's device.
    With ``validate`` (and not while capturing) every page must be inside the pool, the
    destinations distinct and disjoint from the sources (otherwise the copies would race).
    Runs the Triton kernel where :func:`use_triton` says so, else a torch gather/scatter.
    """
    check_tensor("cache", cache, dtypes=FLOAT_DTYPES)
    if cache.dim() < 3:
        raise ValueError(f"cache: expected [num_layers, num_pages, *page_shape], got {list(cache.shape)}")
    page_numel = 1
    for size in cache.shape[2:]:
        page_numel *= size
    expected = 1
    for dim in range(cache.dim() - 1, 1, -1):
        if cache.shape[dim] > 1 and cache.stride(dim) != expected:
            raise ValueError(
                f"cache: each page must be contiguous within its layer, got strides {tuple(cache.stride())}"
            )
        expected *= cache.shape[dim]
    num_pages = cache.shape[1]
    check_int32_vector("src_pages", src_pages, cache.device)
    check_int32_vector("dst_pages", dst_pages, cache.device, length=src_pages.shape[0])
    if validate and not capturing():
        src, dst = src_pages.cpu().tolist(), dst_pages.cpu().tolist()
        for name, pages in (("src_pages", src), ("dst_pages", dst)):
            for i, p in enumerate(pages):
                if not 0 <= p < num_pages:
                    raise ValueError(f"{name}: page {p} at position {i} is outside the pool of {num_pages} pages")
        if len(set(dst)) != len(dst):
            raise ValueError("dst_pages: destinations must be distinct")
        if set(dst) & set(src):
            raise ValueError("dst_pages: a destination is also a source; the copies would race")
    num_copies = src_pages.shape[0]
    if num_copies == 0 or cache.shape[0] == 0 or page_numel == 0:
        return
    if not use_triton(cache.device):
        cache[:, dst_pages.long()] = cache[:, src_pages.long()]
        return
    block = min(next_power_of_2(page_numel), 2048)
    grid = (num_copies, cache.shape[0], triton.cdiv(page_numel, block))
    _copy_pages_kernel[grid](
        cache, src_pages, dst_pages, cache.stride(0), cache.stride(1), page_numel, BLOCK=block,
    )


def copy_pages_unchecked(cache: torch.Tensor, src_pages: torch.Tensor, dst_pages: torch.Tensor) -> None:
    """:func:`copy_pages` without the page checks (no host read): the page copy an engine
    hands its :class:`~cascadeinfer.layouts.pool.PagedKVPool`, whose bookkeeping already
    guarantees pages inside the pool, distinct destinations and no overlap."""
    copy_pages(cache, src_pages, dst_pages, validate=False)
