"""The stream-K matmul (benchmarks/experiments/stream_k.py, a benchmarks.kernels.gemm variant): against torch's
matmul with tiles cut between programs in every way the kernel handles (a program's range
inside one tile, ending inside one, starting inside one, both), ragged M, N and K, and the
tile counters left at zero for the next call (a CUDA graph replays with the same ones). On
CPU the kernel runs under TRITON_INTERPRET=1 (tests/conftest.py); with CUDA (Hopper+) compiled,
where arrival order varies and the bits must not."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed; the stream-K kernel cannot be tested")

from benchmarks.experiments import stream_k  # noqa: E402
from benchmarks.experiments.stream_k import StreamKConfig  # noqa: E402

GPU = torch.cuda.is_available()
if GPU and torch.cuda.get_device_capability()[0] < 9:
    pytest.skip("the kernel loads tiles by TMA descriptors: Hopper or later", allow_module_level=True)
DEVICE = "cuda" if GPU else "cpu"


def _counters_are_zero() -> bool:
    return all(int(counts.abs().sum()) == 0 for _, counts in stream_k._workspaces.values())


# (M, N, K, programs): with 16 x 32 tiles and K blocks of 32, each case cuts tiles differently:
# 3 tiles x 7 K blocks over 4 programs (ranges of 5-6: inside a tile, across a boundary),
# over 13 (ranges of 1-2), one program per tile, and a single program doing everything.
CASES = [(37, 40, 200, None), (37, 40, 200, 13), (37, 40, 200, 0), (5, 72, 104, 1), (48, 64, 64, 5)]


@pytest.mark.parametrize("m,n,k,programs", CASES)
def test_stream_k_matches_the_matmul(m: int, n: int, k: int, programs: int | None) -> None:
    g = torch.Generator().manual_seed(m * n + k)
    dtype = torch.bfloat16 if GPU else torch.float32
    x = torch.randn(m, k, generator=g).to(DEVICE, dtype)
    w = torch.randn(n, k, generator=g).to(DEVICE, dtype)
    config = StreamKConfig(16, 32, 32, 4, 2, programs=programs)
    y = stream_k.linear(x, w, config)
    ref = x.float() @ w.float().T
    tol = 3e-2 * ref.abs().max().item() if GPU else 1e-4
    assert y.dtype == dtype and (y.float() - ref).abs().max().item() <= tol
    assert _counters_are_zero()
    assert torch.equal(stream_k.linear(x, w, config), y)  # again: the counters were reusable


def test_bad_operands_are_named() -> None:
    x = torch.randn(4, 64).to(DEVICE)
    with pytest.raises(ValueError, match=r"weight must be \[N, 64\]"):
        stream_k.linear(x, torch.randn(8, 32).to(DEVICE), StreamKConfig(16, 32, 32, 4, 2))
    odd = torch.randn(4, 50, dtype=torch.float16).to(DEVICE)  # rows of 100 bytes: no TMA descriptor
    with pytest.raises(ValueError, match=r"x and weight need contiguous rows of a multiple of 16 bytes"):
        stream_k.linear(odd, torch.randn(8, 50, dtype=torch.float16).to(DEVICE), StreamKConfig(16, 32, 32, 4, 2))


@pytest.mark.skipif(not GPU, reason="arrival order at the counters varies only on a GPU")
def test_the_bits_do_not_depend_on_who_arrives_last() -> None:
    """A decode step's gate_up at M = 256 on every SM: 224 tiles cut between 132 programs,
    replayed 50 times; each partial sum is added in program order, so the bits never change."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 4096, generator=g).to(DEVICE, torch.bfloat16)
    w = (0.02 * torch.randn(28672, 4096, generator=g)).to(DEVICE, torch.bfloat16)
    config = StreamKConfig(256, 128, 64, 8, 3)
    first = stream_k.linear(x, w, config)
    ref = x.float() @ w.float().T
    assert (first.float() - ref).abs().max().item() <= 2e-2 * ref.abs().max().item()
    assert all(torch.equal(stream_k.linear(x, w, config), first) for _ in range(50))
    assert _counters_are_zero()
