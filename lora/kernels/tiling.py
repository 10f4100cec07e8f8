"""Block sizes and split-K of the SGMV kernels, chosen on the host from shapes alone.

Pure Python (no triton, no device): a CUDA graph captures the launch these choose, so they
may depend only on host ints (rows R, segments G, K, column counts), never on device values.

What they balance. Both ops are memory-bound with tiny arithmetic (rank <= 64), so the
question is how many programs run at once and how far each one's loads must wait:
* Shrink ``h = x @ A^T`` has only ``num_slices * max_rank`` columns (48 for q/k/v at rank
  16). At decode that is a handful of tiles, each walking K = 4096 (14336 for down_proj)
  serially: a few SMs busy out of ~132. Splitting K across programs (each writes its own
  partial sums, no atomics) brings ~``num_sms`` programs that each do one or two K steps.
  Splits stop where they stop paying: ``split_k * R`` is capped because expand re-reads
  the partials once per N-block, and a long prefill has enough row tiles without them.
* Expand ``out += h @ B^T`` is wide (N_out up to 28672) and reads the little h; at decode
  narrower N-blocks give the GPU enough programs, long prefills take wide ones.
* BLOCK_M follows the rows per segment (R / G): segments are whole adapters' rows now, so
  at batch 256 with 8 adapters a 32-row tile is mostly full; 16 is tl.dot's minimum.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ExpandTiling", "ShrinkTiling", "block_m_for", "expand_tiling", "shrink_tiling"]

DEFAULT_NUM_SMS = 132  # an H100's and an H200's SM count; the launcher passes the device's own
# Splitting the shrink's K lets a few rows fill the GPU, but expand re-reads the partials once
# per N-block: beyond about 4 splits the re-reads outweigh the wider shrink at batch 16 and 256,
# while batch 1 gains little more (python -m benchmarks.kernels.sgmv --only step --split-k N;
# BENCHMARKS.md, multi-LoRA, "H200, Llama-3.1-8B shape, bf16 (2026-11-30), ...").
MAX_SPLIT_K = 4
MIN_K_PER_SPLIT = 64  # a split below this is all overhead
# Caps on h's partial sums (fp32), which expand re-reads once per N-block: the whole of h per
# slice, and what one expand program (one row tile) must load before its first multiply.
PARTIALS_BYTES = 64 * 1024
PARTIALS_BYTES_PER_TILE = 16 * 1024
# Registers of expand's partial-sum tile [split chunk, BLOCK_M, BLOCK_R] (fp32): 32 a thread at 4 warps.
PARTIALS_TILE = 4096


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def block_m_for(num_rows: int, num_segments: int) -> int:
    """Rows per tile: the typical segment's rows (R / G), 16 (tl.dot's minimum) to 64."""
    return min(max(next_power_of_2(cdiv(num_rows, max(num_segments, 1))), 16), 64)


@dataclass(frozen=True)
class ShrinkTiling:
    block_m: int
    block_n: int  # over the stacked num_slices * max_rank columns
    block_k: int
    split_k: int  # h's leading dim: cdiv(K, k_per_split)
    k_per_split: int  # a multiple of block_k
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True)
class ExpandTiling:
    block_m: int
    block_n: int  # over out's columns; each slice starts on a fresh block
    block_r: int  # the rank step (h's and B's K dim)
    split_chunk: int  # h partials summed per load
    num_warps: int
    num_stages: int = 2


def shrink_tiling(num_rows: int, num_segments: int, hidden: int, num_slices: int, max_rank: int, elem_size: int, *,
                  num_sms: int = DEFAULT_NUM_SMS, split_k: int | None = None) -> ShrinkTiling:
    """Tiles of ``h = x @ A^T`` for x [R, hidden] of ``elem_size``-byte floats. ``split_k``
    forces a split (tests, benchmarks), which rounding K to whole steps may lower (h's
    leading dim is the returned ``split_k``)."""
    num_cols = num_slices * max_rank
    block_m = block_m_for(num_rows, num_segments)
    block_n = min(64, max(16, next_power_of_2(num_cols)))  # widest first: x read once per tile
    if split_k is None:
        rows = max(num_rows, 1)
        max_split = min(MAX_SPLIT_K, hidden // MIN_K_PER_SPLIT, PARTIALS_BYTES // (rows * max_rank * 4),
                        PARTIALS_BYTES_PER_TILE // (min(rows, block_m) * max_rank * 4))
        split_k = 1
        # Tiles with work are at least cdiv(R, BLOCK_M) (segments of a padded CUDA-graph plan
        # add idle ones only): grow the programs to about one per SM, splits first (free
        # but for h), then narrower column blocks (x re-read, from L2), then shorter row
        # tiles (A re-read, from L2).
        while cdiv(num_rows, block_m) * cdiv(num_cols, block_n) * split_k < num_sms:
            if split_k * 2 <= max_split:
                split_k *= 2
            elif block_n > 16:
                block_n //= 2
            elif block_m > 16:
                block_m //= 2
            else:
                break
    # The K step: long enough to keep loads in flight, short enough that the staged x and A
    # tiles fit shared memory (halved for fp32); a split takes as few steps as it can.
    max_block_k = (256 if block_m <= 32 else 128) * 2 // elem_size
    k_per_split = cdiv(hidden, max(split_k, 1))
    block_k = min(max_block_k, max(16, next_power_of_2(k_per_split)))
    k_per_split = cdiv(k_per_split, block_k) * block_k
    return ShrinkTiling(block_m, block_n, block_k, max(cdiv(hidden, k_per_split), 1), k_per_split)


def expand_tiling(num_rows: int, num_segments: int, slice_widths: tuple[int, ...], max_rank: int, split_k: int, *,
                  num_sms: int = DEFAULT_NUM_SMS, block_n: int | None = None) -> ExpandTiling:
    """``block_n`` forces the column block (benchmark sweeps; a power of 2 >= 16)."""
    block_m = block_m_for(num_rows, num_segments)
    tiles = cdiv(num_rows, block_m)
    if block_n is None:
        block_n = 128
        while block_n > 32 and tiles * sum(cdiv(w, block_n) for w in slice_widths) < num_sms:
            block_n //= 2
    block_r = min(64, max(16, next_power_of_2(max_rank)))
    split_chunk = max(1, min(next_power_of_2(split_k), PARTIALS_TILE // (block_m * block_r)))
    return ExpandTiling(block_m, block_n, block_r, split_chunk, num_warps=8 if block_m * block_n >= 8192 else 4)
