"""Launch-config and split-count sweep for batch_decode_paged (one GPU call, self-checking).

    python -m benchmarks.tools.tune_decode [--budget SECONDS] [--plan main|quick|gaps] [--variants a,b]

bf16, Hq=32, Hkv=8, D=128, page 16 (the shapes of benchmarks/bench_decode.py). Order:

1. correctness on the GPU: every variant in DECODE_VARIANTS, splits 1/2/3/5/8/40, ragged
   lengths with empty rows, against the float64 reference;
2. measured copy bandwidth (bytes read + written, Triton copy kernel and torch.add);
3. per shape: FlashInfer (BatchDecodeWithPagedKVCacheWrapper, use_tensor_cores=True),
   the HEAD code (benchmarks/_decode_v0.py, if present), the default plan, then every
   (variant, num_splits) of the plan below. Each time is the median of 10
   replays of a CUDA graph holding many calls, inputs rotated over pools that together
   exceed 3x L2 (one pool when it alone does), and each variant's output is checked
   against the first one's after its replays;
4. a table per shape (fraction of copy bandwidth, vs FlashInfer) and the best choice.

``--budget``: seconds after which no new measurement starts (the tables still print).
JSON: --json PATH.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import math
import statistics
import sys
import time

import torch

from benchmarks._common import (
    L2_BYTES,
    environment,
    load_flashinfer,
    markdown_table,
    write_json,
)
from benchmarks.fixtures import (
    DTYPE,
    HKV,
    HQ,
    PAGE,
    D,
    fi_wrapper,
    io_bytes,
    kv_bytes,
    new_pool,
    page_table,
)
from cascadeinfer.kernels import decode as decode_mod
from cascadeinfer.kernels import policy
from cascadeinfer.kernels.policy import DECODE_VARIANTS, DecodeConfig
from cascadeinfer.kernels.reference import attention_state_ref
from cascadeinfer.layouts.paged_cache import gather_paged_kv, unpack_paged_kv_cache

# (batch, ctx) -> split counts to try; every variant runs each.
PLAN = {
    (16, 4096): (1, 2, 3, 4, 6, 8),
    (64, 4096): (1, 2),
    (256, 4096): (1,),
    (16, 32768): (1, 2, 3, 4),
    (32, 8192): (1, 2),
    (1, 16384): (16, 33, 66, 132),
    (4, 32768): (8, 16, 33, 66),
}
QUICK_PLAN = {(16, 4096): (2, 3, 4), (64, 4096): (1,)}
# batch * num_kv_heads between the measured points of PLAN (8 .. 2048): the plan's choice
# where it was interpolated
GAPS_PLAN = {
    (4, 32768): (4, 8, 16),
    (9, 16384): (1, 2, 3, 5),
    (12, 8192): (1, 2, 3),
    (17, 8192): (1, 2, 3),
    (24, 8192): (1, 2),
    (40, 4096): (1, 2),
    (48, 4096): (1, 2),
}
# the suffix levels of cascades: many short requests (the bar shapes have 128-1024)
SHORT_PLAN = {
    (256, 128): (1,),
    (64, 256): (1, 2),
    (128, 512): (1,),
    (512, 128): (1,),
}
# launch configs tried only by --plan short (smaller tiles: more programs resident per SM,
# several tiles per short request so the pipeline has something to overlap)
SHORT_VARIANTS = {
    "n64_w4_s3": DecodeConfig(block_n=64, num_warps=4, num_stages=3, programs_per_sm=3),
    "n32_w4_s4": DecodeConfig(block_n=32, num_warps=4, num_stages=4, programs_per_sm=4),
    "n32_w2_s4": DecodeConfig(block_n=32, num_warps=2, num_stages=4, programs_per_sm=4),
    "n16_w2_s5": DecodeConfig(block_n=16, num_warps=2, num_stages=5, programs_per_sm=4),
    "n64_w8_s3": DecodeConfig(block_n=64, num_warps=8, num_stages=3, programs_per_sm=2),
}
DRY_PLAN = {(2, 64): (1, 2)}  # --dry-run: CPU through the Triton interpreter, tiny shapes, no timing
DEV = "cuda"
DRY = False


def graph_seconds(calls, *, replays: int = 10, target_s: float = 3e-3) -> float:
    """Median seconds per call: ``calls`` (one per rotated input set) captured back to back,
    repeated to fill about ``target_s``, in one CUDA graph replayed ``replays`` times."""
    for f in calls:
        f()  # compile and allocate outside the capture
    if DRY:
        return 1e-4
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for f in calls:
        f()
    end.record()
    torch.cuda.synchronize()
    est = max(start.elapsed_time(end) * 1e-3, 1e-6)
    passes = max(1, min(200, math.ceil(target_s / est)))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(passes):
            for f in calls:
                f()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e-3 / (passes * len(calls)))
    del graph
    return statistics.median(times)


def copy_bandwidth() -> float:
    """Bytes/s (read + write) of the faster of a Triton copy kernel and torch.add on 2 GiB."""
    from benchmarks._common import _copy_kernel  # noqa: PLC0415

    if DRY:
        return 3e12
    n = 2**31 // 4
    src = torch.randn(n, device="cuda")
    dst = torch.empty_like(src)
    block = 4096
    grid = ((n + block - 1) // block,)
    t1 = graph_seconds([lambda: _copy_kernel[grid](src, dst, n, BLOCK=block, num_warps=8)], target_s=20e-3)
    t2 = graph_seconds([lambda: torch.add(src, 0, out=dst)], target_s=20e-3)
    assert torch.equal(src, dst)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * 2**31 / min(t1, t2)


def run_variant(q, pool, indptr, indices, last, out, lse, cfg: DecodeConfig | None, splits: int | None):
    """One call; ``cfg=None, splits=None``: the default plan of batch_decode_paged."""
    return decode_mod.decode_with_config(
        q, pool, indptr, indices, last, kv_layout="NHD", sm_scale=None, num_splits=splits, schedule="per_request",
        out=out, lse=lse, validate=False, config=cfg)


def check_correctness(variants: dict[str, DecodeConfig]) -> dict[str, DecodeConfig]:
    """Every variant against the float64 reference; returns those that compiled and passed
    (a variant that does not fit this GPU, or is wrong, is reported and left out)."""
    dev = torch.device(DEV)
    lens = (0, 1, 16, 40, 0, 33) if DRY else (0, 1, 16, 517, 4096, 3000, 70, 12345, 0, 33)
    num_pages = sum((n + PAGE - 1) // PAGE for n in lens) + 64
    pool = new_pool(num_pages, dev)
    indptr, indices, last = page_table(len(lens), list(lens), num_pages, dev, seed=1)
    q = torch.randn(len(lens), HQ, D, device=dev, dtype=DTYPE)
    kv = unpack_paged_kv_cache(pool, "NHD")
    refs = [attention_state_ref(q[b:b + 1], *gather_paged_kv(kv, indptr, indices, last, b)) for b in range(len(lens))]
    passed = {}
    for name, cfg in variants.items():
        t = time.time()
        try:
            for splits in ((1, 2, 5) if DRY else (1, 2, 3, 5, 8, 40)):
                out = torch.full_like(q, float("nan"))
                lse = torch.full((len(lens), HQ), float("nan"), device=dev)
                run_variant(q, pool, indptr, indices, last, out, lse, cfg, splits)
                for b, (o_ref, s_ref) in enumerate(refs):
                    tag = f"{name} splits={splits} row {b}"
                    if lens[b] == 0:
                        assert torch.all(out[b] == 0) and torch.all(lse[b] == -math.inf), tag
                        continue
                    torch.testing.assert_close(out[b].double(), o_ref[0], atol=1.5e-2, rtol=1.5e-2,
                                               msg=lambda m, tag=tag: f"{tag}: {m}")
                    torch.testing.assert_close(lse[b].double(), s_ref[0], atol=1e-3, rtol=1e-4,
                                               msg=lambda m, tag=tag: f"{tag} lse: {m}")
        except AssertionError as exc:
            print(f"# WRONG: {name}: {str(exc).splitlines()[0]}", flush=True)
            continue
        except Exception as exc:  # e.g. more shared memory than this GPU has
            print(f"# variant {name} left out: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}", flush=True)
            continue
        passed[name] = cfg
        print(f"# {name}: correct (compile + check {time.time() - t:.1f} s)", flush=True)
    print(f"# correctness vs float64: {len(passed)}/{len(variants)} variants ok "
          "(splits 1/2/3/5/8/40, ragged lengths with empty rows)", flush=True)
    return passed


def time_shape(batch, ctx, splits_list, variants, copy_bw, fi, v0, deadline, rows, balanced=False) -> None:
    """Time FlashInfer, the HEAD code, the default plan, the balanced schedule's default
    (``balanced``) and every (variant, splits) at one shape; rows go to ``rows``."""
    dev = torch.device(DEV)
    kvb = kv_bytes(batch, ctx)
    n_rot = 1 if kvb > 3 * L2_BYTES else max(2, min(16, math.ceil(3 * L2_BYTES / kvb)))
    num_pages = batch * (ctx // PAGE)
    indptr, indices, last = page_table(batch, [ctx] * batch, num_pages, dev, seed=batch * 7 + ctx)
    pools = [new_pool(num_pages, dev) for _ in range(n_rot)]
    qs = [torch.randn(batch, HQ, D, device=dev, dtype=DTYPE) for _ in range(n_rot)]
    outs = [torch.empty_like(q) for q in qs]
    lses = [torch.empty(batch, HQ, device=dev) for _ in range(n_rot)]
    nbytes = io_bytes(batch, ctx)
    floor_us = nbytes / copy_bw * 1e6
    base = dict(batch=batch, ctx=ctx, rot=n_rot, floor_us=floor_us)

    def add(impl, splits, seconds, err=None):
        row = dict(base, impl=impl, splits=splits, us=seconds * 1e6, frac=nbytes / seconds / copy_bw, err=err)
        rows.append(row)
        print(f"# b{batch:<4d} ctx{ctx:<6d} {impl:22s} splits {splits:>4}: {row['us']:8.1f} us  "
              f"{row['frac']:.3f} of copy" + (f"  ERR {err}" if err else ""), flush=True)

    ref = None
    if fi is not None:
        try:
            w = fi_wrapper(fi, indptr, indices, last)
            fi_outs = [torch.empty_like(q) for q in qs]
            add("flashinfer", "-", graph_seconds([lambda i=i: w.run(qs[i], pools[i], out=fi_outs[i])
                                                  for i in range(n_rot)]))
            ref = fi_outs[0].float()
        except Exception as exc:  # reported, not fatal
            print(f"# flashinfer failed at {batch}x{ctx}: {type(exc).__name__}: {exc}", file=sys.stderr)
    if v0 is not None:  # the HEAD code (default config and split plan, stage 2 + copy)
        head_splits = v0.decode_num_splits(batch, HKV, dev)
        add("HEAD", head_splits, graph_seconds([lambda i=i: v0.decode_with_config(
            qs[i], pools[i], indptr, indices, last, kv_layout="NHD", sm_scale=None, num_splits=None, out=outs[i],
            lse=lses[i], validate=False, config=None) for i in range(n_rot)]))
        if ref is None:
            ref = outs[0].float().clone()
    plan_cfg = decode_mod.pick_decode_config(D, DTYPE, PAGE, work=batch * HKV, num_sms=policy.planning_sms(dev))
    plan_splits = decode_mod.decode_num_splits(batch, HKV, dev, programs_per_sm=plan_cfg.programs_per_sm)
    plan_name = next((k for k, v in DECODE_VARIANTS.items() if v == plan_cfg), str(plan_cfg))
    runs = [("default=" + plan_name, None, plan_splits)]
    if balanced:
        runs.append(("balanced default", "balanced", "-"))
    runs += [(name, cfg, splits) for name, cfg in variants.items() for splits in splits_list]
    for name, cfg, splits in runs:
        if time.time() > deadline:
            return
        try:
            if cfg == "balanced":
                calls = [lambda i=i: decode_mod.decode_with_config(
                    qs[i], pools[i], indptr, indices, last, kv_layout="NHD", sm_scale=None, num_splits=None,
                    schedule="balanced", out=outs[i], lse=lses[i], validate=False, config=None)
                    for i in range(n_rot)]
            else:
                calls = [lambda i=i: run_variant(qs[i], pools[i], indptr, indices, last, outs[i], lses[i], cfg,
                                                 None if cfg is None else splits)
                         for i in range(n_rot)]
            t = graph_seconds(calls)
        except Exception as exc:
            print(f"# {name} splits {splits} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            continue
        o = outs[0].float()
        if ref is None:
            ref = o.clone()
        err = float((o - ref).abs().max())
        add(name, splits, t, None if err < 3e-2 else f"{err:.3g}")
    del pools
    gc.collect()
    if not DRY:
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=float, default=240.0, help="seconds after which no new measurement starts")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--plan", choices=("main", "quick", "gaps", "short"), default="main",
                    help="which shapes to sweep (short: also SHORT_VARIANTS and the balanced schedule)")
    ap.add_argument("--variants", default="", help="comma-separated names from DECODE_VARIANTS and SHORT_VARIANTS")
    ap.add_argument("--dry-run", action="store_true", help="CPU, TRITON_INTERPRET=1, tiny shapes, no timing")
    ap.add_argument("--json", metavar="PATH", help="write the results and the environment here as JSON")
    args = ap.parse_args()
    global DEV, DRY
    if args.dry_run:
        from tests.conftest import _patch_interpreter  # noqa: F401,PLC0415  (conftest patches on import)
        DEV, DRY = "cpu", True
    t0 = time.time()
    deadline = t0 + args.budget
    torch.manual_seed(0)
    env = environment()
    print(f"# {env}", flush=True)
    fi = load_flashinfer()
    try:
        v0 = importlib.import_module("benchmarks._decode_v0")
    except ImportError:
        v0 = None
    pool = dict(DECODE_VARIANTS, **SHORT_VARIANTS)
    if args.variants:
        variants = {k: v for k, v in pool.items() if k in args.variants.split(",")}
    else:
        variants = pool if args.plan == "short" else dict(DECODE_VARIANTS)
    variants = check_correctness(variants)
    copy_bw = copy_bandwidth()
    print(f"# copy bandwidth {copy_bw / 1e9:.0f} GB/s; setup {time.time() - t0:.0f} s", flush=True)
    rows: list[dict] = []
    plan = DRY_PLAN if DRY else dict(main=PLAN, quick=QUICK_PLAN, gaps=GAPS_PLAN, short=SHORT_PLAN)["quick" if args.quick else args.plan]
    for (batch, ctx), splits_list in plan.items():
        if time.time() > deadline:
            print(f"# budget reached before {batch}x{ctx}", flush=True)
            break
        time_shape(batch, ctx, splits_list, variants, copy_bw, fi, v0, deadline, rows, balanced=args.plan == "short")
        write_json(args.json, dict(env=env, copy_Bps=copy_bw, rows=rows, partial=True))
    write_json(args.json, dict(env=env, copy_Bps=copy_bw, variants={k: str(v) for k, v in variants.items()},
                                        rows=rows))
    print(f"\n## tune_decode: fraction of copy bandwidth ({copy_bw / 1e9:.0f} GB/s), bf16 Hq=32 Hkv=8 D=128 page 16\n")
    shapes = list(dict.fromkeys((r["batch"], r["ctx"]) for r in rows))
    impls = list(dict.fromkeys(r["impl"] for r in rows if r["impl"] != "flashinfer"))
    table = []
    for b, c in shapes:
        fi_row = next((r for r in rows if (r["batch"], r["ctx"]) == (b, c) and r["impl"] == "flashinfer"), None)
        for impl in impls:
            cells = {r["splits"]: r for r in rows if (r["batch"], r["ctx"]) == (b, c) and r["impl"] == impl}
            if not cells:
                continue
            line = dict(shape=f"{b}x{c}", impl=impl, fi=fi_row["frac"] if fi_row else None)
            for s, r in cells.items():
                line[f"s{s}"] = r["frac"] if not r["err"] else f"{r['frac']:.3f}!"
            table.append(line)
    cols = ["shape", "impl", "fi"] + [f"s{s}" for s in sorted({s for r in rows for s in [r["splits"]]
                                                               if isinstance(s, int)})]
    print(markdown_table(table, [c for c in cols if any(c in r for r in table)]))
    best = []
    for b, c in shapes:
        cand = [r for r in rows if (r["batch"], r["ctx"]) == (b, c) and r["impl"] != "flashinfer" and not r["err"]]
        fi_row = next((r for r in rows if (r["batch"], r["ctx"]) == (b, c) and r["impl"] == "flashinfer"), None)
        if cand:
            r = min(cand, key=lambda r: r["us"])
            best.append(dict(shape=f"{b}x{c}", best=f"{r['impl']} s{r['splits']}", us=r["us"], frac=r["frac"],
                             fi_us=fi_row["us"] if fi_row else None, fi_frac=fi_row["frac"] if fi_row else None))
    print("\n## best per shape\n")
    print(markdown_table(best, ["shape", "best", "us", "frac", "fi_us", "fi_frac"]))
    print(f"# total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
