"""Power and SM clock while the cascade and each of its levels run: is the cascade bound by energy?

    python -m benchmarks.tools.probe_power [--shapes B,P,S ...] [--seconds 3] [--gemms TOKENS] [--full-clock]
        [--json PATH]

Beside the prefix level the decode level costs about the time of both levels
(benchmarks/NOTES.md, "Cascade" v9-v16), though the two want different parts of an SM
(tensor cores; memory pipes), and even a reader that computes nothing slows down beside
the prefix level on SMs of its own. A GPU held at its power limit lowers its clocks until
the power fits, so work that draws power side by side takes about the time of its energy
over the limit, whatever it overlaps. This measures it: for each shape (default: the
engine's decode batch, 256 requests over a 4096-token shared prompt with 144, 256 and 384
tokens of their own), the prefix level alone (``batch_prefill_paged``, its default grid,
on the portable kernel and, on compute capability 9.0, the Hopper one), the decode level
alone (``batch_decode_paged``, its default schedule and ``"all_heads"``) and the cascade
(``MultiLevelCascadeAttention``, its default plan and with the Hopper prefix level), after
a bf16 matmul, a copy and a read (a sum over 2 GiB) as references, each replayed from CUDA graphs (inputs rotated past
L2, as the benchmarks time them) back to back for ``--seconds`` while ``nvidia-smi`` samples
the board's instant power, SM clock and clock-event reasons every 20 ms.

With ``--full-clock`` also a matmul, a read and each level alone at half duty (each group
of calls followed by a spin on one SM as long), so the board stays under its limit at full
clock: their joules per call above a busy board's own power, comparable between kernels at
the same clock (a matmul alone runs at the limit with its clock lowered, so its joules per
FLOP there are not the prefix level's at full clock). With ``--gemms TOKENS`` also the
weight GEMMs of a Llama-3-8B decode step at that many tokens, each alone, and their sum
per step.

Printed per run: µs per call over the whole loop, the median power and SM clock of the
samples inside it, the share of samples that report the software power cap, and the
energy per call (median power × time). A cascade at the power limit with its clock lowered,
whose energy per call is about the sum of its levels' alone, is bound by energy: however
its kernels overlap, they take about the time their joules take at the limit, and only
kernels that spend fewer joules per call make it faster.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import threading
import time

import torch

from benchmarks._common import environment, gpu_start, markdown_table, write_json
from benchmarks.fixtures import level_alone_calls, ours, shape_workloads

ENGINE_SHAPES = ("256,4096,144", "256,4096,256", "256,4096,384")
# power.draw.instant: the board's power now (power.draw averages over a second, which
# would blend each run with the one before it).
QUERY = "power.draw.instant,clocks.sm,clocks_event_reasons.active,power.limit"
SW_POWER_CAP = 0x4  # nvidia-smi's clocks_event_reasons bit for the software power cap


class Sampler:
    """``nvidia-smi`` streaming ``QUERY`` every 20 ms, each line stamped on arrival."""

    def __init__(self, device: torch.device):
        props = torch.cuda.get_device_properties(device)
        try:  # the device by its PCI address (CUDA's numbering may differ from nvidia-smi's)
            which = f"{props.pci_domain_id:08X}:{props.pci_bus_id:02X}:{props.pci_device_id:02X}.0"
        except AttributeError:
            which = str(device.index)
        query = QUERY
        probe = subprocess.run(["nvidia-smi", "-i", which, f"--query-gpu={QUERY}", "--format=csv,noheader"],
                               capture_output=True, text=True)
        if probe.returncode != 0:  # a driver without the instant reading
            query = QUERY.replace("power.draw.instant", "power.draw")
        self.query = query
        self.proc = subprocess.Popen(["nvidia-smi", "-i", which, f"--query-gpu={query}", "--format=csv,noheader,nounits",
                                      "-lms", "20"], stdout=subprocess.PIPE, text=True)
        self.samples: list[tuple[float, float, float, int, float]] = []
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                power, clock, reasons, limit = (x.strip() for x in line.split(","))
                self.samples.append((time.perf_counter(), float(power), float(clock), int(reasons, 16), float(limit)))
            except ValueError:
                continue  # "[N/A]" or a partial line

    def between(self, t0: float, t1: float) -> list[tuple[float, float, float, int, float]]:
        return [s for s in self.samples if t0 <= s[0] <= t1]

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait()


def graph_of(fns, repeats: int = 1) -> torch.cuda.CUDAGraph:
    """One CUDA graph of every call in ``fns`` (each on its own rotated inputs), ``repeats``
    times over."""
    for f in fns:
        f()  # compile and record outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            for f in fns:
                f()
    return graph


def replay_seconds(graph: torch.cuda.CUDAGraph, replays: int) -> float:
    """GPU seconds of ``replays`` back-to-back replays of ``graph``."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e-3


