"""Shared-prefix multi-query attention (batch_prefill_paged, one group) against the
matmul roofline and its peers.

Run from the repository root on a GPU machine:

    python -m benchmarks.bench_prefix             # full grid + tile sweep on a few shapes
    python -m benchmarks.bench_prefix --quick     # a few shapes, no sweep
    python -m benchmarks.bench_prefix --hopper-splits --shapes 256:4096,256:8192   # Hopper kernel x split counts

The cascade level above the last: ``n`` decode queries (one token each, all in ONE group)
attend to a shared prefix of ``L`` tokens. bf16, Hq=32, Hkv=8, D=128 (``--hkv``,
``--head-dim``), page 16, the prefix's pages randomly permuted in the pool. FLOPs =
4·n·L·Hq·D (QK^T and PV); bytes = the prefix's K and V plus q, o and lse. For each
shape: our time (CUDA-graph replay, median), TFLOP/s, the fraction of the measured bf16
matmul rate, and the roofline floor ``max(bytes / copy bandwidth, flops / matmul rate)``
with the fraction of it we reach.
Beside it: FlashInfer's BatchPrefillWithPagedKVCacheWrapper(backend="fa2") on the same
single-group page table, PyTorch SDPA (enable_gqa) on the prefix gathered into contiguous
[1, Hkv, L, D] K/V (the gather is not timed), and FlexAttention (compiled) on a few shapes.
"Ours" is the portable kernel (``backend="portable"``); on a GPU of compute capability 9.0
the ``hopper`` columns time the warp-specialised kernel (``backend="hopper"``) beside it
(where ``backend=None`` takes it: kernels/backend.py).
KV pools are rotated so the prefix is not served from L2 across calls. A sweep table
compares tile configs and split counts on a few shapes; ``--hopper-splits`` times the
Hopper kernel with each forced split count of ``HOPPER_SPLITS`` beside its default on the
timed shapes (does the portable kernel's split rule suit it?). JSON goes to --json PATH.
"""

from __future__ import annotations

import argparse
import gc
import math
import sys

import torch
import torch.nn.functional as F

from benchmarks._common import (
    bench_rotating,
    environment,
    load_flashinfer,
    markdown_table,
    measure_ceilings,
    roofline_floor,
    rotation_count,
    write_json,
)
from benchmarks.fixtures import (  # one shape, one pool layout
    DTYPE,
    HKV,
    HQ,
    PAGE,
    D,
    new_pool,
    page_table,
)
from cascadeinfer.kernels import policy
from cascadeinfer.kernels import prefill as P
from cascadeinfer.kernels.backend import hopper_unavailable
from cascadeinfer.kernels.prefill import batch_prefill_paged
from cascadeinfer.kernels.reference import attention_state_ref
from cascadeinfer.layouts.paged_cache import gather_paged_kv, unpack_paged_kv_cache


def _pool(num_pages: int, device, layout: str = "NHD") -> torch.Tensor:
    """A paged pool of this run's KV heads and head_dim (``--hkv``, ``--head-dim``)."""
    return new_pool(num_pages, device, layout, num_kv_heads=HKV, head_dim=D)


PREFIXES = (1024, 4096, 8192, 16384, 32768, 65536)
QUERIES = (64, 128, 256, 512)
QUICK_SHAPES = ((128, 8192), (256, 8192), (512, 32768), (128, 65536))
SWEEP_SHAPES = ((64, 16384), (128, 32768), (256, 8192), (512, 32768))
FLEX_SHAPES = ((128, 32768), (512, 8192))
SWEEP_CONFIGS = {  # the default first; benchmarks/tools/tune_prefix.py holds the wider search
    "128x128 w8 s3": policy.TileConfig(128, 128, 8, 3),
    "128x128 w8 s2": policy.TileConfig(128, 128, 8, 2),
    "128x64 w8 s3": policy.TileConfig(128, 64, 8, 3),
    "64x64 w4 s3": policy.TileConfig(64, 64, 4, 3),
}
SWEEP_SPLITS = (("", 1), (" x2", 2))  # the one-wave split count, and twice it
LN2 = math.log(2.0)
SM_SCALE = D ** -0.5


def kv_bytes(length: int) -> int:
    return length * HKV * D * 2 * DTYPE.itemsize


def io_bytes(n: int, length: int) -> int:
    """Bytes one call must move at least: the prefix's K and V, q in, o and lse out."""
    return kv_bytes(length) + 2 * n * HQ * D * DTYPE.itemsize + n * HQ * 4


