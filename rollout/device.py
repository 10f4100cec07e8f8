"""Host-to-device copies that do not stall the device's stream.

A `non_blocking` copy from pageable host memory synchronizes the stream before it starts
(CUDA stages pageable memory), which would serialize every step's metadata upload behind
the previous step's kernels and defeat overlap scheduling. Pinned memory (torch's caching
host allocator, so pinning small tensors each step is cheap) makes the copy truly async.
"""

from __future__ import annotations

import numpy as np
import torch

# Each array's start in an upload's buffer: a multiple of this many bytes, so every part
# views its own dtype (and kernels that read the parts see the alignment cudaMalloc gives).
ALIGN = 256


def pinned(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` (CPU) in pinned memory when it is bound for a CUDA device, else as is: for callers
    that hand CPU tensors to a library that copies them with non_blocking=True."""
    return t.pin_memory() if device.type == "cuda" else t


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type != "cuda":
        return t.to(device)
    return pinned(t, device).to(device, non_blocking=True)


def upload(arrays: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """1-D host arrays as tensors on `device`: to CUDA in ONE host-to-device copy (a step's
    metadata: each copy costs the host ~20 us of CUDA calls, which a step without overlap
    scheduling, such as a speculative verify, waits for before its forward launches), each
    part a view of its dtype into the one buffer; elsewhere as tensors sharing their memory."""
    if device.type != "cuda":
        return [torch.from_numpy(np.ascontiguousarray(a)).to(device) for a in arrays]
    host, spans = pack(arrays)
    buffer = host.to(device, non_blocking=True)
    return unpack(buffer, arrays, spans)


def pack(arrays: list[np.ndarray]) -> tuple[torch.Tensor, list[int]]:
    """The arrays' bytes in one pinned uint8 buffer, each from an ALIGN-multiple offset: the
    buffer and the offsets. (Pinned by torch's caching host allocator, which keeps a block
    from reuse until the copies that read it are done.)"""
    offsets, total = [], 0
    for a in arrays:
        total = -(-total // ALIGN) * ALIGN
        offsets.append(total)
        total += a.nbytes
    host = torch.empty(max(total, 1), dtype=torch.uint8, pin_memory=torch.cuda.is_available())
    view = host.numpy()
    for a, at in zip(arrays, offsets):
        view[at : at + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    return host, offsets


def unpack(buffer: torch.Tensor, arrays: list[np.ndarray], offsets: list[int]) -> list[torch.Tensor]:
    """The parts of a packed buffer (on any device), each viewed as its array's dtype."""
    return [buffer[at : at + a.nbytes].view(_TORCH[a.dtype]) for a, at in zip(arrays, offsets)]


_TORCH = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32, np.dtype(np.float32): torch.float32,
          np.dtype(np.bool_): torch.bool, np.dtype(np.uint8): torch.uint8}
