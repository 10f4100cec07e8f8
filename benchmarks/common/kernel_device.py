"""Where a Triton kernel benchmark runs (benchmarks/kernels/): on CUDA in bf16 on a
model's shape, or, as a smoke run, on the CPU under TRITON_INTERPRET=1 in fp16 on the tiny
shape. Called before anything imports triton (the interpreter is chosen at its import)."""

from __future__ import annotations

import os

import torch


def kernel_bench_device(name: str, shape: str | None) -> tuple[torch.device, str, torch.dtype]:
    """(device, shape: `shape` or llama8b on CUDA / tiny on CPU, dtype) for `--device name`."""
    device = torch.device(name)
    if device.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    elif not torch.cuda.is_available():
        raise SystemExit("needs CUDA (or --device cpu for a smoke run)")
    gpu = device.type == "cuda"
    return device, shape or ("llama8b" if gpu else "tiny"), torch.bfloat16 if gpu else torch.float16


def kernel_ms(fn, device: torch.device, warmup: int = 5, rep: int = 60) -> float:
    """Median ms of fn: triton's do_bench on CUDA; one timed call on the CPU (the smoke run)."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=warmup, rep=rep))
    import time

    start = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - start)
