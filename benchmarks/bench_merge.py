"""Merge-state kernels against the copy-bandwidth roofline and FlashInfer.

Run from the repository root on a GPU machine:

    python -m benchmarks.bench_merge            # correctness, then the timing table
    python -m benchmarks.bench_merge --sweep    # also time a grid of launch configs

8192 rows x 32 heads x 128 dims, bf16 and fp16: merge_state (2 states), merge_states
(2 and 16 states), merge_state_in_place, merge_states_ragged (16 states per row on
average, 1 to 31). The kernels are bandwidth-bound, so each result is given as achieved
GB/s (bytes read + written, values and LSEs) beside the measured kernel-copy bandwidth
and the fraction of it. FlashInfer's merge_state / merge_state_in_place / merge_states run
on the same inputs when it is installed (its LSE is base 2: converted for the check).
Every timing is a CUDA-graph replay median over input sets rotated so that nothing is
served from L2. Correctness against the float64 reference runs first, on the GPU. JSON
goes to --json PATH.
"""

from __future__ import annotations

import argparse
import math

import torch

from benchmarks._common import (
    bench_rotating,
    environment,
    load_flashinfer,
    markdown_table,
    measure_copy_bandwidth,
    rotation_count,
    write_json,
)
from cascadeinfer._device import next_power_of_2
from cascadeinfer.kernels import policy
from cascadeinfer.kernels.merge import (
    launch_merge_two,
    merge_state,
    merge_state_in_place,
)
from cascadeinfer.kernels.merge_many import (
    launch_merge_many,
    merge_states,
    merge_states_ragged,
)
from cascadeinfer.kernels.reference import merge_states_ragged_ref, merge_states_ref

N, H, D = 8192, 32, 128
DTYPES = (torch.bfloat16, torch.float16)
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
TOL = {torch.bfloat16: 1.5e-2, torch.float16: 2e-3, torch.float32: 2e-5}


# ----------------------------------------------------------------------------------
# inputs
# ----------------------------------------------------------------------------------


def states(lead: tuple[int, ...], dtype: torch.dtype, *, empty: float = 0.05):
    """Random values [*lead, H, D] and natural-log LSEs [*lead, H] with wide gaps and some empties."""
    v = torch.randn(*lead, H, D, device="cuda", dtype=dtype)
    s = torch.randn(*lead, H, device="cuda") * 4
    s = s + 40.0 * torch.randint(-1, 2, s.shape, device="cuda")
    s = torch.where(torch.rand(s.shape, device="cuda") < empty, -math.inf, s)
    return v, s


def ragged_indptr(n: int, seed: int = 0) -> torch.Tensor:
    counts = torch.randint(1, 32, (n,), generator=torch.Generator().manual_seed(seed))
    return torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]).to(torch.int32).cuda()


def state_bytes(num_states: int, rows: int, dtype: torch.dtype) -> int:
    """Bytes read for ``num_states`` states of ``rows`` rows plus one state written."""
    per_state = rows * H * (D * dtype.itemsize + 4)
    return (num_states + 1) * per_state


# ----------------------------------------------------------------------------------
# correctness on the GPU, first
# ----------------------------------------------------------------------------------


def assert_close_state(name, o, lse, ref_o, ref_lse, dtype) -> None:
    assert torch.equal(torch.isnan(lse), torch.isnan(ref_lse)), f"{name}: NaN pattern of lse"
    assert not torch.isnan(o[~torch.isnan(ref_lse)]).any(), f"{name}: NaN in v"
    assert torch.equal(lse == -math.inf, ref_lse == -math.inf), f"{name}: -inf pattern of lse"
    ok = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[ok].double(), ref_lse[ok], atol=1e-5, rtol=2e-6, msg=lambda m: f"{name} lse: {m}")
    tol = TOL[dtype]
    torch.testing.assert_close(o.double(), ref_o, atol=tol, rtol=tol, msg=lambda m: f"{name} v: {m}")


