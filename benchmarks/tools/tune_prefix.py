"""Tile / pipeline variants of the prefill kernel on the shared-prefix shapes, in one call.

    python -m benchmarks.tools.tune_prefix                 # GPU: check every variant, then time them
    python -m benchmarks.tools.tune_prefix --small-groups  # GPU: only the few-rows-per-group cases
    python -m benchmarks.tools.tune_prefix --sass          # CPU or GPU: compile each variant for
                                                     # sm_90a and report registers, spills,
                                                     # shared memory, wgmma count and the
                                                     # cp.async waits of each loop
    TRITON_INTERPRET=1 python -m benchmarks.tools.tune_prefix --smoke   # CPU dry run, tiny shapes

The shared-prefix level of the cascade: ONE group of ``n`` single-token queries over an
``L``-token prefix; bf16, Hq=32, Hkv=8, D=128, pages of 16 randomly permuted in the pool
(the shapes of ``bench_prefix``). Each variant is a :class:`TileConfig` plus a split-count
multiplier (programs per SM: configs that fit two or three programs on an SM want two or
three times the single-wave split count). Every variant is first checked against the float64
reference (two shapes, forced splits included), then timed with CUDA-graph replay over
rotated pools. FlashInfer ``fa2`` on the same page table and our kernel on the prefix
gathered contiguously (``shared_prefix_attention``'s path: the cost of paging) sit beside
it. If ``benchmarks/_prefill_v0.py`` exists (an untracked copy of an older prefill.py, e.g.
``git show c10d23c:cascadeinfer/kernels/prefill.py > benchmarks/_prefill_v0.py``), its
default config is timed too, as the before. Shapes away from the tuned one (other head
dims, page sizes, causal prefill, groups of a few rows) compare v0, the new default and
FlashInfer. The last thing printed is a table of the fraction of the measured bf16 matmul
rate per variant and shape. JSON goes to --json PATH. Results: benchmarks/NOTES.md.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import re
import subprocess
import sys
from dataclasses import dataclass

import torch

from cascadeinfer.kernels import policy, prefill_kernel
from cascadeinfer.kernels import prefill as P

SHAPES = ((128, 8192), (256, 8192), (512, 8192), (128, 32768), (256, 32768), (512, 32768))
QUICK_SHAPES = ((128, 8192), (512, 32768))
T = policy.TileConfig


@dataclass(frozen=True)
class Variant:
    name: str
    cfg: policy.TileConfig | None  # None: the module's default
    split_mult: int = 1  # times the one-wave split count (programs per SM)
    module: str = "new"  # "new" (prefill.py), "v0" (benchmarks/_prefill_v0.py)


# The measured contenders (benchmarks/NOTES.md, "Prefix level"): on the H200, 128x128 with 3
# stages beat 128x64 s3/s4, 128x128 s2, 64x64 and 64x32 (4 warps, 2-3 programs per SM) at
# every shape, and a lazy rescale lost 5-10%; on the H100, one warpgroup per program at two
# programs per SM (64-row tiles, 112 KiB each) against two lock-stepped warpgroups of one
# 128-row program.
VARIANTS = [
    Variant("v0 default", None, module="v0"),
    Variant("128x128 s3", T(128, 128, 8, 3)),
    Variant("128x64 s3", T(128, 64, 8, 3)),
    Variant("128x64 s4", T(128, 64, 8, 4)),
    Variant("64x64 w4 s3 sx2", T(64, 64, 4, 3), 2),
    Variant("64x64 w4 s2 sx2", T(64, 64, 4, 2), 2),
    Variant("64x64 w4 s3 sx4", T(64, 64, 4, 3), 4),
]
CONTIG_CFG = T(128, 128, 8, 3)


def ablate_exp(mode: str) -> None:
    """Swap the kernel's softmax step for a timing ablation (wrong results, never checked):
    ``noexp`` replaces the per-score exp2 (MUFU) by the FMA alone: what the softmax's MUFU
    work costs. (``ex2.approx.f16x2`` would not halve it: ptxas splits it into two
    ``MUFU.EX2.F16`` on sm_90a.) Call before any compile."""
    import triton  # noqa: PLC0415
    import triton.language as tl  # noqa: PLC0415

    @triton.jit
    def _step(acc, l_i, m_i, s, v, qk_scale, EMPTY_ROWS: tl.constexpr, DOT_PRECISION: tl.constexpr):
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        if EMPTY_ROWS:
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_sub = m_new
        p = s * qk_scale - m_sub[:, None]  # noexp: no exp2
        alpha = tl.math.exp2(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        return acc, l_i, m_new

    if mode != "noexp":
        raise ValueError(f"ablate: unknown mode {mode!r}")
    prefill_kernel.online_softmax_step = _step  # read by the kernel's helpers at compile time


def load_v0():
    path = os.path.join(os.path.dirname(__file__), "_prefill_v0.py")
    if not os.path.exists(path):
        return None
    spec = importlib.util.spec_from_file_location("_prefill_v0", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["_prefill_v0"] = mod
    spec.loader.exec_module(mod)
    return mod


# --------------------------------------------------------------------------- sm_90 report


def compile_sm90(cfg: policy.TileConfig, address: policy.AddressPath):
    """``(compiled kernel, ptxas -v report, the wheel's CUDA bin folder)`` of the paged
    prefill kernel for sm_90a at the shared-prefix shapes (bf16, group 4, page 16, D 128,
    non-causal, several groups), with 16-byte-aligned pointers and strides: triton.compile
    with a GPUTarget and the wheel's ptxas, so no GPU is needed."""
    import triton  # noqa: PLC0415
    from triton.backends.compiler import GPUTarget  # noqa: PLC0415
    from triton.compiler import ASTSource  # noqa: PLC0415

    fn = prefill_kernel.prefill_kernel
    types = {n: "*bf16" if n.endswith("_ptr") else "i32" for n in fn.arg_names}
    types.update(qk_scale="fp32", lse_ptr="*fp32", qo_indptr_ptr="*i32", kv_indptr_ptr="*i32",
                 kv_indices_ptr="*i32", kv_last_page_len_ptr="*i32")
    const = dict(GROUP_SIZE=4, PAGE_SIZE=16, HEAD_DIM=128, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                 BLOCK_D=128, PAGED=True, CAUSAL=False, ONE_GROUP=False, DOT_PRECISION="tf32",
                 OFFSETS_32=address.offsets_32, ALIGNED_PAGES=address.aligned_pages)
    sig = {n: "constexpr" if n in const else types[n] for n in fn.arg_names}
    aligned = [n for n in fn.arg_names if n not in const and (n.endswith("_ptr") or n.startswith("stride_"))
               and n not in ("stride_ls", "stride_lh")]
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    k = triton.compile(ASTSource(fn, sig, constexprs=const, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    path = f"/tmp/tune_prefix_{os.getpid()}.ptx"
    with open(path, "w") as f:
        f.write(k.asm["ptx"])
    info = subprocess.run([os.path.join(bindir, "ptxas"), "-arch=sm_90a", "-v", path, "-o", "/dev/null"],
                          capture_output=True, text=True).stderr
    os.remove(path)
    return k, info, bindir


def sass_report(variants) -> list[dict]:
    """Compile each variant for sm_90a (no GPU needed) and read what matters off the PTX
    and ptxas: registers, spills, shared memory, wgmma count, cp.async waits per loop.
    Every variant on the int32 + hoisted address path (not the launcher's default for
    128-row tiles, the hoisting alone: tune_prefix_offsets compares the paths)."""
    rows = []
    for var in variants:
        if var.module != "new" or var.cfg is None:
            continue
        k, info, _ = compile_sm90(var.cfg, policy.AddressPath(offsets_32=True, aligned_pages=True))
        ptx = k.asm["ptx"]
        loops = ptx.split("Inner Loop Header")[1:]
        rows.append(dict(
            variant=var.name,
            regs=int(re.search(r"Used (\d+) registers", info).group(1)),
            spill=int(re.search(r"(\d+) bytes spill stores", info).group(1)),
            smem=k.metadata.shared,
            wgmma=ptx.count("wgmma.mma_async"),
            loop_waits=" ".join(re.search(r"cp\.async\.wait_group\s+(\d+)", lp).group(1)
                                if "cp.async.wait_group" in lp else "-" for lp in loops),
        ))
    return rows


# --------------------------------------------------------------------------- GPU


def splits_for(mod, var: Variant, n: int, length: int, dev) -> int:
    cfg = var.cfg or mod.default_tile_config(128, torch.bfloat16)
    from benchmarks.fixtures import HKV, HQ, PAGE  # noqa: PLC0415

    tiles = mod.num_m_tiles(n, 1, HQ // HKV, cfg.block_m)
    base = mod.default_num_splits(tiles, HKV, -(-length // PAGE) * PAGE, dev)
    return max(1, min(base * var.split_mult, length // 256))


def runner(mod, var: Variant, q, qo, pool, indptr, indices, last, out, lse, splits):
    from benchmarks.fixtures import D  # noqa: PLC0415
    from cascadeinfer.layouts.paged_cache import unpack_paged_kv_cache  # noqa: PLC0415

    cfg = var.cfg or mod.default_tile_config(D, q.dtype)
    # An older prefill.py (the v0 copy) names these two privately.
    paged_source = getattr(mod, "paged_source", None) or mod._paged_source
    run_prefill = getattr(mod, "run_prefill", None) or mod._run
    source = paged_source(unpack_paged_kv_cache(pool, "NHD"), indptr, indices, last)
    return lambda: run_prefill(q, qo, source, out, lse, causal=False, sm_scale=D ** -0.5, num_splits=splits,
                               config=cfg)


def check_variants(mods, variants, dev, shapes=((77, 3001), (300, 20011))) -> None:
    """Every variant (default and forced split counts) against float64 on the GPU."""
    from benchmarks.fixtures import HQ, PAGE, new_pool, page_table  # noqa: PLC0415
    from cascadeinfer.kernels.reference import attention_state_ref  # noqa: PLC0415
    from cascadeinfer.layouts.paged_cache import gather_paged_kv, unpack_paged_kv_cache  # noqa: PLC0415

    for n, length in shapes:
        pages = -(-length // PAGE)
        pool = new_pool(pages + 5, dev)
        indptr, indices, last = page_table(1, [length], pages + 5, dev, seed=length)
        q = torch.randn(n, HQ, 128, device=dev, dtype=torch.bfloat16)
        q[: n // 2] *= 3.0  # larger logits for half the queries
        qo = torch.tensor([0, n], dtype=torch.int32, device=dev)
        k, v = gather_paged_kv(unpack_paged_kv_cache(pool, "NHD"), indptr, indices, last, 0)
        o_ref, s_ref = attention_state_ref(q, k, v)
        for var in variants:
            mod = mods.get(var.module)
            if mod is None:
                continue
            for splits in (splits_for(mod, var, n, length, dev), 3):
                out = torch.full_like(q, float("nan"))
                lse = torch.full((n, HQ), float("nan"), device=dev)
                runner(mod, var, q, qo, pool, indptr, indices, last, out, lse, splits)()
                rel = ((out.double() - o_ref).norm() / o_ref.norm()).item()
                err_lse = (lse.double() - s_ref).abs().max().item()
                if not (rel < 1e-2 and err_lse < 2e-3):
                    raise AssertionError(
                        f"{var.name} n={n} L={length} splits={splits}: rel {rel:.2e} lse {err_lse:.2e}")
    print(f"# correctness: all {len(variants)} variants ok (rel error norm < 1e-2, lse < 2e-3)", flush=True)


def time_all(mods, variants, shapes, mm_rate, fi, rep_ms) -> list[dict]:
    from benchmarks._common import bench_rotating  # noqa: PLC0415
    from benchmarks.bench_prefix import Shape, fi_wrapper, flops  # noqa: PLC0415
    from cascadeinfer.layouts.paged_cache import gather_paged_kv, unpack_paged_kv_cache  # noqa: PLC0415

    results = []
    for n, length in shapes:
        sh = Shape(n, length)
        dev = sh.qo.device
        fl = flops(n, length)

        def record(name, seconds, splits=None):
            results.append(dict(variant=name, n=n, L=length, splits=splits, us=seconds * 1e6,
                                mm=fl / seconds / mm_rate))

        for var in variants:
            mod = mods.get(var.module)
            if mod is None:
                continue
            splits = splits_for(mod, var, n, length, dev)
            try:
                t = bench_rotating([runner(mod, var, sh.qs[i], sh.qo, sh.pools[i], sh.indptr, sh.indices, sh.last,
                                           sh.outs[i], sh.lses[i], splits) for i in range(sh.rot)], rep_ms=rep_ms)
                record(var.name, t, splits)
            except Exception as exc:  # a config that does not fit is reported, not fatal
                print(f"# {var.name} failed at n {n} L {length}: {type(exc).__name__}: {exc}", file=sys.stderr)
        if fi is not None:
            w = fi_wrapper(fi, sh.qo, sh.indptr, sh.indices, sh.last)
            fo = [torch.empty_like(q) for q in sh.qs]
            record("flashinfer fa2", bench_rotating([lambda i=i: w.run(sh.qs[i], sh.pools[i], out=fo[i])
                                                     for i in range(sh.rot)], rep_ms=rep_ms))
        # The same kernel on the prefix gathered into contiguous [L, Hkv, D]: what paging costs.
        kvs = [gather_paged_kv(unpack_paged_kv_cache(p, "NHD"), sh.indptr, sh.indices, sh.last, 0) for p in sh.pools]
        del sh.pools
        var = Variant("contiguous 128x128 s3", CONTIG_CFG)
        splits = splits_for(P, var, n, length, dev)

        def contig(i):
            src = P.ragged_source(sh.qs[i], *kvs[i], None)
            return lambda: P.run_prefill(sh.qs[i], None, src, sh.outs[i], sh.lses[i], causal=False,
                                  sm_scale=128 ** -0.5, num_splits=splits, config=CONTIG_CFG)

        record(var.name, bench_rotating([contig(i) for i in range(sh.rot)], rep_ms=rep_ms), splits)
        del kvs, sh
        gc.collect()
        torch.cuda.empty_cache()
        done = [r for r in results if r["n"] == n and r["L"] == length]
        best = max(done, key=lambda r: r["mm"])
        print(f"# n {n} L {length}: best {best['variant']} {best['us']:.1f} us {best['mm']:.3f} of matmul", flush=True)
    return results


# (name, qo_lens, kv_lens, Hq, Hkv, D, dtype, page, causal): shapes away from the tuned one,
# to check the new defaults lose nothing there (prefill, cascade suffix level, other D/pages).
GENERAL_CASES = [
    ("prefix n256 L8K D64", [256], [8192], 32, 8, 64, torch.bfloat16, 16, False),
    ("prefix n256 L8K D256", [256], [8192], 32, 8, 256, torch.bfloat16, 16, False),
    ("prefix n256 L8K fp16 page64", [256], [8192], 32, 8, 128, torch.float16, 64, False),
    ("causal prefill 8x1024 over 2048", [1024] * 8, [2048] * 8, 32, 8, 128, torch.bfloat16, 16, True),
    ("suffix 256 x 1 query over 300", [1] * 256, [300] * 256, 32, 8, 128, torch.bfloat16, 16, True),
    ("middle 32 groups x 8 over 2048", [8] * 32, [2048] * 32, 32, 8, 128, torch.bfloat16, 16, False),
    ("middle 64 groups x 16 over 1024", [16] * 64, [1024] * 64, 32, 8, 128, torch.bfloat16, 16, False),
]
SMALL_GROUP_CASES = GENERAL_CASES[4:]  # where the rows-per-group tile choice matters


def time_general(mods, fi, mm_rate, rep_ms, dev, cases=GENERAL_CASES) -> list[dict]:
    """v0 default vs the new default vs FlashInfer fa2 on GENERAL_CASES (each checked first)."""
    from benchmarks._common import bench_rotating, rotation_count  # noqa: PLC0415
    from cascadeinfer.layouts.paged_cache import unpack_paged_kv_cache  # noqa: PLC0415

    if dev.type != "cuda":  # --smoke: one plain call instead of a CUDA-graph timing
        def bench_rotating(fns, rep_ms):  # noqa: ARG001
            for f in fns:
                f()
            return 1.0
    rows = []
    for name, qo_lens, kv_lens, hq, hkv, d, dtype, page, causal in cases:
        need = [-(-x // page) for x in kv_lens]
        num_pages = sum(need)
        g = torch.Generator().manual_seed(len(name))
        perm = torch.randperm(num_pages, generator=g).to(dev, torch.int32)
        indptr = torch.tensor([0, *torch.tensor(need).cumsum(0).tolist()], dtype=torch.int32, device=dev)
        last = torch.tensor([x - (p - 1) * page for x, p in zip(kv_lens, need)], dtype=torch.int32, device=dev)
        qo = torch.tensor([0, *torch.tensor(qo_lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
        nbytes = num_pages * page * hkv * d * 2 * dtype.itemsize
        rot = rotation_count(nbytes)
        pools = [torch.randn(num_pages, 2, page, hkv, d, device=dev, dtype=dtype) for _ in range(rot)]
        qs = [torch.randn(sum(qo_lens), hq, d, device=dev, dtype=dtype) for _ in range(rot)]
        outs = [torch.empty_like(q) for q in qs]
        lses = [torch.empty(q.shape[:2], device=dev) for q in qs]
        fl = sum(4 * hq * d * ((n * (L - n) + n * (n + 1) // 2) if causal else n * L) for n, L in zip(qo_lens, kv_lens))
        args = lambda i: (qs[i], qo, pools[i], indptr, perm, last)  # noqa: E731
        o_ref, s_ref = P.batch_prefill_paged_ref(*args(0), causal=causal)
        row = dict(case=name)

        def public(mod):
            return lambda i: lambda: mod.batch_prefill_paged(*args(i), causal=causal, out=outs[i], lse=lses[i],
                                                             validate=False)

        def forced(cfg):  # the new kernel with a forced tile config (default split count)
            def make(i):
                src = P.paged_source(unpack_paged_kv_cache(pools[i], "NHD"), indptr, perm, last)
                return lambda: P.run_prefill(qs[i], qo, src, outs[i], lses[i], causal=causal, sm_scale=d ** -0.5,
                                      config=cfg)
            return make

        runs = [("new", public(P))]
        if mods.get("v0") is not None:
            runs.insert(0, ("v0", public(mods["v0"])))
        if d == 128 and dtype != torch.float32:
            runs.append(("new128", forced(T(128, 128, 8, 3))))
        for tag, make in runs:
            lses[0].fill_(float("nan"))
            make(0)()
            rel = ((outs[0].double() - o_ref).norm() / o_ref.norm()).item()
            assert rel < 1e-2 and not lses[0].isnan().any(), f"{tag} {name}: rel error {rel:.2e}"
            t = bench_rotating([make(i) for i in range(rot)], rep_ms=rep_ms)
            row[f"{tag}_us"], row[f"{tag}_mm"] = t * 1e6, fl / t / mm_rate
        if fi is not None:
            try:
                ws = torch.zeros(256 * 2**20, dtype=torch.uint8, device=dev)
                w = fi.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend="fa2")
                w.plan(qo, indptr, perm, last, hq, hkv, d, page, causal=causal, q_data_type=dtype,
                       kv_data_type=dtype)
                o = w.run(qs[0], pools[0])
                rel = ((o.double() - o_ref).norm() / o_ref.norm()).item()
                assert rel < 1e-2, f"flashinfer {name}: rel error {rel:.2e}"
                t = bench_rotating([lambda i=i: w.run(qs[i], pools[i], out=outs[i]) for i in range(rot)], rep_ms=rep_ms)
                row["fi_us"], row["fi_mm"] = t * 1e6, fl / t / mm_rate
            except Exception as exc:
                print(f"# flashinfer failed on {name}: {type(exc).__name__}: {exc}", file=sys.stderr)
        rows.append(row)
        print(f"# {row}", flush=True)
        del pools, qs, outs, lses
        gc.collect()
        torch.cuda.empty_cache()
    return rows


def table(results, shapes) -> str:
    names = list(dict.fromkeys(r["variant"] for r in results))
    cell = {(r["variant"], r["n"], r["L"]): r for r in results}
    head = "| variant | " + " | ".join(f"n{n} L{L // 1024}K" for n, L in shapes) + " |"
    lines = [head, "|" + " --- |" * (len(shapes) + 1)]
    for name in names:
        vals = []
        for n, L in shapes:
            r = cell.get((name, n, L))
            vals.append("—" if r is None else f"{r['mm']:.3f} ({r['us']:.0f}us s{r['splits'] or '-'})")
        lines.append(f"| {name} | " + " | ".join(vals) + " |")
    return "\n".join(lines)


def smoke() -> None:
    """Run the checks and the general cases on tiny shapes through the CPU interpreter."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("--smoke: run with TRITON_INTERPRET=1 (and no GPU)")
    from tests.conftest import _patch_interpreter  # noqa: F401,PLC0415  (conftest patches on import)

    dev = torch.device("cpu")
    mods = {"new": P, "v0": load_v0()}
    check_variants(mods, VARIANTS[:2], dev, shapes=((5, 150),))
    cases = [("tiny prefix", [6], [150], 8, 2, 64, torch.bfloat16, 16, False),
             ("tiny causal", [5, 3], [40, 3], 8, 2, 128, torch.float16, 4, True),
             ("tiny groups", [1, 2, 1], [70, 33, 90], 8, 2, 128, torch.bfloat16, 16, False)]
    print(time_general(mods, None, 1e12, 1, dev, cases))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sass", action="store_true", help="compile-only report for sm_90 (no GPU needed)")
    ap.add_argument("--quick", action="store_true", help="two shapes")
    ap.add_argument("--smoke", action="store_true", help="CPU dry run through the interpreter (tiny shapes)")
    ap.add_argument("--rep-ms", type=int, default=120)
    ap.add_argument("--shapes", nargs="*", help="n,L pairs (default: the six of SHAPES)")
    ap.add_argument("--ablate", choices=("noexp",),
                    help="timing only: replace the softmax's exp2 (no correctness check, no general cases)")
    ap.add_argument("--no-general", action="store_true", help="skip the shapes away from the tuned one")
    ap.add_argument("--small-groups", action="store_true",
                    help="only the general cases of few rows per group (no variant sweep)")
    ap.add_argument("--json", metavar="PATH", help="write the results and the environment here as JSON")
    args = ap.parse_args()
    if args.smoke:
        smoke()
        return
    if args.sass:
        from benchmarks._common import markdown_table  # noqa: PLC0415

        rows = sass_report(VARIANTS)
        print(markdown_table(rows, ["variant", "regs", "spill", "smem", "wgmma", "loop_waits"]))
        return
    if not torch.cuda.is_available():
        sys.exit("tune_prefix needs a CUDA device (or --sass)")
    from benchmarks._common import (  # noqa: PLC0415
        environment,
        load_flashinfer,
        measure_matmul_rate,
        write_json,
    )

    env = environment()
    print(f"# {env}", flush=True)
    mods = {"new": P, "v0": load_v0()}
    fi = load_flashinfer()
    if args.ablate:
        ablate_exp(args.ablate)
        mods["v0"], fi, args.no_general = None, None, True
    elif not args.small_groups:
        check_variants(mods, VARIANTS, torch.device("cuda"))
    mm_rate = measure_matmul_rate()
    print(f"# bf16 matmul {mm_rate / 1e12:.0f} TFLOP/s", flush=True)
    shapes = QUICK_SHAPES if args.quick else SHAPES
    if args.shapes:
        shapes = tuple(tuple(int(x) for x in t.split(",")) for t in args.shapes)
    cases = SMALL_GROUP_CASES if args.small_groups else GENERAL_CASES
    general = [] if args.no_general else time_general(mods, fi, mm_rate, args.rep_ms, torch.device("cuda"), cases)
    results = [] if args.small_groups else time_all(mods, VARIANTS, shapes, mm_rate, fi, args.rep_ms)
    write_json(args.json, dict(env=env, matmul_flops=mm_rate, results=results, general=general,
                                        variants={v.name: f"{v.cfg} x{v.split_mult} {v.module}" for v in VARIANTS}))
    if general:
        from benchmarks._common import markdown_table  # noqa: PLC0415

        print("\n## other shapes: v0 default vs new default vs FlashInfer fa2 (time us, fraction of matmul)\n")
        print(markdown_table(general, ["case", "v0_us", "new_us", "new128_us", "fi_us", "v0_mm", "new_mm",
                                       "new128_mm", "fi_mm"]))
    if not results:
        return
    print(f"\n## fraction of the bf16 matmul rate ({mm_rate / 1e12:.0f} TFLOP/s), (time, splits); "
          f"one group of n queries over an L-token prefix, bf16 Hq=32 Hkv=8 D=128 page 16\n")
    print(table(results, shapes))


if __name__ == "__main__":
    main()
