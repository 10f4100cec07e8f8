"""Run a program of the checkout as BENCHMARKS.md's commands do (`python -m MODULE ARGS` from the
repository root): in this process through the module's `main(argv)` (`run_main`), or as a child
process (`run_module`). A failing run fails the test: with the program's exception in process,
with the end of its output in a child.

In process, a run skips the child's start (importing torch and transformers, 2-4 s) and runs
Triton under this process's faster interpreter (interpreter_builtins.py). What a program may
set for the whole process is put back after it: the environment, torch's intra-op threads,
its default dtype and its global RNG."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def run_module(*args: str, timeout: int = 300) -> str:
    out = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return out.stdout


def run_main(module: str, *args: str, capsys: pytest.CaptureFixture[str], interpreted: bool = False) -> str:
    """MODULE's main(ARGS) in this process; what it printed to stdout.

    `interpreted`: the program runs Triton kernels under TRITON_INTERPRET=1, which must be set
    before triton's first import. Where this process imported triton without it (a CUDA
    machine), the program runs as a child process, which sets it itself."""
    if interpreted and os.environ.get("TRITON_INTERPRET") != "1":
        return run_module(module, *args)
    main = importlib.import_module(module).main
    capsys.readouterr()  # what the test printed before is not the program's
    with _process_state_kept():
        main(list(args))
    return capsys.readouterr().out


@contextmanager
def _process_state_kept() -> Iterator[None]:
    env = dict(os.environ)
    threads, dtype = torch.get_num_threads(), torch.get_default_dtype()
    cuda_rngs = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    try:
        with torch.random.fork_rng(devices=cuda_rngs):
            yield
    finally:
        for name in set(os.environ) - set(env):
            del os.environ[name]
        os.environ.update(env)
        torch.set_num_threads(threads)
        torch.set_default_dtype(dtype)
