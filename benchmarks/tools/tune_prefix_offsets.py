"""The prefill kernel's K/V address paths (:class:`cascadeinfer.kernels.prefill.AddressPath`)
on the shared-prefix shapes: the old int64 path against each cheaper one, in one call.

    python -m benchmarks.tools.tune_prefix_offsets            # GPU: check every path, then time them (< 3 min)
    python -m benchmarks.tools.tune_prefix_offsets --sass     # CPU or GPU: compile each path for sm_90a and
                                                        # report registers, spills and the SASS of the
                                                        # unmasked key loop (instructions per tile)
    TRITON_INTERPRET=1 python -m benchmarks.tools.tune_prefix_offsets --smoke   # CPU: the checks, tiny shape

The shared-prefix level of the cascade: ONE group of ``n`` single-token queries over an
``L``-token prefix (non-causal), bf16, Hq=32, Hkv=8, D=128, pages of 16 randomly permuted
in the pool, the default tiles (128x128, 8 warps, 3 stages) and split count. The paths:

* ``int64``: the kernel before this change (64-bit ``page * stride_page + slot *
  stride_token`` per row, per-row page positions and slots recomputed every tile);
* ``int32``: the same in int32 (the launcher allows it while every element offset of the
  pool is below 2**31);
* ``aligned``: int64, but each row's slot offset and page position hoisted out of the loop
  (``BLOCK_N % page_size == 0``: every tile starts on a page boundary);
* ``int32+aligned``: both (the launcher's default for these shapes).

Beside them, the same kernel on the prefix gathered into contiguous K/V (the ragged path,
int64 and int32 offsets): what paging still costs. Every path is first checked against the
float64 reference at n=128, L=8229 (a partial last tile, four KV splits) and all paths must
agree bit for bit. Then each is timed with ``do_bench_cudagraph`` (median) over K/V pools
rotated inside one graph so no call finds its prefix in L2. The table gives microseconds and
the fraction of a bf16 matmul rate measured in the same run (the floor at these shapes:
intensity ~4n FLOP/byte is past the ridge). JSON goes to --json PATH.
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import subprocess
import sys
import time

import torch

from cascadeinfer.kernels import policy
from cascadeinfer.kernels import prefill as P
from cascadeinfer.kernels.reference import attention_state_ref
from cascadeinfer.layouts.paged_cache import gather_paged_kv, unpack_paged_kv_cache

HQ, HKV, D, PAGE = 32, 8, 128, 16
DTYPE = torch.bfloat16
SHAPES = ((128, 8192), (256, 8192), (512, 8192), (128, 32768), (256, 32768), (512, 32768))
CHECK_SHAPE = (128, 8229)
PATHS = {
    "int64": policy.AddressPath(offsets_32=False, aligned_pages=False),
    "int32": policy.AddressPath(offsets_32=True, aligned_pages=False),
    "aligned": policy.AddressPath(offsets_32=False, aligned_pages=True),
    "int32+aligned": policy.AddressPath(offsets_32=True, aligned_pages=True),
}
CONTIG_PATHS = {
    "contiguous int64": policy.AddressPath(offsets_32=False, aligned_pages=False),
    "contiguous int32": policy.AddressPath(offsets_32=True, aligned_pages=False),
}
SM_SCALE = D ** -0.5


def flops(n: int, length: int) -> int:
    return 4 * n * length * HQ * D


def new_prefix(n: int, length: int, device, seed: int, spare_pages: int = 7):
    """q, qo_indptr, an NHD pool with ``spare_pages`` owned by nobody, and the page table of
    one group whose pages are a random permutation of the pool's (drawn on ``device``)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    pages = -(-length // PAGE)
    num_pages = pages + spare_pages
    pool = torch.randn((num_pages, 2, PAGE, HKV, D), generator=gen, device=device, dtype=DTYPE)
    indices = torch.randperm(num_pages, generator=gen, device=device)[:pages].to(torch.int32)
    indptr = torch.tensor([0, pages], dtype=torch.int32, device=device)
    last = torch.tensor([length - (pages - 1) * PAGE], dtype=torch.int32, device=device)
    q = torch.randn((n, HQ, D), generator=gen, device=device, dtype=DTYPE)
    qo = torch.tensor([0, n], dtype=torch.int32, device=device)
    return q, qo, pool, indptr, indices, last


