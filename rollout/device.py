"""Host-to-device copies that do not stall the device's stream.

A `non_blocking` copy from pageable host memory synchronizes the stream before it starts
(CUDA stages pageable memory), which would serialize every step's metadata upload behind
the previous step's kernels and defeat overlap scheduling. Pinned memory (torch's caching
host allocator, so pinning small tensors each step is cheap) makes the copy truly async.
"""

from __future__ import annotations

import torch


def pinned(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` (CPU) in pinned memory when it is bound for a CUDA device, else as is: for callers
    that hand CPU tensors to a library that copies them with non_blocking=True."""
    return t.pin_memory() if device.type == "cuda" else t


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type != "cuda":
        return t.to(device)
    return pinned(t, device).to(device, non_blocking=True)
