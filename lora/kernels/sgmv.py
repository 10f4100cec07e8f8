"""Triton SGMV kernels: segmented LoRA shrink (h = x @ A^T) and expand (out += h @ B^T).

The rows that run an adapter come as positions of ``row_ids`` (token rows of x / out),
grouped in G segments of one slot each (``rollout.model.lora_segments``). Both kernels tile
(column block, [split,] row tile of a segment) on a flat grid, columns fastest, so programs that
share an input tile run together and read it from L2 after the first.

Row tiles are numbered compactly: segment g's are ``g + seg_start // BLOCK_M + m`` for
``m < cdiv(seg_len, BLOCK_M)``. The first ids rise strictly with g, so a program finds its
segment as the one g with ``first_g <= tile < first_{g+1}`` (a vector load of seg_indptr
for up to BLOCK_G segments, one reduction), and the ids stay below
``G + cdiv(R, BLOCK_M)``, a bound known on the host. Ids between two segments' blocks, empty
or base (-1) segments and empty slots (rank 0) are idle: the program returns at once.

Shrink splits K across programs (``lora.kernels.tiling`` picks the split from shapes):
program (split s) writes its fp32 partial sums to h[s], so there are no atomics and no
memset, and the result does not depend on scheduling. Expand sums the partials of its rows
(at most 64 rank columns each: a few L2 loads) before its one multiply. Neither writes
what the other never reads: h stays unwritten (torch.empty) at padding positions and
columns past a slot's rank, out's rows outside every segment are not even read.

The grid depends only on host ints (shapes), never on device values, so a call is one
launch and is CUDA-graph capturable with the segment tensors changing between replays.

Expand launches with programmatic dependent launch on Hopper and later (`pdl_enabled`; its
`pdl` argument, KernelOptions.lora_pdl, default from ROLLOUT_LORA_PDL, may turn it off):
it may start while the kernel before it (the base GEMM that wrote out, or the shrink that
wrote h) drains, and does its launch, segment lookup and row loads meanwhile; it waits
(griddepcontrol.wait) before its first read of h or out, the only inputs a kernel right
before it writes. Kernels after it wait for it whole, as usual.

This module knows nothing about models or slots' contents; ``lora.ops`` checks arguments,
holds the torch reference and dispatches here. The launchers assume checked arguments.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from lora.kernels import MAX_SLICES
from rollout.kernels.pdl import enabled as pdl_on
from rollout.kernels.pdl import launch as pdl_launch
from lora.kernels.tiling import expand_tiling, shrink_tiling

__all__ = ["pdl_enabled", "sgmv_expand", "sgmv_shrink"]

# Segments scanned per vector load when a program looks up its tile's segment.
_MAX_BLOCK_G = 128
# Under the interpreter (CPU tensors) programs run one after another: few and wide ones.
_INTERPRETER_NUM_SMS = 1


def pdl_enabled(device: torch.device, on: bool = True) -> bool:
    """Does expand launch with programmatic dependent launch on this device (`on`:
    KernelOptions.lora_pdl, CUDA, sm_90+, a Triton that supports it)? Never under the
    interpreter."""
    return pdl_on(device, on)


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return _INTERPRETER_NUM_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def _block_g(num_segments: int) -> int:
    return min(max(triton.next_power_of_2(num_segments), 16), _MAX_BLOCK_G)


# ------------------------------------------------------------------------------ tile math


@triton.jit
def _find_tile(seg_indptr_ptr, seg_slots_ptr, slot_ranks_ptr, num_segments, tile,
               BLOCK_M: tl.constexpr, BLOCK_G: tl.constexpr):
    """(first position in row_ids, positions left in the segment from there, slot, rank,
    idle) of compact tile id ``tile`` (see the module docstring)."""
    found = tl.zeros((), dtype=tl.int32)  # 1 + the segment's index, 0: none
    for g0 in range(0, num_segments, BLOCK_G):  # one iteration for up to BLOCK_G segments
        gs = g0 + tl.arange(0, BLOCK_G)
        in_range = gs < num_segments
        starts = tl.load(seg_indptr_ptr + gs, mask=in_range, other=0)
        ends = tl.load(seg_indptr_ptr + gs + 1, mask=in_range, other=0)
        # the first ids of segments g and g+1 bracket the tile for at most one g
        hit = in_range & (gs + starts // BLOCK_M <= tile) & (tile < gs + 1 + ends // BLOCK_M)
        found += tl.sum(tl.where(hit, gs + 1, 0), axis=0)
    g = tl.maximum(found - 1, 0)
    seg_start = tl.load(seg_indptr_ptr + g)  # cached: just loaded as a vector
    seg_end = tl.load(seg_indptr_ptr + g + 1)
    slot = tl.load(seg_slots_ptr + g)
    pos0 = seg_start + (tile - g - seg_start // BLOCK_M) * BLOCK_M
    rows_left = seg_end - pos0  # <= 0: an id past the segment's blocks
    valid = (found > 0) & (slot >= 0) & (rows_left > 0)
    rank = tl.load(slot_ranks_ptr + slot, mask=valid, other=0)
    return pos0, rows_left, slot, rank, (rank <= 0)  # rank is 0 unless valid


# ---------------------------------------------------------------------------------- shrink


@triton.jit
def _shrink_kernel(
    x_ptr, w_ptr, h_ptr, row_ids_ptr, seg_indptr_ptr, seg_slots_ptr, slot_ranks_ptr,
    num_segments, K, k_per_split, stride_xt, stride_ws, stride_wn, stride_hs,
    N_COLS: tl.constexpr, MAX_RANK: tl.constexpr, N_BLOCKS: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_G: tl.constexpr,
    EVEN_K: tl.constexpr, SKIP_PAST_RANK: tl.constexpr, PRECISION: tl.constexpr,
):
    # grid: [N_BLOCKS * SPLIT_K * row tiles], column block fastest, then split
    pid = tl.program_id(0)
    pid_n = pid % N_BLOCKS
    split = (pid // N_BLOCKS) % SPLIT_K
    tile = pid // (N_BLOCKS * SPLIT_K)
    pos0, rows_left, slot, rank, idle = _find_tile(seg_indptr_ptr, seg_slots_ptr, slot_ranks_ptr, num_segments,
                                                   tile, BLOCK_M, BLOCK_G)
    col0 = pid_n * BLOCK_N  # of the stacked num_slices * MAX_RANK columns
    if SKIP_PAST_RANK:  # the block lies in one slice: all of it past the rank, or none
        idle = idle | (col0 % MAX_RANK >= rank)
    if idle:  # h stays unwritten there: expand never reads it
        return

    offs_m = tl.arange(0, BLOCK_M)
    row_mask = offs_m < rows_left
    pos = pos0 + offs_m  # [BLOCK_M] positions in row_ids
    rows = tl.load(row_ids_ptr + pos, mask=row_mask, other=0).to(tl.int64)  # int64: T * K can pass 2^31
    cols = col0 + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    col_mask = (cols < N_COLS) & (cols % MAX_RANK < rank)
    k_start = split * k_per_split
    k_len = tl.minimum(k_per_split, K - k_start)  # a multiple of BLOCK_K when EVEN_K
    ks = k_start + tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows[:, None] * stride_xt + ks[None, :]  # [BLOCK_M, BLOCK_K]
    w_ptrs = w_ptr + slot.to(tl.int64) * stride_ws + cols[:, None].to(tl.int64) * stride_wn + ks[None, :]

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_len, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=row_mask[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=col_mask[:, None], other=0.0)
        else:
            k_mask = (ks + k0) < K
            x = tl.load(x_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=col_mask[:, None] & k_mask[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)  # A is K-contiguous: [N, K]
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    h_ptrs = h_ptr + split * stride_hs + pos[:, None] * N_COLS + cols[None, :]
    tl.store(h_ptrs, acc, mask=row_mask[:, None] & col_mask[None, :])


def sgmv_shrink(x: torch.Tensor, weights: torch.Tensor, row_ids: torch.Tensor, seg_indptr: torch.Tensor,
                seg_slots: torch.Tensor, slot_ranks: torch.Tensor, *, num_slices: int, max_rank: int,
                split_k: int | None = None) -> torch.Tensor:
    """h fp32 [SPLIT_K, R, num_slices * max_rank] of partial sums; see ``lora.ops.sgmv_shrink``.
    Padding positions and columns at or past a slot's rank are left unwritten. `split_k`
    forces the split (KernelOptions.lora_split_k: tests, benchmark sweeps); None: from shapes."""
    num_tokens, hidden = x.shape
    num_rows, num_segments, num_cols = row_ids.shape[0], seg_slots.shape[0], num_slices * max_rank
    tiling = shrink_tiling(num_rows, num_segments, hidden, num_slices, max_rank, x.element_size(),
                           num_sms=_num_sms(x.device), split_k=split_k)
    if hidden == 0:  # x @ A^T of an empty K is zero
        return torch.zeros((1, num_rows, num_cols), dtype=torch.float32, device=x.device)
    h = torch.empty((tiling.split_k, num_rows, num_cols), dtype=torch.float32, device=x.device)
    if num_tokens == 0 or num_rows == 0 or num_segments == 0:
        return h
    n_blocks = triton.cdiv(num_cols, tiling.block_n)
    num_tiles = num_segments + triton.cdiv(num_rows, tiling.block_m)  # bound on compact tile ids
    _shrink_kernel[(n_blocks * tiling.split_k * num_tiles,)](
        x, weights, h, row_ids, seg_indptr, seg_slots, slot_ranks,
        num_segments, hidden, tiling.k_per_split, x.stride(0), weights.stride(0), weights.stride(1), h.stride(0),
        N_COLS=num_cols, MAX_RANK=max_rank, N_BLOCKS=n_blocks, SPLIT_K=tiling.split_k,
        BLOCK_M=tiling.block_m, BLOCK_N=tiling.block_n, BLOCK_K=tiling.block_k, BLOCK_G=_block_g(num_segments),
        EVEN_K=hidden % tiling.block_k == 0, SKIP_PAST_RANK=max_rank % tiling.block_n == 0,
        PRECISION=_dot_precision(x.dtype), num_warps=tiling.num_warps, num_stages=tiling.num_stages,
    )
    return h


# ---------------------------------------------------------------------------------- expand


@triton.jit
def _expand_kernel(
    h_ptr, w_ptr, out_ptr, row_ids_ptr, seg_indptr_ptr, seg_slots_ptr, slot_ranks_ptr,
    num_segments, n_out, total_blocks, off1, off2, off3, blk1, blk2, blk3,
    stride_hs, stride_ws, stride_wn, stride_ot,
    N_COLS: tl.constexpr, MAX_RANK: tl.constexpr, SPLIT_K: tl.constexpr, SPLIT_CHUNK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr,
    PRECISION: tl.constexpr, USE_PDL: tl.constexpr,
):
    # grid: [total_blocks * row tiles], column block fastest. Slice j's columns [off_j,
    # off_j+1) start on a fresh block (blk_j), so a block reads one slice's h columns.
    # Unused slices have off = n_out and a blk past the grid.
    pid = tl.program_id(0)
    pid_n = pid % total_blocks
    tile = pid // total_blocks
    pos0, rows_left, slot, rank, idle = _find_tile(seg_indptr_ptr, seg_slots_ptr, slot_ranks_ptr, num_segments,
                                                   tile, BLOCK_M, BLOCK_G)
    if idle:  # out's rows outside every segment are not even read
        return
    slice_id = (pid_n >= blk1).to(tl.int32) + (pid_n >= blk2).to(tl.int32) + (pid_n >= blk3).to(tl.int32)
    first_block = tl.where(slice_id == 0, 0, tl.where(slice_id == 1, blk1, tl.where(slice_id == 2, blk2, blk3)))
    n_start = tl.where(slice_id == 0, 0, tl.where(slice_id == 1, off1, tl.where(slice_id == 2, off2, off3)))
    n_end = tl.where(slice_id == 0, off1, tl.where(slice_id == 1, off2, tl.where(slice_id == 2, off3, n_out)))

    offs_m = tl.arange(0, BLOCK_M)
    row_mask = offs_m < rows_left
    pos = pos0 + offs_m  # [BLOCK_M] positions in row_ids (h's rows)
    rows = tl.load(row_ids_ptr + pos, mask=row_mask, other=0).to(tl.int64)  # out's rows
    cols = n_start + (pid_n - first_block) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] of out
    col_mask = cols < n_end
    rs = tl.arange(0, BLOCK_R)
    splits = tl.arange(0, SPLIT_CHUNK)
    # [1, BLOCK_M, BLOCK_R] this slice's rank columns of h, split 0
    h_ptrs = h_ptr + pos[None, :, None] * N_COLS + (slice_id * MAX_RANK + rs)[None, None, :]
    w_ptrs = w_ptr + slot.to(tl.int64) * stride_ws + cols[:, None].to(tl.int64) * stride_wn + rs[None, :]
    if USE_PDL:  # launched early (PDL): h and out come from the kernels right before this one
        tl.extra.cuda.gdc_wait()

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):  # only up to this slot's rank: h past it is unwritten
        r_mask = (r0 + rs) < rank
        h_sum = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for s0 in tl.static_range(0, SPLIT_K, SPLIT_CHUNK):  # unrolled: all partials' loads in flight at once
            s = s0 + splits
            mask = (s < SPLIT_K)[:, None, None] & row_mask[None, :, None] & r_mask[None, None, :]
            h_sum += tl.sum(tl.load(h_ptrs + s[:, None, None] * stride_hs + r0, mask=mask, other=0.0), axis=0)
        b = tl.load(w_ptrs + r0, mask=col_mask[:, None] & r_mask[None, :], other=0.0).to(tl.float32)
        acc = tl.dot(h_sum, tl.trans(b), acc, input_precision=PRECISION)  # B is K-contiguous: [N, R]

    o_ptrs = out_ptr + rows[:, None] * stride_ot + cols[None, :]
    mask = row_mask[:, None] & col_mask[None, :]
    base = tl.load(o_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(o_ptrs, (base + acc).to(out_ptr.dtype.element_ty), mask=mask)


def sgmv_expand(h: torch.Tensor, weights: torch.Tensor, out: torch.Tensor, row_ids: torch.Tensor,
                seg_indptr: torch.Tensor, seg_slots: torch.Tensor, slot_ranks: torch.Tensor, *,
                slice_offsets: tuple[int, ...], max_rank: int, block_n: int | None = None, pdl: bool = True) -> None:
    """out[row_ids] += (sum of h's partials) @ B^T per segment, in place; see ``lora.ops.sgmv_expand``.
    `block_n` forces the column block (KernelOptions.lora_expand_block_n); `pdl`: launch early
    where the GPU can (KernelOptions.lora_pdl)."""
    num_tokens, n_out = out.shape
    split_k, num_rows, num_cols = h.shape
    num_segments = seg_slots.shape[0]
    widths = tuple(hi - lo for lo, hi in zip(slice_offsets[:-1], slice_offsets[1:]))
    if num_tokens == 0 or num_rows == 0 or num_segments == 0 or n_out == 0:
        return
    tiling = expand_tiling(num_rows, num_segments, widths, max_rank, split_k, num_sms=_num_sms(out.device),
                           block_n=block_n)
    block_starts = [0]
    for width in widths:
        block_starts.append(block_starts[-1] + triton.cdiv(width, tiling.block_n))
    total_blocks = block_starts[-1]
    # Pad to MAX_SLICES: unused slices start at n_out, on a block the grid never reaches.
    offs = list(slice_offsets[1:-1]) + [n_out] * (MAX_SLICES - len(widths))
    blks = block_starts[1:-1] + [total_blocks] * (MAX_SLICES - len(widths))
    num_tiles = num_segments + triton.cdiv(num_rows, tiling.block_m)
    _expand_kernel[(total_blocks * num_tiles,)](
        h, weights, out, row_ids, seg_indptr, seg_slots, slot_ranks,
        num_segments, n_out, total_blocks, *offs, *blks,
        h.stride(0), weights.stride(0), weights.stride(1), out.stride(0),
        N_COLS=num_cols, MAX_RANK=max_rank, SPLIT_K=split_k, SPLIT_CHUNK=tiling.split_chunk,
        BLOCK_M=tiling.block_m, BLOCK_N=tiling.block_n, BLOCK_R=tiling.block_r, BLOCK_G=_block_g(num_segments),
        PRECISION=_dot_precision(weights.dtype), num_warps=tiling.num_warps, num_stages=tiling.num_stages,
        **pdl_launch(out.device, pdl),
    )


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 models: exact products ("ieee"; TF32 would cost ~1e-3). 16-bit: shrink's operands
    # are 16-bit anyway (the option is ignored); expand multiplies fp32 partial sums by B
    # widened to fp32 in TF32, which keeps B exact (8-bit mantissas fit TF32's 10) and h to
    # 2^-11 relative, finer than the 16-bit output's rounding.
    return "ieee" if dtype == torch.float32 else "tf32"
