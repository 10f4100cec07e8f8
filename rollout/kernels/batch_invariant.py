"""Batch-invariant matmul for deterministic mode (EngineConfig.deterministic).

Why it is needed: a matmul library picks its algorithm (blocking, split-K, threads) from the
problem's shape, so one row's result depends on how many other rows share the call. Measured
on the CI CPU (torch 2.13, MKL): F.linear of a row alone differs bitwise from the same row
inside a call of 300 rows for M in 1-15, 64, 100 and 128 (SmolLM2's shapes). A request's
log-probs then depend on what else was batched with it, and on whether its prefix was
prefilled in one chunk or several. cuBLAS does the same on the GPU (split-K picked by M).

- CPU: the rows go through the library in fixed blocks of ROW_BLOCK rows (the last block
  padded with zeros), one batched GEMM of fixed-shape blocks: rows of a block do not
  interact, and every block is computed the same way.
- GPU: one Triton matmul without split-K whose K loop is fixed (blocks of BLOCK_K, in
  order), so each output's reduction over K runs in the same order whatever M is (as in
  Thinking Machines' batch_invariant_ops). The same kernel runs on CPU tensors under
  TRITON_INTERPRET=1 (tests).

What it does not know: which layers call it (the model's Linear does, when told to by the
engine's builder).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

ROW_BLOCK = 16  # CPU: 4.6x the cost of a 1-row call at batch 1, 1.6x a 64-row call at batch 64


@dataclass(frozen=True)
class TileConfig:
    """A GPU kernel configuration. What fixes a row's result is the K loop: blocks of
    block_k, in order, one program (no split-K). Tile sizes along M and N only say which
    program computes which outputs; on the H200 every config with block_k = 64 gives the same
    bits for every row (tests/kernels/test_batch_invariant.py checks it), so the tiles may
    follow the row count while block_k never does."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


BLOCK_K = 64
GROUP_M = 8  # row tiles per launch group (L2 reuse, batch_invariant_triton.py); no effect on bits
# Measured on the H200 (BENCHMARKS.md, scripts/bench_batch_invariant.py; bf16, Llama-3.1-8B
# projections at 1-2048 rows): 64x64 tiles with 4 stages at decode sizes, 128x128 with 8 warps
# for the wide projections (gate_up, lm_head) from a few hundred rows and for every projection
# at prefill sizes.
_SMALL = TileConfig(64, 64, BLOCK_K, 4, 4)
_LARGE = TileConfig(128, 128, BLOCK_K, 8, 3)
# Up to 16 rows (decode at small batch) the matmul is a weight stream: one 16-row tile (tl.dot's
# smallest) and as many column tiles as it takes to give every SM a few programs (a 64-wide tile
# left the o projection 64 programs on 132 SMs), each with a deep pipeline of 64-wide K steps
# so that enough bytes are in flight per SM to reach the HBM bandwidth.
_STREAM = {16: TileConfig(16, 16, BLOCK_K, 4, 8), 32: TileConfig(16, 32, BLOCK_K, 4, 6),
           64: TileConfig(16, 64, BLOCK_K, 4, 4)}
config: TileConfig | None = None  # a fixed override (the benchmark's candidates); None: chosen here


def config_for(m: int, n: int) -> TileConfig:
    if config is not None:
        return config
    if m <= 16:
        return _STREAM[16 if n <= 8192 else 32 if n <= 32768 else 64]
    if m <= 64 or (m <= 512 and n < 16384):
        return _SMALL
    return _LARGE

# None: Triton on CUDA tensors (when it imports), blocked torch elsewhere. Tests set True to
# run the Triton kernel on CPU tensors under TRITON_INTERPRET=1.
use_triton: bool | None = None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) whose every row is computed the same way whatever the other
    rows are and however many there are. x: [..., K], weight: [N, K] -> [..., N]."""
    lead, k = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, k)
    if _triton_wanted(x):
        out = _triton_linear(rows, weight, bias)
    else:
        out = _blocked_linear(rows, weight, bias)
    return out.reshape(*lead, weight.shape[0])


def _triton_wanted(x: torch.Tensor) -> bool:
    if use_triton is not None:
        return use_triton
    if not x.is_cuda:
        return False
    from rollout import kernels

    return kernels.available()


def _blocked_linear(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    # One batched GEMM over [blocks, ROW_BLOCK, K] with the weight broadcast (stride 0): every
    # block is its own fixed-shape GEMM (checked: equal bit for bit for any block count), and
    # one call instead of a loop of them (2-5x faster on the CI CPU). A plain matmul would
    # fold the blocks back into one M-row GEMM and lose the point.
    m, k = rows.shape
    blocks = -(-m // ROW_BLOCK)
    if blocks * ROW_BLOCK != m:
        rows = torch.cat([rows, rows.new_zeros(blocks * ROW_BLOCK - m, k)])
    n = weight.shape[0]
    out = torch.bmm(rows.view(blocks, ROW_BLOCK, k), weight.t().expand(blocks, k, n)).view(-1, n)[:m]
    return out if bias is None else out + bias


def _triton_linear(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    import triton

    from rollout.kernels.batch_invariant_triton import matmul_kernel

    m, k = rows.shape
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"weight must be [N, {k}], got {tuple(weight.shape)}")
    out = torch.empty(m, n, dtype=rows.dtype, device=rows.device)
    if m == 0:
        return out
    c = config_for(m, n)
    grid = (triton.cdiv(m, c.block_m) * triton.cdiv(n, c.block_n),)
    matmul_kernel[grid](
        rows, weight, bias if bias is not None else out, out, m, n, k,
        rows.stride(0), rows.stride(1), weight.stride(0), weight.stride(1), out.stride(0), out.stride(1),
        HAS_BIAS=bias is not None, BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, GROUP_M=GROUP_M,
        PRECISION="ieee" if rows.dtype == torch.float32 else "tf32", num_warps=c.num_warps, num_stages=c.num_stages,
    )
    return out
