"""Launch policy of the attention kernels: which tiles, how many KV splits, which schedule.

Every rule here reads shapes only (never tensor contents: the launches stay CUDA-graph
safe), and every choice is measured: the comments say on which device, at which shapes
and against what (benchmarks/NOTES.md has the sweeps). The kernels' launchers apply
these rules; planners call the same public functions to size work ahead of a launch
(``cascade.plan`` sizes the prefix level's grid beside the decode with
:func:`paged_num_splits`).

* Prefill (``kernels/prefill.py``): :class:`TileConfig` and :func:`default_tile_config`
  (tiles from head_dim, dtype and rows per group), :func:`default_num_splits` (KV splits
  that fill one wave), :class:`AddressPath` (the key loop's address arithmetic).
* Decode (``kernels/decode.py``, ``kernels/decode_balanced.py``): :class:`DecodeConfig`,
  the measured variants, :func:`pick_decode_config`, :func:`decode_num_splits`,
  :func:`pick_balanced_config`, :func:`balanced_num_programs` and
  :func:`pick_decode_schedule`.
* Merge (``kernels/merge.py``, ``kernels/merge_many.py``): :func:`merge_tile_config`
  (heads and head-dim chunk per program) and :func:`merge_unroll` (states per tile).

SM counts come from :func:`planning_sms`: a CUDA device's own; for CPU tensors (the
interpreter) the H100/H200's 132, so that CPU tests check the plan a GPU gets.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch

from cascadeinfer._device import cuda_num_sms, next_power_of_2
from cascadeinfer.kernels.decode_balanced import MAX_PROGRAMS as MAX_BALANCED_PROGRAMS
from cascadeinfer.layouts.indptr import host_array

REFERENCE_SMS = 132  # H100/H200 SXM: the SM count CPU tensors are planned for
_MIN_KEYS_PER_SPLIT = 256  # a prefill split shorter than this costs more in merge traffic than it gains


def planning_sms(device: torch.device) -> int:
    """Multiprocessors the plans fill: the CUDA device's, or :data:`REFERENCE_SMS` for CPU
    tensors (the interpreter runs the GPU's plan, program by program)."""
    return cuda_num_sms(device) if device.type == "cuda" else REFERENCE_SMS


# ---------------------------------------------------------------------------------- prefill


@dataclass(frozen=True, slots=True)
class TileConfig:
    """Tile sizes and launch options of the prefill kernel (powers of two, >= 16)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n"):
            x = getattr(self, name)
            if x < 16 or x & (x - 1):
                raise ValueError(f"TileConfig.{name}: expected a power of two >= 16, got {x}")


def padded_head_dim(head_dim: int) -> int:
    """The kernels' BLOCK_D: head_dim padded to the next power of two (at least 16)."""
    return max(16, next_power_of_2(head_dim))


def default_tile_config(head_dim: int, dtype: torch.dtype, rows_per_group: int | None = None) -> TileConfig:
    """Tiles for Hopper (227 KiB shared memory, 255 registers per thread), from shapes only.

    ``rows_per_group`` is the average number of packed rows (queries × query heads per KV
    head) of a group, ``None`` for many. Shared memory per program is about ``(BLOCK_M +
    2 * stages * BLOCK_N) * BLOCK_D * itemsize``; the float32 accumulator ``BLOCK_M x
    BLOCK_D`` lives in registers. Every choice below was compiled for sm_90 and keeps its
    key loop free of register spills (ptxas -v, SASS); fp16/bf16 tiles of 64+ rows use
    ``wgmma``. Float32 with ``input_precision="ieee"`` runs on FMA units, which hold both
    operands in registers, hence its small tiles. Measured on an H200 (benchmarks/NOTES.md):
    128x128 with 3 stages is the fastest for long shared prefixes (0.49-0.65 of the bf16
    matmul rate vs 0.31-0.35 for the former 128x64 default); groups of a few rows (cascade
    middle levels, decode-like groups) get tiles of 16-64 rows instead of padding 128.
    """
    block_d = padded_head_dim(head_dim)
    rows = 1 << 30 if rows_per_group is None else rows_per_group
    fp32 = dtype == torch.float32
    for is_fp32, max_block_d, max_rows, config in PREFILL_TILES:
        if is_fp32 == fp32 and block_d <= max_block_d and (max_rows is None or rows <= max_rows):
            return config
    raise ValueError(f"head_dim: no prefill tiles for {head_dim} (at most 256)")


# The table default_tile_config reads, first match wins: (float32?, largest BLOCK_D, most
# packed rows per group or None for any, tiles). Resources from sm_90 builds (ptxas -v),
# speed from bench_prefix and the cascade benchmarks (benchmarks/NOTES.md, "Prefix /
# prefill kernel").
PREFILL_TILES: tuple[tuple[bool, int, int | None, TileConfig], ...] = (
    (True, 64, None, TileConfig(32, 16, 4, 2)),  # float32 "ieee": FMA units, operands in registers
    (True, 128, None, TileConfig(32, 16, 8, 2)),
    (True, 256, None, TileConfig(16, 16, 8, 2)),
    (False, 128, 16, TileConfig(16, 64, 4, 3)),  # mma.sync, 128 registers: 3 programs per SM
    (False, 128, 32, TileConfig(32, 64, 4, 3)),
    (False, 128, 64, TileConfig(64, 64, 4, 3)),  # 112 KiB shared, 214 registers: 2 programs per SM
    (False, 128, None, TileConfig(128, 128, 8, 3)),  # 224 KiB shared, 255 registers, no spill in the loop
    (False, 256, 16, TileConfig(16, 32, 4, 3)),
    (False, 256, None, TileConfig(128, 32, 8, 3)),  # 160 KiB shared, 255 registers
)


def num_m_tiles(nnz_qo: int, num_groups: int, group_size: int, block_m: int) -> int:
    """Upper bound on the M tiles of all groups (the grid's first dimension), from shapes.

    Group ``g`` starts at tile ``(qo_indptr[g] * G + g * (block_m - 1)) // block_m``; its
    tiles never reach the next group's start, and the last group's end is at most this.
    """
    return (nnz_qo * group_size + num_groups * (block_m - 1)) // block_m


def default_num_splits(num_tiles: int, num_kv_heads: int, max_kv_len: int, device: torch.device,
                       sm_share: float = 1.0) -> int:
    """KV splits per group, from shapes only (never from indptr contents).

    Without splitting the grid has ``num_tiles * num_kv_heads`` programs. When that is
    below the SM count, split each group's KV into as many chunks as keep the grid within
    one wave (``sms // programs``), but no chunk shorter than ``_MIN_KEYS_PER_SPLIT`` keys
    of the longest possible group (``max_kv_len``, an upper bound from the shapes).
    ``sm_share < 1`` sizes the grid to the program count nearest that share of the SMs
    (the rest run another stream's work), never above one wave.
    """
    programs = max(1, num_tiles * num_kv_heads)
    sms = planning_sms(device)
    if programs >= sms:
        return 1
    splits = sms // programs
    if sm_share < 1:
        target = sm_share * sms
        lo = max(1, int(target // programs))
        splits = min(splits, lo if target - lo * programs <= (lo + 1) * programs - target else lo + 1)
    return max(1, min(splits, max_kv_len // _MIN_KEYS_PER_SPLIT))


def groups_tile_config(nnz_qo: int, num_groups: int, group_size: int, head_dim: int,
                       dtype: torch.dtype) -> TileConfig:
    """The tiles the launchers pick for ``nnz_qo`` queries in ``num_groups`` groups: those of
    the average packed rows per group (``nnz_qo * group_size / num_groups``, from shapes)."""
    return default_tile_config(head_dim, dtype, -(-nnz_qo * group_size // max(1, num_groups)))


def paged_num_splits(nnz_qo: int, num_groups: int, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                     dtype: torch.dtype, max_kv_len: int, device: torch.device, sm_share: float = 1.0) -> int:
    """The split count :func:`batch_prefill_paged` takes by default for these shapes, or for
    a grid sized to ``sm_share`` of the SMs (pass the result as ``num_splits``)."""
    config = groups_tile_config(nnz_qo, num_groups, num_qo_heads // num_kv_heads, head_dim, dtype)
    tiles = num_m_tiles(nnz_qo, num_groups, num_qo_heads // num_kv_heads, config.block_m)
    return default_num_splits(tiles, num_kv_heads, max_kv_len, device, sm_share)


_INT32_OFFSET_LIMIT = 2**31  # row offsets computed in int32 must stay below this


@dataclass(frozen=True, slots=True)
class AddressPath:
    """How the unmasked key loop forms K/V row addresses (the kernel's address switches).

    ``offsets_32``: row offsets (``page * stride_page + slot * stride_token``, or ``token *
    stride_token`` for ragged K/V) in int32 instead of int64: one IMAD per row instead of a
    64-bit multiply-add, and 32-bit offsets live across the softmax instead of 64-bit
    pointers. Only where every offset fits (:func:`exact_address_path`).
    ``aligned_pages``: paged K/V with ``block_n % page_size == 0``: each row's slot offset and
    page position are loop invariants (every tile starts on a page boundary), so per tile
    only a scalar moves. The launcher picks both from shapes; tests and benchmarks force them.
    """

    offsets_32: bool
    aligned_pages: bool


def _max_element_offset(t: torch.Tensor) -> int:
    """The largest element offset from ``t``'s first element that indexing ``t`` forms."""
    if t.numel() == 0:
        return 0
    return sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))


def exact_address_path(kv, config: TileConfig) -> AddressPath:
    """Every address switch that is exact for these shapes (host side, from shapes and
    strides only: no sync, CUDA-graph safe); a forced path may use at most these. ``kv``:
    the prefill launcher's KV source (its ``k`` and ``v`` views, ``paged``, ``page_size``).

    int32 offsets are safe when the largest element offset of the K and V views (the
    paged pool ``[num_pages, page_size, Hkv, D]`` in its layout, or ragged ``[nnz_kv, Hkv,
    D]``), i.e. ``sum((size - 1) * stride)``, is below 2**31. Every offset the kernel forms
    in int32 is at most that: a paged row offset ``page * stride_page + slot *
    stride_token`` (valid page ids are ``< num_pages``, the page-id loads never read past
    the group's pages, and strides are non-negative) or a ragged ``t * stride_token`` with
    ``t`` below the group's length, counted from the group's first key, whose offset is
    added to the base pointer in int64 like the KV head's. Pools of 2**31 elements or more
    keep the int64 path.
    """
    extent = max(_max_element_offset(kv.k), _max_element_offset(kv.v))
    return AddressPath(offsets_32=extent < _INT32_OFFSET_LIMIT,
                       aligned_pages=kv.paged and config.block_n % kv.page_size == 0)


def default_address_path(kv, config: TileConfig) -> AddressPath:
    """The address path the launcher takes: of the exact switches
    (:func:`exact_address_path`), the ones measured fastest for the tile.

    H100, bf16 Hq 32 Hkv 8 D 128 page 16, one group (benchmarks/tools/tune_prefix_offsets.py,
    fraction of matmul at n 128-512 x L 8K-32K): 128-row tiles, int64 0.47-0.61, int32
    0.52-0.65, hoisted page math alone 0.55-0.68, both 0.53-0.66: the hoisting alone, or
    int32 where pages do not align. 64-row tiles: both (the Hkv 32 cascade at (64, 8192,
    256) unchanged, 150.5 us against 150.8). 16- and 32-row tiles (bandwidth-bound
    decode-like groups): neither; both made the Hkv 32 cascade at (16, 65536, 1024) 8%
    slower (489 us against 452).
    """
    exact = exact_address_path(kv, config)
    if config.block_m >= 128:
        return AddressPath(offsets_32=exact.offsets_32 and not exact.aligned_pages,
                           aligned_pages=exact.aligned_pages)
    if config.block_m >= 64:
        return exact
    return AddressPath(offsets_32=False, aligned_pages=False)


# ---------------------------------------------------------------------------------- decode


@dataclass(frozen=True, slots=True)
class DecodeConfig:
    """Launch parameters of the stage-1 kernel (internal; the benchmarks compare several).

    ``programs_per_sm`` sets the split plan when the caller leaves ``num_splits`` to it
    (:func:`decode_num_splits`, :func:`balanced_num_programs`): about that many programs
    per SM, the number of this config's programs that are resident on one SM at once (one
    wave, no tail). Balanced schedule only: ``min_tokens``, the default plan gives each
    program at least this many tokens' pages (a batch with few pages runs on fewer
    programs, the others exit at once); ``pdl``, launch its stage 2 as a programmatic
    dependent launch where the device has it (CUDA, sm_90+).
    """

    block_n: int
    num_warps: int
    num_stages: int
    programs_per_sm: int = 2
    min_tokens: int = 256
    pdl: bool = True
    subtiles: int = 1
    clamp_tail: bool = False

    def __post_init__(self) -> None:
        if self.block_n < 16 or self.block_n & (self.block_n - 1):
            raise ValueError(f"block_n: expected a power of two >= 16, got {self.block_n}")
        if self.subtiles < 1 or self.subtiles & (self.subtiles - 1) or self.block_n // self.subtiles < 16:
            raise ValueError(f"subtiles: expected a power of two leaving >= 16 keys per sub-tile, got {self.subtiles}")
        if (self.num_warps not in (1, 2, 4, 8, 16) or self.num_stages < 1 or self.programs_per_sm < 1
                or self.min_tokens < 1 or (self.clamp_tail and self.subtiles > 1)):
            raise ValueError(f"invalid DecodeConfig {self}")


# Variants the benchmarks compare; ``pick_decode_config`` chooses among them. The loop's
# K/V loads hang off an in-loop page-table load, and Triton 3.6's pipeliner then keeps
# floor((num_stages - 1) / 2) K/V tiles in flight (seen in the sm_90 TTGIR). sm_90a builds
# (bf16, D=128, group 4; ptxas -v): n128_w4_s5 235 registers, 137 KiB shared memory ->
# 1 program per SM, two 64 KiB K+V tiles in flight; n128_w4_s3 235 registers, 73 KiB ->
# 2 programs per SM (registers), one 64 KiB tile each; n64_w4_s5 144 registers, 70 KiB ->
# 3 programs per SM, two 32 KiB tiles each; n16_w2_s5 128 registers, 21 KiB -> 8 programs
# of 2 warps per SM, two 8 KiB tiles each; n16_w1_s5 198 registers, 20 KiB -> 10 programs
# of one warp (its split plan keeps 8). ``programs_per_sm`` is that residency.
DECODE_VARIANTS: dict[str, DecodeConfig] = {
    "n128_w4_s5": DecodeConfig(block_n=128, num_warps=4, num_stages=5, programs_per_sm=1),
    "n128_w4_s3": DecodeConfig(block_n=128, num_warps=4, num_stages=3, programs_per_sm=2),
    "n64_w4_s5": DecodeConfig(block_n=64, num_warps=4, num_stages=5, programs_per_sm=3),
    "n16_w2_s5": DecodeConfig(block_n=16, num_warps=2, num_stages=5, programs_per_sm=8),
    # Two 16-key sub-tiles per 32-key tile, a softmax state and a warp each (SUBTILES in
    # decode_kernel): the "shared_pages" schedule's tiles. programs_per_sm 4 sets its split
    # plan: (16, 65536, 1024) over shared pages was fastest at 4 splits (128 pairs).
    "n32_w2_s5_x2": DecodeConfig(block_n=32, num_warps=2, num_stages=5, programs_per_sm=4, subtiles=2),
    # One warp per 16-key tile: no row max, sum or probability crosses warps. The rule's
    # pick for many short rows (pick_decode_config).
    "n16_w1_s5": DecodeConfig(block_n=16, num_warps=1, num_stages=5, programs_per_sm=8),
    # The same one-warp tiles with the split plan of 4 programs per SM: the "shared_pages"
    # schedule's tiles at head_dim 256 (sm_90a: 255 registers, 228 bytes spilled, 40 KiB),
    # where (16, 65536, 1024) over shared pages was fastest at 4 splits (128 pairs).
    "n16_w1_s5_p4": DecodeConfig(block_n=16, num_warps=1, num_stages=5, programs_per_sm=4),
    # The same one-warp tiles with the partial last tile inside the key loop (its rows
    # clamped to the range's last key, only the scores masked) and 4 stages (16 KiB):
    # the "concurrent" schedule's tiles, a decode level of short rows beside a prefill
    # kernel on another stream.
    "n16_w1_s4_c": DecodeConfig(block_n=16, num_warps=1, num_stages=4, programs_per_sm=8, clamp_tail=True),
}

MAX_SPLITS = 256


def pick_decode_config(head_dim: int, dtype: torch.dtype, page_size: int, *, work: int | None = None,
                       num_sms: int = REFERENCE_SMS, group_size: int | None = None,
                       shared_pages: bool = False, concurrent: bool = False) -> DecodeConfig:
    """The stage-1 launch parameters :func:`batch_decode_paged` uses for these shapes.

    ``work``: ``batch * num_kv_heads``, the programs before any split (None: many). The
    split count then follows from the config's ``programs_per_sm``
    (:func:`decode_num_splits`). ``page_size`` does not change the choice today (pages of
    16 and 64 compile to the same shared-memory footprint); it is part of the key so that
    it can.

    For fp16/bf16 and head_dim <= 128 the rule aims at one wave of programs (no tail)
    with about 128 KiB of K/V loads in flight per SM, and as few splits as possible (each
    adds a merge). Measured on an H200 (benchmarks/NOTES.md): ``work <= SMs``: one
    n128_w4_s5 program per SM (the splits fill the SMs), unless a 2-per-SM n128_w4_s3 plan
    keeps >= 1.25x the loads in flight (e.g. work 72: 3 splits instead of 1);
    ``SMs < work <= 3 SMs``: n64_w4_s5, 3 per SM, 2 splits up to 1.5 SMs, then none;
    more: n128_w4_s3, no split (many waves of 2 per SM). (n16_w2_s5, 8 small programs
    per SM, is 4-13% faster alone on short requests (H100: 256x128 0.89 of copy against
    0.79) and equal at 4K, but as the cascade's suffix level beside the prefix it made
    (64, 8192, 256) slower, 49 -> 55 us, and flat decode over shared prefix pages 317 ->
    433 us: benchmarks/NOTES.md.) With ``group_size`` (query heads per kv head) given and at
    most 4, head_dim 65-128 and ``work >= 7.5 SMs``, n16_w2_s5 after all: its 8 programs
    per SM keep more loads in flight than a few large tiles when every SM has many
    programs, and a row of a few pages wastes none of a 16-key tile (H100, bf16, Hq 32 /
    Hkv 8: cascades at (256, 4096, 160) 118 -> 88 us, (512, 1024, 64) 124 -> 86,
    (128, 4096, 160) 67 -> 54; (128, 32768, 512) 200 -> 204; below that work,
    (64, 8192, 256), it lost: 51 -> 59). Other group sizes and head dims keep the rule
    above until measured. Those shapes now take n16_w1_s5, the same tiles on one warp
    each, whose softmax never crosses warps (H200, 2026-11-28: the cascade's decode level
    alone 42.4 / 68.7 / 40.8 us against 44.5 / 70.4 / 42.2 at (256, 4096, 144 / 256) and
    (512, 1024, 64), the cascade 82.2 / 84.9 / 69.5 against 81.2 / 102 / 71.3; plain
    decode of 128 x 8K and 256 x 4K 962 / 966 against 973 / 977), and so do 2 to 7.5 SMs
    of work, where the one-warp tiles were 6-28% ahead of the n64/n128 tiles over rows of
    256-1031 keys and within 3.1% over rows of 4-8K (H200, 2026-11-28, decode level alone /
    cascade, µs: (48, 8192, 263) 19.0 / 42.4 against 21.5 / 47.0, (96, 4096, 263) 30.6 /
    47.2 against 42.4 / 60.8, (64, 1024, 1031) 67.0 / 74.2 against 75.3 / 92.3, (64, 1024,
    8199) 487 / 512 against 490 / 502).

    ``concurrent`` (the ``"concurrent"`` schedule: a decode level of short rows beside a
    prefill kernel on another stream, :func:`decode_schedule_beside_prefill`): from 7.5
    SMs of work, where the plain rule takes n16_w1_s5, n16_w1_s4_c instead: 4 stages
    and the partial last tile inside the pipelined loop. Beside the prefill level the
    cascade then took 86.6 / 84.4 / 80.6 / 75.2 / 50.1 µs against 91.7 / 85.8 / 81.0 /
    79.8 / 51.4 at (256, 4096, 263 / 256 / 144), (512, 1024, 71) and (128, 4096, 263)
    (H200, 2026-11-28); below 7.5 SMs its shallower pipeline lost alone.

    ``shared_pages`` (the ``"shared_pages"`` schedule: the requests' page lists share most
    of their pages): n32_w2_s5_x2, two 16-key sub-tiles per tile with a warp and a softmax
    state each, where measured faster: fp16/bf16, head_dim 65-128, query groups of at most
    4 and ``work >= 3/4 SMs``. Flat decode over shared prefix pages is then bound by the
    kernel's work per key, not by memory, and the default tiles spend much of it on
    exchanging row maxima, sums and probabilities between warps (H200, bf16, Hq 32 / Hkv
    8: (64, 8192, 256) 332 -> 235 us, (128, 32768, 512) 2633 -> 1860, (256, 4096, 128)
    674 -> 481, (16, 65536, 1024) 771 -> 469; FlashInfer's flat decode 242 / 1802 / 484 /
    458; at 128 pairs with 4 splits). At 32-64 pairs the default's splits do as well ((4,
    16384, 16384): 103 us, the sub-tiled tiles at their best split count 104; (8, 128,
    2048): 24.8 against 25.6). Reading from HBM
    the sub-tiled tiles lose (a cascade's suffix level at (256, 4096, 144): 69 against 44
    us), so plain decode keeps the rule above. At head_dim 256 (same conditions otherwise)
    ``shared_pages`` takes n16_w1_s5_p4, 16-key tiles on one warp each: the plain tiles
    (then 8 warps over 32 keys) exchange every tile's softmax between warps, and sub-tiles of 256
    dims spill (H100, bf16, Hq 32 / Hkv 8: (64, 8192, 256) 1408 -> 531 us, (256, 4096, 128)
    2834 -> 1154, (16, 65536, 1024) 2702 -> 1034 at 4 splits, (128, 32768, 512) 10983 ->
    4375; 2.0-2.2x the head_dim 128 times, as the bytes are). Plain decode at head_dim
    256 (fp16/bf16) takes 32-key tiles on 4 warps, 2 programs per SM (H100, bf16, Hq 32 /
    Hkv 8, flat decode at its default splits, µs: (4, 16384, 16384) 348 -> 237, (8, 128,
    2048) 60.7 -> 54.4, (16, 16, 8192) 372 -> 361, (64, 16, 4096) 744 -> 715, (256, 16,
    1024) 803 -> 720; FlashInfer's flat decode 240 / 58.1 / 365 / 717 / 726; the 8-warp
    tiles it replaces fit one program per SM).
    """
    block_d = max(16, next_power_of_2(head_dim))
    if (shared_pages and dtype != torch.float32 and block_d in (128, 256) and group_size is not None
            and group_size <= 4 and work is not None and 4 * work >= 3 * num_sms):
        return DECODE_VARIANTS["n32_w2_s5_x2" if block_d == 128 else "n16_w1_s5_p4"]
    if dtype == torch.float32:
        # fp32 "ieee" products run on FMA units and need many registers: 8 warps and 16-key
        # tiles keep head_dim 128 free of spills (175 registers).
        return DecodeConfig(block_n=16, num_warps=8, num_stages=5)
    if block_d >= 256:
        # Twice the bytes per key: half the keys per tile, on 4 warps (sm_90a: 202 registers,
        # 229 with the in-kernel split merge, no spill, 73 KiB), so 2 programs fit an SM with
        # two 32 KiB K+V tiles in flight each. On 8 warps (167 registers x 256 threads) only
        # one fit, half the split plan's residency: 0.64 of the copy bandwidth at 4 x 32K.
        return DecodeConfig(block_n=32, num_warps=4, num_stages=5)
    one, two, three = DECODE_VARIANTS["n128_w4_s5"], DECODE_VARIANTS["n128_w4_s3"], DECODE_VARIANTS["n64_w4_s5"]
    if work is not None and group_size is not None and group_size <= 4 and block_d == 128 and work >= 2 * num_sms:
        if concurrent and 2 * work >= 15 * num_sms:
            return DECODE_VARIANTS["n16_w1_s4_c"]
        return DECODE_VARIANTS["n16_w1_s5"]
    if work is None or work > 3 * num_sms:
        return two
    if work > num_sms:
        return three
    # in flight: one -> 128 KiB x work x splits(1 per SM); two -> 64 KiB x work x splits(2 per SM)
    splits_one, splits_two = num_sms // max(1, work), 2 * num_sms // max(1, work)
    return two if 2 * splits_two >= 5 * splits_one else one


def decode_num_splits(batch: int, num_kv_heads: int, device: torch.device | str, *,
                      programs_per_sm: int | None = None) -> int:
    """How many KV splits per (request, kv head) :func:`batch_decode_paged` uses by default.

    A plan from shapes only (no look at sequence lengths, so it is CUDA-graph safe): about
    ``programs_per_sm`` programs on every multiprocessor, i.e.
    ``floor(num_sms * programs_per_sm / (batch * num_kv_heads))`` clamped to ``[1, 256]``,
    and no split once ``batch * num_kv_heads`` exceeds 1.5x the SM count.
    ``programs_per_sm=None`` takes it from the config :func:`pick_decode_config` picks for
    fp16/bf16 with head_dim <= 128 (the plan those inputs get; fp32 and larger head dims
    use 2). The multiprocessor count is read once per device (132 for CPU tensors).
    """
    if batch < 0 or num_kv_heads < 1:
        raise ValueError(f"batch, num_kv_heads: expected >= 0 and >= 1, got {batch}, {num_kv_heads}")
    dev = torch.device(device)
    work = max(1, batch * num_kv_heads)
    num_sms = planning_sms(dev)
    if 2 * work > 3 * num_sms:
        # Past 1.5 pairs per SM a split only adds a merge (what the configs' residencies
        # gave already; n16_w2_s5, 8 per SM, lost 1-12% at 2 splits on 64x4K and 64x256).
        return 1
    if programs_per_sm is None:
        programs_per_sm = pick_decode_config(128, torch.bfloat16, 16, work=work, num_sms=num_sms).programs_per_sm
    return max(1, min(MAX_SPLITS, num_sms * programs_per_sm // work))


# The "all_heads" schedule's programs (kernels/decode_heads.py): at most ALL_HEADS_ACC
# accumulator floats and ALL_HEADS_TILE_BYTES of K a step. At Hkv 8, group 4, head_dim 128,
# bf16 that is every kv head in one program of 8 warps, 16-key tiles, 3 stages (a K/V ring
# one tile deep), registers held to 128 (127 used, no spills on sm_90a), so two programs
# share an SM: the H200 probe's best (benchmarks/NOTES.md, "Cascade" v16).
ALL_HEADS_ACC = 4096
ALL_HEADS_TILE_BYTES = 32768


@dataclass(frozen=True)
class AllHeadsConfig:
    """Launch parameters of the "all_heads" decode kernel: kv heads per program, keys per
    tile, warps, pipeline stages and the register cap (None: the compiler's choice)."""

    heads: int
    block_n: int
    num_warps: int
    num_stages: int
    maxnreg: int | None


def all_heads_config(num_kv_heads: int, group: int, head_dim: int, dtype: torch.dtype) -> AllHeadsConfig:
    """The "all_heads" programs for these shapes: as many kv heads (a power of two) as fit
    :data:`ALL_HEADS_ACC` accumulator floats and :data:`ALL_HEADS_TILE_BYTES` of 16 keys,
    one warp per head up to 8; 8-warp programs capped at 128 registers (two an SM)."""
    block_g = next_power_of_2(group)
    block_d = max(16, next_power_of_2(head_dim))
    heads = min(next_power_of_2(num_kv_heads), max(1, ALL_HEADS_ACC // (block_d * block_g)),
                max(1, ALL_HEADS_TILE_BYTES // (16 * block_d * dtype.itemsize)))
    warps = min(8, heads)
    return AllHeadsConfig(heads, 16, warps, 3, 128 if warps == 8 else None)


# (num_kv_heads, group, head_dim) of the one "all_heads" shape measured beside a prefill
# level (all_heads_beside): Llama-3-8B's, all 8 kv heads in one program.
ALL_HEADS_MEASURED = (8, 4, 128)


def all_heads_num_splits(batch: int, num_kv_heads: int, group: int, head_dim: int, dtype: torch.dtype,
                         device: torch.device | str) -> int:
    """KV splits per (request, head block) of the "all_heads" schedule: none once the
    programs cover every SM, else ``floor(num_sms / programs)`` (at most
    :data:`MAX_SPLITS`), about one program an SM. From shapes only (CUDA-graph safe)."""
    cfg = all_heads_config(num_kv_heads, group, head_dim, dtype)
    programs = max(1, batch * -(-num_kv_heads // cfg.heads))
    return max(1, min(MAX_SPLITS, planning_sms(torch.device(device)) // programs))


def whole_sm_decode_programs(batch: int, num_qo_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                             page_size: int, device: torch.device | str) -> int:
    """The programs of :func:`batch_decode_paged`'s per-request plan for these shapes when
    they are one wave of one program per SM, else 0.

    Such a plan (few requests: :func:`pick_decode_config`'s 128-key, 5-stage tiles, 137
    KiB of shared memory on sm_90a) cuts every (request, kv head) pair into as many splits
    as fill the SMs once, so each program runs for the whole level. Beside another
    stream's kernel a program that finds no free SM waits for one of that kernel's
    programs to end before it starts: the level then ends that much later
    (``MultiLevelCascadeAttention`` gives its prefill level the whole grid then).
    """
    cfg, programs, num_sms = _per_request_plan(batch, num_kv_heads, head_dim, dtype, page_size, device,
                                               group_size=num_qo_heads // num_kv_heads)
    return programs if cfg.programs_per_sm == 1 and programs <= num_sms else 0


def _per_request_plan(batch: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, page_size: int,
                      device: torch.device | str, *, group_size: int | None = None) -> tuple[DecodeConfig, int, int]:
    """The per-request plan's config (:func:`pick_decode_config`), its programs (every
    (request, kv head) pair times :func:`decode_num_splits`) and the SMs it plans for."""
    dev = torch.device(device)
    num_sms = planning_sms(dev)
    work = max(1, batch * num_kv_heads)
    cfg = pick_decode_config(head_dim, dtype, page_size, work=work, num_sms=num_sms, group_size=group_size)
    return cfg, work * decode_num_splits(batch, num_kv_heads, dev, programs_per_sm=cfg.programs_per_sm), num_sms


# The balanced schedule's variants (sm_90a builds of its kernel, bf16, D=128, group 4:
# n128_w4_s5 168 registers, 137 KiB of shared memory -> 1 program per SM with two 64 KiB
# K+V tiles in flight; n128_w4_s3 168 registers, 73 KiB -> up to 3 per SM).
BALANCED_VARIANTS: dict[str, DecodeConfig] = {
    "n128_w4_s5": DecodeConfig(block_n=128, num_warps=4, num_stages=5, programs_per_sm=1),
    "n128_w4_s3x2": DecodeConfig(block_n=128, num_warps=4, num_stages=3, programs_per_sm=2),
    "n128_w4_s3x3": DecodeConfig(block_n=128, num_warps=4, num_stages=3, programs_per_sm=3),
}


def pick_balanced_config(head_dim: int, dtype: torch.dtype, *, num_kv_heads: int,
                         num_sms: int = REFERENCE_SMS) -> DecodeConfig:
    """The balanced schedule's launch parameters for these shapes.

    fp16/bf16, head_dim 65..128: n128_w4_s5, one program per SM with two 64 KiB K+V tiles
    in flight (~128 KiB per SM saturates HBM): 16 programs per kv head at 132 SMs and 8 kv
    heads. Fewer, longer programs cross fewer request boundaries, where a program's K/V
    pipeline drains and refills (H100, 16 shapes: best of six one-wave plans or within
    0.5% of it at 14). When ``floor(num_sms / num_kv_heads)`` programs per kv head leave
    more than a tenth of the SMs idle (e.g. 48 kv heads: 96 of 132), n128_w4_s3 at 2 or 3
    per SM, whichever fills the wave better (not timed).
    """
    block_d = max(16, next_power_of_2(head_dim))
    if dtype == torch.float32:
        # fp32 "ieee" products run on FMA units: 8 warps and 16-key tiles.
        return DecodeConfig(block_n=16, num_warps=8, num_stages=5)
    if block_d >= 256:
        # twice the bytes per key: half the keys per tile, 8 warps (2 per SM).
        return DecodeConfig(block_n=32, num_warps=8, num_stages=5)
    if block_d <= 64:
        # half the bytes per key: two programs per SM keep ~128 KiB of K/V in flight.
        return DecodeConfig(block_n=128, num_warps=4, num_stages=5, programs_per_sm=2)
    heads = max(1, num_kv_heads)
    if heads > num_sms or (num_sms // heads) * heads >= 0.9 * num_sms:
        return BALANCED_VARIANTS["n128_w4_s5"]

    def filled(per_sm: int) -> float:  # busy fraction of a wave of per_sm programs per SM
        return (per_sm * num_sms // heads) * heads / (per_sm * num_sms)

    return BALANCED_VARIANTS["n128_w4_s3x2" if filled(2) >= filled(3) else "n128_w4_s3x3"]


def balanced_num_programs(num_kv_heads: int, device: torch.device | str, *,
                          programs_per_sm: int | None = None) -> int:
    """Programs per kv head (``P``) of the balanced schedule's default plan: one wave,
    ``floor(num_sms * programs_per_sm / num_kv_heads)`` clamped to ``[1, 4096]``, from
    shapes only (CUDA-graph safe). ``programs_per_sm=None`` takes it from
    :func:`pick_balanced_config` for bf16, head_dim 128."""
    if num_kv_heads < 1:
        raise ValueError(f"num_kv_heads: expected >= 1, got {num_kv_heads}")
    num_sms = planning_sms(torch.device(device))
    if programs_per_sm is None:
        programs_per_sm = pick_balanced_config(128, torch.bfloat16, num_kv_heads=num_kv_heads,
                                               num_sms=num_sms).programs_per_sm
    return max(1, min(MAX_BALANCED_PROGRAMS, num_sms * programs_per_sm // num_kv_heads))


SCHEDULES = ("per_request", "balanced", "shared_pages", "concurrent", "all_heads")
# The "concurrent" schedule's tiles win beside a prefill level only over short rows: the
# longest row a cascade hands them (decode_schedule_beside_prefill).
CONCURRENT_MAX_KEYS = 512
# The per-request plan is kept while its busiest SM has at most 1/0.9 of the average work
# (H100, bf16 Hq 32 Hkv 8 D 128, fraction of copy, per-request vs balanced: 17x8K 0.83 vs
# 0.95 (fill 0.69), 40x4K 0.94 vs 0.96 (0.81), 100x4K 0.95 vs 0.99 (0.87); 64x4K 0.997 vs
# 0.986 (0.97), 256x4K 1.016 vs 1.003 (0.97), 16x4K 0.957 vs 0.939 (one wave)).
_MIN_WAVE_FILL = 0.9
# ... and while the requests' mean length is at least this fraction of the longest
# (1 x 64K + 63 x 1K: per-request 0.16 of copy, balanced 0.90).
_MIN_LENGTH_BALANCE = 0.8


def pick_decode_schedule(batch: int, num_kv_heads: int, device: torch.device | str, *, head_dim: int = 128,
                         dtype: torch.dtype = torch.bfloat16, seq_lens=None) -> str:
    """``"per_request"`` or ``"balanced"``: the schedule :func:`batch_decode_paged` uses.

    From shapes: the per-request plan (:func:`pick_decode_config`, :func:`decode_num_splits`)
    gives every program the same work, so with more programs than SMs the busiest SM gets
    ``ceil(programs / num_sms)`` of them against ``programs / num_sms`` on average; below
    0.9 of that, balanced. (At one program per SM or fewer no SM waits on another.)
    ``seq_lens`` (optional, host ints, a numpy array or a CPU tensor, ``[batch]`` tokens per request):
    when their mean is under 0.8 of the longest, the per-request plan waits on the long
    requests' programs: balanced. Reading lengths needs them on the host, so only callers
    that have them (a planner) pass them.
    """
    if batch < 0 or num_kv_heads < 1:
        raise ValueError(f"batch, num_kv_heads: expected >= 0 and >= 1, got {batch}, {num_kv_heads}")
    _, programs, num_sms = _per_request_plan(batch, num_kv_heads, head_dim, dtype, 16, device)
    if programs > num_sms:
        per_sm = programs / num_sms
        if per_sm / math.ceil(per_sm) < _MIN_WAVE_FILL:
            return "balanced"
    if seq_lens is not None:
        # numpy: a planner calls this on every re-plan, and a torch op costs several µs.
        lens = np.asarray(host_array(seq_lens), dtype=np.float64).reshape(-1)
        if lens.size != batch:
            raise ValueError(f"seq_lens: expected {batch} lengths, got {lens.size}")
        longest = float(lens.max()) if batch else 0.0
        if longest > 0 and float(lens.sum()) / batch < _MIN_LENGTH_BALANCE * longest:
            return "balanced"
    return "per_request"


def decode_schedule_beside_prefill(schedule: str, seq_lens, *, num_kv_heads: int | None = None,
                                   group: int | None = None, head_dim: int | None = None,
                                   dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> str:
    """The schedule of a decode level that runs beside a prefill kernel on another stream
    (``MultiLevelCascadeAttention``'s side stream), from the one it would run alone.

    Where the schedule is ``"per_request"`` and every row holds at most
    :data:`CONCURRENT_MAX_KEYS` keys: ``"all_heads"`` when the shapes are given
    (``num_kv_heads``, query ``group``, ``head_dim``, ``dtype``, ``device``) and
    :func:`all_heads_beside` takes them, else ``"concurrent"``; any other case keeps
    ``schedule``. ``seq_lens``: host ints (numpy array, list or CPU tensor), tokens per row.
    The concurrent tiles (:func:`pick_decode_config` with ``concurrent``) keep fewer loads
    in flight per program, which costs long rows (H200, bf16, Hq 32 / Hkv 8, cascades at
    (48, 1024, 8199) 391 -> 614 µs, at (128, 1024, 8199) 982 -> 1004) and helps short ones
    beside the prefill level (benchmarks/NOTES.md, "Decode").
    """
    if schedule != "per_request":
        return schedule
    lens = np.asarray(host_array(seq_lens)).reshape(-1)
    if not lens.size or int(lens.max()) > CONCURRENT_MAX_KEYS:
        return schedule
    if num_kv_heads is not None and all_heads_beside(lens.size, num_kv_heads, group, head_dim, dtype, device):
        return "all_heads"
    return "concurrent"


def all_heads_beside(batch: int, num_kv_heads: int, group: int, head_dim: int, dtype: torch.dtype,
                     device: torch.device | str) -> bool:
    """Whether a decode level of ``batch`` short rows beside a prefill level takes the
    "all_heads" schedule: where it was measured faster than the concurrent tiles, i.e. its
    programs are the measured one (every kv head of a Llama-3-8B layer: 8 heads, group 4,
    head_dim 128, 16-bit, 8 warps capped at 128 registers) and cover the SMs without a
    split (H200, cascades at (256, 4096, 128 / 144 / 256 / 384) and (128, 32768, 512):
    1.4-3.6% faster; at (64, 8192, 256), whose 64 requests need 2 splits, 5.5% slower;
    benchmarks/NOTES.md, "Cascade" v16)."""
    if (num_kv_heads, group, head_dim) != ALL_HEADS_MEASURED or dtype not in (torch.float16, torch.bfloat16):
        return False
    return all_heads_num_splits(batch, num_kv_heads, group, head_dim, dtype, device) == 1


# ---------------------------------------------------------------------------------- merge

# Tiles of the merge kernels, from the H200 sweep in benchmarks/tools/tune_merge.py
# (benchmarks/NOTES.md): (bytes of values one program holds per state, 16-byte vectors per
# thread and state). Two states: 2 vectors a thread was best at every tile size (1 or 4:
# 10-15% slower). Many states: small programs (bf16 D=128: 2 heads, one warp, one vector a
# thread and state) with 8 states per 3-D tile; larger 3-D tiles cost registers fast and
# the multi-warp ones ran up to 5x slower.
MERGE_TWO_TILE = (4096, 2)  # the two-state kernel
MERGE_MANY_TILE = (512, 1)  # the many-state kernel
MERGE_MAX_UNROLL = 8  # states per value tile (and LSE tile) in the many-state kernel
MERGE_MAX_UNROLL_FEW = 32  # the same when programs are too few to fill the GPU (latency-bound)


def merge_min_programs(device: torch.device) -> int:
    """Programs that keep every SM busy: 4 per SM of :func:`planning_sms`."""
    return 4 * planning_sms(device)


def merge_tile_config(n: int, num_heads: int, head_dim: int, elem_size: int, device: torch.device,
                      tile: tuple[int, int] = MERGE_MANY_TILE) -> tuple[int, int, int]:
    """``(BLOCK_H, BLOCK_D, num_warps)`` of a merge of ``n`` rows of ``[num_heads, head_dim]``
    values of ``elem_size`` bytes: about ``tile[0]`` bytes of values per program and state,
    ``tile[1]`` 16-byte vectors per thread and state along head_dim, fewer heads per program
    when rows are few (so that every SM gets programs). From shapes only."""
    min_programs = merge_min_programs(device)
    return _merge_tile_config(min(n, min_programs), num_heads, head_dim, elem_size, min_programs, *tile)


@functools.cache
def _merge_tile_config(n: int, num_heads: int, head_dim: int, elem_size: int, min_programs: int,
                       tile_bytes: int, vecs_per_thread: int) -> tuple[int, int, int]:
    tile = tile_bytes // elem_size
    block_d = min(next_power_of_2(head_dim), tile)
    block_h = max(1, min(tile // block_d, next_power_of_2(num_heads)))
    while block_h > 1 and n * -(-num_heads // block_h) < min_programs:
        block_h //= 2
    vec = 16 // elem_size
    num_warps = max(1, min(16, block_h * block_d // (vecs_per_thread * vec * 32)))
    return block_h, block_d, num_warps


def merge_unroll(states_per_row: int, few_programs: bool) -> int:
    """States per value tile of the many-state merge for a typical number of states per
    row: more when the grid is too small to fill the GPU (each tile is one round trip to
    memory)."""
    return min(MERGE_MAX_UNROLL_FEW if few_programs else MERGE_MAX_UNROLL, next_power_of_2(max(1, states_per_row)))


# ------------------------------------------------------------------ split-KV merge in a kernel

# The last split of a decode row merges the splits' float32 states inside the kernel
# (cascadeinfer.kernels.split_merge) in eager calls, when they are few bytes: it reads
# them in tiles of [splits, rows, head_dim] of at most SPLIT_MERGE_TILE elements (32 KiB,
# 64 registers a thread at 4 warps), one round trip to L2 per tile. That saves the merge
# kernel's launch on the host (4-8 µs of an eager call) but costs the GPU about 2 µs more
# than the merge kernel does inside a CUDA graph (benchmarks/tools/tune_split_merge.py,
# NOTES.md "Host cost"), so calls being captured keep the merge kernel. Past
# IN_KERNEL_MERGE_BYTES the splits go to merge_states' kernel, which spreads the merge
# over the whole GPU.
SPLIT_MERGE_TILE = 8192
IN_KERNEL_MERGE_BYTES = 4 * 4 * SPLIT_MERGE_TILE


def merge_in_kernel(num_splits: int, rows: int, head_dim: int, *, capturing: bool = False) -> bool:
    """Whether a program's last split merges the ``num_splits`` float32 states of its
    ``rows`` rows of ``head_dim`` values itself (else a merge kernel follows): in eager
    calls (not ``capturing`` a CUDA graph) whose states are few bytes."""
    return not capturing and num_splits * rows * head_dim * 4 <= IN_KERNEL_MERGE_BYTES


def split_merge_block(rows: int, block_d: int) -> int:
    """Splits per tile of the in-kernel merge: a power of two, at least 1, with the
    ``[splits, rows, block_d]`` tile within :data:`SPLIT_MERGE_TILE` elements where it can be."""
    block = 1
    while block * 2 * rows * block_d <= SPLIT_MERGE_TILE:
        block *= 2
    return block


# ---------------------------------------------------------------------------------- rope


def rope_splits(tokens: int, num_kv_heads: int, device: torch.device) -> int:
    """Head shares per token of :func:`cascadeinfer.kernels.fused.apply_rope`: enough
    programs to give every multiprocessor four (a decode batch has few tokens), in powers
    of two up to one share per kv head."""
    target = 4 * planning_sms(device)
    splits = 1
    while splits * 2 <= num_kv_heads and tokens * splits < target:
        splits *= 2
    return splits
