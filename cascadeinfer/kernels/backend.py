"""Which kernel runs a launch: the portable Triton kernel, or one written for a device.

A device-specific kernel (the warp-specialised Hopper prefill kernel,
:mod:`cascadeinfer.kernels.prefill_kernel_hopper`) sits behind the same public function,
arguments and ``(o, lse)`` contract as the portable kernel it accelerates. Every public
launcher that has one takes ``backend``:

* ``None`` (default): the device-specific kernel where it runs (device, Triton version,
  shapes; see :func:`prefill_declines`) and is measured at least 10% faster, else the
  portable kernel — silently, since both give the same answer. For the Hopper prefill
  kernel that is one group (shared-prefix attention) whose packed query rows and packed
  rows x keys reach one of :data:`HOPPER_PREFILL_BOUNDS` (:func:`pick_prefill_backend`;
  benchmarks/NOTES.md, "Prefix / prefill kernel", v5 and v8). A cascade applies the same
  bounds to each prefill level from the level's own keys at plan time
  (:func:`hopper_prefill_shape`), not from its page table's capacity
  (:class:`~cascadeinfer.MultiLevelCascadeAttention`).
* ``"portable"``: always the portable ``tl.dot`` kernel (the reference; what the CPU
  interpreter runs).
* ``"hopper"``: the Hopper kernel, or a ``ValueError`` saying why it cannot run here.

The choice is made once per call signature, on the host, from shapes, strides, dtypes and
the device (never from tensor contents), and recorded with the launch, so replays pay
nothing for it.
"""

from __future__ import annotations

import functools

import torch
import triton

BACKENDS = ("portable", "hopper")

# Triton versions the Hopper kernels were tested with (Gluon's API moves between releases).
HOPPER_TRITON_VERSIONS = ("3.6.",)

# backend=None picks the Hopper prefill kernel for one group whose packed query rows and
# packed rows x keys (an upper bound from shapes: rows x the page table's capacity) reach
# both numbers of one of its head_dim's (rows, rows x keys) pairs. On the H100 (Hq 32,
# bf16, page 16; benchmarks/NOTES.md, "Prefix / prefill kernel", v5): at head_dim 128 every
# measured shape from 256 rows and 2^23 ran 1.10-1.26x the portable kernel's speed (Hkv 1,
# 8 and 32), every Hkv 8 shape below less than 1.10x but one (1024 rows over 4K keys,
# 1.10x); 128 rows of one head (Hkv 32) over 64K keys, memory-bound, ran 0.99x. With the
# kernel in FlashAttention-3's order (v8, on an H200) 512 rows over 8K keys and 1024 over 4K
# (2^22) ran 1.12x and 1.14x, and the cascade's prefix level of 1024 rows over 4K keys beside
# 128-384 keys of decode 0.88-1.01x the time; 256 rows over 16K keys (2^22) stays below.
# At head_dim 64 the gain is smaller: 1.09-1.10x at 2^23, 1.11-1.13x from 2^25.
HOPPER_PREFILL_BOUNDS = {64: ((256, 2**25),), 128: ((256, 2**23), (512, 2**22))}

# The Hopper prefill kernel's head dims and (BLOCK_N, K slots, V slots) for each: shared
# memory is (128 Q rows + slots * BLOCK_N) * head_dim * 2 bytes (224 KiB at 128, 144 KiB
# at 64; the limit is 227).
HOPPER_PREFILL_TILES = {64: (128, 4, 4), 128: (128, 3, 3)}
# Its setmaxnreg split (producer, consumer) registers a thread: the producer gathers a partial
# tile 32 rows at a time (40); each consumer holds a 64x128 score tile in flight beside its
# softmax (232).
HOPPER_PREFILL_REGS = (40, 232)


def check_backend(backend: object) -> str | None:
    """``backend`` if it names a backend (or is None), else a ``ValueError`` naming it."""
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend: expected None, 'portable' or 'hopper', got {backend!r}")
    return backend


def hopper_refused(reason: str) -> ValueError:
    """The error of ``backend="hopper"`` where the Hopper prefill kernel does not run."""
    return ValueError(f"backend='hopper': the Hopper prefill kernel does not run {reason}")


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def hopper_unavailable(device: torch.device) -> str | None:
    """Why the Hopper kernels cannot run on ``device`` (None: they can)."""
    if device.type != "cuda":
        return f"a {device.type} device (the Hopper kernels run on CUDA devices of compute capability 9.0)"
    cap = _capability(torch.cuda.current_device() if device.index is None else device.index)
    if cap != (9, 0):
        return f"compute capability {cap[0]}.{cap[1]} (the Hopper kernels are built for 9.0)"
    if not triton.__version__.startswith(HOPPER_TRITON_VERSIONS):
        return f"Triton {triton.__version__} (the Hopper kernels are tested with {', '.join(HOPPER_TRITON_VERSIONS)}x)"
    return None