def flops(n: int, length: int) -> int:
    return 4 * n * length * HQ * D


def fi_wrapper(fi, qo_indptr, indptr, indices, last, causal=False):
    workspace = torch.zeros(256 * 2**20, dtype=torch.uint8, device=indptr.device)
    w = fi.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend="fa2")
    w.plan(qo_indptr, indptr, indices, last, HQ, HKV, D, PAGE, causal=causal,
           q_data_type=DTYPE, kv_data_type=DTYPE)
    return w


# --------------------------------------------------------------------------- correctness


def check_correctness(fi) -> None:
    """Ours against the float64 reference on the GPU (single-group prefixes of ragged
    lengths, both layouts, default / forced split counts and every sweep config; a causal
    multi-group batch), then FlashInfer against ours. Raises on a mismatch."""
    dev = torch.device("cuda")
    for layout in ("NHD", "HND"):
        for n, length in ((1, 1), (64, 1000), (128, 4097), (300, 20011)):
            pages = -(-length // PAGE)
            pool = _pool(pages + 7, dev, layout)
            indptr, indices, last = page_table(1, [length], pages + 7, dev, seed=length)
            q = torch.randn(n, HQ, D, device=dev, dtype=DTYPE)
            qo = torch.tensor([0, n], dtype=torch.int32, device=dev)
            kv = unpack_paged_kv_cache(pool, layout)
            k, v = gather_paged_kv(kv, indptr, indices, last, 0)
            o_ref, s_ref = attention_state_ref(q, k, v)
            runs = {"default": lambda: batch_prefill_paged(q, qo, pool, indptr, indices, last, kv_layout=layout),
                    "shared_prefix_attention": lambda: P.shared_prefix_attention(q, k, v)}
            for splits in (1, 3):
                for name, cfg in SWEEP_CONFIGS.items():
                    runs[f"{name} splits={splits}"] = lambda cfg=cfg, splits=splits: run_config(
                        q, qo, pool, indptr, indices, last, cfg, splits, layout)
            for name, run in runs.items():
                o, s = run()
                torch.testing.assert_close(o.double(), o_ref, atol=2e-2, rtol=2e-2,
                                           msg=lambda m: f"{name} {layout} n={n} L={length}: {m}")
                torch.testing.assert_close(s.double(), s_ref, atol=2e-3, rtol=2e-3,
                                           msg=lambda m: f"{name} {layout} n={n} L={length} lse: {m}")
    # Causal prefill of several groups (empty ones included), NHD.
    lens_q, lens_kv = [7, 0, 300, 1, 64], [7, 100, 2000, 0, 40]
    num_pages = sum(-(-x // PAGE) for x in lens_kv) + 5
    pool = _pool(num_pages, dev)
    indptr, indices, last = page_table(len(lens_kv), lens_kv, num_pages, dev, seed=3)
    qo = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    q = torch.randn(sum(lens_q), HQ, D, device=dev, dtype=DTYPE)
    o, s = batch_prefill_paged(q, qo, pool, indptr, indices, last, causal=True)
    o_ref, s_ref = P.batch_prefill_paged_ref(q, qo, pool, indptr, indices, last, causal=True)
    seen = torch.isfinite(s_ref)
    assert torch.equal(torch.isfinite(s), seen) and (o[~seen] == 0).all()
    torch.testing.assert_close(o.double(), o_ref, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(s.double()[seen], s_ref[seen], atol=2e-3, rtol=2e-3)
    print("# correctness: ok (NHD/HND, split counts 1/3/default, sweep configs, causal multi-group)")
    if fi is not None:
        length, n = 20011, 128
        pool = _pool(-(-length // PAGE) + 3, dev)
        indptr, indices, last = page_table(1, [length], pool.shape[0], dev)
        q = torch.randn(n, HQ, D, device=dev, dtype=DTYPE)
        qo = torch.tensor([0, n], dtype=torch.int32, device=dev)
        o_fi, s_fi = fi_wrapper(fi, qo, indptr, indices, last).run(q, pool, return_lse=True)
        o, s = batch_prefill_paged(q, qo, pool, indptr, indices, last)
        torch.testing.assert_close(o_fi.float(), o.float(), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(s_fi.float() * LN2, s, atol=2e-3, rtol=2e-3)  # FlashInfer's LSE is base 2
        print("# FlashInfer agrees with ours (lse base 2 converted)")


def run_config(q, qo, pool, indptr, indices, last, cfg, splits, layout="NHD", out=None, lse=None):
    """batch_prefill_paged with a forced tile config and split count (None: the default)."""
    source = P.paged_source(unpack_paged_kv_cache(pool, layout), indptr, indices, last)
    if out is None:
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:2], device=q.device)
    return P.run_prefill(q, qo, source, out, lse, causal=False, sm_scale=SM_SCALE,
                  num_splits=splits, config=cfg)


# --------------------------------------------------------------------------- timing


def default_splits(n: int, length: int, dev, cfg: policy.TileConfig | None = None) -> int:
    """The split count batch_prefill_paged picks for one group of n queries (pool = the prefix)."""
    cfg = cfg or policy.default_tile_config(D, DTYPE, n * (HQ // HKV))
    tiles = policy.num_m_tiles(n, 1, HQ // HKV, cfg.block_m)
    return policy.default_num_splits(tiles, HKV, -(-length // PAGE) * PAGE, dev)


class Shape:
    """Rotated pools, queries and outputs for one (n, L)."""

    def __init__(self, n: int, length: int):
        dev = torch.device("cuda")
        self.n, self.length = n, length
        self.rot = rotation_count(kv_bytes(length))
        self.num_pages = -(-length // PAGE)
        self.indptr, self.indices, self.last = page_table(1, [length], self.num_pages, dev, seed=n + length)
        self.qo = torch.tensor([0, n], dtype=torch.int32, device=dev)
        self.pools = [_pool(self.num_pages, dev) for _ in range(self.rot)]
        self.qs = [torch.randn(n, HQ, D, device=dev, dtype=DTYPE) for _ in range(self.rot)]
        self.outs = [torch.empty_like(q) for q in self.qs]
        self.lses = [torch.empty(n, HQ, device=dev) for _ in range(self.rot)]

    def ours(self, i: int, backend: str | None = None):
        return lambda: batch_prefill_paged(self.qs[i], self.qo, self.pools[i], self.indptr, self.indices, self.last,
                                           out=self.outs[i], lse=self.lses[i], validate=False, backend=backend)

    def config(self, i: int, cfg, splits):
        return lambda: run_config(self.qs[i], self.qo, self.pools[i], self.indptr, self.indices, self.last, cfg,
                                  splits, out=self.outs[i], lse=self.lses[i])


def time_shape(n: int, length: int, copy_bw: float, mm_rate: float, fi, flex) -> dict:
    sh = Shape(n, length)
    fl, nbytes = flops(n, length), io_bytes(n, length)
    floor = roofline_floor(nbytes, fl, copy_bw, mm_rate)
    row = dict(n=n, L=length, rot=sh.rot, splits=default_splits(n, length, sh.qo.device), floor_us=floor * 1e6,
               ai=fl / nbytes)

    def record(prefix: str, seconds: float | None) -> None:
        row[f"{prefix}_us"] = None if seconds is None else seconds * 1e6
        row[f"{prefix}_TFLOPs"] = None if seconds is None else fl / seconds / 1e12
        row[f"{prefix}_mm"] = None if seconds is None else fl / seconds / mm_rate
        row[f"{prefix}_floor"] = None if seconds is None else floor / seconds

    record("ours", bench_rotating([sh.ours(i, "portable") for i in range(sh.rot)]))  # the portable kernel
    ref_o = sh.outs[0].float()
    if hopper_unavailable(ref_o.device) is None:  # the warp-specialised kernel beside it
        record("hopper", bench_rotating([sh.ours(i, "hopper") for i in range(sh.rot)]))
        torch.testing.assert_close(sh.outs[0].float(), ref_o, atol=2e-2, rtol=2e-2)
    else:
        record("hopper", None)

    if fi is not None:
        try:
            w = fi_wrapper(fi, sh.qo, sh.indptr, sh.indices, sh.last)
            fi_outs = [torch.empty_like(q) for q in sh.qs]
            t = bench_rotating([lambda i=i: w.run(sh.qs[i], sh.pools[i], out=fi_outs[i]) for i in range(sh.rot)])
            torch.testing.assert_close(fi_outs[0].float(), ref_o, atol=2e-2, rtol=2e-2)
            record("fi", t)
        except Exception as exc:
            print(f"# flashinfer failed at n {n} L {length}: {type(exc).__name__}: {exc}", file=sys.stderr)
            record("fi", None)
    else:
        record("fi", None)

    # Contiguous [1, H, L, D] copies of the prefix for SDPA / FlexAttention (not timed).
    contiguous = []
    for pool in sh.pools:
        kv = unpack_paged_kv_cache(pool, "NHD")
        k, v = gather_paged_kv(kv, sh.indptr, sh.indices, sh.last, 0)
        contiguous.append((k.transpose(0, 1).unsqueeze(0).contiguous(), v.transpose(0, 1).unsqueeze(0).contiguous()))
    del sh.pools
    q4 = [q.transpose(0, 1).unsqueeze(0).contiguous() for q in sh.qs]  # [1, Hq, n, D]

    def peer(name: str, fn) -> None:
        try:
            o = fn(0)()
            torch.testing.assert_close(o[0].transpose(0, 1).float(), ref_o, atol=2e-2, rtol=2e-2)
            record(name, bench_rotating([fn(i) for i in range(sh.rot)]))
        except Exception as exc:
            print(f"# {name} failed at n {n} L {length}: {type(exc).__name__}: {exc}", file=sys.stderr)
            record(name, None)

    peer("sdpa", lambda i: lambda: F.scaled_dot_product_attention(q4[i], *contiguous[i], enable_gqa=True))
    if flex is not None and (n, length) in FLEX_SHAPES:
        peer("flex", lambda i: lambda: flex(q4[i], *contiguous[i], enable_gqa=True))
    else:
        record("flex", None)
    if row.get("fi_us"):
        row["fi_over_ours"] = row["fi_us"] / row["ours_us"]
    return row


def sweep_shape(n: int, length: int, mm_rate: float) -> dict:
    """Tile configs × split counts (one wave, two waves) at one shape: fraction of matmul rate."""
    sh = Shape(n, length)
    base = default_splits(n, length, sh.qo.device)
    row = dict(n=n, L=length, splits=base)
    fl = flops(n, length)
    for name, cfg in SWEEP_CONFIGS.items():
        cfg_base = default_splits(n, length, sh.qo.device, cfg)
        for tag, mult in SWEEP_SPLITS:
            splits = mult * cfg_base
            key = f"{name}{tag}"
            try:
                t = bench_rotating([sh.config(i, cfg, splits) for i in range(sh.rot)])
                row[key] = fl / t / mm_rate
            except Exception as exc:
                print(f"# config {key} failed at n {n} L {length}: {type(exc).__name__}: {exc}", file=sys.stderr)
                row[key] = None
    return row


HOPPER_SPLITS = (1, 2, 3, 4, 6)


def hopper_splits_shape(n: int, length: int, mm_rate: float) -> dict:
    """The Hopper kernel at its default split count and at each of ``HOPPER_SPLITS``, with
    the portable kernel's default beside them: fractions of the bf16 matmul rate, every
    forced count's output checked against the portable kernel's."""
    sh = Shape(n, length)
    fl = flops(n, length)
    row = dict(n=n, L=length, splits=default_splits(n, length, sh.qo.device))
    row["portable"] = fl / bench_rotating([sh.ours(i, "portable") for i in range(sh.rot)]) / mm_rate
    ref_o = sh.outs[0].float().clone()
    for splits in (None, *HOPPER_SPLITS):
        def call(i: int, splits=splits):
            return lambda: batch_prefill_paged(sh.qs[i], sh.qo, sh.pools[i], sh.indptr, sh.indices, sh.last,
                                               out=sh.outs[i], lse=sh.lses[i], validate=False, backend="hopper",
                                               num_splits=splits)
        row[f"hopper_s{splits or 'default'}"] = fl / bench_rotating([call(i) for i in range(sh.rot)]) / mm_rate
        torch.testing.assert_close(sh.outs[0].float(), ref_o, atol=2e-2, rtol=2e-2)
    return row


def main() -> None:
    global HKV, D, SM_SCALE  # --hkv and --head-dim rebind the shape constants every function here reads
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a few shapes, no sweep, no flex")
    ap.add_argument("--no-sweep", action="store_true", help="skip the tile-config / split sweep")
    ap.add_argument("--no-flex", action="store_true", help="skip FlexAttention (compiles per shape)")
    ap.add_argument("--hopper-splits", action="store_true",
                    help="only the Hopper kernel at each forced split count, on the shapes (compute capability 9.0)")
    ap.add_argument("--hkv", type=int, default=HKV, help=f"KV heads (Hq {HQ}; default {HKV})")
    ap.add_argument("--head-dim", type=int, default=D, help=f"head_dim (default {D})")
    ap.add_argument("--shapes", metavar="N:L,...", help="these (queries, prefix) shapes instead of the grid")
    ap.add_argument("--json", metavar="PATH", help="write the results and the environment here as JSON")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_prefix needs a CUDA device")
    if HQ % args.hkv:
        sys.exit(f"--hkv {args.hkv}: must divide Hq {HQ}")
    if args.hopper_splits and (reason := hopper_unavailable(torch.device("cuda"))) is not None:
        sys.exit(f"--hopper-splits: {reason}")
    HKV, D = args.hkv, args.head_dim
    SM_SCALE = D ** -0.5

    env = environment()
    print(f"# {env}")
    fi = load_flashinfer()
    check_correctness(fi)
    copy_bw, mm_rate = measure_ceilings()
    flex = None
    if not (args.quick or args.no_flex):
        try:
            from torch.nn.attention.flex_attention import flex_attention  # noqa: PLC0415

            flex = torch.compile(flex_attention, dynamic=False)
        except Exception as exc:
            print(f"# flex_attention unavailable: {type(exc).__name__}: {exc}", file=sys.stderr)

    if args.shapes:
        shapes = [tuple(int(x) for x in item.split(":")) for item in args.shapes.split(",")]
    else:
        shapes = list(QUICK_SHAPES) if args.quick else [(n, L) for L in PREFIXES for n in QUERIES]
    if args.hopper_splits:
        rows = []
        for n, length in shapes:
            rows.append(hopper_splits_shape(n, length, mm_rate))
            gc.collect()
            torch.cuda.empty_cache()
        write_json(args.json, dict(env=env, copy_Bps=copy_bw, matmul_flops=mm_rate, rows=rows,
                                   shape=dict(hq=HQ, hkv=HKV, head_dim=D, page_size=PAGE, dtype=str(DTYPE))))
        print(f"\n## the Hopper kernel's split counts (fraction of the bf16 matmul rate {mm_rate / 1e12:.0f} TFLOP/s; "
              f"splits: the default count)\n")
        print(markdown_table(rows, list(rows[0])))
        return
    rows = []
    for n, length in shapes:
        row = time_shape(n, length, copy_bw, mm_rate, fi, flex)
        gc.collect()
        torch.cuda.empty_cache()
        rows.append(row)
        print(f"# n {n:4d} L {length:6d}: ours {row['ours_us']:8.1f} us {row['ours_TFLOPs']:6.1f} TFLOP/s "
              f"{row['ours_mm']:.3f} of matmul, {row['ours_floor']:.3f} of floor"
              + (f"; hopper {row['hopper_us']:8.1f} us {row['hopper_mm']:.3f}" if row.get("hopper_us") else "")
              + (f"; flashinfer {row['fi_us']:8.1f} us" if row.get("fi_us") else ""), flush=True)

    sweep = []
    if not (args.quick or args.no_sweep):
        for n, length in SWEEP_SHAPES:
            sweep.append(sweep_shape(n, length, mm_rate))
            gc.collect()
            torch.cuda.empty_cache()

    write_json(args.json, dict(
        env=env, copy_Bps=copy_bw, matmul_flops=mm_rate,
        shape=dict(hq=HQ, hkv=HKV, head_dim=D, page_size=PAGE, dtype=str(DTYPE)),
        default_config=str(policy.default_tile_config(D, DTYPE)), rows=rows, sweep=sweep,
        sweep_configs={k: str(v) for k, v in SWEEP_CONFIGS.items()}))
    if sweep:
        cols = ["n", "L", "splits"] + [f"{c}{t}" for c in SWEEP_CONFIGS for t, _ in SWEEP_SPLITS]
        print("\n## tile configs × split counts (fraction of the bf16 matmul rate)\n")
        print(markdown_table(sweep, cols))
    print(f"\n## batch_prefill_paged, one group of n single-token queries over an L-token shared prefix; "
          f"bf16, Hq={HQ}, Hkv={HKV}, D={D}, page {PAGE} (matmul {mm_rate / 1e12:.0f} TFLOP/s, "
          f"copy {copy_bw / 1e9:.0f} GB/s)\n")
    print(markdown_table(rows, ["n", "L", "splits", "floor_us", "ours_us", "ours_TFLOPs", "ours_mm", "ours_floor",
                                "hopper_us", "hopper_mm",
                                "fi_us", "fi_TFLOPs", "fi_over_ours", "sdpa_us", "sdpa_TFLOPs", "flex_us",
                                "flex_TFLOPs"]))


if __name__ == "__main__":
    main()
