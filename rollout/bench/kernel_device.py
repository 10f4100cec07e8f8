"""Where a Triton kernel benchmark runs (rollout/kernels/bench_*.py): on CUDA in bf16 on a
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
