"""Tuning sweeps and probes: the measurements behind the launch policy and the planner's
constants (benchmarks/NOTES.md says which decision each one made). The benchmarks a user
runs are one level up (``python -m benchmarks.bench_<op>``); these run as
``python -m benchmarks.tools.<name>``."""