def check_correctness(fi) -> list[str]:
    """Our four functions (and FlashInfer's three) against the float64 reference."""
    notes = []
    rows = 1024
    for dtype in DTYPES:
        v, s = states((rows, 16), dtype)
        ref2 = merge_states_ref(v[:, :2], s[:, :2])
        assert_close_state("merge_state", *merge_state(v[:, 0], s[:, 0], v[:, 1], s[:, 1]), *ref2, dtype)
        acc_v, acc_s = v[:, 0].clone(), s[:, 0].clone()
        mask = torch.rand(rows, device="cuda") < 0.5
        merge_state_in_place(acc_v, acc_s, v[:, 1], s[:, 1], mask=mask)
        assert_close_state("merge_state_in_place", acc_v[mask], acc_s[mask], ref2[0][mask], ref2[1][mask], dtype)
        assert torch.equal(acc_v[~mask], v[:, 0][~mask]), "merge_state_in_place touched an unmarked row"
        for num_states in (2, 5, 16):
            assert_close_state(f"merge_states S={num_states}", *merge_states(v[:, :num_states], s[:, :num_states]),
                               *merge_states_ref(v[:, :num_states], s[:, :num_states]), dtype)
        indptr = ragged_indptr(rows)
        vr, sr = states((int(indptr[-1]),), dtype)
        assert_close_state("merge_states_ragged", *merge_states_ragged(vr, sr, indptr),
                           *merge_states_ragged_ref(vr, sr, indptr), dtype)
        if fi is not None:
            # FlashInfer wants contiguous tensors and makes NaN of two empties: no empties here.
            # Its LSE is base 2: in with log2(e), out with ln(2).
            v, s = states((rows, 16), dtype, empty=0.0)
            va, sa, vb, sb = (t.contiguous() for t in (v[:, 0], s[:, 0], v[:, 1], s[:, 1]))
            try:
                fo, fl = fi.merge_state(va, sa * LOG2E, vb, sb * LOG2E)
                assert_close_state("flashinfer.merge_state", fo, fl * LN2, *merge_states_ref(v[:, :2], s[:, :2]), dtype)
                fo, fl = fi.merge_states(v, s * LOG2E)
                assert_close_state("flashinfer.merge_states", fo, fl * LN2, *merge_states_ref(v, s), dtype)
            except AssertionError as exc:
                notes.append(f"flashinfer check failed ({dtype}): {str(exc).splitlines()[0]}")
    torch.cuda.synchronize()
    return notes


# ----------------------------------------------------------------------------------
# timing
# ----------------------------------------------------------------------------------


REP_MS = 200  # do_bench_cudagraph's rep per timing (--rep-ms)


def timed(label: str, impl: str, dtype: torch.dtype, num_states, nbytes: int, make_call, copy_bw: float) -> dict:
    """``make_call()`` builds one input set and returns a zero-argument call on it."""
    calls = [make_call() for _ in range(rotation_count(nbytes))]
    seconds = bench_rotating(calls, rep_ms=REP_MS)
    del calls
    torch.cuda.empty_cache()
    gbps = nbytes / seconds / 1e9
    return {
        "kernel": label, "impl": impl, "dtype": str(dtype).removeprefix("torch."), "states": num_states,
        "rows": N, "heads": H, "head_dim": D, "MB": nbytes / 1e6, "us": seconds * 1e6,
        "floor_us": nbytes / copy_bw * 1e6, "GB/s": gbps, "copy GB/s": copy_bw / 1e9,
        "fraction": gbps / (copy_bw / 1e9),
    }


def two_state_call(fn, dtype, *, in_place=False):
    """Two separate contiguous states (FlashInfer assumes contiguous tensors)."""
    def make():
        (v_a, s_a), (v_b, s_b) = states((N,), dtype), states((N,), dtype)
        if in_place:
            return lambda: fn(v_a, s_a, v_b, s_b)
        if fn is merge_state:
            out = torch.empty(N, H, D, device="cuda", dtype=dtype)
            lse = torch.empty(N, H, device="cuda")
            return lambda: fn(v_a, s_a, v_b, s_b, out=out, out_lse=lse)
        return lambda: fn(v_a, s_a, v_b, s_b)

    return make


def many_state_call(fn, dtype, num_states):
    def make():
        v, s = states((N, num_states), dtype)
        if fn is merge_states:
            out = torch.empty(N, H, D, device="cuda", dtype=dtype)
            lse = torch.empty(N, H, device="cuda")
            return lambda: fn(v, s, out=out, out_lse=lse)
        return lambda: fn(v, s)

    return make


def ragged_call(dtype, indptr):
    def make():
        v, s = states((int(indptr[-1]),), dtype)
        out = torch.empty(N, H, D, device="cuda", dtype=dtype)
        lse = torch.empty(N, H, device="cuda")
        return lambda: merge_states_ragged(v, s, indptr, out=out, out_lse=lse, validate=False)

    return make


def run_table(fi, copy_bw: float) -> list[dict]:
    rows = []
    for dtype in DTYPES:
        nb2 = state_bytes(2, N, dtype)
        rows.append(timed("merge_state", "ours", dtype, 2, nb2, two_state_call(merge_state, dtype), copy_bw))
        if fi is not None:
            rows.append(timed("merge_state", "flashinfer", dtype, 2, nb2, two_state_call(fi.merge_state, dtype), copy_bw))
        rows.append(timed("merge_state_in_place", "ours", dtype, 2, nb2,
                          two_state_call(merge_state_in_place, dtype, in_place=True), copy_bw))
        if fi is not None:
            rows.append(timed("merge_state_in_place", "flashinfer", dtype, 2, nb2,
                              two_state_call(fi.merge_state_in_place, dtype, in_place=True), copy_bw))
        for num_states in (2, 16):
            nb = state_bytes(num_states, N, dtype)
            rows.append(timed("merge_states", "ours", dtype, num_states, nb,
                              many_state_call(merge_states, dtype, num_states), copy_bw))
            if fi is not None:
                rows.append(timed("merge_states", "flashinfer", dtype, num_states, nb,
                                  many_state_call(fi.merge_states, dtype, num_states), copy_bw))
        indptr = ragged_indptr(N, seed=1)
        nnz = int(indptr[-1])
        nb = (nnz + N) * H * (D * dtype.itemsize + 4) + (N + 1) * 4
        rows.append(timed("merge_states_ragged", "ours", dtype, f"1-31 (mean {nnz / N:.1f})", nb,
                          ragged_call(dtype, indptr), copy_bw))
    return rows


