"""``cascadeinfer bench`` with ``backend=None``'s Hopper prefill bound moved.

    python -m benchmarks.tools.engine_hopper_bound --min-work 22 -- \\
        bench --preset llama3-8b --requests 256 --prefix 4096 --suffix 128 --new-tokens 256 \\
        --modes cascade --skip-check --json PATH

The cascade's prefill levels take the Hopper kernel where ``backend=None``'s shape bounds
hold (``kernels.backend.hopper_prefill_shape``: one group whose packed rows and packed
rows x keys reach one of ``HOPPER_PREFILL_BOUNDS``'s pairs). This runs the engine's command
line (everything after ``--``) with the head_dim-128 bounds replaced by one, 256 packed rows
and ``2 ** --min-work`` packed rows x keys, so a bound can be timed in the engine's own step
before it moves: at 22, the engine's prefix level of 256 requests (1,024 packed rows over
4,096 keys) takes the Hopper kernel (as the default bounds now do); at 23 it stays on the
portable one.
Everything else (devices, Triton versions, layouts the Hopper kernel declines) falls back
as always.
"""

from __future__ import annotations

import argparse
import sys


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--min-work", type=int, required=True,
                    help="log2 of the packed rows x keys from which a head_dim-128 prefill level takes the Hopper kernel")
    ap.add_argument("engine_args", nargs=argparse.REMAINDER, help="-- then the cascadeinfer command line")
    args = ap.parse_args()
    engine_args = args.engine_args[1:] if args.engine_args[:1] == ["--"] else args.engine_args
    if not engine_args:
        sys.exit("engine_hopper_bound: give the cascadeinfer command line after --")
    from cascadeinfer.engine.cli import main as cli  # noqa: PLC0415
    from cascadeinfer.kernels import backend  # noqa: PLC0415

    backend.HOPPER_PREFILL_BOUNDS[128] = ((256, 2 ** args.min_work),)
    print(f"# Hopper prefill bound at head_dim 128: 256 packed rows, {2 ** args.min_work} packed rows x keys",
          flush=True)
    sys.exit(cli(engine_args))


if __name__ == "__main__":
    main()
