"""The Triton kernels behind rollout.kernels.batch_invariant.linear on the GPU (imported only
when they run: triton is optional on CPU).

What fixes an output's bits is the shape of its reduction over K, which here depends on K
alone: K is cut into chunks of K_CHUNK (a multiple of BLOCK_K); inside a chunk the products
are accumulated block after block in one MMA chain started from zero; the chunk sums are then
added in order, from zero. Every program computes that same chain whatever M is, so a row
is computed the same way alone or among thousands. The chunks are what let a narrow call
(decode at small batch) spread one output tile over several programs without changing a
bit: with SPLIT each program computes one chunk sum into a float32 workspace and
`reduce_kernel` adds them in chunk order, the same additions a single program makes."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """This program's output tile (row tile, column tile). Programs are numbered in groups of
    GROUP_M row tiles: consecutive programs sweep the column tiles of a few row tiles, so a
    wave of programs reads a few MB of X and W that stay in L2 instead of all of X per column
    tile (prefill chunks: X is 64-224 MB). Which program computes a tile never changes its bits."""
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % group_rows, (pid % per_group) // group_rows


@triton.jit
def matmul_kernel(
    X, W, Bias, Y, P, M, N, K,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_ym, stride_yn,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    K_CHUNK: tl.constexpr, SPLIT: tl.constexpr, GROUP_M: tl.constexpr, PRECISION: tl.constexpr,
):
    """Y[M, N] = X[M, K] @ W[N, K]^T (+ bias), one program per output tile (and per K chunk
    with SPLIT: the chunk sum goes to P[chunk, M, N], float32, for reduce_kernel)."""
    pid_m, pid_n = _tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    if SPLIT:
        c0 = tl.program_id(1) * K_CHUNK
        part = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(c0, tl.minimum(c0 + K_CHUNK, K), BLOCK_K):
            ks = k0 + offs_k
            mask_k = ks < K
            x = tl.load(X + offs_m[:, None] * stride_xm + ks[None, :] * stride_xk,
                        mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
            w = tl.load(W + offs_n[None, :] * stride_wn + ks[:, None] * stride_wk,
                        mask=mask_n[None, :] & mask_k[:, None], other=0.0)  # [BLOCK_K, BLOCK_N]
            part = tl.dot(x, w, part, input_precision=PRECISION)
        tl.store(P + tl.program_id(1) * M * N + offs_m[:, None] * N + offs_n[None, :], part,
                 mask=mask_m[:, None] & mask_n[None, :])
    else:
        # One loop over K's blocks (a loop per chunk would drain the load pipeline at every
        # chunk boundary: measured 20% slower at prefill sizes); a chunk's sum joins acc after
        # its last block, which is the order of the SPLIT path's reduce.
        steps: tl.constexpr = K_CHUNK // BLOCK_K
        n_k = tl.cdiv(K, BLOCK_K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        part = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for i in range(0, n_k):
            ks = i * BLOCK_K + offs_k
            mask_k = ks < K
            x = tl.load(X + offs_m[:, None] * stride_xm + ks[None, :] * stride_xk,
                        mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            w = tl.load(W + offs_n[None, :] * stride_wn + ks[:, None] * stride_wk,
                        mask=mask_n[None, :] & mask_k[:, None], other=0.0)
            part = tl.dot(x, w, part, input_precision=PRECISION)
            if ((i + 1) % steps == 0) | (i == n_k - 1):
                acc += part
                part = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if HAS_BIAS:
            acc += tl.load(Bias + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        tl.store(Y + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn, acc.to(Y.dtype.element_ty),
                 mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def reduce_kernel(P, Bias, Y, M, N, stride_ym, stride_yn, CHUNKS: tl.constexpr, HAS_BIAS: tl.constexpr,
                  BLOCK: tl.constexpr):
    """Y = the chunk sums P[0] + P[1] + ... in chunk order, from zero (+ bias): the additions
    matmul_kernel makes without SPLIT, so the bits are the same. The loop is unrolled
    (CHUNKS is a constant per weight shape) so that every chunk's load is in flight at once
    and only the additions wait on each other: a rolled loop paid a load's latency per
    chunk."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for c in tl.static_range(CHUNKS):
        acc += tl.load(P + c * M * N + offs, mask=mask, other=0.0)
    row = offs // N
    col = offs % N
    if HAS_BIAS:
        acc += tl.load(Bias + col, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_ym + col * stride_yn, acc.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def matmul_tma_kernel(
    x_desc, w_desc, Bias, Y, M, N, K, stride_ym, stride_yn,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    K_CHUNK: tl.constexpr, GROUP_M: tl.constexpr, PRECISION: tl.constexpr,
):
    """matmul_kernel without SPLIT, its X and W tiles fetched by the Hopper's tensor memory
    accelerator (host-made descriptors; out-of-range rows and columns read as zeros, as the
    masked loads do): the same MMA chain and chunk sums, so the same bits, with the address
    arithmetic and the load pipeline off the warps that compute."""
    pid_m, pid_n = _tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    steps: tl.constexpr = K_CHUNK // BLOCK_K
    n_k = tl.cdiv(K, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    part = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for i in range(0, n_k):
        x = x_desc.load([pid_m * BLOCK_M, i * BLOCK_K])  # [BLOCK_M, BLOCK_K]
        w = w_desc.load([pid_n * BLOCK_N, i * BLOCK_K])  # [BLOCK_N, BLOCK_K]
        part = tl.dot(x, w.T, part, input_precision=PRECISION)
        if ((i + 1) % steps == 0) | (i == n_k - 1):
            acc += part
            part = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    if HAS_BIAS:
        acc += tl.load(Bias + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn, acc.to(Y.dtype.element_ty),
             mask=(offs_m < M)[:, None] & mask_n[None, :])
