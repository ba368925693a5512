"""A roofline cost model that decides between cascade and flat paged attention.

Cascade reads the shared prefix once and runs it on tensor cores, but pays one launch
per level plus a merge; flat decode reads every request's full page list (the prefix
once per request, partly from L2 when it is short) in a single launch. Neither always
wins: a short prefix or a small batch favours flat decode. The model predicts both
times from bytes moved and FLOPs, plus a fixed cost per level. v3 constants: grid search
(benchmarks/tools/fit_planner.py) on 196 shapes measured on an H100 (176 grid + 20 bar/generality)
and the 72 H200 shapes of v2; it picks the faster path, or one within 5% of it, on all 268
(v2: 194/196 and 71/72). The side-stream gain counts where the runtime takes the side
stream (with ``overlap_gain`` 0.3: 196/196 on the H100 shapes re-measured with the prefix
kernel's 64-row tiles on the side stream too). benchmarks/NOTES.md, "Planner v3".
v4 (flat decode over shared pages): flat decode's programs read a shared prefix at about
the same time, so its repeated reads hit L2 even where the prefix is larger than L2, and
the time is bound by how fast the decode kernel reads what hits (``l2_read_bandwidth``).
On 45 more H100 shapes with 1-16 requests over 8K-64K prefixes, where the two paths
cross, the v3 flat model erred up to 2.4x and picked within 5% at 38; v4 picks within 5%
at 42 (238 of the 241 H100 shapes). benchmarks/NOTES.md, "Planner v4".
v5 (the side stream beside 16- and 32-row prefill tiles too, "Cascade" v12): their gain,
``overlap_gain_narrow``, set for the H200 on 97 shapes measured there after that change (91
picked within 5%, against 83 without it); elsewhere 0 until measured (the H100 shapes above
ran those tiles on one stream). benchmarks/NOTES.md, "Planner v5".
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from cascadeinfer.kernels import groups_tile_config
from cascadeinfer.kernels.policy import TileConfig


@dataclass(frozen=True, slots=True)
class DeviceModel:
    """Ceilings of a device, and what our kernels reach of them (v3: fitted on an H100 and an H200)."""

    copy_bandwidth: float = 3.0e12  # bytes/s, kernel copy on an H100 SXM (read + write)
    matmul_rate: float = 6.8e14  # FLOP/s, bf16 dense
    l2_bytes: int = 50 * 2**20
    decode_bandwidth_efficiency: float = 0.97  # of copy bandwidth (bench_decode: 0.95-1.05)
    prefix_flop_efficiency: float = 0.7  # of matmul rate (H100 grid, faster prefix kernel: ~0.73 at scale)
    decode_flop_efficiency: float = 0.25  # the GQA-packed decode dot, M padded to 16 rows
    prefix_level_seconds: float = 6e-6  # fixed cost of a prefill level (splits + their merge)
    decode_level_seconds: float = 14e-6  # fixed cost of a decode level (splits + their merge)
    merge_seconds: float = 4e-6  # fixed cost of merging two levels
    l2_miss_small: float = 0.4  # repeated reads of a level that fits in L2 that still miss
    l2_miss_large: float = 0.1  # the same for a level larger than L2 (flat's programs read it together)
    l2_read_bandwidth: float = 6.5e12  # bytes/s the decode kernel reads from L2 (flat decode over
    # shared pages on an H100: 6.7-6.8e12 at the four bar shapes, tools/probe_flat_shared)
    overlap_gain: float = 0.3  # of the shorter of a prefill level and the decode level under it,
    # saved by running them on two streams (measured 0.28-0.43 on an H100 at four shapes; the
    # v3 fit over 268 shapes chose 0.2; once 64-row prefill tiles took the side stream too,
    # the H100 grid and bar shapes re-measured pass 196/196 with 0.25-0.4 and 193/196 with
    # 0.2: benchmarks/NOTES.md "Planner v3")
    overlap_gain_narrow: float = 0.0  # the same beside 16- and 32-row prefill tiles (their
    # whole grid on the side stream since "Cascade" v12); measured on the H200 only (0.5 there,
    # H200_MODEL), so elsewhere the model keeps predicting those cascades as one stream

    @staticmethod
    def for_device(device: torch.device | None) -> "DeviceModel":
        if device is None or device.type != "cuda":
            return _DEFAULT_MODEL
        return _cuda_model(torch.cuda.current_device() if device.index is None else device.index)


# What an H200's model differs in: its ceilings, and the narrow tiles' side-stream gain,
# the smallest value that picks within 5% at the most of 97 H200 shapes measured with that
# side stream (91, as with 0.5-1.0; 0.4: 89, 0: 83; benchmarks/NOTES.md, "Planner v5").
H200_MODEL = dict(copy_bandwidth=4.25e12, matmul_rate=6.83e14, overlap_gain_narrow=0.5)


@functools.cache
def _cuda_model(index: int) -> DeviceModel:
    """The model of CUDA device ``index`` (read once: a planner asks on every re-plan)."""
    props = torch.cuda.get_device_properties(index)
    l2 = getattr(props, "L2_cache_size", 50 * 2**20)
    if "H200" in props.name:
        return DeviceModel(**H200_MODEL, l2_bytes=l2)
    return DeviceModel(l2_bytes=l2)


_DEFAULT_MODEL = DeviceModel()


@dataclass(frozen=True, slots=True)
class LevelShape:
    """What one cascade level costs: its queries, and the keys each group reads."""

    num_queries: int  # query tokens in the level
    decode: bool  # one query per group: the decode kernel runs it
    unique_keys: int  # sum over groups with queries of each group's key count
    query_key_pairs: int  # sum over groups of queries × keys (FLOPs / (4·Hq·D))
    flat_key_reads: int  # keys of this level that flat attention reads (once per last-level group)
    num_groups: int = 1  # groups of the level (sets the prefill tile height; 1 where unknown)


def overlaps(levels: list[LevelShape]) -> bool:
    """Whether the last level (decode) runs on a second stream beside the prefill level
    above it, as the runtime does wherever this holds. With 64- and 128-row prefill tiles
    (compute-bound, one or two programs per SM) the prefill level's grid is sized to leave
    the decode level its share of the SMs (:func:`prefix_sm_fraction`); with 16- and
    32-row tiles (groups of a few rows, bandwidth-bound like the decode) it keeps its
    whole grid (:func:`~cascadeinfer.cascade.plan.prefix_splits_beside_decode`).
    Measured against one stream: 64-row tiles 152 -> 141 us at (64, 8192, 256) Hkv 32, 129
    -> 122 at (16, 65536, 1024) (H100); 16- and 32-row tiles 0.73-0.94 of the one-stream
    time at every such shape of two H200 grids (2-8 requests over 8K-64K prefixes, 16 at Hkv
    32; e.g. 42.6 -> 33.9 us at (4, 8192, 4096)); benchmarks/NOTES.md, "Cascade" v12."""
    return len(levels) > 1 and levels[-1].decode and not levels[-2].decode


def is_narrow_tile(config: TileConfig) -> bool:
    """Whether a prefill level's tiles (:func:`groups_tile_config` on its average packed
    rows per group) are 16 or 32 rows: groups of a few rows, bandwidth-bound like the
    decode level. The one test of it, for the cost model (:func:`narrow_prefill_tiles`)
    and the runtime's split rule (:func:`~cascadeinfer.cascade.plan.prefix_splits_beside_decode`)
    alike."""
    return config.block_m < 64


def narrow_prefill_tiles(levels: list[LevelShape], *, group_size: int, head_dim: int, elem_bytes: int) -> bool:
    """Whether the prefill level above the last level runs 16- or 32-row tiles
    (:func:`is_narrow_tile`; fp16 and bf16 pick the same tiles). Beside such a level the
    decode level saves ``overlap_gain_narrow`` of the shorter of the two on the side
    stream, beside 64- and 128-row tiles ``overlap_gain``."""
    if len(levels) < 2:
        return False
    pre = levels[-2]
    dtype = torch.float32 if elem_bytes == 4 else torch.bfloat16
    return is_narrow_tile(groups_tile_config(pre.num_queries, pre.num_groups, group_size, head_dim, dtype))


def prefix_sm_fraction(t_prefix: float, t_decode: float) -> float:
    """The share of SMs the prefill level should take when the decode level runs beside it.

    Proportional to the two times, with the decode's counted half: decode programs pack
    2-3 to an SM and draw more bandwidth per SM when fewer SMs compete for it. Measured on
    an H100 at the four bar shapes, this picks the best or within 2% of the best split.
    """
    return t_prefix / (t_prefix + 0.5 * t_decode) if t_prefix > 0 else 1.0


def predict_seconds(
    levels: list[LevelShape],
    *,
    num_qo_heads: int,
    num_kv_heads: int,
    head_dim: int,
    elem_bytes: int,
    model: DeviceModel,
    per_level: list[float] | None = None,
) -> tuple[float, float]:
    """Predicted seconds of (cascade, flat) for the same batch.

    A level takes the larger of its memory time (unique K/V once) and its compute time
    (tensor-core prefill, or the decode kernel's padded dot), plus a fixed cost; levels
    after the first add a merge; a decode level that runs beside the prefill level above
    it (:func:`overlaps`) saves ``overlap_gain`` of the shorter of the two
    (``overlap_gain_narrow`` beside 16- and 32-row prefill tiles,
    :func:`narrow_prefill_tiles`). Flat runs the last level's kernel over every key of
    every level: keys of an upper level are re-read once per request, mostly from L2
    (``l2_miss_small`` of them still miss where the level fits there, ``l2_miss_large``
    where it does not), and every key read takes at least its bytes over
    ``l2_read_bandwidth``.
    ``per_level``, if given, receives each cascade level's predicted seconds.
    """
    kv_bytes_per_key = 2 * num_kv_heads * head_dim * elem_bytes
    bw = model.copy_bandwidth * model.decode_bandwidth_efficiency
    flop = 4.0 * num_qo_heads * head_dim
    pad = max(1.0, 16 / (num_qo_heads // num_kv_heads))  # decode's dot pads the head group to 16 rows
    decode_rate = model.matmul_rate * model.decode_flop_efficiency / pad
    prefix_rate = model.matmul_rate * model.prefix_flop_efficiency

    def level_time(lv: LevelShape, key_bytes: float, pairs: int, read_seconds: float = 0.0) -> float:
        rate, fixed = (decode_rate, model.decode_level_seconds) if lv.decode else (
            prefix_rate, model.prefix_level_seconds)
        return max(key_bytes / bw, flop * pairs / rate, read_seconds) + fixed

    state_bytes = levels[-1].num_queries * num_qo_heads * (head_dim * elem_bytes + 4)
    times = [level_time(lv, lv.unique_keys * kv_bytes_per_key, lv.query_key_pairs) for lv in levels]
    if per_level is not None:
        per_level[:] = times
    cascade = sum(times) + (len(levels) - 1) * (model.merge_seconds + 3 * state_bytes / bw)
    if overlaps(levels):
        narrow = narrow_prefill_tiles(levels, group_size=num_qo_heads // num_kv_heads, head_dim=head_dim,
                                      elem_bytes=elem_bytes)
        cascade -= (model.overlap_gain_narrow if narrow else model.overlap_gain) * min(times[-2], times[-1])

    flat_bytes = 0.0  # from memory
    flat_reads = 0.0  # by the kernel, from L2 or memory
    for lv in levels:
        unique = lv.unique_keys * kv_bytes_per_key
        reads = lv.flat_key_reads * kv_bytes_per_key
        miss = model.l2_miss_large if unique > model.l2_bytes else model.l2_miss_small
        flat_bytes += unique + miss * max(0.0, reads - unique)
        flat_reads += max(reads, unique)
    flat = level_time(levels[-1], flat_bytes, sum(lv.query_key_pairs for lv in levels),
                      flat_reads / model.l2_read_bandwidth)
    return cascade, flat
