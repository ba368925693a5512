"""Launch-config sweep for the merge kernels (one GPU call, self-checking).

    python -m benchmarks.tools.tune_merge [--budget SECONDS]

8192 rows x 32 heads x 128 dims, bf16 (the shapes of benchmarks/bench_merge.py), plus the
small fp32 -> bf16 merges that batch_decode_paged's stage 2 runs. Order:

1. correctness on the GPU of every config timed below against the float64 reference;
2. measured copy bandwidth (bytes read + written);
3. the HEAD kernels (benchmarks/_merge_v0.py, if present) and FlashInfer, then a sweep
   of (BLOCK_H, num_warps) for the two-state kernel and (BLOCK_H, num_warps, UNROLL) for
   the many-state kernel (16 states, then the best few on ragged rows of 1 to 31
   states), then the decode stage-2 shapes. Times are medians of 10 replays of a CUDA
   graph of many calls over two input sets (together more than 3x L2) for the large
   shapes, one set for the small L2-resident stage-2 shapes;
4. tables, best config per case.

JSON: --json PATH.
"""

from __future__ import annotations

import argparse
import importlib
import math
import sys
import time

import torch

from benchmarks._common import environment, load_flashinfer, markdown_table, write_json
from benchmarks.bench_merge import MANY, assert_close_state
from benchmarks.tools import tune_decode
from benchmarks.tools.tune_decode import copy_bandwidth, graph_seconds
from cascadeinfer.kernels.merge import launch_merge_two, merge_state
from cascadeinfer.kernels.merge_many import (
    launch_merge_many,
    merge_states,
    merge_states_ragged,
    merge_states_unchecked,
)
from cascadeinfer.kernels.reference import merge_states_ragged_ref, merge_states_ref

N, H, D = 8192, 32, 128
DT = torch.bfloat16
DEV = "cuda"


def states(lead, dtype, *, empty=0.05):
    """Random values [*lead, H, D] and natural-log LSEs [*lead, H] with wide gaps and some empties."""
    v = torch.randn(*lead, H, D, device=DEV, dtype=dtype)
    s = torch.randn(*lead, H, device=DEV) * 4
    s = s + 40.0 * torch.randint(-1, 2, s.shape, device=DEV)
    s = torch.where(torch.rand(s.shape, device=DEV) < empty, -math.inf, s)
    return v, s


def ragged_indptr(n: int, seed: int = 0) -> torch.Tensor:
    counts = torch.randint(1, 32, (n,), generator=torch.Generator().manual_seed(seed))
    return torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]).to(DEV, torch.int32)


def state_bytes(num_states: int, rows: int, dtype: torch.dtype) -> int:
    """Bytes read for ``num_states`` states of ``rows`` rows plus one state written."""
    return (num_states + 1) * rows * H * (D * dtype.itemsize + 4)


def two_configs():
    for bh, warps in ((4, 1), (4, 2), (8, 1), (8, 2), (8, 4), (16, 1), (16, 2), (16, 4), (16, 8),
                      (32, 2), (32, 4), (32, 8), (32, 16)):
        yield (bh, D, warps)


# the HEAD many-state kernel (2-D tiles, statically unrolled groups) around its default
HEAD_MANY = ((16, 4, 4), (16, 4, 8), (8, 2, 4), (8, 2, 8), (8, 4, 4), (32, 8, 4), (4, 1, 4), (4, 1, 8))


