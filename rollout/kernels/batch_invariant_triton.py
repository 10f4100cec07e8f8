"""The Triton kernel behind rollout.kernels.batch_invariant.linear on the GPU (imported only
when it runs: triton is optional on CPU)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def matmul_kernel(
    X, W, Bias, Y, M, N, K,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_ym, stride_yn,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, PRECISION: tl.constexpr,
):
    """Y[M, N] = X[M, K] @ W[N, K]^T (+ bias). One program per output tile; the K loop runs
    start to end in one program (no split-K), so an output's reduction order is fixed by
    BLOCK_K alone, never by M.

    Programs are numbered in groups of GROUP_M row tiles: consecutive programs sweep the
    column tiles of a few row tiles, so a wave of programs reads a few MB of X and W that stay
    in L2 instead of all of X per column tile (prefill chunks: X is 64-224 MB). Which program
    computes a tile never changes its bits."""
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        mask_k = ks < K
        x = tl.load(X + offs_m[:, None] * stride_xm + ks[None, :] * stride_xk,
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        w = tl.load(W + offs_n[None, :] * stride_wn + ks[:, None] * stride_wk,
                    mask=mask_n[None, :] & mask_k[:, None], other=0.0)  # [BLOCK_K, BLOCK_N]
        acc = tl.dot(x, w, acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(Bias + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn, acc.to(Y.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])
