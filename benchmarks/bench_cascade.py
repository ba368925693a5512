"""Shared-prefix batch decode: MultiLevelCascadeAttention (cascade, flat, planner) against
FlashInfer and PyTorch SDPA, each beside its roofline floor.

Run from the repository root on a GPU machine:

    python -m benchmarks.bench_cascade                      # --bar and --generality
    python -m benchmarks.bench_cascade --bar                # the four bar shapes only
    python -m benchmarks.bench_cascade --generality         # Hkv 1/32 and head_dim 64/256 only
    python -m benchmarks.bench_cascade --grid --quick --plot PNG  # planner check + speedup plot, a subset
    python -m benchmarks.bench_cascade --grid --hkv 8       # the full grid, one Hkv per device call
    python -m benchmarks.bench_cascade --smoke              # tiny shapes; runs on a CPU (no timing claims)

Workload: bf16, Hq=32, one query token per request, page 16, two levels: level 0 is one
group (every request) over a shared prefix, level 1 is each request's own suffix. All used
pages are randomly permuted over a pool of at least 256 MiB; several pools (with their own
queries) are rotated inside one captured CUDA graph so the shared prefix is not served
from L2 between calls (one pool when it alone exceeds 3x L2; shapes whose rotations still
fit in 3x L2 are marked). Timing is CUDA-graph replay, median (``_common.bench_rotating``).

Side by side, on the same pools and page tables:

* ours cascade: ``MultiLevelCascadeAttention.plan(..., use_cascade=True)`` + ``run``;
* ours cascade, Hopper prefix: the same with ``backend="hopper"`` (compute capability 9.0
  only; a prefix level the Hopper kernel declines is reported, not timed);
* ours flat: ``use_cascade=False`` (one paged decode over each request's concatenated pages);
* ours planner: ``use_cascade=None``; its time is that of the path it picked, and the
  check is that it is within 5% of the better of cascade and flat (PASS/FAIL);
* FI cascade: FlashInfer's fastest cascade, two ``BatchPrefillWithPagedKVCacheWrapper
  (backend="fa2")`` levels + ``flashinfer.merge_state_in_place``;
* FI shipped: ``flashinfer.MultiLevelCascadeAttentionWrapper(2, ...)`` (fa3 on Hopper);
* FI flat: ``BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=True)`` over the
  concatenated page lists;
* SDPA: ``F.scaled_dot_product_attention(enable_gqa=True)`` on K/V gathered into
  contiguous ``[batch, Hkv, prefix + suffix, D]`` tensors — not paged, the gather is not
  timed, and it reads the prefix once per request; only where the copy fits in memory.

Before timing, each shape is checked on the GPU: ours cascade/flat/planner and every
peer against ours cascade on all requests and against a float64 reference on a few
sampled ones (FlashInfer's base-2 LSE times ln 2 is ours). A peer that fails to plan,
run or agree is reported as "—" with the reason on stderr; a mismatch of ours marks the
row FAIL and the script exits with status 1 after writing everything.

Roofline floor per shape: ``max(bytes / copy bandwidth, FLOPs / bf16 matmul rate)`` with
both ceilings measured in this run; bytes = the unique K/V (prefix once + every suffix)
+ q + o; FLOPs = 4 * batch * (prefix + suffix) * Hq * D. Fraction = floor / time.

Markdown tables go to stdout (for benchmarks/RESULTS.md), JSON with every row and the
environment to --json PATH, and for --grid a plot of the cascade speedup over
flat decode against prefix length to --plot PNG, when given (and matplotlib imports).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from benchmarks._common import (
    environment,
    load_flashinfer,
    markdown_table,
    measure_copy_bandwidth,
    measure_matmul_rate,
    roofline_floor,
    write_json,
)
from benchmarks.fixtures import (
    BAR_SHAPES,
    DTYPE,
    HQ,
    MAX_ROTATIONS,
    MIN_POOL_BYTES,
    PAGE,
    Method,
    Shape,
    Workload,
    fi_cascade,
    fi_flat,
    fi_shipped,
    make_timer,
    ours,
    sdpa,
)
from cascadeinfer.kernels.backend import hopper_unavailable

BAR_HEADS = ((8, 128),)  # (Hkv, head_dim)
GENERALITY_HEADS = ((1, 128), (32, 128), (8, 64), (8, 256))
FI_PREBUILT_HEAD_DIMS = (128,)  # the AOT package ships bf16 head_dim 128 kernels only

GRID_BATCHES = (1, 16, 64, 256, 512)
GRID_PREFIXES = (128, 1024, 8192, 65536)
GRID_SUFFIXES = (16, 256, 4096)
GRID_HKV = (1, 8, 32)
GRID_HEAD_DIM = 128
MAX_GRID_KV_BYTES = 30e9  # skip grid combinations whose unique K/V is larger

PLANNER_TOLERANCE = 1.05

METHODS = ("cascade", "hopper", "flat", "planner", "fi_cascade", "fi_shipped", "fi_flat", "sdpa")
OURS = ("cascade", "flat", "planner")
METHOD_TITLES = {
    "cascade": "ours cascade",
    "hopper": "ours cascade, Hopper prefix",
    "flat": "ours flat",
    "planner": "ours planner",
    "fi_cascade": "FI cascade (fa2 x2 + merge)",
    "fi_shipped": "FI shipped (MultiLevel, fa3)",
    "fi_flat": "FI flat decode (tensor cores)",
    "sdpa": "SDPA (contiguous, not paged)",
}
OUT_ATOL = OUT_RTOL = 2e-2  # bf16 outputs
LSE_ATOL = LSE_RTOL = 2e-3  # float32 LSE of bf16 products


def log(msg: str) -> None:
    print(msg, flush=True)


def warn(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300] if text else ''}"


# --------------------------------------------------------------------------- checks and timing


def mismatch(what: str, got: torch.Tensor, want: torch.Tensor, atol: float, rtol: float) -> str | None:
    """None when ``got`` matches ``want`` elementwise (and is finite where ``want`` is)."""
    got, want = got.double(), want.double()
    if got.shape != want.shape:
        return f"{what}: shape {list(got.shape)} vs {list(want.shape)}"
    err = (got - want).abs()
    bad = ~(err <= atol + rtol * want.abs())  # NaN counts as bad
    if bool(bad.any()):
        worst = float(torch.nan_to_num(err, nan=math.inf).max())
        return f"{what}: {int(bad.sum())}/{bad.numel()} elements off, max |diff| {worst:.3g} (atol {atol}, rtol {rtol})"
    return None


def check_state(name: str, o, lse, base_name, o_base, lse_base, rows, o_ref, lse_ref) -> list[str]:
    """``name``'s (o, lse) against the baseline on every request and float64 on ``rows``."""
    problems = []
    if o_base is not None:
        problems.append(mismatch(f"{name} o vs {base_name}", o, o_base, OUT_ATOL, OUT_RTOL))
        if lse is not None and lse_base is not None:
            problems.append(mismatch(f"{name} lse vs {base_name}", lse, lse_base, LSE_ATOL, LSE_RTOL))
    problems.append(mismatch(f"{name} o vs float64", o[rows], o_ref, OUT_ATOL, OUT_RTOL))
    if lse is not None:
        problems.append(mismatch(f"{name} lse vs float64", lse[rows], lse_ref, LSE_ATOL, LSE_RTOL))
    return [p for p in problems if p]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