def many_configs():
    for bh, warps, unroll in MANY:
        yield (bh, D, warps), unroll


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=float, default=90.0, help="seconds after which no new measurement starts")
    ap.add_argument("--dry-run", action="store_true", help="CPU, TRITON_INTERPRET=1, tiny shapes, no timing")
    ap.add_argument("--json", metavar="PATH", help="write the results and the environment here as JSON")
    args = ap.parse_args()
    global N, H, DEV
    if args.dry_run:
        from tests.conftest import _patch_interpreter  # noqa: F401,PLC0415  (conftest patches on import)
        N, H, DEV = 3, 4, "cpu"
        tune_decode.DEV, tune_decode.DRY = "cpu", True
    t0 = time.time()
    deadline = t0 + args.budget
    torch.manual_seed(0)
    env = environment()
    print(f"# {env}", flush=True)
    fi = load_flashinfer()
    try:
        v0 = importlib.import_module("benchmarks._merge_v0")
    except ImportError:
        v0 = None
    rows: list[dict] = []

    # ---- correctness of every config first (small rows, all on the GPU)
    small = 3 if args.dry_run else 512
    va, sa = states((small, 16), DT)
    ref2 = merge_states_ref(va[:, :2], sa[:, :2])
    ref16 = merge_states_ref(va, sa)
    indptr_s = ragged_indptr(small)
    vr, sr = states((int(indptr_s[-1]),), DT)
    refr = merge_states_ragged_ref(vr, sr, indptr_s)
    for cfg in two_configs():
        o, l = torch.empty(small, H, D, device=DEV, dtype=DT), torch.empty(small, H, device=DEV)
        launch_merge_two(va[:, 0], sa[:, 0], va[:, 1], sa[:, 1], o, l, None, config=cfg)
        assert_close_state(f"two {cfg}", o, l, *ref2, DT)
    for cfg, unroll in many_configs():
        o, l = torch.empty(small, H, D, device=DEV, dtype=DT), torch.empty(small, H, device=DEV)
        launch_merge_many(va, sa, None, o, l, config=cfg, unroll=unroll)
        assert_close_state(f"many {cfg} u{unroll}", o, l, *ref16, DT)
        launch_merge_many(vr, sr, indptr_s, o, l, config=cfg, unroll=unroll)
        assert_close_state(f"ragged {cfg} u{unroll}", o, l, *refr, DT)
    assert_close_state("merge_states S=2", *merge_states(va[:, :2], sa[:, :2]), *ref2, DT)
    of = torch.empty(small, H, D, device=DEV, dtype=torch.float32)
    merge_states(va, sa, out=of)
    assert_close_state("merge_states fp32 out", of, merge_states(va, sa)[1], *ref16, torch.float32)
    print(f"# correctness vs float64: ok (all configs; {time.time() - t0:.0f} s)", flush=True)

    copy_bw = copy_bandwidth()
    print(f"# copy bandwidth {copy_bw / 1e9:.0f} GB/s", flush=True)

    def record(case, impl, nbytes, seconds, **extra):
        row = dict(case=case, impl=impl, us=seconds * 1e6, frac=nbytes / seconds / copy_bw, **extra)
        rows.append(row)
        print(f"# {case:24s} {impl:34s} {row['us']:8.2f} us  {row['frac']:.3f}", flush=True)

    # ---- large shapes: two input sets rotated
    sets2 = [(states((N,), DT), states((N,), DT)) for _ in range(2)]
    outs = [(torch.empty(N, H, D, device=DEV, dtype=DT), torch.empty(N, H, device=DEV)) for _ in range(2)]
    nb2 = state_bytes(2, N, DT)

    def two_calls(fn):
        return [lambda i=i: fn(*sets2[i][0], *sets2[i][1], *outs[i]) for i in range(2)]

    record("merge_state", "ours default", nb2,
           graph_seconds(two_calls(lambda a, sa_, b, sb, o, l: merge_state(a, sa_, b, sb, out=o, out_lse=l))))
    if v0 is not None:
        record("merge_state", "HEAD", nb2,
               graph_seconds(two_calls(lambda a, sa_, b, sb, o, l: v0.merge_state(a, sa_, b, sb, out=o, out_lse=l))))
    if fi is not None:
        record("merge_state", "flashinfer", nb2, graph_seconds(two_calls(
            lambda a, sa_, b, sb, o, l: fi.merge_state(a, sa_, b, sb))))
    for cfg in two_configs():
        if time.time() > deadline:
            break
        record("merge_state", f"two bh{cfg[0]} w{cfg[2]}", nb2, graph_seconds(two_calls(
            lambda a, sa_, b, sb, o, l, cfg=cfg: launch_merge_two(a, sa_, b, sb, o, l, None, config=cfg))),
            cfg=list(cfg))

    # merge_states with 2 states (strided views of [N, 2, H, D])
    dense2 = [states((N, 2), DT) for _ in range(2)]
    record("merge_states S=2", "ours default", nb2, graph_seconds(
        [lambda i=i: merge_states(*dense2[i], out=outs[i][0], out_lse=outs[i][1]) for i in range(2)]))
    if v0 is not None:
        record("merge_states S=2", "HEAD", nb2, graph_seconds(
            [lambda i=i: v0.merge_states(*dense2[i], out=outs[i][0], out_lse=outs[i][1]) for i in range(2)]))
    if fi is not None:
        record("merge_states S=2", "flashinfer", nb2, graph_seconds(
            [lambda i=i: fi.merge_states(*dense2[i]) for i in range(2)]))
    del dense2, sets2

    dense16 = [states((N, 16), DT) for _ in range(2)]
    nb16 = state_bytes(16, N, DT)

    def many_calls(fn):
        return [lambda i=i: fn(*dense16[i], *outs[i]) for i in range(2)]

    record("merge_states S=16", "ours default", nb16,
           graph_seconds(many_calls(lambda v, s, o, l: merge_states(v, s, out=o, out_lse=l))))
    if v0 is not None:
        record("merge_states S=16", "HEAD", nb16,
               graph_seconds(many_calls(lambda v, s, o, l: v0.merge_states(v, s, out=o, out_lse=l))))
    if fi is not None:
        record("merge_states S=16", "flashinfer", nb16, graph_seconds(many_calls(lambda v, s, o, l: fi.merge_states(v, s))))
    for cfg, unroll in many_configs():
        if time.time() > deadline:
            break
        record("merge_states S=16", f"many bh{cfg[0]} w{cfg[2]} u{unroll}", nb16, graph_seconds(many_calls(
            lambda v, s, o, l, cfg=cfg, unroll=unroll: launch_merge_many(v, s, None, o, l, config=cfg,
                                                                            unroll=unroll))),
            cfg=list(cfg), unroll=unroll)
    if v0 is not None:
        for bh, warps, unroll in HEAD_MANY:
            if time.time() > deadline:
                break
            cfg = (bh, D, warps)
            record("merge_states S=16", f"HEAD-kernel bh{bh} w{warps} u{unroll}", nb16, graph_seconds(many_calls(
                lambda v, s, o, l, cfg=cfg, unroll=unroll: v0._launch_many(v, s, None, o, l, config=cfg,
                                                                            state_blocks=(16, unroll)))),
                cfg=list(cfg), unroll=unroll, head_kernel=True)
    del dense16

    indptr = ragged_indptr(N, seed=1)
    nnz = int(indptr[-1])
    ragged = [states((nnz,), DT) for _ in range(2)]
    nbr = (nnz + N) * H * (D * DT.itemsize + 4) + (N + 1) * 4
    record("ragged 1-31", "ours default", nbr, graph_seconds(
        [lambda i=i: merge_states_ragged(*ragged[i], indptr, out=outs[i][0], out_lse=outs[i][1], validate=False)
         for i in range(2)]))
    if v0 is not None:
        record("ragged 1-31", "HEAD", nbr, graph_seconds(
            [lambda i=i: v0.merge_states_ragged(*ragged[i], indptr, out=outs[i][0], out_lse=outs[i][1],
                                                validate=False) for i in range(2)]))
    cand = sorted((r for r in rows if r["case"] == "merge_states S=16" and "cfg" in r), key=lambda r: r["us"])
    best16 = [r for r in cand if not r.get("head_kernel")][:6] + [r for r in cand if r.get("head_kernel")][:2]
    for r in best16:
        if time.time() > deadline:
            break
        cfg, unroll = tuple(r["cfg"]), r["unroll"]
        if r.get("head_kernel"):
            calls = [lambda i=i, cfg=cfg, unroll=unroll: v0._launch_many(*ragged[i], indptr, *outs[i], config=cfg,
                                                                         state_blocks=(16, unroll)) for i in range(2)]
        else:
            calls = [lambda i=i, cfg=cfg, unroll=unroll: launch_merge_many(*ragged[i], indptr, *outs[i],
                                                                             config=cfg, unroll=unroll)
                     for i in range(2)]
        record("ragged 1-31", r["impl"], nbr, graph_seconds(calls), cfg=list(cfg), unroll=unroll,
               head_kernel=bool(r.get("head_kernel")))
    del ragged, outs
    if not args.dry_run:
        torch.cuda.empty_cache()

    # ---- decode stage 2: fp32 partial states -> bf16 out, small and L2-resident
    for n, s_count in ((1, 33), (1, 66), (4, 16), (16, 4), (16, 3)):
        if time.time() > deadline:
            break
        v = torch.randn(n, s_count, H, D, device=DEV)
        s = torch.randn(n, s_count, H, device=DEV)
        o = torch.empty(n, H, D, device=DEV, dtype=DT)
        l = torch.empty(n, H, device=DEV)
        ref = merge_states_ref(v, s)
        nb = n * s_count * H * (D * 4 + 4) + n * H * (D * 2 + 4)
        case = f"stage2 n{n} S{s_count}"
        record(case, "ours default", nb, graph_seconds([lambda: merge_states_unchecked(v, s, o, l)]))
        for bh, bd, warps, unroll in ((1, 128, 1, 4), (1, 128, 1, 8), (1, 128, 1, 16), (1, 128, 2, 16),
                                      (1, 128, 1, 32), (2, 128, 2, 8), (4, 128, 4, 4), (4, 128, 4, 8)):
            if s_count <= 4 and unroll > 4:
                continue
            launch_merge_many(v, s, None, o, l, config=(bh, bd, warps), unroll=unroll)
            assert_close_state(case, o, l, *ref, DT)
            record(case, f"many bh{bh} w{warps} u{unroll}", nb, graph_seconds(
                [lambda bh=bh, bd=bd, warps=warps, unroll=unroll: launch_merge_many(
                    v, s, None, o, l, config=(bh, bd, warps), unroll=unroll)]),
                cfg=[bh, bd, warps], unroll=unroll)

    write_json(args.json, dict(env=env, copy_Bps=copy_bw, rows=rows))
    print(f"\n## tune_merge (copy bandwidth {copy_bw / 1e9:.0f} GB/s; frac = of copy bandwidth)\n")
    print(markdown_table(rows, ["case", "impl", "us", "frac"]))
    best = []
    for case in dict.fromkeys(r["case"] for r in rows):
        cand = [r for r in rows if r["case"] == case]
        top = sorted(cand, key=lambda r: r["us"])[:3]
        ref_rows = {r["impl"]: r for r in cand}
        best.append(dict(case=case, best=" / ".join(f"{r['impl']} {r['frac']:.3f}" for r in top),
                         default=ref_rows.get("ours default", {}).get("frac"),
                         head=ref_rows.get("HEAD", {}).get("frac"), fi=ref_rows.get("flashinfer", {}).get("frac")))
    print("\n## best per case\n")
    print(markdown_table(best, ["case", "default", "head", "fi", "best"]))
    print(f"# total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
