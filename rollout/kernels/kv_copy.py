"""Copy KV slots in every layer's pool buffers in one launch (KVPool.copy_slots on the GPU).

A draft tree's accepted path is moved into position order after its verify step
(speculative/verify.py `_compact_path`), and a fork copies its leader's partial page
(rollout/cache/manager.py). The torch form, `k[dst] = k[src]` per layer and buffer, is four
ops a layer with a CPU index each: on a GPU every index is a blocking host-to-device copy, so
a move costed 64 stream syncs and 128 launches on Llama-3-8B's 32 layers, all on the host
between a verify's read back and the next step's launch, where nothing overlaps them.

Here the buffers' addresses, the sources and the destinations go to the device in one copy
(rollout/device.py `upload`) and one kernel copies them: a program per (buffer, column
block), walking the moves in order. The moves must not read a slot an earlier move writes
(a tree's path and a fork's pages do not), so in-order and read-all-first copies agree, and
the torch form stays this kernel's reference (and the CPU path).
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from rollout.device import upload

__all__ = ["copy_slots"]

_BLOCK = 1024  # columns (heads x head_dim) per program: Llama-3-8B's 8 x 128 in one


@triton.jit
def _copy_slots_kernel(ptrs_ptr, src_ptr, dst_ptr, like_ptr, n_moves, width, BLOCK: tl.constexpr):
    # grid: [buffers, column blocks]; every buffer is [num_slots, width] contiguous, of like's dtype
    base = tl.load(ptrs_ptr + tl.program_id(0)).to(like_ptr.dtype)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    for m in range(n_moves):  # in order: no move reads what an earlier one wrote
        s = tl.load(src_ptr + m).to(tl.int64)
        d = tl.load(dst_ptr + m).to(tl.int64)
        tl.store(base + d * width + cols, tl.load(base + s * width + cols, mask=mask), mask=mask)


def copy_slots(buffers: list[torch.Tensor], src: torch.Tensor, dst: torch.Tensor) -> None:
    """buffer[dst[m]] = buffer[src[m]] for every buffer and move m, in one launch. buffers:
    [num_slots, ...] of one shape and dtype, contiguous, on one device; src, dst: int CPU
    tensors of one length (slot ids; not bounds-checked: a device sync)."""
    if src.shape != dst.shape or src.dim() != 1:
        raise ValueError(f"kv_copy.copy_slots: src and dst must be 1-D of one length, got {tuple(src.shape)} "
                         f"and {tuple(dst.shape)}")
    if not buffers or src.numel() == 0:
        return
    first = buffers[0]
    if any(b.shape != first.shape or b.dtype != first.dtype or b.device != first.device or not b.is_contiguous()
           for b in buffers):
        raise ValueError("kv_copy.copy_slots: buffers must share one shape, dtype and device, each contiguous")
    ptrs = np.fromiter((b.data_ptr() for b in buffers), dtype=np.int64, count=len(buffers))
    ptrs_d, src_d, dst_d = upload([ptrs, src.numpy().astype(np.int64), dst.numpy().astype(np.int64)], first.device)
    width = first[0].numel()
    block = min(triton.next_power_of_2(width), _BLOCK)
    _copy_slots_kernel[(len(buffers), triton.cdiv(width, block))](
        ptrs_d, src_d, dst_d, first, src.numel(), width, BLOCK=block, num_warps=4)