SETTLE = 0.25  # the share of each loop's samples left out while the clock and power settle

# A replay's launch costs the host ~25 µs and leaves the GPU a gap; with the sampler's
# thread beside it, more. Each replay holds this much GPU work, so neither shows.
REPLAY_SECONDS = 0.01


def sampled_replays(graph: torch.cuda.CUDAGraph, replay_s: float, seconds: float,
                    sampler: Sampler) -> tuple[float, dict | None]:
    """Replay ``graph`` (about ``replay_s`` each) back to back for about ``seconds``: seconds
    per replay, and the median power, SM clock, share at the power cap and count of the
    samples taken meanwhile (its first ``SETTLE`` left out; None without samples)."""
    replays = max(10, round(seconds / replay_s))
    t0 = time.perf_counter()
    elapsed = replay_seconds(graph, replays)
    t1 = time.perf_counter()
    got = sampler.between(t0 + SETTLE * (t1 - t0), t1)
    if not got:
        return elapsed / replays, None
    return elapsed / replays, {"W": statistics.median(s[1] for s in got), "SM MHz": statistics.median(s[2] for s in got),
                               "power capped": sum(bool(s[3] & SW_POWER_CAP) for s in got) / len(got),
                               "samples": len(got), "limit W": got[-1][4]}


def run_loop(name: str, fns, seconds: float, sampler: Sampler) -> dict:
    """Replay ``fns``' calls back to back for about ``seconds`` (graphs of about
    ``REPLAY_SECONDS`` each): time per call, the board's samples meanwhile
    (:func:`sampled_replays`) and the energy per call."""
    one = replay_seconds(graph_of(fns), 3) / 3
    repeats = max(1, round(REPLAY_SECONDS / one))
    per_replay, board = sampled_replays(graph_of(fns, repeats), one * repeats, seconds, sampler)
    call_s = per_replay / (repeats * len(fns))
    if board is None:
        return {"run": name, "us": call_s * 1e6, "samples": 0}
    return {"run": name, "us": call_s * 1e6, "W": board["W"], "SM MHz": board["SM MHz"],
            "power capped": board["power capped"], "uJ per call": board["W"] * call_s * 1e6,
            "samples": board["samples"], "limit W": board["limit W"]}


MM_N = 8192
COPY_BYTES = 2**31


