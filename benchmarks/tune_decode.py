"""Launch-config sweep for batch_decode_paged's balanced split-KV (one GPU call, self-checking).

    python -m benchmarks.tune_decode [--budget SECONDS] [--plan main|quick] [--variants a,b]
    python -m benchmarks.tune_decode --sass        # CPU or GPU: sm_90a build report, no timing
    python -m benchmarks.tune_decode --dry-run     # CPU, TRITON_INTERPRET=1, tiny shapes

bf16, Hq=32, Hkv=8, D=128, page 16 (the shapes of benchmarks/bench_decode.py). Order:

1. correctness on the GPU: every variant of VARIANTS, num_splits 1/2/3/5/8/40 and the
   default plan, ragged lengths with empty rows, against the float64 reference;
2. measured copy bandwidth (bytes read + written, Triton copy kernel and torch.add);
3. per shape (uniform batch x context, and variable-length batches): FlashInfer
   (BatchDecodeWithPagedKVCacheWrapper, use_tensor_cores=True, planned outside the timing),
   the previous code with its own plan (benchmarks/tune_decode_old.py, if present, not
   committed: ``git show 83a6360:cascadeinfer/kernels/decode.py > benchmarks/tune_decode_old.py``,
   the per-request split kernel), then every variant of VARIANTS. Each time is the
   median of 10 replays of a CUDA graph holding many calls, inputs rotated over pools that
   together exceed 3x L2 (one pool when it alone does), and each variant's output is
   checked against the first one's after its replays;
4. a table (fraction of copy bandwidth per implementation) and the best variant per shape.

``--budget``: seconds after which no new measurement starts (the tables still print);
``--until``: the same as a wall-clock time, for a device call with earlier steps.
JSON: $OUT/tune_decode.json.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import importlib.util
import math
import os
import re
import statistics
import subprocess
import sys
import time

import torch

from benchmarks._common import L2_BYTES, environment, load_flashinfer, markdown_table, write_json
from benchmarks.bench_decode import DTYPE, HKV, HQ, PAGE, D, fi_wrapper, new_pool, page_table
from cascadeinfer.kernels import decode as decode_mod
from cascadeinfer.kernels.decode import DECODE_VARIANTS, DecodeConfig
from cascadeinfer.kernels.reference import attention_state_ref
from cascadeinfer.layouts.paged_cache import gather_paged_kv, unpack_paged_kv_cache

_N128_S3 = DECODE_VARIANTS["n128_w4_s3"]


def _with(cfg: DecodeConfig, **kw) -> DecodeConfig:
    return DecodeConfig(**{f: getattr(cfg, f) for f in DecodeConfig.__slots__} | kw)


# name -> (stage-1 config, num_splits or None for that config's default P: one wave).
# "default" is what batch_decode_paged picks; the others are the alternatives around it.
VARIANTS: dict[str, tuple[DecodeConfig | None, int | None]] = {
    "default": (None, None),
    "n128_w4_s5_nopdl": (_with(DECODE_VARIANTS["n128_w4_s5"], pdl=False), None),
    "n128_w4_s5_2waves": (_with(DECODE_VARIANTS["n128_w4_s5"], programs_per_sm=2), None),
    "n128_w4_s3": (_N128_S3, None),
    "n128_w4_s3_3sm": (_with(_N128_S3, programs_per_sm=3), None),
    "n64_w4_s5": (DECODE_VARIANTS["n64_w4_s5"], None),
}


def uniform(batch: int, ctx: int) -> tuple[str, list[int]]:
    return f"{batch}x{ctx // 1024}K", [ctx] * batch


# The shapes: the benchmarked ones, and the batch sizes between them where a
# shape-only per-request split count makes partial waves; then variable lengths.
MAIN_SHAPES = [  # most telling first, in case the budget runs out
    uniform(16, 4096), uniform(17, 8192), uniform(40, 4096), ("1x64K+63x1K", [65536] + [1024] * 63),
    uniform(9, 16384), uniform(24, 8192), uniform(16, 32768), uniform(64, 4096), uniform(256, 4096),
    uniform(1, 16384), uniform(4, 32768), uniform(12, 8192), uniform(48, 4096), uniform(100, 4096),
    uniform(136, 2048), ("1x100K+99x1-2K", [100_000] + [1024 + (i * 337) % 1024 for i in range(99)]),
]
QUICK_SHAPES = [uniform(16, 4096), uniform(17, 8192), ("1x64K+63x1K", [65536] + [1024] * 63)]
DRY_SHAPES = [("2x64", [64, 64]), ("var", [0, 100, 3, 17])]
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
    """One call; ``splits=None``: the config's default P; ``cfg=None``: the default config."""
    return decode_mod._batch_decode_paged(
        q, pool, indptr, indices, last, kv_layout="NHD", sm_scale=None, num_splits=splits, out=out, lse=lse,
        validate=False, config=cfg)


