"""Run a program of the checkout as `python -m MODULE ARGS` from the repository root, as
BENCHMARKS.md's commands do; a failing run fails the test with the end of its output."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_module(*args: str, timeout: int = 300) -> str:
    out = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return out.stdout
