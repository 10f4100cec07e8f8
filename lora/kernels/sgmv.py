"""Triton SGMV kernels: segmented LoRA shrink (x @ A^T) and expand (out += h @ B^T).

A batch's tokens come in G contiguous segments, each with one adapter slot (-1: the base
model, no LoRA). Both kernels tile (N-block, M-block of a segment) with the N axis fastest,
so programs sharing an input tile run together and read it from L2 after the first.
Programs of a base segment, or (shrink) past the slot's rank, return at once.

M-blocks are numbered compactly rather than as a (segment, M-block) rectangle: segment g's
blocks are tiles ``g + seg_start_g // BLOCK_M + m`` for ``m < cdiv(seg_len_g, BLOCK_M)``.
These ids increase with g, never collide (a segment's last block ends before the next
segment's first id) and stay below ``G + cdiv(T, BLOCK_M)``, a bound known on the host. A
rectangle sized by the longest segment would launch G * cdiv(max_seg_len, BLOCK_M) blocks:
in a mixed step of 256 decode tokens and a 4096-token prefill chunk that is ~16k blocks
where ~320 have work, each idle one still a block launch times every N-block. Each program
finds its segment by counting the first ids <= its tile over seg_indptr (one vector load
of G ints for G <= 256, cached). Rows are never skipped, whatever ``max_seg_len`` says: it
only picks BLOCK_M.

The grid depends only on host ints (shapes, ``max_seg_len``), never on device values, so
one call is one launch and is CUDA-graph capturable.

This module knows nothing about models or slots' contents; ``lora.ops`` checks arguments,
holds the torch reference and dispatches here. The launchers assume checked arguments.
Accumulation is fp32; each output element is rounded once to its dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lora.kernels import MAX_SLICES

__all__ = ["sgmv_expand", "sgmv_shrink"]

# CUDA limits grid axes 1 and 2 to 2^16 - 1 programs (M-tiles are axis 1).
_MAX_GRID_YZ = 65535
# Segments scanned per vector load when a program looks up its tile's segment.
_BLOCK_G = 256


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs would default to TF32 on tensor cores (~1e-3 error); keep them exact.
    # For bf16/fp16 the option is ignored.
    return "ieee" if dtype == torch.float32 else "tf32"


def _block_m(max_seg_len: int) -> int:
    # tl.dot needs M >= 16. Decode (every segment one token) takes 16 and wastes only MMA
    # work on masked rows, which cost no memory traffic; long segments take 64 rows so a
    # weight tile is reused across more tokens.
    return min(max(triton.next_power_of_2(max_seg_len), 16), 64)


# ------------------------------------------------------------------------------ tile math


@triton.jit
def _tile(seg_indptr_ptr, seg_slots_ptr, slot_ranks_ptr, num_segments, tile,
          BLOCK_M: tl.constexpr, BLOCK_G: tl.constexpr):
    """(first row, rows left in the segment from there, slot, rank) of compact tile id
    ``tile`` (see the module docstring), and whether it is idle: an id between two
    segments' blocks, a base segment (slot -1) or an empty slot (rank 0)."""
    # The segment is the last one whose first id is <= tile; first ids rise with g.
    count = tl.zeros((), dtype=tl.int32)
    for g0 in range(0, num_segments, BLOCK_G):
        gs = g0 + tl.arange(0, BLOCK_G)
        in_range = gs < num_segments
        first = gs + tl.load(seg_indptr_ptr + gs, mask=in_range, other=0) // BLOCK_M
        count += tl.sum((in_range & (first <= tile)).to(tl.int32), axis=0)
    g = tl.maximum(count - 1, 0)  # count 0: a tile before the first segment's rows
    seg_start = tl.load(seg_indptr_ptr + g)
    seg_len = tl.load(seg_indptr_ptr + g + 1) - seg_start
    m = tile - (g + seg_start // BLOCK_M)  # M-block within the segment
    slot = tl.load(seg_slots_ptr + g)
    rank = tl.load(slot_ranks_ptr + slot, mask=slot >= 0, other=0)
    idle = (count == 0) | (m * BLOCK_M >= seg_len) | (slot < 0) | (rank <= 0)
    return seg_start + m * BLOCK_M, seg_len - m * BLOCK_M, slot, rank, idle


def _num_tiles(num_tokens: int, num_segments: int, block_m: int) -> int:
    """Upper bound on the compact tile ids (see the module docstring)."""
    return num_segments + triton.cdiv(num_tokens, block_m)


# ---------------------------------------------------------------------------------- shrink


@triton.jit
def _shrink_kernel(
    x_ptr, w_ptr, h_ptr, seg_indptr_ptr, seg_slots_ptr, slot_ranks_ptr,
    num_segments, K, stride_xt, stride_ws, stride_wn, stride_ht,
    MAX_RANK: tl.constexpr, N_BLOCKS_PER_SLICE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_G: tl.constexpr,
    EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
):
    # grid: (num_slices * N_BLOCKS_PER_SLICE, compact M-tiles)
    pid_n = tl.program_id(0)
    row0, rows_left, slot, rank, idle = _tile(seg_indptr_ptr, seg_slots_ptr, slot_ranks_ptr, num_segments,
                                              tl.program_id(1), BLOCK_M, BLOCK_G)
    slice_id = pid_n // N_BLOCKS_PER_SLICE
    rank_start = (pid_n % N_BLOCKS_PER_SLICE) * BLOCK_N
    if idle | (rank_start >= rank):  # h stays unwritten there: expand never reads it
        return

    rows = tl.arange(0, BLOCK_M)  # [BLOCK_M] from the tile's first row
    ranks = rank_start + tl.arange(0, BLOCK_N)  # [BLOCK_N] rank index within the slice
    ks = tl.arange(0, BLOCK_K)
    row_mask = rows < rows_left
    rank_mask = ranks < rank
    token = (row0 + rows).to(tl.int64)  # int64: T * K can pass 2^31 in long prefills
    w_rows = slice_id * MAX_RANK + ranks  # [BLOCK_N] rows of the slot's stacked A
    x_ptrs = x_ptr + token[:, None] * stride_xt + ks[None, :]  # [BLOCK_M, BLOCK_K]
    w_ptrs = w_ptr + slot.to(tl.int64) * stride_ws + w_rows[:, None].to(tl.int64) * stride_wn + ks[None, :]

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=row_mask[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=rank_mask[:, None], other=0.0)
        else:
            k_mask = (k0 + ks) < K
            x = tl.load(x_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=rank_mask[:, None] & k_mask[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)  # w is K-contiguous: [N, K]
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    h_ptrs = h_ptr + token[:, None] * stride_ht + w_rows[None, :]
    tl.store(h_ptrs, acc.to(h_ptr.dtype.element_ty), mask=row_mask[:, None] & rank_mask[None, :])


def sgmv_shrink(x: torch.Tensor, weights: torch.Tensor, seg_indptr: torch.Tensor, seg_slots: torch.Tensor,
                slot_ranks: torch.Tensor, *, num_slices: int, max_rank: int, max_seg_len: int) -> torch.Tensor:
    """h [T, num_slices * max_rank] in x's dtype; see ``lora.ops.sgmv_shrink``. Rows of base
    segments and columns at or past a slot's rank are left unwritten (torch.empty)."""
    num_tokens, hidden = x.shape
    h = torch.empty((num_tokens, num_slices * max_rank), dtype=x.dtype, device=x.device)
    num_segments = seg_slots.shape[0]
    if num_tokens == 0 or num_segments == 0 or hidden == 0:
        return h
    block_m = _block_m(max_seg_len)
    # Decode: the narrowest N-block, so a rank-64 adapter still spreads over 4 programs per
    # slice, and a long K step. Long segments: one N-block covers the rank (x is read once
    # per slice), and a shorter K step keeps the staged tiles within shared memory.
    block_n = 16 if block_m == 16 else min(max(triton.next_power_of_2(max_rank), 16), 64)
    block_k = 256 if block_m == 16 else 128
    if x.element_size() == 4:
        block_k //= 2
    block_k = min(block_k, max(triton.next_power_of_2(hidden), 16))
    n_blocks = triton.cdiv(max_rank, block_n)
    grid = (num_slices * n_blocks, _num_tiles(num_tokens, num_segments, block_m))
    _check_grid(grid)
    _shrink_kernel[grid](
        x, weights, h, seg_indptr, seg_slots, slot_ranks,
        num_segments, hidden, x.stride(0), weights.stride(0), weights.stride(1), h.stride(0),
        MAX_RANK=max_rank, N_BLOCKS_PER_SLICE=n_blocks,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_G=_BLOCK_G,
        EVEN_K=hidden % block_k == 0, PRECISION=_dot_precision(x.dtype),
        num_warps=4, num_stages=3,
    )
    return h


# ---------------------------------------------------------------------------------- expand


@triton.jit
def _expand_kernel(
    h_ptr, w_ptr, out_ptr, seg_indptr_ptr, seg_slots_ptr, slot_ranks_ptr,
    num_segments, n_out, off1, off2, off3, blk1, blk2, blk3,
    stride_ht, stride_ws, stride_wn, stride_ot,
    MAX_RANK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_G: tl.constexpr, PRECISION: tl.constexpr,
):
    # grid: (N-blocks of all slices, compact M-tiles). Slice j's columns [off_j, off_j+1)
    # start on a fresh N-block (blk_j), so a block never straddles two slices and reads one
    # slice's h columns. Unused slices have off = n_out and a blk past the grid.
    pid_n = tl.program_id(0)
    row0, rows_left, slot, rank, idle = _tile(seg_indptr_ptr, seg_slots_ptr, slot_ranks_ptr, num_segments,
                                              tl.program_id(1), BLOCK_M, BLOCK_G)
    if idle:  # base segments' rows of out are not even read
        return
    slice_id = (pid_n >= blk1).to(tl.int32) + (pid_n >= blk2).to(tl.int32) + (pid_n >= blk3).to(tl.int32)
    first_block = tl.where(slice_id == 0, 0, tl.where(slice_id == 1, blk1, tl.where(slice_id == 2, blk2, blk3)))
    n_start = tl.where(slice_id == 0, 0, tl.where(slice_id == 1, off1, tl.where(slice_id == 2, off2, off3)))
    n_end = tl.where(slice_id == 0, off1, tl.where(slice_id == 1, off2, tl.where(slice_id == 2, off3, n_out)))

    rows = tl.arange(0, BLOCK_M)  # [BLOCK_M] from the tile's first row
    cols = n_start + (pid_n - first_block) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] of out
    ks = tl.arange(0, BLOCK_K)
    row_mask = rows < rows_left
    col_mask = cols < n_end
    token = (row0 + rows).to(tl.int64)
    h_ptrs = h_ptr + token[:, None] * stride_ht + (slice_id * MAX_RANK + ks)[None, :]  # [BLOCK_M, BLOCK_K]
    w_ptrs = w_ptr + slot.to(tl.int64) * stride_ws + cols[:, None].to(tl.int64) * stride_wn + ks[None, :]

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, rank, BLOCK_K):  # only up to this slot's rank
        # h past the rank was never written (may hold NaN): masked, not multiplied by B's zeros
        k_mask = (k0 + ks) < rank
        a = tl.load(h_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(w_ptrs, mask=col_mask[:, None] & k_mask[None, :], other=0.0)
        acc = tl.dot(a, tl.trans(b), acc, input_precision=PRECISION)  # B is K-contiguous: [N, K]
        h_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    o_ptrs = out_ptr + token[:, None] * stride_ot + cols[None, :]
    mask = row_mask[:, None] & col_mask[None, :]
    base = tl.load(o_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(o_ptrs, (base + acc).to(out_ptr.dtype.element_ty), mask=mask)


def sgmv_expand(h: torch.Tensor, weights: torch.Tensor, out: torch.Tensor, seg_indptr: torch.Tensor,
                seg_slots: torch.Tensor, slot_ranks: torch.Tensor, *, slice_offsets: tuple[int, ...], max_rank: int,
                max_seg_len: int) -> None:
    """out += h @ B^T per segment, in place; see ``lora.ops.sgmv_expand``."""
    num_tokens, n_out = out.shape
    num_segments = seg_slots.shape[0]
    if num_tokens == 0 or num_segments == 0 or n_out == 0:
        return
    block_m = _block_m(max_seg_len)
    # Memory-bound on out's read-modify-write: tiles of ~16 elements a thread (~80
    # registers on sm_90, so many warps per SM keep loads in flight); a batch-1 decode of a
    # 6144-wide qkv still spreads over 48 programs. K is the rank: one or a few steps, the
    # shorter ones for decode where B's tile dominates the registers.
    block_n, num_warps = (128, 4) if block_m == 16 else (64, 8 if block_m == 64 else 4)
    block_k = min(max(triton.next_power_of_2(max_rank), 16), 32 if block_m == 16 else 64)
    widths = [hi - lo for lo, hi in zip(slice_offsets[:-1], slice_offsets[1:])]
    block_starts = [0]
    for width in widths:
        block_starts.append(block_starts[-1] + triton.cdiv(width, block_n))
    total_blocks = block_starts[-1]
    if total_blocks == 0:
        return
    # Pad to MAX_SLICES: unused slices start at n_out, on a block the grid never reaches.
    offs = list(slice_offsets[1:-1]) + [n_out] * (MAX_SLICES - len(widths))
    blks = block_starts[1:-1] + [total_blocks] * (MAX_SLICES - len(widths))
    grid = (total_blocks, _num_tiles(num_tokens, num_segments, block_m))
    _check_grid(grid)
    _expand_kernel[grid](
        h, weights, out, seg_indptr, seg_slots, slot_ranks,
        num_segments, n_out, *offs, *blks,
        h.stride(0), weights.stride(0), weights.stride(1), out.stride(0),
        MAX_RANK=max_rank, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_G=_BLOCK_G,
        PRECISION=_dot_precision(h.dtype),
        num_warps=num_warps, num_stages=2,
    )


def _check_grid(grid: tuple[int, int]) -> None:
    if grid[1] > _MAX_GRID_YZ:
        raise ValueError(f"SGMV grid {grid} exceeds CUDA's {_MAX_GRID_YZ} M-tiles on axis 1: too many tokens "
                         f"or segments for one call; split it")
