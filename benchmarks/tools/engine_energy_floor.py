"""The engine's decode step against the power limit: its power, its energy, its energy floor.

    python -m benchmarks.tools.engine_energy_floor --bench BENCH.json --probe PROBE.json \\
        --smi SMI.csv [--json PATH]

Reads three files of one machine and one session of work on it:

* ``--bench``: a ``cascadeinfer bench`` JSON (one engine mode; its per-step times and the
  wall-clock moment its timed run ended locate the decode steps in time);
* ``--probe``: a ``tools/probe_power`` JSON, for its references' rates and energies: the
  copy's bytes/s and joules per byte, the matmul's FLOP/s and joules per FLOP (each beyond
  the idle board's power) and the power the limit leaves above idle;
* ``--smi``: ``nvidia-smi --query-gpu=timestamp,power.draw.instant,clocks.sm,clocks_event_reasons.active
  --format=csv,noheader -lms 20``, logged while the bench ran (timestamps in UTC).

Printed: the decode steps' median time, the board's median power and SM clock over them and
the share of samples at the software power cap; the median step's energy (power × time);
its roofline floor (the bench's: max(bytes / copy rate, FLOPs / matmul rate), here at the
probe's rates) and its energy floor: the step's bytes at the copy's joules per byte plus its
FLOPs at the matmul's joules per FLOP, within the power the limit leaves above idle. The
bytes and FLOPs are the bench's (``ModelCosts.step_work``: the weights once, the K/V the
step reads with the shared prefix once, every (query, key) pair's attention FLOPs).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys

SW_POWER_CAP = 0x4


def smi_samples(path: str) -> list[tuple[float, float, float, int]]:
    """``(unix seconds, W, SM MHz, clock-event reasons)`` per line of an ``nvidia-smi`` CSV log."""
    out = []
    with open(path) as f:
        for line in f:
            fields = [x.strip() for x in line.split(",")]
            try:
                when = datetime.datetime.strptime(fields[0], "%Y/%m/%d %H:%M:%S.%f").replace(tzinfo=datetime.UTC)
                out.append((when.timestamp(), float(fields[1].split()[0]), float(fields[2].split()[0]),
                            int(fields[3], 16)))
            except (ValueError, IndexError):
                continue  # a header or a partial line
    return out


def costs_of(workload: dict, weights_gb: float):
    """The bench's ``ModelCosts`` for its workload (a preset's shapes)."""
    import dataclasses  # noqa: PLC0415

    import torch  # noqa: PLC0415

    from cascadeinfer.engine.bench import ModelCosts  # noqa: PLC0415
    from cascadeinfer.engine.model_loader import preset  # noqa: PLC0415

    mc = dataclasses.replace(preset(workload["model"]), num_layers=workload["num_layers"])
    elem = torch.empty((), dtype=getattr(torch, workload["dtype"])).element_size()
    return ModelCosts.of(mc, round(weights_gb * 1e9), elem, workload["tensor_parallel_size"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bench", required=True, help="a cascadeinfer bench JSON")
    ap.add_argument("--probe", required=True, help="a tools/probe_power JSON of the same machine")
    ap.add_argument("--smi", required=True, help="the nvidia-smi log taken while the bench ran")
    ap.add_argument("--mode", default=None, help="the bench row (engine mode); default: its only one")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()
    from cascadeinfer.engine.bench import Workload  # noqa: PLC0415

    bench = json.load(open(args.bench))
    rows = [r for r in bench["rows"] if args.mode in (None, r.get("mode"))]
    if len(rows) != 1 or "decode_steps_ms" not in rows[0] or "ended_unix_s" not in rows[0]:
        sys.exit("--bench: needs one engine row (see --mode) with decode_steps_ms and ended_unix_s")
    row, wl = rows[0], bench["workload"]
    rates = json.load(open(args.probe))["rates"]

    # The full decode steps are the timed run's last steps but a few: where they ran.
    steps_s = [t * 1e-3 for t in row["decode_steps_ms"]]
    end = row["ended_unix_s"]
    window = [s for s in smi_samples(args.smi) if end - sum(steps_s) <= s[0] <= end]
    if not window:
        sys.exit("--smi: no samples while the decode steps ran (is the log from the same run, in UTC?)")
    power = statistics.median(s[1] for s in window)
    step = statistics.median(steps_s)

    costs = costs_of(wl, row["weights_gb"])
    work = Workload(wl["requests"], wl["prefix"], wl["suffix"], wl["new_tokens"]).decode_steps(wl["max_num_seqs"])
    roofline, energy = [], []
    for w in work:
        nbytes, flops = costs.step_work(**w)
        roofline.append(max(nbytes / rates["copy_bw"], flops / rates["mm_rate"]))
        energy.append((nbytes * rates["j_per_byte"] + flops * rates["j_per_flop"]) / rates["dynamic_limit_w"])
    result = {
        "decode step ms": step * 1e3, "samples": len(window), "W": power,
        "SM MHz": statistics.median(s[2] for s in window),
        "power capped": sum(bool(s[3] & SW_POWER_CAP) for s in window) / len(window),
        "J per step": power * step,
        "roofline floor ms": statistics.median(roofline) * 1e3, "energy floor ms": statistics.median(energy) * 1e3,
    }
    result["of roofline"] = result["roofline floor ms"] / result["decode step ms"]
    result["of energy floor"] = result["energy floor ms"] / result["decode step ms"]
    for k, v in result.items():
        print(f"{k}: {v:.4g}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bench": args.bench, "probe": args.probe, "smi": args.smi, "rates": rates, **result}, f, indent=1)


if __name__ == "__main__":
    main()