def reference_calls(device: torch.device) -> list[tuple[str, list]]:
    """A bf16 matmul (``MM_N``³), a copy of ``COPY_BYTES`` and a sum over them (a read), each one call."""
    a = torch.randn(MM_N, MM_N, device=device, dtype=torch.bfloat16)
    b, c = torch.randn_like(a), torch.empty_like(a)
    src = torch.rand(COPY_BYTES // 4, device=device, dtype=torch.float32)
    dst = torch.empty_like(src)
    total = torch.empty((), device=device, dtype=torch.float32)
    return [("matmul", [lambda: torch.mm(a, b, out=c)]), ("copy", [lambda: torch.add(src, 0, out=dst)]),
            ("read", [lambda: torch.sum(src, 0, out=total)])]


def gemm_runs(tokens: int, seconds: float, sampler: Sampler) -> list[dict]:
    """Each weight GEMM of a Llama-3-8B decode step at ``tokens`` tokens (``torch.matmul``
    into a buffer, cuBLAS; weight copies rotated past L2: ``tools/probe_gemm``'s operands),
    then the step's sum: each GEMM's time and energy times its count per step."""
    from benchmarks.tools.probe_gemm import LLAMA3_8B, operands  # noqa: PLC0415

    rows, us, uj = [], 0.0, 0.0
    for name, k, n, per_step in LLAMA3_8B:
        ws, x, outs, _ = operands(tokens, k, n)
        fns = [lambda w=w, o=o: torch.matmul(x, w.t(), out=o) for w, o in zip(ws, outs)]
        rows.append({**run_loop(f"GEMM {name} {tokens}x{k}x{n}", fns, seconds, sampler), "per step": per_step})
        print("#", rows[-1], flush=True)
        us += rows[-1]["us"] * per_step
        uj += rows[-1].get("uJ per call", float("nan")) * per_step
        del ws, outs, fns
        torch.cuda.empty_cache()
    rows.append({"run": f"the step's GEMMs ({tokens} tokens)", "us": us, "uJ per call": uj})
    return rows


FULL_CLOCK_HZ = 1.98e9  # the H100's and H200's SM clock when the power allows (what the spins count in)


def full_clock_run(name: str, fns, seconds: float, sampler: Sampler) -> dict:
    """``fns``' calls at half duty: each group of calls followed by a spin of about the same
    time (``torch.cuda._sleep`` on one SM), so the board's average power stays under its
    limit and the clock up; then the spins alone. The calls' own time is the difference of
    the two loops' periods, and their energy what the board draws above the spinning
    board's power over the mixed loop: joules per call at full clock, above a busy board's
    own power (where :func:`run_loop`'s are at whatever clock the limit leaves, above idle)."""
    one = replay_seconds(graph_of(fns), 3) / 3
    cycles = max(1, round(one * FULL_CLOCK_HZ))
    repeats = max(1, round(REPLAY_SECONDS / (2 * one)))

    def mixed():
        for f in fns:
            f()
        torch.cuda._sleep(cycles)

    def spin():
        torch.cuda._sleep(cycles)

    out = {"run": f"{name}, half duty"}
    for label, body in (("mix", mixed), ("spin", spin)):
        graph = graph_of([body], repeats)
        per_replay, board = sampled_replays(graph, replay_seconds(graph, 2) / 2, seconds, sampler)
        if board is None:
            return {**out, "samples": 0}
        out[f"{label} us"] = per_replay / repeats * 1e6
        out[f"{label} W"] = board["W"]
        out[f"{label} SM MHz"] = board["SM MHz"]
        out[f"{label} capped"] = board["power capped"]
    out["us"] = (out["mix us"] - out["spin us"]) / len(fns)
    out["uJ per call above spin"] = (out["mix W"] - out["spin W"]) * out["mix us"] / len(fns)
    return out


def full_clock_rows(wl, seconds: float, sampler: Sampler) -> list[dict]:
    """A matmul (4096³), a read of 512 MiB and the levels alone at ``wl``'s shape, each at half duty."""
    device = wl.device
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    b, c = torch.randn_like(a), torch.empty_like(a)
    src = torch.rand(2**27, device=device, dtype=torch.float32)
    total = torch.empty((), device=device, dtype=torch.float32)
    runs = [("matmul 4096^3", [lambda: torch.mm(a, b, out=c)]), ("read 512 MiB", [lambda: torch.sum(src, 0, out=total)])]
    runs += [(f"{wl.shape.batch},{wl.shape.prefix},{wl.shape.suffix} {name}", fns)
             for name, fns in shape_runs(wl) if not name.startswith("cascade")]
    rows = []
    for name, fns in runs:
        try:
            rows.append(full_clock_run(name, fns, seconds, sampler))
        except ValueError as e:  # backend="hopper" where its kernel declines the level
            print(f"# {name}: {e}", flush=True)
            continue
        print("#", rows[-1], flush=True)
    return rows


def shape_runs(wl) -> list[tuple[str, list]]:
    """The levels alone and the cascade, on each kernel that runs here."""
    from cascadeinfer import batch_decode_paged  # noqa: PLC0415
    from cascadeinfer.kernels.backend import hopper_unavailable  # noqa: PLC0415

    outs, lses = wl.out_buffers()
    all_heads = [lambda i=i: batch_decode_paged(wl.qs[i], wl.pools[i], wl.kv_indptr[1], wl.kv_indices[1],
                                                wl.kv_last[1], out=outs[i], lse=lses[i], validate=False,
                                                schedule="all_heads") for i in range(wl.rot)]
    runs = [("prefix level alone", level_alone_calls(wl, 0, "portable")),
            ("decode level alone", level_alone_calls(wl, 1)),
            ("decode level alone, all_heads", all_heads),
            ("cascade", [ours(wl, use_cascade=True).call(i) for i in range(wl.rot)])]
    if hopper_unavailable(wl.device) is None:
        runs += [("prefix level alone, Hopper", level_alone_calls(wl, 0, "hopper")),
                 ("cascade, Hopper prefix", [ours(wl, use_cascade=True, backend="hopper").call(i)
                                             for i in range(wl.rot)])]
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="*", default=list(ENGINE_SHAPES), help="batch,prefix,suffix triples")
    ap.add_argument("--seconds", type=float, default=3.0, help="how long each run replays")
    ap.add_argument("--gemms", type=int, metavar="TOKENS",
                    help="also Llama-3-8B's decode-step weight GEMMs at this many tokens, and their sum per step")
    ap.add_argument("--full-clock", action="store_true",
                    help="also a matmul, a read and each level alone at half duty, below the power limit")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()
    device = gpu_start("probe_power")
    sampler = Sampler(device)
    rows, full_clock = [], []
    try:
        time.sleep(1.5)
        idle = sampler.between(time.perf_counter() - 1.0, time.perf_counter())
        if not idle:
            raise SystemExit("probe_power: no samples from nvidia-smi")
        rows.append({"run": "idle", "W": statistics.median(s[1] for s in idle),
                     "SM MHz": statistics.median(s[2] for s in idle), "limit W": idle[-1][4]})
        for name, fns in reference_calls(device):
            rows.append(run_loop(name, fns, args.seconds, sampler))
            print("#", rows[-1], flush=True)
        if args.gemms:
            rows += gemm_runs(args.gemms, args.seconds, sampler)
        for text, _, wl in shape_workloads(args.shapes, device):
            if args.full_clock:
                full_clock += full_clock_rows(wl, args.seconds, sampler)
            for name, fns in shape_runs(wl):
                try:
                    rows.append({"shape": text, **run_loop(f"{text} {name}", fns, args.seconds, sampler)})
                except ValueError as e:  # backend="hopper" where its kernel declines the level
                    print(f"# {text} {name}: {e}", flush=True)
                    torch.cuda.synchronize()
                    continue
                print("#", rows[-1], flush=True)
            del wl
            torch.cuda.empty_cache()
    finally:
        sampler.close()
    columns = ["run", "us", "W", "SM MHz", "power capped", "uJ per call", "samples"]
    print(markdown_table(rows, columns))
    if full_clock:
        print(markdown_table(full_clock, ["run", "us", "mix W", "spin W", "mix SM MHz", "mix capped",
                                          "uJ per call above spin"]))
    write_json(args.json, {"environment": environment(), "args": vars(args), "query": sampler.query, "rows": rows,
                           "full_clock": full_clock})


if __name__ == "__main__":
    main()
