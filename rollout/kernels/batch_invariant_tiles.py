"""The batch-invariant matmul's tile configuration (batch_invariant.py): a value of
KernelOptions.batch_invariant_tiles as well as of the kernel's per-shape table, so it sits
below both. Its K chunk is what fixes a row's bits; everything else may follow the shape."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["K_CHUNK", "TileConfig"]


# The reduction's chunk along K (batch_invariant_triton.py): part of what fixes the bits, so a
# constant of the engine, never chosen per call. 2048 gives the down projection (K = 14336) 7
# chunks to spread over programs at one row and the 4096-wide ones 2 (enough at 17-64 rows),
# while a wide call drains its MMA pipeline to add a chunk's sum only once per 32 K steps of 64.
# Against chunks of 512 it drew level at one row and was faster at 64 and 512 rows and for a
# prefill chunk; one chunk for all of K (no split possible) was no faster for prefill and slower
# at 1 and 64 rows (benchmarks/kernels/batch_invariant.py --k-chunk; BENCHMARKS.md, deterministic
# mode, "H200, 2026-12-01: K in chunks of 2048, kernels warmed at start, an ABBA re-measure").
K_CHUNK = 2048


@dataclass(frozen=True)
class TileConfig:
    """A GPU kernel configuration. What fixes a row's result is the reduction over K: an
    in-order MMA chain over each chunk of k_chunk, the chunk sums added in order
    (batch_invariant_triton.py). The tiles along M and N, the K step (block_k), `split` (one
    program per chunk, the sums added by a second kernel in the same order) and `tma` only say
    which program computes what and how it loads; on Hopper every config with the same
    k_chunk gives the same bits for every row (tests/kernels/test_batch_invariant.py checks
    it), so they may follow the call's shape while k_chunk never does."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split: bool = False
    k_chunk: int = K_CHUNK
    tma: bool = False  # X and W tiles by TMA descriptors (Hopper and later; not with split)
