"""Batch-invariant matmul for deterministic mode (EngineConfig.deterministic).

Why it is needed: a matmul library picks its algorithm (blocking, split-K, threads) from the
problem's shape, so one row's result depends on how many other rows share the call. Measured
on the CI CPU (torch 2.13, MKL): F.linear of a row alone differs bitwise from the same row
inside a call of 300 rows for M in 1-15, 64, 100 and 128 (SmolLM2's shapes). A request's
log-probs then depend on what else was batched with it, and on whether its prefix was
prefilled in one chunk or several. cuBLAS does the same on the GPU (split-K picked by M).

- CPU: the rows go through the library in fixed blocks of ROW_BLOCK rows (the last block
  padded with zeros): every call has the same shape, and rows of a block do not interact.
- GPU: one Triton matmul with a single tile configuration and no split-K, so each output's
  reduction over K runs in the same order whatever M is (as in Thinking Machines'
  batch_invariant_ops). The same kernel runs on CPU tensors under TRITON_INTERPRET=1 (tests).

What it does not know: which layers call it (the model's Linear does, when told to by the
engine's builder).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ROW_BLOCK = 16  # CPU: 4.6x the cost of a 1-row call at batch 1, 1.6x a 64-row call at batch 64
_BLOCK_M, _BLOCK_N, _BLOCK_K = 32, 64, 64  # GPU: one tile config for every M, never split-K

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
    m = rows.shape[0]
    padded = -(-m // ROW_BLOCK) * ROW_BLOCK
    if padded != m:
        rows = torch.cat([rows, rows.new_zeros(padded - m, rows.shape[1])])
    out = torch.cat([F.linear(block, weight, bias) for block in rows.split(ROW_BLOCK)])
    return out[:m]


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
    grid = (triton.cdiv(m, _BLOCK_M), triton.cdiv(n, _BLOCK_N))
    matmul_kernel[grid](
        rows, weight, bias if bias is not None else out, out, m, n, k,
        rows.stride(0), rows.stride(1), weight.stride(0), weight.stride(1), out.stride(0), out.stride(1),
        HAS_BIAS=bias is not None, BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K,
        PRECISION="ieee" if rows.dtype == torch.float32 else "tf32",
    )
    return out
