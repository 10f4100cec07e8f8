"""The SGMV kernels' block sizes and split-K, chosen on the host from shapes alone
(lora/kernels/tiling.py): decode spreads over the GPU, long prefills do not split."""

from __future__ import annotations

import pytest

from lora.kernels import tiling


@pytest.mark.parametrize("num_slices,hidden", [(3, 4096), (1, 4096), (2, 4096), (1, 14336)],
                         ids=["qkv", "o", "gate_up", "down"])
def test_tiling_spreads_decode_and_splits_only_what_needs_it(num_slices: int, hidden: int) -> None:
    for rows, segments in ((1, 1), (16, 8), (256, 8), (512, 1), (4096, 4)):
        t = tiling.shrink_tiling(rows, segments, hidden, num_slices, 16, 2)
        assert t.k_per_split % t.block_k == 0 and (t.split_k - 1) * t.k_per_split < hidden <= t.split_k * t.k_per_split
        assert t.split_k * min(rows, t.block_m) * 16 * 4 <= tiling.PARTIALS_BYTES_PER_TILE
        programs = tiling.cdiv(rows, t.block_m) * tiling.cdiv(num_slices * 16, t.block_n) * t.split_k
        if rows == 1:  # batch-1 decode: K split up to the cap measured best on the H200 (tiling.py)
            assert t.split_k == tiling.MAX_SPLIT_K and t.block_n == 16 and programs >= num_slices * t.split_k
        if rows >= 4096:
            assert t.split_k == 1
    assert tiling.expand_tiling(1, 1, (4096, 1024, 1024), 16, 64).block_n <= 64  # >= 96 programs




@pytest.mark.parametrize("block_n", [16, 256])
def test_forced_expand_column_blocks_stay_exact(block_n: int) -> None:
    # benchmarks.kernels.sgmv --expand-block-n sweeps this: the narrowest and widest blocks, under
    # the interpreter, against the reference (slices narrower and wider than the block)
    pytest.importorskip("triton")
    from test_ops import SLICES, check_triton_vs_reference, random_problem

    from lora.kernels import sgmv

    assert tiling.expand_tiling(9, 3, (32, 12, 12), 16, 1, block_n=block_n).block_n == block_n
    check_triton_vs_reference(random_problem(SLICES["three"], seed=12), block_n=block_n)