# (BLOCK_H, num_warps, UNROLL) of the many-state kernel at bf16, D=128 that build for sm_90a
# without spills (ptxas -v: the 3-D value tiles cost registers fast; the others spill).
MANY = ((2, 1, 2), (2, 1, 4), (2, 1, 8), (2, 1, 16), (4, 1, 2), (4, 1, 4), (4, 1, 8), (4, 2, 2), (4, 2, 4),
        (4, 2, 8), (4, 2, 16), (8, 1, 2), (8, 1, 4), (8, 2, 2), (8, 2, 4), (8, 4, 2), (8, 4, 4), (8, 4, 8),
        (8, 4, 16), (16, 2, 2), (16, 4, 2), (16, 8, 2), (16, 8, 4), (32, 4, 2), (32, 8, 2))


def run_sweep(copy_bw: float) -> list[dict]:
    """Launch configs around the defaults, bf16, through the internal launchers: the
    two-state kernel at 1, 2 and 4 vectors a thread, the many-state kernel at the configs
    that build without spills (benchmarks/tools/tune_merge.py has the full sweep)."""
    dtype = torch.bfloat16
    rows = []
    dev = torch.device("cuda", torch.cuda.current_device())
    two_default = policy.merge_tile_config(N, H, D, dtype.itemsize, dev, policy.MERGE_TWO_TILE)
    many_default = policy.merge_tile_config(N, H, D, dtype.itemsize, dev, policy.MERGE_MANY_TILE)
    for block_h, num_warps in ((4, 1), (8, 2), (8, 4), (16, 2), (16, 4), (16, 8), (32, 4), (32, 8)):
        config = (block_h, next_power_of_2(D), num_warps)
        tag = f"BLOCK_H={block_h} warps={num_warps}" + (" (default)" if config == two_default else "")

        def make_two(config=config):
            v, s = states((N, 2), dtype)
            out, lse = torch.empty(N, H, D, device="cuda", dtype=dtype), torch.empty(N, H, device="cuda")
            return lambda: launch_merge_two(v[:, 0], s[:, 0], v[:, 1], s[:, 1], out, lse, None, config=config)

        rows.append(timed("merge_state", tag, dtype, 2, state_bytes(2, N, dtype), make_two, copy_bw))
    for block_h, num_warps, unroll in MANY:
        config = (block_h, next_power_of_2(D), num_warps)
        default = config == many_default and unroll == policy.MERGE_MAX_UNROLL
        tag = f"BLOCK_H={block_h} warps={num_warps} unroll={unroll}" + (" (default)" if default else "")

        def make_many(config=config, unroll=unroll):
            v, s = states((N, 16), dtype)
            out, lse = torch.empty(N, H, D, device="cuda", dtype=dtype), torch.empty(N, H, device="cuda")
            return lambda: launch_merge_many(v, s, None, out, lse, config=config, unroll=unroll)

        rows.append(timed("merge_states", tag, dtype, 16, state_bytes(16, N, dtype), make_many, copy_bw))
    return rows


def main() -> None:
    global REP_MS
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also time a grid of launch configs")
    parser.add_argument("--rep-ms", type=int, default=REP_MS, help="do_bench_cudagraph rep per timing")
    parser.add_argument("--json", metavar="PATH", help="write the results and the environment here as JSON")
    args = parser.parse_args()
    REP_MS = args.rep_ms
    torch.manual_seed(0)
    fi = load_flashinfer()
    notes = check_correctness(fi)
    print("# correctness against the float64 reference: ok" + "".join(f"\n# {n}" for n in notes))
    copy_bw = measure_copy_bandwidth()
    print(f"# kernel-copy bandwidth: {copy_bw / 1e9:.0f} GB/s (read + write)")
    rows = run_table(fi, copy_bw)
    sweep = run_sweep(copy_bw) if args.sweep else []
    columns = ["kernel", "impl", "dtype", "states", "MB", "us", "floor_us", "GB/s", "copy GB/s", "fraction"]
    write_json(args.json, {"environment": environment(), "copy_bw": copy_bw, "notes": notes,
                                    "rows": rows, "sweep": sweep})
    if sweep:
        print("\n## launch-config sweep (bf16, 8192 x 32 x 128)\n")
        print(markdown_table(sweep, columns))
    print(f"\n## merge kernels, {N} rows x {H} heads x {D} dims\n")
    print(markdown_table(rows, columns))


if __name__ == "__main__":
    main()
