"""A roofline cost model that decides between cascade and flat paged decode.

Cascade reads the shared prefix once and runs it on tensor cores, but pays one launch
per level plus a merge; flat decode reads every request's full page list (the prefix
once per request, partly from L2 when it is short) in a single launch. Neither always
wins: a short prefix or a small batch favours flat decode. The model predicts both
times from bytes moved and FLOPs, with ceilings calibrated on the H100 (see
benchmarks/NOTES.md), and the planner takes the smaller.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class DeviceModel:
    """Measured ceilings of a device, and the fractions our kernels reach of them."""

    copy_bandwidth: float = 3.0e12  # bytes/s, kernel copy on an H100 SXM (read + write)
    matmul_rate: float = 7.0e14  # FLOP/s, bf16 dense
    decode_efficiency: float = 0.85  # fraction of copy bandwidth the decode kernel reaches
    prefix_efficiency: float = 0.45  # fraction of matmul rate the prefix kernel reaches
    l2_bytes: int = 50 * 2**20
    launch_seconds: float = 4e-6  # one extra kernel in a CUDA graph, tail + ramp

    @staticmethod
    def for_device(device: torch.device | None) -> "DeviceModel":
        if device is None or device.type != "cuda":
            return DeviceModel()
        props = torch.cuda.get_device_properties(device)
        name = props.name
        if "H200" in name:
            return DeviceModel(copy_bandwidth=4.3e12, matmul_rate=7.8e14, l2_bytes=props.L2_cache_size)
        return DeviceModel(l2_bytes=getattr(props, "L2_cache_size", 50 * 2**20))


@dataclass(frozen=True, slots=True)
class LevelShape:
    """What one cascade level costs: its queries, and the keys each group reads."""

    num_queries: int  # query tokens in the level
    unique_keys: int  # sum over groups of each group's key count (read once per group)
    query_key_pairs: int  # sum over groups of queries × keys (the attention FLOPs / (4·Hq·D))


def predict_seconds(
    levels: list[LevelShape],
    *,
    num_qo_heads: int,
    num_kv_heads: int,
    head_dim: int,
    elem_bytes: int,
    model: DeviceModel,
) -> tuple[float, float]:
    """Predicted seconds of (cascade, flat decode) for the same batch.

    Cascade: each level moves its unique K/V once and does its FLOPs on tensor cores;
    a level is the larger of the two times. Levels after the first add a launch and a
    merge pass over the fp32-sized state. Flat: the last level's queries each read the
    keys of every level above them; repeated prefix keys beyond L2 are read again.
    """
    kv_bytes_per_key = 2 * num_kv_heads * head_dim * elem_bytes
    state_bytes = levels[-1].num_queries * num_qo_heads * (head_dim * elem_bytes + 4)
    bw = model.copy_bandwidth * model.decode_efficiency
    rate = model.matmul_rate * model.prefix_efficiency

    cascade = 0.0
    for i, lv in enumerate(levels):
        mem = lv.unique_keys * kv_bytes_per_key / bw
        flops = 4.0 * lv.query_key_pairs * num_qo_heads * head_dim / rate
        cascade += max(mem, flops)
        if i:
            cascade += model.launch_seconds + 3 * state_bytes / bw

    # Flat: every query reads all its keys. The prefix levels' keys are shared by many
    # queries; as long as a level fits in L2 the repeats mostly hit it.
    flat_bytes = levels[-1].unique_keys * kv_bytes_per_key
    for lv in levels[:-1]:
        unique = lv.unique_keys * kv_bytes_per_key
        repeated = lv.query_key_pairs * kv_bytes_per_key - unique
        miss = 0.1 if unique <= model.l2_bytes // 2 else 1.0
        flat_bytes += unique + miss * max(0.0, repeated)
    flat_flops = 4.0 * sum(lv.query_key_pairs for lv in levels) * num_qo_heads * head_dim
    # Decode's GQA-packed dot pads the head group to 16 rows: its FLOP rate is lower.
    group = num_qo_heads // num_kv_heads
    flat = max(flat_bytes / bw, flat_flops * max(1.0, 16 / group) / rate)
    return cascade, flat
