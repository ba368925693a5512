"""The planner's cost model (cascadeinfer/cascade/cost.py) against the shapes measured on an
H100 (benchmarks/results): the path it picks is within 5% of the faster one everywhere but
at three known near ties, and its flat predictions follow flat decode over shared pages,
whose re-reads come from L2 whatever the prefix's size (benchmarks/NOTES.md, "Planner v4").
Those H100 runs had the decode level on one stream beside 16- and 32-row prefill tiles, as
the H100's model still predicts it; the H200 runs after that side stream ("Cascade" v12)
are checked with the H200's model, which counts its gain ("Planner v5").

The shapes are rebuilt as the planner sees them (host page tables of a shared prefix and
one suffix per request), so these tests check the model the planner runs, on the CPU.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from cascadeinfer.cascade.cost import H200_MODEL, DeviceModel, predict_seconds
from cascadeinfer.cascade.plan import HostLevel, level_shapes

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
PAGE = 16
H100 = DeviceModel()  # what DeviceModel.for_device gives an H100
H200 = DeviceModel(**H200_MODEL)  # and an H200
# (batch, prefix, suffix, Hkv): measured within 10% of each other, their prefix within L2
KNOWN_MISSES = {(4, 8192, 4096, 8), (4, 8192, 16384, 8), (16, 8192, 16384, 8)}


def _level(qo_indptr: list[int], kv_lens: list[int]) -> HostLevel:
    pages = [-(-n // PAGE) for n in kv_lens]
    kv_indptr = [0]
    for p in pages:
        kv_indptr.append(kv_indptr[-1] + p)
    return HostLevel.from_lists(qo_indptr, kv_indptr, [0] * kv_indptr[-1],
                                [n - (p - 1) * PAGE for n, p in zip(kv_lens, pages)], PAGE)


def predict(batch: int, prefix: int, suffix: int, hq: int, hkv: int, d: int,
            model: DeviceModel = H100) -> tuple[float, float]:
    """Predicted (cascade, flat) µs of a shared-prefix batch decode, bf16."""
    levels = level_shapes([_level([0, batch], [prefix]), _level(list(range(batch + 1)), [suffix] * batch)], PAGE)
    cascade, flat = predict_seconds(levels, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, elem_bytes=2, model=model)
    return cascade * 1e6, flat * 1e6


def measured_rows() -> list[dict]:
    """Every H100 shape the planner is fitted on: (batch, prefix, suffix, hq, hkv, d,
    cascade µs, flat µs)."""
    check = json.loads((RESULTS / "planner_check_h100_2026-11-21.json").read_text())
    rows = [dict(batch=r["batch"], prefix=r["prefix"], suffix=r["suffix"], hq=r["hq"], hkv=r["hkv"], d=r["d"],
                 cascade=r["cascade"], flat=r["flat"]) for r in check["grid"] + check["bar"]]
    small = json.loads((RESULTS / "bench_cascade_grid_small_batch_h100_2026-11-28.json").read_text())
    rows += [dict(batch=r["batch"], prefix=r["prefix"], suffix=r["suffix"], hq=r["hq"], hkv=r["hkv"], d=r["head_dim"],
                  cascade=r["cascade_us"], flat=r["flat_us"]) for r in small["rows"]]
    return rows


def test_picks_within_5_percent_on_the_measured_h100_shapes():
    rows = measured_rows()
    assert len(rows) == 241
    misses = set()
    for r in rows:
        cascade, flat = predict(r["batch"], r["prefix"], r["suffix"], r["hq"], r["hkv"], r["d"])
        picked = r["cascade"] if cascade < flat else r["flat"]
        if picked > 1.05 * min(r["cascade"], r["flat"]):
            misses.add((r["batch"], r["prefix"], r["suffix"], r["hkv"]))
    assert misses <= KNOWN_MISSES, f"new misses: {sorted(misses - KNOWN_MISSES)}"


def misses_of(rows: list[dict], model: DeviceModel) -> set[tuple[int, int, int, int]]:
    """The rows where the path the model picks measured more than 5% slower than the other."""
    misses = set()
    for r in rows:
        cascade, flat = predict(r["batch"], r["prefix"], r["suffix"], r["hq"], r["hkv"], r["head_dim"], model)
        picked = r["cascade_us"] if cascade < flat else r["flat_us"]
        if picked > 1.05 * min(r["cascade_us"], r["flat_us"]):
            misses.add((r["batch"], r["prefix"], r["suffix"], r["hkv"]))
    return misses


def test_picks_within_5_percent_on_the_h200_shapes_with_the_narrow_side_stream():
    """97 H200 shapes measured with the decode level beside 16- and 32-row prefill tiles
    on the side stream: the model picks within 5% at 91, and with no gain for those tiles
    at 83. The misses left: short prefixes (128-1024 keys) under 16-64 requests, where flat
    is predicted faster and the cascade measured 12-23% faster, and one near tie at Hkv 1."""
    rows = [r for name in ("bench_cascade_grid_small_batch_side_stream_h200_2026-11-28.json",
                           "bench_cascade_grid_quick_side_stream_h200_2026-11-28.json")
            for r in json.loads((RESULTS / name).read_text())["rows"]]
    assert len(rows) == 97
    known = {(16, 128, 256, 8), (16, 1024, 256, 8), (64, 128, 256, 8), (16, 128, 16, 8), (16, 8192, 256, 1),
             (16, 128, 256, 32)}
    assert misses_of(rows, H200) <= known
    assert len(misses_of(rows, replace(H200, overlap_gain_narrow=0.0))) == 14


@pytest.mark.parametrize("batch,prefix,suffix", [(64, 8192, 256), (128, 32768, 512), (256, 4096, 128),
                                                 (16, 65536, 1024)])
def test_flat_prediction_follows_shared_pages_read_from_l2(batch, prefix, suffix):
    """At the bar shapes (the prefix 33-268 MB, L2 50 MB) flat decode re-reads the prefix
    once per request, from L2: the prediction is within 20% of the measured time, and at
    least the key reads over the kernel's L2 read rate."""
    measured = {r["batch"]: r["flat_us"] for r in
                json.loads((RESULTS / "bench_cascade_bar_h100_2026-11-27.json").read_text())["rows"]}[batch]
    _, flat = predict(batch, prefix, suffix, 32, 8, 128)
    assert abs(flat / measured - 1) < 0.2, (flat, measured)
    key_bytes = 2 * 8 * 128 * 2
    assert flat >= batch * (prefix + suffix) * key_bytes / H100.l2_read_bandwidth * 1e6


def test_small_batch_over_a_prefix_past_l2_falls_back_to_flat():
    """4 requests over a 16K-token prefix (64 MiB of K/V) with 16K own tokens each: flat
    decode measured 121.8 µs against the cascade's 129.7, and the model now says so."""
    cascade, flat = predict(4, 16384, 16384, 32, 8, 128)
    assert flat < cascade


def test_bench_cascade_heads_option():
    """bench_cascade --heads picks (Hkv, head_dim) pairs for --generality and names bad ones."""
    from benchmarks.bench_cascade import parse_heads  # noqa: PLC0415

    assert parse_heads(["8:64", "1:128"]) == ((8, 64), (1, 128))
    for bad in ("8", "8:", "0:128", "8:x", "-1:64"):
        with pytest.raises(SystemExit, match="--heads"):
            parse_heads([bad])