@dataclass
class Ceilings:
    copy_bw: float
    mm_rate: float


def run_shape(shape: Shape, ceil: Ceilings, *, device, fi, peers: bool, fi_jit: bool, rep_ms: int,
              min_pool_bytes: int, seed: int) -> dict:
    """Check then time every method on one shape; returns the row."""
    s = shape
    floor = roofline_floor(s.io_bytes, s.flops, ceil.copy_bw, ceil.mm_rate)
    row: dict = dict(batch=s.batch, prefix=s.prefix, suffix=s.suffix, hq=s.hq, hkv=s.hkv, head_dim=s.head_dim,
                     kv_GB=s.kv_bytes / 1e9, floor_us=floor * 1e6, check="ok")
    for m in METHODS:
        row[f"{m}_us"] = row[f"{m}_frac"] = None
    failures: dict[str, str] = {}
    timer = make_timer(device, rep_ms)
    wl = Workload(s, device, seed=seed, min_pool_bytes=min_pool_bytes, max_rot=MAX_ROTATIONS)
    row.update(rot=wl.rot, l2_resident=wl.l2_resident, pool_pages=wl.num_pages)

    # Plan every method (a failure of a peer is reported, not fatal).
    methods: dict[str, Method] = {}
    builders: dict[str, Callable[[], Method]] = {
        "cascade": lambda: ours(wl, True),
        "flat": lambda: ours(wl, False),
        "planner": lambda: ours(wl, None),
    }
    if hopper_unavailable(device) is None:  # the prefix level on backend="hopper" (a decline is a table entry)
        builders["hopper"] = lambda: ours(wl, True, "hopper")
    if peers:
        if fi is None:
            pass  # load_flashinfer said why, once; the FlashInfer columns stay "—"
        elif s.head_dim not in FI_PREBUILT_HEAD_DIMS and not fi_jit:
            failures.update({m: f"head_dim {s.head_dim} is not prebuilt (pass --fi-jit to compile it)"
                             for m in ("fi_cascade", "fi_shipped", "fi_flat")})
        else:
            builders.update(fi_cascade=lambda: fi_cascade(fi, wl), fi_shipped=lambda: fi_shipped(fi, wl),
                            fi_flat=lambda: fi_flat(fi, wl))
        builders["sdpa"] = lambda: sdpa(wl)
    for name, build in builders.items():
        try:
            methods[name] = build()
        except Exception as exc:  # noqa: BLE001 — any peer failure is a table entry, not a crash
            failures[name] = f"plan: {reason(exc)}"
            free(device)

    # Correctness on rotation 0: every method against float64 on sampled requests and against
    # the first method that passed that (ours cascade, normally) on every request.
    rows = sorted({0, s.batch // 2, s.batch - 1})
    o_ref, lse_ref = wl.reference(rows)
    base_name, base_o, base_lse = None, None, None
    for name in list(methods):
        try:
            o, lse = methods[name].result()
            sync(device)
            o, lse = o.clone(), None if lse is None else lse.clone()
        except Exception as exc:  # noqa: BLE001
            failures[name] = f"run: {reason(exc)}"
            del methods[name]
            continue
        problems = check_state(name, o, lse, base_name, base_o, base_lse, rows, o_ref, lse_ref)
        if problems:
            failures[name] = "mismatch: " + "; ".join(problems)
            if name not in OURS:  # a peer that disagrees is not timed; ours is timed and marked FAIL
                del methods[name]
                continue
        if base_o is None and not problems:  # the first method that matches float64 (ours cascade)
            base_name, base_o, base_lse = name, o, lse
    del o_ref, lse_ref
    for name in OURS:
        if name in failures:
            row["check"] = "FAIL"
    if "planner" in methods:
        row["pick"] = methods["planner"].pick
        pc, pf = methods["planner"].predicted
        row.update(pred_cascade_us=pc * 1e6, pred_flat_us=pf * 1e6)

    # Timing; the planner's time is the time of the path it picked.
    for name, m in methods.items():
        if name == "planner":
            continue
        try:
            t = timer([m.call(i) for i in range(m.n_calls or wl.rot)])
        except Exception as exc:  # noqa: BLE001
            failures[name] = f"timing: {reason(exc)}"
            continue
        row[f"{name}_us"] = t * 1e6
        row[f"{name}_frac"] = floor / t
    if "planner" in methods and row.get(f"{row['pick']}_us") is not None:
        row["planner_us"] = row[f"{row['pick']}_us"]
        row["planner_frac"] = row[f"{row['pick']}_frac"]
    # The methods and their builders hold the workload's pools: drop them all before the next shape.
    methods.clear()
    builders.clear()
    wl = None
    free(device)

    for name, why in failures.items():
        warn(f"# {name} — at {s.label()}: {why}")
    row["failures"] = failures
    derive(row)
    return row


def derive(row: dict) -> None:
    """Speedups and the planner check from the timed columns."""
    c, f, p = row.get("cascade_us"), row.get("flat_us"), row.get("planner_us")
    fic = row.get("fi_cascade_us")
    row["cascade_vs_fi"] = fic / c if c and fic else None  # > 1: ours faster
    row["flat_over_cascade"] = f / c if c and f else None  # > 1: cascade faster than flat
    fi_best = [row[k] for k in ("fi_cascade_us", "fi_shipped_us", "fi_flat_us") if row.get(k)]
    row["ours_vs_fi_best"] = min(fi_best) / p if p and fi_best else None
    if c and f and p:
        row["planner_over_best"] = p / min(c, f)
        row["planner_check"] = "PASS" if row["planner_over_best"] <= PLANNER_TOLERANCE else "FAIL"
    else:
        row["planner_over_best"] = None
        row["planner_check"] = None


# --------------------------------------------------------------------------- tables and plot


def cell(row: dict, m: str) -> str | None:
    us, frac = row.get(f"{m}_us"), row.get(f"{m}_frac")
    if us is None:
        return None
    text = f"{us:.1f} ({frac:.2f})" if us < 1000 else f"{us:.0f} ({frac:.2f})"
    if m == "planner" and row.get("pick"):
        text += f" {row['pick']}"
    return text


def shape_cells(row: dict) -> dict:
    mark = "†" if row.get("l2_resident") else ""
    return {"batch": f"{row['batch']}{mark}", "prefix": row["prefix"], "suffix": row["suffix"], "Hkv": row["hkv"],
            "D": row["head_dim"], "KV GB": row["kv_GB"], "floor µs": row["floor_us"]}


def comparison_table(rows: list[dict]) -> str:
    display = []
    for r in rows:
        d = shape_cells(r)
        for m in METHODS:
            d[METHOD_TITLES[m]] = cell(r, m)
        d["cascade vs FI cascade"] = r.get("cascade_vs_fi")
        d["ours vs best FI"] = r.get("ours_vs_fi_best")
        d["planner / best"] = r.get("planner_over_best")
        d["planner ≤5%"] = r.get("planner_check")
        d["check"] = r.get("check")
        display.append(d)
    cols = list(display[0]) if display else []
    return markdown_table(display, cols)


def grid_table(rows: list[dict]) -> str:
    display = []
    for r in rows:
        d = shape_cells(r)
        d.pop("D")
        d["ours cascade"] = cell(r, "cascade")
        d["ours flat"] = cell(r, "flat")
        d["flat / cascade"] = r.get("flat_over_cascade")
        d["pick"] = r.get("pick")
        d["predicted cascade / flat µs"] = (f"{r['pred_cascade_us']:.3g} / {r['pred_flat_us']:.3g}"
                                            if r.get("pred_cascade_us") is not None else None)
        d["planner / best"] = r.get("planner_over_best")
        d["planner ≤5%"] = r.get("planner_check")
        d["check"] = r.get("check")
        display.append(d)
    cols = list(display[0]) if display else []
    return markdown_table(display, cols)


LEGEND = (
    "Each cell: µs (fraction of the roofline floor = floor / time). Floor = max(bytes / copy bandwidth, "
    "FLOPs / bf16 matmul rate), bytes = unique K/V (prefix once + every suffix) + q + o, FLOPs = "
    "4·batch·(prefix+suffix)·Hq·D. Planner: the time of the path it picked (named), checked to be within "
    "5% of the better of ours cascade / ours flat. 'cascade vs FI cascade' = FI cascade µs / ours cascade µs "
    "and 'ours vs best FI' = fastest FlashInfer µs / ours planner µs (> 1: ours faster). SDPA runs on K/V "
    "gathered into contiguous [batch, Hkv, L, D] tensors: not paged, gather not timed. — : not run (reason "
    "on stderr). † : the rotated pools together fit in 3× L2, so repeated calls may hit L2."
)


def plot_grid(rows: list[dict], path: str) -> None:
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except Exception as exc:  # noqa: BLE001
        log(f"# plot skipped: matplotlib not importable ({reason(exc)})")
        return
    panels = sorted({(r["hkv"], r["suffix"]) for r in rows})
    hkvs = sorted({h for h, _ in panels})
    suffixes = sorted({x for _, x in panels})
    colors = {b: f"C{i}" for i, b in enumerate(sorted({r["batch"] for r in rows}))}  # one color per batch
    prefixes = sorted({r["prefix"] for r in rows})
    fig, axes = plt.subplots(len(hkvs), len(suffixes), figsize=(4.2 * len(suffixes), 3.4 * len(hkvs)),
                             squeeze=False)
    for a, hkv in enumerate(hkvs):
        for b, suffix in enumerate(suffixes):
            ax = axes[a][b]
            sel = [r for r in rows if r["hkv"] == hkv and r["suffix"] == suffix and r.get("flat_over_cascade")]
            if not sel:
                ax.set_visible(False)
                continue
            for batch in sorted({r["batch"] for r in sel}):
                pts = sorted((r["prefix"], r["flat_over_cascade"], r.get("pick")) for r in sel if r["batch"] == batch)
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=colors[batch],
                        label=f"batch {batch}")
                flat_picks = [p for p in pts if p[2] == "flat"]
                if flat_picks:  # hollow rings where the planner chose flat decode
                    ax.plot([p[0] for p in flat_picks], [p[1] for p in flat_picks], ls="none", marker="o",
                            markersize=10, markerfacecolor="none", markeredgecolor=colors[batch])
            ax.axhline(1.0, color="gray", lw=0.8, ls="--")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log", base=2)
            ax.set_xticks(prefixes, [str(p) for p in prefixes])
            ax.minorticks_off()
            ax.set_title(f"Hkv={hkv}, suffix={suffix}", fontsize=10)
            ax.set_xlabel("shared prefix length (tokens)")
            ax.set_ylabel("flat µs / cascade µs")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle("Cascade speedup over flat decode (bf16, Hq=32, D=128, page 16; ringed: the planner picked flat)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    log(f"# plot written to {path}")


# --------------------------------------------------------------------------- main


def grid_shapes(quick: bool, hkv_filter: tuple[int, ...] | None, batches: tuple[int, ...] | None = None,
                prefixes: tuple[int, ...] | None = None, suffixes: tuple[int, ...] | None = None) -> list[Shape]:
    """The grid's shapes; ``batches``, ``prefixes``, ``suffixes`` replace its own values
    (the quick grid's too), ``hkv_filter`` keeps only those Hkv."""
    bs, ps, xs = batches or GRID_BATCHES, prefixes or GRID_PREFIXES, suffixes or GRID_SUFFIXES
    if quick:
        combos = [(b, p, 256, 8) for b in bs for p in ps]
        combos += [(b, p, x, 8) for x in (16, 4096) for b in (16, 256) for p in ps]
        combos += [(b, p, 256, h) for h in (1, 32) for b in (16, 256) for p in ps]
        if batches or suffixes:  # the quick grid's fixed batches and suffixes give way too
            combos = [(b, p, x, h) for h in GRID_HKV for x in (suffixes or (256,)) for b in bs for p in ps]
    else:
        combos = [(b, p, x, h) for h in GRID_HKV for x in xs for b in bs for p in ps]
    shapes = []
    for b, p, x, h in combos:
        if hkv_filter and h not in hkv_filter:
            continue
        sh = Shape(b, p, x, hkv=h, head_dim=GRID_HEAD_DIM)
        if sh.kv_bytes > MAX_GRID_KV_BYTES:
            log(f"# skip {sh.label()}: {sh.kv_bytes / 1e9:.1f} GB of K/V")
            continue
        shapes.append(sh)
    return shapes


def smoke_shapes() -> tuple[list[Shape], list[Shape], list[Shape]]:
    """Tiny shapes that run on a CPU in seconds (every table and code path, no timing claims)."""
    bar = [Shape(4, 64, 20, hkv=2, head_dim=32, hq=8), Shape(3, 32, 16, hkv=2, head_dim=32, hq=8)]
    gen = [Shape(4, 48, 5, hkv=1, head_dim=64, hq=8), Shape(2, 16, 1, hkv=8, head_dim=16, hq=8)]
    grid = [Shape(b, p, 7, hkv=2, head_dim=32, hq=8) for b in (1, 4) for p in (16, 64)]
    return bar, gen, grid


def run_section(title: str, shapes: list[Shape], ceil: Ceilings, *, device, fi, peers, fi_jit, rep_ms,
                min_pool_bytes) -> list[dict]:
    rows = []
    t0 = time.perf_counter()
    for n, sh in enumerate(shapes):
        try:
            row = run_shape(sh, ceil, device=device, fi=fi, peers=peers, fi_jit=fi_jit, rep_ms=rep_ms,
                            min_pool_bytes=min_pool_bytes, seed=1000 + n)
        except Exception as exc:  # noqa: BLE001 — e.g. out of memory building the pools: report, go on
            warn(f"# ERROR at {sh.label()}: {reason(exc)}")
            free(device)
            row = dict(batch=sh.batch, prefix=sh.prefix, suffix=sh.suffix, hq=sh.hq, hkv=sh.hkv,
                       head_dim=sh.head_dim, kv_GB=sh.kv_bytes / 1e9, floor_us=None, rot=None,
                       check="error", error=reason(exc))
            derive(row)
        row["section"] = title
        rows.append(row)
        parts = [f"{m} {row[f'{m}_us']:.1f} us ({row[f'{m}_frac']:.2f})" for m in METHODS
                 if row.get(f"{m}_us") is not None and m != "planner"]
        log(f"# [{title} {n + 1}/{len(shapes)} {time.perf_counter() - t0:5.0f} s] {sh.label()} rot {row['rot']}: "
            + ", ".join(parts) + f"; planner -> {row.get('pick')} {row.get('planner_check')}; check {row['check']}")
    return rows


def parse_heads(items: list[str]) -> tuple[tuple[int, int], ...]:
    """``["8:64", "1:128"]`` as ``((8, 64), (1, 128))``."""
    heads = []
    for item in items:
        hkv, sep, d = item.partition(":")
        if not (sep and hkv.isdigit() and d.isdigit() and int(hkv) >= 1 and int(d) >= 1):
            raise SystemExit(f"--heads: expected HKV:HEAD_DIM pairs of positive ints, got {item!r}")
        heads.append((int(hkv), int(d)))
    return tuple(heads)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bar", action="store_true", help="the four bar shapes (Hq 32, Hkv 8, D 128)")
    ap.add_argument("--generality", action="store_true", help="the same shapes with Hkv 1/32 and head_dim 64/256")
    ap.add_argument("--grid", action="store_true", help="batch x prefix x suffix x Hkv: planner check and plot")
    ap.add_argument("--quick", action="store_true", help="with --grid: a subset that runs in a few minutes")
    ap.add_argument("--hkv", type=int, nargs="+", help="with --grid: only these Hkv values")
    ap.add_argument("--batches", type=int, nargs="+", help="with --grid: these batch sizes instead of its own")
    ap.add_argument("--prefixes", type=int, nargs="+", help="with --grid: these prefix lengths instead of its own")
    ap.add_argument("--suffixes", type=int, nargs="+", help="with --grid: these suffix lengths instead of its own")
    ap.add_argument("--heads", nargs="+", metavar="HKV:D",
                    help="with --generality: only these (Hkv, head_dim) pairs, e.g. 8:64 8:256")
    ap.add_argument("--fi-jit", action="store_true", help="let FlashInfer JIT-compile head dims it does not ship")
    ap.add_argument("--no-peers", action="store_true", help="ours only (no FlashInfer, no SDPA)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes; runs on a CPU")
    ap.add_argument("--plot-from", metavar="JSON", help="only draw the grid plot from an earlier bench_cascade.json")
    ap.add_argument("--plot", metavar="PNG",
                    help="with --grid or --plot-from: where to draw the grid plot (none without it)")
    ap.add_argument("--json", metavar="PATH", help="write the results and the environment here as JSON")
    args = ap.parse_args()
    if args.plot_from:
        if not args.plot:
            ap.error("--plot-from needs --plot PNG")
        with open(args.plot_from) as f:
            rows = [r for r in json.load(f)["rows"] if r.get("section") == "grid"]
        plot_grid(rows, args.plot)
        return
    if not (args.bar or args.generality or args.grid):
        args.bar = args.generality = True

    t_start = time.perf_counter()
    has_gpu = torch.cuda.is_available()
    if not has_gpu and not args.smoke:
        sys.exit("bench_cascade needs a CUDA device (or --smoke for a CPU dry run)")
    device = torch.device("cuda" if has_gpu else "cpu")
    env = environment()
    log(f"# {env}")
    fi = load_flashinfer() if not args.no_peers else None
    if has_gpu:
        ceil = Ceilings(measure_copy_bandwidth(), measure_matmul_rate())
    else:
        ceil = Ceilings(3.0e12, 7.0e14)  # nominal H100 numbers: the smoke run's fractions mean nothing
    log(f"# copy bandwidth {ceil.copy_bw / 1e9:.0f} GB/s (read + write), bf16 matmul {ceil.mm_rate / 1e12:.0f} "
        f"TFLOP/s{'' if has_gpu else ' (nominal, no GPU)'}")

    if args.smoke:
        bar_shapes, gen_shapes, grid = smoke_shapes()
    else:
        bar_shapes = [Shape(b, p, x, hkv=h, head_dim=d) for h, d in BAR_HEADS for b, p, x in BAR_SHAPES]
        heads = parse_heads(args.heads) if args.heads else GENERALITY_HEADS
        gen_shapes = [Shape(b, p, x, hkv=h, head_dim=d) for h, d in heads for b, p, x in BAR_SHAPES]
        grid = grid_shapes(args.quick, tuple(args.hkv) if args.hkv else None,
                           *(tuple(v) if v else None for v in (args.batches, args.prefixes, args.suffixes))
                           ) if args.grid else []
    min_pool = MIN_POOL_BYTES if has_gpu else 0
    common = dict(device=device, fi=fi, fi_jit=args.fi_jit, min_pool_bytes=min_pool)

    sections: dict[str, list[dict]] = {}
    if args.bar:
        sections["bar"] = run_section("bar", bar_shapes, ceil, peers=not args.no_peers, rep_ms=200, **common)
    if args.generality:
        sections["generality"] = run_section("generality", gen_shapes, ceil, peers=not args.no_peers, rep_ms=100,
                                             **common)
    if args.grid:
        sections["grid"] = run_section("grid", grid, ceil, peers=False, rep_ms=100 if args.quick else 60, **common)

    all_rows = [r for rows in sections.values() for r in rows]
    write_json(args.json, dict(
        env=env, copy_Bps=ceil.copy_bw, matmul_flops=ceil.mm_rate,
        config=dict(hq=HQ, page_size=PAGE, dtype=str(DTYPE), min_pool_bytes=min_pool, max_rotations=MAX_ROTATIONS,
                    planner_tolerance=PLANNER_TOLERANCE,
                    args={k: v for k, v in vars(args).items() if k not in ("json", "plot")}),
        rows=all_rows))

    head = (f"bf16, Hq={HQ}, one query token per request, page {PAGE}; copy {ceil.copy_bw / 1e9:.0f} GB/s, "
            f"matmul {ceil.mm_rate / 1e12:.0f} TFLOP/s; {env['device']}")
    if "bar" in sections:
        log(f"\n## Shared-prefix batch decode, the four bar shapes (Hkv 8, D 128); {head}\n")
        log(comparison_table(sections["bar"]))
        log(f"\n{LEGEND}")
    if "generality" in sections:
        log(f"\n## The same shapes with Hkv 1 / 32 and head_dim 64 / 256; {head}\n")
        log(comparison_table(sections["generality"]))
        log(f"\n{LEGEND} FlashInfer ships bf16 kernels for head_dim 128 only; other head dims need --fi-jit.")
    if "grid" in sections:
        rows = sections["grid"]
        log(f"\n## Planner check over the grid{' (quick subset)' if args.quick else ''}; {head}\n")
        log(grid_table(rows))
        checked = [r for r in rows if r.get("planner_check")]
        fails = [r for r in checked if r["planner_check"] == "FAIL"]
        log(f"\nplanner within {PLANNER_TOLERANCE - 1:.0%} of the better path: {len(checked) - len(fails)}/"
            f"{len(checked)} PASS" + (": FAIL at " + "; ".join(
                f"batch {r['batch']} prefix {r['prefix']} suffix {r['suffix']} Hkv {r['hkv']} "
                f"({r['pick']}, {r['planner_over_best']:.2f}x)" for r in fails) if fails else ""))
        if args.plot:
            plot_grid(rows, args.plot)
    planner_rows = [r for r in all_rows if r.get("planner_check")]
    passed = sum(r["planner_check"] == "PASS" for r in planner_rows)
    log(f"\n# planner check overall: {passed}/{len(planner_rows)} PASS; total {time.perf_counter() - t_start:.0f} s")
    bad = [r for r in all_rows if r["check"] != "ok"]
    if bad:
        warn(f"# CORRECTNESS FAILURE of ours at {len(bad)} shape(s): "
             + "; ".join(f"batch {r['batch']} prefix {r['prefix']} suffix {r['suffix']} Hkv {r['hkv']} "
                         f"D {r['head_dim']}" for r in bad))
        sys.exit(1)


if __name__ == "__main__":
    main()
