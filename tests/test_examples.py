"""The README's example runs as a new user runs it: it says which path ran and passes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def test_shared_prefix_decode_example_passes_and_names_its_path():
    env = {**os.environ, "TRITON_INTERPRET": "0"}  # as on a CPU machine outside the tests
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "shared_prefix_decode.py"), "--small",
                           "--batch", "4", "--prefix", "256", "--suffix", "40"],
                          capture_output=True, text=True, env=env, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    # On a GPU the example runs our Triton kernels; on a plain CPU, the PyTorch path.
    assert ("Triton kernels" if torch.cuda.is_available() else "the PyTorch path") in done.stdout
    assert "\nPASS: cascade and flat decode agree" in done.stdout
    assert "planner (use_cascade=None) picks" in done.stdout