def prefill_declines(q: torch.Tensor, kv, causal: bool, block_m: int) -> str | None:
    """Why the Hopper prefill kernel does not take this launch (None: it does).

    It takes non-causal attention over a paged cache, fp16/bf16, head_dim 64 or 128, where
    the portable kernel would use 128-row tiles (groups of at least 65 packed rows: the
    prefix levels of a cascade), with every row 16-byte aligned (strides multiples of 8
    elements), pages of 8-128 tokens dividing its 128-key tiles and a layout its TMA
    descriptors can address (:func:`tma_rows`). ``kv`` is the launchers' ``KVSource``.
    """
    reason = hopper_unavailable(q.device)
    if reason is not None:
        return reason
    if causal:
        return "causal attention (it runs non-causal levels)"
    if not kv.paged:
        return "contiguous K/V (it reads paged caches)"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {q.dtype} (fp16 and bf16 only)"
    if q.shape[2] not in HOPPER_PREFILL_TILES:
        return f"head_dim {q.shape[2]} (64 or 128)"
    if block_m != 128:
        return "groups of at most 64 packed rows (it computes 128-row tiles)"
    strides = (q.stride(0), q.stride(1), *kv.k_strides)
    if any(s % 8 for s in strides) or any(t.data_ptr() % 16 for t in (q, kv.k, kv.v)):
        return "rows not 16-byte aligned (strides must be multiples of 8 elements)"
    if kv.page_size % 8 or 128 % kv.page_size:
        return f"page size {kv.page_size} (8, 16, 32, 64 or 128: whole pages are its TMA boxes)"
    if tma_rows(kv) is None:
        return "a cache layout whose pages are not whole rows of its token stride"
    return None


def tma_rows(kv) -> int | None:
    """Rows of the 2-D view the Hopper kernel's TMA descriptors take of a paged K or V:
    rows of ``stride_token`` elements, in which page ``p``'s slot ``s`` of head ``h`` is row
    ``p * (stride_page // stride_token) + (h * stride_head) // stride_token + s`` at column
    ``(h * stride_head) % stride_token`` (NHD: heads side by side in a row; HND: a head's
    slots are rows). None where the layout has no such view, or its rows overflow int32."""
    num_pages = kv.k.shape[0]
    stride_page, stride_token, stride_head = kv.k_strides
    head_dim = kv.k.shape[-1]
    if stride_token <= 0 or stride_page % stride_token:
        return None
    # Every head's columns must lie within one row (where a head starts in its row need
    # not grow with the head, so each is checked).
    if any((h * stride_head) % stride_token + head_dim > stride_token for h in range(kv.num_kv_heads)):
        return None
    last_head = (kv.num_kv_heads - 1) * stride_head
    end = (num_pages - 1) * stride_page + last_head + (kv.page_size - 1) * stride_token + head_dim
    rows = -(-end // stride_token)
    return rows if rows < 2**31 else None


def hopper_prefill_shape(rows: int, max_keys: int, head_dim: int, num_groups: int) -> bool:
    """Whether a prefill launch of ``num_groups`` groups, ``rows`` packed query rows (query
    tokens x query heads per kv head) and at most ``max_keys`` keys a group is inside the
    shape bounds where ``backend=None`` takes the Hopper kernel: one group whose rows and
    rows x keys reach one of :data:`HOPPER_PREFILL_BOUNDS`'s pairs for ``head_dim``.
    The device and the tensors (:func:`prefill_declines`) decide the rest at the launch."""
    return num_groups == 1 and any(rows >= min_rows and rows * max_keys >= min_work
                                   for min_rows, min_work in HOPPER_PREFILL_BOUNDS.get(head_dim, ()))


def pick_prefill_backend(backend: str | None, q: torch.Tensor, kv, causal: bool, block_m: int,
                         num_groups: int) -> str:
    """The backend a prefill launch of ``num_groups`` groups runs on (see the module
    docstring): ``backend`` if given (``"hopper"`` raising where it cannot run); for None
    the Hopper kernel where it runs, on one group inside :data:`HOPPER_PREFILL_BOUNDS`
    (:func:`hopper_prefill_shape`), else the portable kernel."""
    if backend == "portable":
        return "portable"
    if backend is None:  # the shape bounds first: they cost nothing, the declines ask the device
        rows = q.shape[0] * (q.shape[1] // kv.num_kv_heads)
        if not hopper_prefill_shape(rows, kv.max_kv_len, q.shape[2], num_groups):
            return "portable"
    reason = prefill_declines(q, kv, causal, block_m)
    if backend == "hopper":
        if reason is not None:
            raise hopper_refused(reason)
        return "hopper"
    return "portable" if reason is not None else "hopper"
