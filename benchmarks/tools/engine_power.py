"""The board's power while the engine's decode steps ran: is the step at the power limit?

    python -m benchmarks.tools.engine_power --bench BENCH.json --smi SMI.csv [--json PATH]

Reads a ``cascadeinfer bench`` JSON (one engine mode: its per-step times and the
wall-clock moment its timed run ended locate the full-batch decode steps in time) and an
``nvidia-smi --query-gpu=timestamp,power.draw.instant,clocks.sm,clocks_event_reasons.active
--format=csv,noheader -lms 20`` log taken while it ran (timestamps in UTC). Printed: the
steps' median time, the board's median power and SM clock over them, the share of samples
at the software power cap, and the energy of the median step (power × time). A step drawing
the board's limit, with its clock lowered, gets faster only by spending fewer joules. Then
each step's own samples (each step placed in time by the steps after it): the correlation
of the steps' GPU times (the bench's ``decode_steps_gpu_ms``) with their mean SM clock, and
in ``--json`` every step's clock and power.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys

SW_POWER_CAP = 0x4  # nvidia-smi's clocks_event_reasons bit for the software power cap


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bench", required=True, help="a cascadeinfer bench JSON")
    ap.add_argument("--smi", required=True, help="the nvidia-smi log taken while the bench ran")
    ap.add_argument("--mode", default=None, help="the bench row (engine mode); default: its only one")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()
    bench = json.load(open(args.bench))
    rows = [r for r in bench["rows"] if args.mode in (None, r.get("mode"))]
    if len(rows) != 1 or "decode_steps_ms" not in rows[0] or "ended_unix_s" not in rows[0]:
        sys.exit("--bench: needs one engine row (see --mode) with decode_steps_ms and ended_unix_s")
    row = rows[0]
    # The full decode steps are the timed run's last steps but a few: where they ran.
    steps_s = [t * 1e-3 for t in row["decode_steps_ms"]]
    end = row["ended_unix_s"]
    window = [s for s in smi_samples(args.smi) if end - sum(steps_s) <= s[0] <= end]
    if not window:
        sys.exit("--smi: no samples while the decode steps ran (is the log from the same run, in UTC?)")
    step, power = statistics.median(steps_s), statistics.median(s[1] for s in window)
    result = {"decode step ms": step * 1e3, "samples": len(window), "W": power,
              "SM MHz": statistics.median(s[2] for s in window),
              "SM MHz range": [min(s[2] for s in window), max(s[2] for s in window)],
              "power capped": sum(bool(s[3] & SW_POWER_CAP) for s in window) / len(window),
              "J per step": power * step}
    per_step = each_step(row, smi_samples(args.smi))
    if len(per_step) >= 3 and row.get("decode_steps_gpu_ms"):
        gpu = [row["decode_steps_gpu_ms"][i] for i, _, _ in per_step]
        result["corr(step GPU ms, SM MHz)"] = statistics.correlation(gpu, [mhz for _, mhz, _ in per_step])
    for k, v in result.items():
        print(f"{k}: {v:.4g}" if isinstance(v, float) else f"{k}: {v}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bench": args.bench, "smi": args.smi, **result,
                       "steps": [{"step": i, "SM MHz": mhz, "W": w} for i, mhz, w in per_step]}, f, indent=1)


def each_step(row: dict, samples: list) -> list[tuple[int, float, float]]:
    """``(step, mean SM MHz, mean W)`` of the samples inside each full decode step (the last
    one ending at the run's end, each earlier one where the next began), steps without a
    sample left out."""
    out, end = [], row["ended_unix_s"]
    for i in range(len(row["decode_steps_ms"]) - 1, -1, -1):
        start = end - row["decode_steps_ms"][i] * 1e-3
        got = [s for s in samples if start <= s[0] <= end]
        if got:
            out.append((i, statistics.fmean(s[2] for s in got), statistics.fmean(s[1] for s in got)))
        end = start
    return out[::-1]


if __name__ == "__main__":
    main()