def check_correctness(variants: dict) -> dict:
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
    for name, (cfg, _) in variants.items():
        t = time.time()
        try:
            for splits in ((None, 1, 2, 5) if DRY else (None, 1, 2, 3, 5, 8, 40)):
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
        passed[name] = variants[name]
        print(f"# {name}: correct (compile + check {time.time() - t:.1f} s)", flush=True)
    print(f"# correctness vs float64: {len(passed)}/{len(variants)} variants ok "
          "(num_splits default/1/2/3/5/8/40, ragged lengths with empty rows)", flush=True)
    return passed


def kv_bytes_of(lens: list[int]) -> int:
    return sum(lens) * HKV * D * 2 * DTYPE.itemsize


def time_shape(name, lens, variants, copy_bw, fi, old, deadline, rows) -> None:
    dev = torch.device(DEV)
    batch = len(lens)
    kvb = kv_bytes_of(lens)
    n_rot = 1 if kvb > 3 * L2_BYTES else max(2, min(16, math.ceil(3 * L2_BYTES / kvb)))
    num_pages = sum((n + PAGE - 1) // PAGE for n in lens)
    indptr, indices, last = page_table(batch, lens, num_pages, dev, seed=batch * 7 + sum(lens) % 1009)
    pools = [new_pool(num_pages, dev) for _ in range(n_rot)]
    qs = [torch.randn(batch, HQ, D, device=dev, dtype=DTYPE) for _ in range(n_rot)]
    outs = [torch.empty_like(q) for q in qs]
    lses = [torch.empty(batch, HQ, device=dev) for _ in range(n_rot)]
    nbytes = kvb + 2 * batch * HQ * D * DTYPE.itemsize + batch * HQ * 4
    base = dict(shape=name, batch=batch, tokens=sum(lens), rot=n_rot, floor_us=nbytes / copy_bw * 1e6)

    def add(impl, splits, seconds, err=None):
        row = dict(base, impl=impl, splits=splits, us=seconds * 1e6, frac=nbytes / seconds / copy_bw, err=err)
        rows.append(row)
        print(f"# {name:16s} {impl:16s} P {str(splits):>4}: {row['us']:9.1f} us  {row['frac']:.3f} of copy"
              + (f"  ERR {err}" if err else ""), flush=True)

    ref = None
    if fi is not None:
        try:
            w = fi_wrapper(fi, indptr, indices, last)
            fi_outs = [torch.empty_like(q) for q in qs]
            add("flashinfer", "-", graph_seconds([lambda i=i: w.run(qs[i], pools[i], out=fi_outs[i])
                                                  for i in range(n_rot)]))
            ref = fi_outs[0].float()
        except Exception as exc:  # reported, not fatal
            print(f"# flashinfer failed at {name}: {type(exc).__name__}: {exc}", file=sys.stderr)
    if old is not None and time.time() < deadline:  # the per-request split kernel with its own plan
        try:
            old_splits = old.decode_num_splits(batch, HKV, dev)
            add("old", old_splits, graph_seconds([lambda i=i: old._batch_decode_paged(
                qs[i], pools[i], indptr, indices, last, kv_layout="NHD", sm_scale=None, num_splits=None,
                out=outs[i], lse=lses[i], validate=False, config=None) for i in range(n_rot)]))
            if ref is None:
                ref = outs[0].float().clone()
        except Exception as exc:
            print(f"# old failed at {name}: {type(exc).__name__}: {exc}", file=sys.stderr)
    for vname, (cfg, splits) in variants.items():
        if time.time() > deadline:
            break
        use = cfg or decode_mod.pick_decode_config(D, DTYPE, PAGE)
        p = splits or decode_mod.decode_num_splits(batch, HKV, dev, programs_per_sm=use.programs_per_sm)
        try:
            t = graph_seconds([lambda i=i: run_variant(qs[i], pools[i], indptr, indices, last, outs[i], lses[i], cfg,
                                                       splits) for i in range(n_rot)])
        except Exception as exc:
            print(f"# {vname} failed at {name}: {type(exc).__name__}: {exc}", file=sys.stderr)
            continue
        o = outs[0].float()
        if ref is None:
            ref = o.clone()
        err = float((o - ref).abs().max())
        add(vname, p, t, None if err < 3e-2 else f"{err:.3g}")
    del pools
    gc.collect()
    if not DRY:
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------- sm_90a report


def sass_report() -> list[dict]:
    """Compile stage 1 (each variant) and stage 2 for sm_90a without a GPU; read registers,
    spills and shared memory off ptxas -v (residency: 65536 registers, 227 KiB per SM)."""
    import triton  # noqa: PLC0415
    from triton.backends.compiler import GPUTarget  # noqa: PLC0415
    from triton.compiler import ASTSource  # noqa: PLC0415

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")

    def build(fn, const, types, aligned, num_warps, num_stages):
        sig = {n: "constexpr" if n in const else types.get(n, "i32") for n in fn.arg_names}
        attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
        k = triton.compile(ASTSource(fn, sig, constexprs=const, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                           options=dict(num_warps=num_warps, num_stages=num_stages))
        path = f"/tmp/tune_decode_{os.getpid()}.ptx"
        with open(path, "w") as f:
            f.write(k.asm["ptx"])
        info = subprocess.run([ptxas, "-arch=sm_90a", "-v", path, "-o", "/dev/null"], capture_output=True,
                              text=True).stderr
        os.remove(path)
        regs = int(re.search(r"Used (\d+) registers", info).group(1))
        by_regs = 65536 // (-(-regs * 32 // 256) * 256 * num_warps)  # registers are allocated per warp, 256 at a time
        by_smem = 232448 // max(1, k.metadata.shared + 1024)  # 1 KiB per block reserved
        return dict(regs=regs, spill=int(re.search(r"(\d+) bytes spill stores", info).group(1)),
                    smem_KiB=round(k.metadata.shared / 1024, 1), per_sm=min(by_regs, by_smem),
                    griddep="griddepcontrol" in k.asm["ptx"])

    fn = decode_mod._decode_kernel
    types = {n: "*bf16" for n in fn.arg_names if n.endswith("_ptr")}
    types.update(kv_indptr_ptr="*i32", kv_indices_ptr="*i32", kv_last_page_len_ptr="*i32", lse_ptr="*fp32",
                 part_o_ptr="*fp32", part_lse_ptr="*fp32", qk_scale="fp32")
    # what the launcher's arguments are at the benchmark shapes: 16-aligned pointers and strides
    aligned = [n for n in fn.arg_names if n.endswith("_ptr")] + [
        "stride_qb", "stride_qh", "stride_page", "stride_token", "stride_head", "stride_ob", "stride_oh",
        "stride_lb", "stride_ps", "stride_ph", "stride_pls"]
    rows = []
    cases = [(n, c or decode_mod.pick_decode_config(D, DTYPE, PAGE), 4, 128) for n, (c, _) in VARIANTS.items()]
    one = DECODE_VARIANTS["n128_w4_s5"]
    cases += [("n128_w4_s5 group 8", one, 8, 128), ("n128_w4_s5 group 16", one, 16, 128),
              ("n128_w4_s5 D 64", one, 4, 64)]
    for name, cfg, group, head_dim in cases:
        const = dict(GROUP=group, BLOCK_H=max(16, group), HEAD_DIM=head_dim, BLOCK_D=head_dim, PAGE_SIZE=PAGE,
                     BLOCK_N=cfg.block_n, NUM_STAGES=cfg.num_stages, IEEE=False, BLOCK_B=decode_mod._BLOCK_B,
                     PDL=cfg.pdl)
        rows.append(dict(kernel="stage 1 " + name, **build(fn, const, types, aligned, cfg.num_warps, cfg.num_stages)))
    fn2 = decode_mod._decode_merge_kernel
    types2 = {n: "*fp32" for n in fn2.arg_names if n.endswith("_ptr")}
    types2.update(kv_indptr_ptr="*i32", o_ptr="*bf16")
    aligned2 = [n for n in fn2.arg_names if n.endswith("_ptr")] + ["stride_ps", "stride_ph", "stride_pls", "stride_ob",
                                                                  "stride_oh", "stride_lb"]
    const2 = dict(HEAD_DIM=D, BLOCK_D=D, BLOCK_H=decode_mod._MERGE_BLOCK_H, UNROLL=decode_mod._MERGE_MAX_UNROLL,
                  BLOCK_B=decode_mod._BLOCK_B, PDL=True)
    rows.append(dict(kernel="stage 2", **build(fn2, const2, types2, aligned2, 4, 3)))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=float, default=240.0, help="seconds after which no new measurement starts")
    ap.add_argument("--until", type=float, default=None,
                    help="wall-clock time (epoch seconds) after which no new measurement starts, if sooner")
    ap.add_argument("--plan", choices=("main", "quick"), default="main", help="which shapes to time")
    ap.add_argument("--variants", default="", help="comma-separated subset of VARIANTS")
    ap.add_argument("--no-old", action="store_true", help="skip the previous kernel")
    ap.add_argument("--sass", action="store_true", help="sm_90a build report only (no GPU needed)")
    ap.add_argument("--dry-run", action="store_true", help="CPU, TRITON_INTERPRET=1, tiny shapes, no timing")
    args = ap.parse_args()
    global DEV, DRY
    if args.sass:
        print(markdown_table(sass_report(), ["kernel", "regs", "spill", "smem_KiB", "per_sm", "griddep"]))
        return
    if args.dry_run:
        DEV, DRY = "cpu", True
        if os.environ.get("TRITON_INTERPRET") != "1":
            sys.exit("--dry-run: set TRITON_INTERPRET=1")
        # the test set-up's interpreter patches (numpy >= 2.4 loop bounds, bf16 dots)
        spec = importlib.util.spec_from_file_location(
            "_decode_conftest", os.path.join(os.path.dirname(__file__), "..", "tests", "conftest.py"))
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
    t0 = time.time()
    deadline = t0 + args.budget if args.until is None else min(t0 + args.budget, args.until)
    torch.manual_seed(0)
    env = environment()
    print(f"# {env}", flush=True)
    fi = load_flashinfer()
    old = None
    if not args.no_old:
        try:
            old = importlib.import_module("benchmarks.tune_decode_old")
        except ImportError:
            pass
    variants = {k: v for k, v in VARIANTS.items() if not args.variants or k in args.variants.split(",")}
    if DRY:
        variants = {k: (c and _with(c, pdl=False), n) for k, (c, n) in variants.items()}  # no PDL on the CPU
    variants = check_correctness(variants)
    copy_bw = copy_bandwidth()
    print(f"# copy bandwidth {copy_bw / 1e9:.0f} GB/s; setup {time.time() - t0:.0f} s", flush=True)
    rows: list[dict] = []
    shapes = DRY_SHAPES if DRY else dict(main=MAIN_SHAPES, quick=QUICK_SHAPES)[args.plan]
    for name, lens in shapes:
        if time.time() > deadline:
            print(f"# budget reached before {name}", flush=True)
            break
        time_shape(name, lens, variants, copy_bw, fi, old, deadline, rows)
        write_json("tune_decode.json", dict(env=env, copy_Bps=copy_bw, rows=rows, partial=True))
    write_json("tune_decode.json", dict(env=env, copy_Bps=copy_bw, rows=rows,
                                        variants={k: str(v) for k, v in variants.items()}))
    print(f"\n## tune_decode: fraction of copy bandwidth ({copy_bw / 1e9:.0f} GB/s), bf16 Hq=32 Hkv=8 D=128 "
          "page 16 (P = programs per kv head)\n")
    names = list(dict.fromkeys(r["shape"] for r in rows))
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    table = []
    for s in names:
        line = dict(shape=s)
        for r in rows:
            if r["shape"] == s:
                line[r["impl"]] = r["frac"] if not r["err"] else f"{r['frac']:.3f}!"
        new = [r for r in rows if r["shape"] == s and r["impl"] not in ("flashinfer", "old") and not r["err"]]
        fi_row = next((r for r in rows if r["shape"] == s and r["impl"] == "flashinfer"), None)
        if new:
            best = min(new, key=lambda r: r["us"])
            line["best"] = f"{best['impl']} P{best['splits']}"
            line["best_us"] = best["us"]
            if fi_row:
                line["fi/best"] = fi_row["us"] / best["us"]
        table.append(line)
    print(markdown_table(table, ["shape"] + impls + ["best", "best_us", "fi/best"]))
    print(f"# total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
