"""Whether Hopper's tensor memory accelerator can load tiles of these tensors (the Triton
matmul that takes TMA descriptors: batch_invariant's)."""

from __future__ import annotations

import torch


def tma_ok(*tensors: torch.Tensor) -> bool:
    """A TMA descriptor needs a contiguous last dimension, 16-byte aligned rows and base, and
    a GPU that has the unit (compute capability 9+); the interpreter (CPU tensors) emulates it."""
    for t in tensors:
        if t.stride(1) != 1 or (t.stride(0) * t.element_size()) % 16 or t.data_ptr() % 16:
            return False
    return not tensors[0].is_cuda or torch.cuda.get_device_capability(tensors[0].device)[0] >= 9