def paged_runner(q, qo, pool, indptr, indices, last, out, lse, address):
    source = P.paged_source(unpack_paged_kv_cache(pool, "NHD"), indptr, indices, last)
    return lambda: P.run_prefill(q, qo, source, out, lse, causal=False, sm_scale=SM_SCALE, address=address)


def contig_runner(q, k, v, out, lse, address):
    source = P.ragged_source(q, k, v, None)
    return lambda: P.run_prefill(q, None, source, out, lse, causal=False, sm_scale=SM_SCALE, address=address)


# --------------------------------------------------------------------------- correctness


def check_paths(device, shape=CHECK_SHAPE) -> dict:
    """Every path against the float64 reference, and bit-identical to the int64 path.
    Raises on a mismatch; returns the errors (relative error norm of o, max |lse error|)."""
    n, length = shape
    q, qo, pool, indptr, indices, last = new_prefix(n, length, device, seed=1)
    q[: n // 2] *= 3.0  # larger logits for half the queries
    k, v = gather_paged_kv(unpack_paged_kv_cache(pool, "NHD"), indptr, indices, last, 0)
    o_ref, s_ref = attention_state_ref(q, k, v, sm_scale=SM_SCALE)
    errors, first = {}, None
    runs = {name: (lambda out, lse, a=a: paged_runner(q, qo, pool, indptr, indices, last, out, lse, a)())
            for name, a in PATHS.items()}
    runs.update({name: (lambda out, lse, a=a: contig_runner(q, k, v, out, lse, a)())
                 for name, a in CONTIG_PATHS.items()})
    for name, run in runs.items():
        out = torch.full_like(q, float("nan"))
        lse = torch.full((n, HQ), float("nan"), device=device)
        run(out, lse)
        if out.isnan().any() or lse.isnan().any():
            raise AssertionError(f"{name}: unwritten (NaN) outputs")
        rel = ((out.double() - o_ref).norm() / o_ref.norm()).item()
        err_lse = (lse.double() - s_ref).abs().max().item()
        errors[name] = dict(o_rel=rel, lse_abs=err_lse)
        if not (rel < 1e-2 and err_lse < 2e-3):
            raise AssertionError(f"{name} n={n} L={length}: o rel error {rel:.2e}, lse error {err_lse:.2e}")
        if name in PATHS:
            if first is None:
                first = (out, lse)
            elif not (torch.equal(out, first[0]) and torch.equal(lse, first[1])):
                raise AssertionError(f"{name}: not bit-identical to the int64 path")
    print(f"# correctness at n={n} L={length}: every path within rel 1e-2 / lse 2e-3 of float64, paged paths "
          f"bit-identical; " + ", ".join(f"{k} {e['o_rel']:.1e}" for k, e in errors.items()), flush=True)
    return errors


# --------------------------------------------------------------------------- timing


def time_paths(mm_rate: float, rep_ms: int, shapes=SHAPES, contiguous: bool = True, device: str = "cuda",
               bench_rotating=None, passes: int = 2) -> list[dict]:
    """Time every path at every shape (``bench_rotating``: _common's CUDA-graph timer unless
    given, e.g. a one-call stub for the CPU dry run)."""
    from benchmarks._common import rotation_count  # noqa: PLC0415

    if bench_rotating is None:
        from benchmarks._common import bench_rotating  # noqa: PLC0415
    dev = torch.device(device)
    rows = []
    for n, length in shapes:
        kv_bytes = length * HKV * D * 2 * DTYPE.itemsize
        rot = rotation_count(kv_bytes)
        sets = [new_prefix(n, length, dev, seed=100 + i) for i in range(rot)]
        outs = [(torch.empty_like(s[0]), torch.empty((n, HQ), device=dev)) for s in sets]
        tiles = policy.num_m_tiles(n, 1, HQ // HKV, policy.groups_tile_config(n, 1, HQ // HKV, D, DTYPE).block_m)
        splits = policy.default_num_splits(tiles, HKV, -(-length // PAGE) * PAGE, dev)
        row = dict(n=n, L=length, splits=splits, rotations=rot)
        runs = {name: [paged_runner(*st, *o, address) for st, o in zip(sets, outs)] for name, address in PATHS.items()}
        if contiguous:  # the same queries over each pool's prefix gathered contiguously
            kvs = [gather_paged_kv(unpack_paged_kv_cache(st[2], "NHD"), *st[3:], 0) for st in sets]
            runs.update({name: [contig_runner(st[0], *kv, *o, address) for st, kv, o in zip(sets, kvs, outs)]
                         for name, address in CONTIG_PATHS.items()})
        # Passes in alternating order (A B C .. C B A ..): drift of clocks or temperature
        # over a shape's timings falls on every path alike; the mean of the medians is kept.
        times = {name: [] for name in runs}
        for p in range(passes):
            for name in (list(runs) if p % 2 == 0 else list(runs)[::-1]):
                times[name].append(bench_rotating(runs[name], rep_ms=rep_ms))
        for name, ts in times.items():
            t = sum(ts) / len(ts)
            row[f"{name}_us"], row[f"{name}_mm"] = t * 1e6, flops(n, length) / t / mm_rate
            row[f"{name}_passes_us"] = [x * 1e6 for x in ts]
        del runs, sets
        if contiguous:
            del kvs
        row["speedup"] = row["int64_us"] / min(row[f"{k}_us"] for k in PATHS)
        rows.append(row)
        done = ", ".join(f"{k} {row[f'{k}_us']:.1f} us {row[f'{k}_mm']:.3f}" for k in times)
        print(f"# n {n} L {length} splits {splits}: {done}", flush=True)
        gc.collect()
        torch.cuda.empty_cache()
    return rows


# --------------------------------------------------------------------------- sm_90a report

_ADDRESS_OPS = ("IMAD", "IADD3", "LEA", "SHF", "LOP3", "SEL", "ISETP", "VIADD", "VIADDMNMX", "IMNMX", "PRMT")


def sass_report(config: policy.TileConfig | None = None) -> list[dict]:
    """Compile the paged kernel for sm_90a once per path (no GPU needed: triton.compile with a
    GPUTarget, the wheel's ptxas and cuobjdump) and read off the cubin: registers, spill
    bytes, and for the unmasked key loop (the first SASS loop with tensor-core MMAs) its
    instructions per tile, LDGSTS, LDG, integer/address instructions, local spills."""
    from benchmarks.tools.tune_prefix import compile_sm90  # noqa: PLC0415

    cfg = config or policy.default_tile_config(D, DTYPE)
    rows = []
    for name, address in PATHS.items():
        k, info, bindir = compile_sm90(cfg, address)
        base = f"/tmp/tune_prefix_offsets_{os.getpid()}"
        with open(base + ".cubin", "wb") as f:
            f.write(k.asm["cubin"])
        sass = subprocess.run([os.path.join(bindir, "cuobjdump"), "-sass", base + ".cubin"], capture_output=True,
                              text=True).stdout
        os.remove(base + ".cubin")
        code = [(int(m.group(1), 16), m.group(2).strip()) for line in sass.splitlines()
                if (m := re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", line))]
        at = {a: i for i, (a, _) in enumerate(code)}
        loop = []
        for i, (a, ins) in enumerate(code):  # a loop: a branch back to an earlier address
            m = re.search(r"\bBRA\b.*?(0x[0-9a-f]+)", ins)
            if m and int(m.group(1), 16) < a and int(m.group(1), 16) in at:
                body = [x for _, x in code[at[int(m.group(1), 16)]: i + 1]]
                if any("HGMMA" in x or "HMMA" in x for x in body):
                    loop = body
                    break
        ops = [re.sub(r"^@!?U?P\w+\s+", "", x).split()[0].split(".")[0] for x in loop]
        rows.append(dict(
            path=name,
            regs=int(re.search(r"Used (\d+) registers", info).group(1)),
            spill=int(re.search(r"(\d+) bytes spill stores", info).group(1)),
            loop_instrs=len(loop),
            int_addr=sum(o in _ADDRESS_OPS for o in ops),
            ldgsts=ops.count("LDGSTS"),
            ldg=ops.count("LDG"),
            loop_spill_ops=ops.count("STL") + ops.count("LDL"),
        ))
    return rows


# --------------------------------------------------------------------------- main


def table(rows: list[dict], contiguous: bool) -> str:
    names = [*PATHS, *(CONTIG_PATHS if contiguous else ())]
    head = "| n | L | splits | " + " | ".join(f"{k} us (frac)" for k in names) + " | speedup |"
    lines = [head, "|" + " --- |" * (len(names) + 4)]
    for r in rows:
        cells = [f"{r[f'{k}_us']:.1f} ({r[f'{k}_mm']:.3f})" for k in names]
        lines.append(f"| {r['n']} | {r['L'] // 1024}K | {r['splits']} | " + " | ".join(cells)
                     + f" | {r['speedup']:.3f}x |")
    return "\n".join(lines)


def smoke() -> None:
    """The correctness check through the CPU interpreter at a tiny shape."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("--smoke: run with TRITON_INTERPRET=1 (and no GPU)")
    from tests.conftest import _patch_interpreter  # noqa: F401,PLC0415  (conftest patches on import)

    torch.set_num_threads(1)
    check_paths(torch.device("cpu"), shape=(3, 300))

    def one_call(fns, rep_ms):  # noqa: ARG001
        for f in fns[:1]:
            f()
        return 1e-3

    rows = time_paths(1e12, 1, shapes=((3, 300),), device="cpu", bench_rotating=one_call)
    print(table(rows, True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sass", action="store_true", help="compile-only sm_90a report (no GPU needed)")
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter dry run of the checks")
    ap.add_argument("--rep-ms", type=int, default=60, help="do_bench_cudagraph rep per timing")
    ap.add_argument("--passes", type=int, default=2, help="timings per path and shape (alternating order)")
    ap.add_argument("--no-contiguous", action="store_true", help="skip the contiguous K/V rows")
    ap.add_argument("--json", metavar="PATH", help="write the results and the environment here as JSON")
    args = ap.parse_args()
    if args.smoke:
        smoke()
        return
    if args.sass:
        from benchmarks._common import markdown_table  # noqa: PLC0415

        print(markdown_table(sass_report(), ["path", "regs", "spill", "loop_instrs", "int_addr", "ldgsts", "ldg",
                                             "loop_spill_ops"]))
        return
    if not torch.cuda.is_available():
        sys.exit("tune_prefix_offsets needs a CUDA device (or --sass / --smoke)")
    from benchmarks._common import environment, measure_matmul_rate, write_json  # noqa: PLC0415

    t0 = time.perf_counter()
    env = environment()
    print(f"# {env}", flush=True)
    errors = check_paths(torch.device("cuda"))
    mm_rate = measure_matmul_rate()
    print(f"# bf16 matmul {mm_rate / 1e12:.0f} TFLOP/s", flush=True)
    rows = time_paths(mm_rate, args.rep_ms, contiguous=not args.no_contiguous, passes=args.passes)
    write_json(args.json, dict(
        env=env, matmul_flops=mm_rate, correctness=errors, results=rows,
        paths={k: str(v) for k, v in {**PATHS, **CONTIG_PATHS}.items()}, config=str(policy.default_tile_config(D, DTYPE))))
    print(f"\n## prefix kernel address paths: us (fraction of the bf16 matmul rate, {mm_rate / 1e12:.0f} TFLOP/s); "
          f"one group of n queries over an L-token prefix, bf16 Hq={HQ} Hkv={HKV} D={D} page {PAGE}, default "
          f"tiles and splits; speedup = int64 / best paged path\n")
    print(table(rows, not args.no_contiguous))
    print(f"\n# total {time.perf_counter() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
