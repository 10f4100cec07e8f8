"""The batch-invariant Triton kernels (deterministic mode) on tiny shapes: the matmul and the
fused RMSNorm at one row per program (the attention kernel: tests/attention/
test_deterministic_attention.py). Each row's result must be
bit for bit the same whatever the other rows are and however many there are, and close to
the torch reference. On CPU the kernels run under TRITON_INTERPRET=1 (tests/conftest.py);
with CUDA the same tests run compiled."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed; the batch-invariant kernels cannot be tested")

from mma_dot import use_mma_dot  # noqa: E402
from rollout.kernels import batch_invariant  # noqa: E402
from rollout.kernels.options import KernelOptions  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TRITON = KernelOptions(deterministic_triton=True)  # the Triton matmul, on CPU tensors too (interpreted)


@pytest.fixture
def triton_matmul(monkeypatch) -> KernelOptions:
    use_mma_dot(monkeypatch)  # the interpreter's tl.dot reduces like an MMA (tests/mma_dot.py)
    return TRITON


@pytest.mark.parametrize("k,n", [(64, 96), (72, 40)])
def test_triton_matmul_rows_do_not_depend_on_the_batch(triton_matmul, k: int, n: int) -> None:
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(n, k, generator=g).to(DEVICE)
    bias = torch.randn(n, generator=g).to(DEVICE)
    x = torch.randn(70, k, generator=g).to(DEVICE)
    full = batch_invariant.linear(x, weight, bias, triton_matmul)
    assert torch.allclose(full, x @ weight.T + bias, atol=1e-4)
    for m in (1, 5, 33):
        assert torch.equal(batch_invariant.linear(x[:m], weight, bias, triton_matmul), full[:m]), m
    other = torch.randn(70, k, generator=g).to(DEVICE)
    other[17] = x[3]
    assert torch.equal(batch_invariant.linear(other, weight, bias, triton_matmul)[17], full[3])


@pytest.mark.parametrize("k", [200, 448])
def test_split_chunks_give_the_bits_of_one_program(triton_matmul, k: int) -> None:
    """K in chunks (the last one short): one program per chunk plus the ordered
    reduce must equal one program running the chunks in turn (its tiles loaded by pointers or
    by TMA descriptors), for every row count and with a bias; and all stay close to the plain
    product."""
    g = torch.Generator().manual_seed(4)
    weight = torch.randn(40, k, generator=g).to(DEVICE)
    bias = torch.randn(40, generator=g).to(DEVICE)
    x = torch.randn(37, k, generator=g).to(DEVICE)
    tile = batch_invariant.TileConfig

    def tiles(c: batch_invariant.TileConfig) -> KernelOptions:
        return replace(triton_matmul, batch_invariant_tiles=c)

    full = batch_invariant.linear(x, weight, bias, tiles(tile(32, 32, 64, 4, 2, split=False, k_chunk=128)))
    assert torch.allclose(full, x @ weight.T + bias, atol=1e-4)
    for c in (tile(16, 16, 64, 4, 2, split=True, k_chunk=128), tile(16, 32, 64, 4, 2, split=False, k_chunk=128),
              tile(16, 32, 64, 4, 2, k_chunk=128, tma=True)):
        for m in (1, 5, 37):
            assert torch.equal(batch_invariant.linear(x[:m], weight, bias, tiles(c)), full[:m]), (c, m)
    with pytest.raises(ValueError, match="multiple of block_k"):
        batch_invariant.linear(x, weight, options=tiles(tile(16, 16, 64, 4, 2, split=True, k_chunk=96)))


def test_rms_norm_one_row_per_program_is_batch_invariant() -> None:
    from rollout.kernels import fused

    g = torch.Generator().manual_seed(2)
    x = torch.randn(40, 64, generator=g).to(DEVICE)
    weight = torch.randn(64, generator=g).to(DEVICE)
    full = fused.rms_norm(x, weight, 1e-5, rows_per_program=1)
    for m in (1, 3, 17):
        assert torch.equal(fused.rms_norm(x[:m], weight, 1e-5, rows_per_program=1), full[:m])
    assert torch.allclose(full, torch.nn.functional.rms_norm(x, (64,), weight, 1e-5), atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="a property of the GPU's MMA instructions (the interpreter's numpy dot is not them)")
def test_every_tile_config_gives_the_same_bits() -> None:
    """The row count picks the tiles (batch_invariant.config_for): safe only because every
    config with the same BLOCK_K and K_CHUNK reduces each output in the same order, bit for
    bit: the 16- and 32-row tiles (mma.sync) as the 64- and 128-row ones (Hopper's wgmma),
    narrow tiles along N as wide ones, 8 pipeline stages as 3, chunks split over programs as
    chunks in one, and 64-, 128- and 256-wide K steps (an MMA chain of 16-wide steps either
    way), which is why only K_CHUNK is a constant."""
    g = torch.Generator(device=DEVICE).manual_seed(3)
    configs = [(64, 64, 64, 4, 4), (128, 128, 64, 8, 3), (32, 64, 64, 4, 3), (64, 128, 64, 4, 3), (64, 256, 64, 8, 3),
               (16, 16, 64, 4, 8), (16, 32, 64, 4, 6), (16, 64, 64, 4, 4), (128, 256, 64, 8, 3),
               (16, 16, 64, 4, 4, True), (16, 32, 64, 4, 4, True), (64, 64, 64, 4, 4, True),
               (16, 32, 256, 4, 3), (16, 64, 128, 4, 3, True), (128, 128, 128, 8, 3), (64, 128, 128, 4, 3),
               (128, 128, 128, 8, 3, False, batch_invariant.K_CHUNK, True), (64, 64, 128, 4, 3, False, batch_invariant.K_CHUNK, True),
               (64, 128, 64, 4, 4, False, batch_invariant.K_CHUNK, True), (128, 256, 64, 8, 3, False, batch_invariant.K_CHUNK, True),
               (128, 128, 64, 8, 4, False, batch_invariant.K_CHUNK, True)]
    for k, n in ((4096, 6144), (14336, 4096), (4096, 20000)):
        weight = (torch.randn(n, k, generator=g, device=DEVICE) * 0.02).bfloat16()
        x = torch.randn(300, k, generator=g, device=DEVICE).bfloat16()
        outs = []
        for c in configs:
            outs.append(batch_invariant.linear(x, weight, options=KernelOptions(
                batch_invariant_tiles=batch_invariant.TileConfig(*c))))
        assert all(torch.equal(o, outs[0]) for o in outs), (k, n, [torch.equal(o, outs[0]) for o in outs])
        full = batch_invariant.linear(x, weight)  # 300 rows: 64- or 128-row tiles; up to 16 rows: 16-row ones
        for m in (1, 3, 16, 17, 64, 65):
            assert torch.equal(batch_invariant.linear(x[:m], weight), full[:m]), (k, n, m)


@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336), (128256, 4096)])
def test_warm_up_reaches_every_kernel_variant_a_step_can_launch(n: int, k: int) -> None:
    """The engine compiles at start what its steps will launch (batch_invariant.warm_up):
    every row count up to the bound maps to a variant that some warmed row count has, and no
    two warmed row counts share one (one call each, at the fewest rows)."""
    max_rows = 8192 + 512
    rows = batch_invariant.warm_rows(n, k, max_rows)
    warmed = [batch_invariant.variant_of(m, n, k) for m in rows]
    assert len(set(warmed)) == len(warmed) and rows == sorted(rows) and rows[0] == 1
    missing = {batch_invariant.variant_of(m, n, k) for m in range(1, max_rows + 1)} - set(warmed)
    assert not missing, missing
    # the variants differ in tile config across the regimes (1, 17, 65 rows and a prefill chunk)
    assert len({batch_invariant.config_for(m, n, k) for m in (1, 17, 65, 8192)}) >= 3


def test_every_config_fits_shared_memory_in_float32_and_16_bit_configs_are_untouched() -> None:
    """A float32 engine on the GPU asked 294 KB of shared memory of the 65-256-row and prefill
    tiles (Triton: out of resources); fit_shared_memory halves their K step, which keeps the
    bits (test_every_tile_config_gives_the_same_bits; on the GPU the float32 invariance test
    above runs the fitted tiles), and leaves the bf16 picks as measured."""
    budget = batch_invariant._SHARED_BUDGET
    for n, k in [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096), (96, 64)]:
        for m in (1, 16, 17, 64, 65, 70, 256, 257, 384, 512, 513, 8192):
            c = batch_invariant.config_for(m, n, k)
            assert batch_invariant.fit_shared_memory(c, 2) == c
            f = batch_invariant.fit_shared_memory(c, 4)
            assert f.num_stages * (f.block_m + f.block_n) * f.block_k * 4 <= budget, (m, n, k, f)
            assert (f.block_m, f.block_n, f.split, f.tma, f.k_chunk) == (c.block_m, c.block_n, c.split, c.tma, c.k_chunk)
            assert c.k_chunk % f.block_k == 0


def test_warm_up_does_nothing_off_the_gpu() -> None:
    assert batch_invariant.warm_up({(32, 64)}, 100, torch.float32, torch.device("cpu")) == 0
