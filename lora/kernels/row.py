"""The shrink of one row under one slot: h = x A_slot^T for a batch-1 step, the first half of
the low-rank term the GEMV's epilogue adds (rollout/kernels/low_rank.py).

At one row the SGMV shrink's segment lookup and tiling buy nothing: the row's slot is read
from the device (a CUDA graph replays any adapter) and each program takes one column block
of one slice (rank columns of A) and one K block, so a few dozen programs stream the slot's
A (128 KB a slice at rank 16 on Llama-3-8B) with every load in flight at once. Partial
sums go to h[split] (no atomics, no memset; the epilogue sums them), and blocks past the
slot's rank, or every block when the row runs no adapter (slot -1), return at once,
leaving h unwritten where the epilogue never reads.

Launched under PDL where available (rollout/kernels/pdl.py): A is read before the wait (no
kernel of a step writes it), x after; it lets the GEMV after it launch at once, so the
GEMV's first tile of W (and the adapter's B rows) are in flight while this runs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rollout.kernels.pdl import launch as pdl_launch
from rollout.kernels.low_rank import MAX_SPLIT

__all__ = ["BLOCK_K", "shrink_row", "splits"]

# K per program: one [BLOCK_R, BLOCK_K] load of A (launch shapes: BENCHMARKS.md, multi-LoRA,
# "H200, 2026-12-02: the one-row shrink's launch shape, in the engine")
BLOCK_K = 512
_BLOCK_R = 16  # rank columns per program
NUM_WARPS = 4  # per program; BLOCK_K and this are read at each launch (benchmarks/kernels/lora_row.py sweeps them)
# Under the interpreter (CPU tests), K blocks this wide so several splits run on tiny shapes.
INTERPRETER_BLOCK_K = 32


def _block_k(hidden: int, device: torch.device) -> int:
    """K per program: BLOCK_K, doubled until K takes at most MAX_SPLIT of them (the epilogue
    loads all partials at once)."""
    block_k = BLOCK_K if device.type == "cuda" else INTERPRETER_BLOCK_K
    while triton.cdiv(hidden, block_k) > MAX_SPLIT:
        block_k *= 2
    return block_k


def splits(hidden: int, device: torch.device) -> int:
    """SPLIT, h's first dim: K blocks of x's row."""
    return max(triton.cdiv(hidden, _block_k(hidden, device)), 1)


@triton.jit
def _shrink_row_kernel(x_ptr, a_ptr, h_ptr, slot_ptr, ranks_ptr, K, stride_as, stride_an,
                       MAX_RANK: tl.constexpr, COLS: tl.constexpr, R_BLOCKS: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
    # grid: [num_slices * R_BLOCKS, SPLIT]
    if USE_PDL:  # the GEMV after this may launch now: it waits for this kernel before its epilogue
        tl.extra.cuda.gdc_launch_dependents()
    pid_c = tl.program_id(0)
    split = tl.program_id(1)
    slot = tl.load(slot_ptr)  # written before the step, by no kernel of it
    rank = tl.load(ranks_ptr + tl.maximum(slot, 0))
    r0 = (pid_c % R_BLOCKS) * BLOCK_R
    if (slot < 0) | (r0 >= rank):  # no adapter, or a block past the rank: h stays unwritten
        return
    rs = r0 + tl.arange(0, BLOCK_R)
    cols = (pid_c // R_BLOCKS) * MAX_RANK + rs  # [BLOCK_R] of h's num_slices * MAX_RANK
    r_ok = rs < rank
    ks = split * BLOCK_K + tl.arange(0, BLOCK_K)
    k_ok = ks < K
    a_ptrs = a_ptr + slot.to(tl.int64) * stride_as + cols[:, None].to(tl.int64) * stride_an + ks[None, :]
    a = tl.load(a_ptrs, mask=r_ok[:, None] & k_ok[None, :], other=0.0)
    if USE_PDL:  # x is the output of the kernel right before this one
        tl.extra.cuda.gdc_wait()
    x = tl.load(x_ptr + ks, mask=k_ok, other=0.0)
    h = tl.sum(a.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    tl.store(h_ptr + split * COLS + cols, h, mask=r_ok)


def shrink_row(x: torch.Tensor, weights: torch.Tensor, slot: torch.Tensor, slot_ranks: torch.Tensor, *,
               num_slices: int, max_rank: int, pdl: bool = True) -> torch.Tensor:
    """h fp32 [SPLIT, num_slices * max_rank] of partial sums; see ``lora.ops.shrink_row``.
    Columns at or past the slot's rank, and all of h when the slot is -1, are left unwritten.
    `pdl`: launch early where the GPU can (KernelOptions.pdl)."""
    hidden = x.shape[1]
    cols = num_slices * max_rank
    block_k = _block_k(hidden, x.device)
    split = splits(hidden, x.device)
    h = torch.empty((split, cols), dtype=torch.float32, device=x.device)
    if hidden == 0:
        return h.zero_()
    r_blocks = triton.cdiv(max_rank, _BLOCK_R)
    _shrink_row_kernel[(num_slices * r_blocks, split)](
        x, weights, h, slot, slot_ranks, hidden, weights.stride(0), weights.stride(1),
        MAX_RANK=max_rank, COLS=cols, R_BLOCKS=r_blocks, BLOCK_R=_BLOCK_R, BLOCK_K=block_k, num_warps=NUM_WARPS,
        **pdl_launch(x.device, pdl))
    return h
