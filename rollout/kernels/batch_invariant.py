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
- GPU: a Triton matmul whose reduction over K is fixed by K alone (as in Thinking Machines'
  batch_invariant_ops): chunks of K_CHUNK, each an in-order MMA chain from zero, the chunk
  sums added in order. A narrow call (decode at small batch) splits the chunks over programs
  and adds them in a second kernel in the same order (a split fixed by K, never by M: the
  bits do not change); a wide one keeps them in one program. The same kernels run on CPU
  tensors under TRITON_INTERPRET=1 (tests).

What it does not know: which layers call it (the model's Linear does, when told to by the
engine's builder). Its KernelOptions (the caller's) say whether the Triton kernel runs
(`deterministic_triton`) and may fix one tile config for every shape (`batch_invariant_tiles`).
"""

from __future__ import annotations

import functools
from dataclasses import replace

import torch
import torch.nn.functional as F

from rollout.kernels.batch_invariant_tiles import K_CHUNK, TileConfig
from rollout.kernels.options import DEFAULT_OPTIONS, KernelOptions
from rollout.kernels.tma import tma_ok

ROW_BLOCK = 16  # CPU: 4.6x the cost of a 1-row call at batch 1, 1.6x a 64-row call at batch 64


GROUP_M = 8  # row tiles per launch group (L2 reuse, batch_invariant_triton.py); no effect on bits
# Chosen by benchmarks/kernels/batch_invariant.py (bf16, the Llama-3.1-8B projections replayed from
# CUDA graphs with the weight coming from HBM; BENCHMARKS.md, deterministic mode, "H200, 2026-12-01:
# K in fixed chunks, split at small batch, TMA tiles" and the section after it). The K step may
# follow the shape too: 64-, 128- and 256-wide K steps give the same bits (an MMA chain of
# 16-wide steps either way), only K_CHUNK may not change.
# Up to 16 rows the matmul is a weight stream: 16-row tiles (tl.dot's smallest), 32 columns so
# that every SM gets a few programs, 256-wide K steps so that enough bytes are in flight; a long
# K (the down projection's 14336) also splits its chunks over programs: 7 of 2048 instead of one
# 14336-long loop per program. At one row this keeps level with cuBLAS.
_STREAM = TileConfig(16, 32, 256, 4, 3)
_STREAM_SPLIT = TileConfig(16, 64, 128, 4, 3, split=True)
# 17-64 rows: 64x64 tiles, chunks split over programs for the narrow projections; 64x128 by
# TMA for the wide ones (gate_up, lm_head), which have programs enough.
_MID = TileConfig(64, 64, 64, 4, 4, split=True)
_MID_WIDE = TileConfig(64, 128, 64, 4, 4, tma=True)
# From 65 rows the tiles come by TMA (nearer cuBLAS than with pointer loads): 64x128 for the
# narrow projections up to 256 rows, 128x256 for the wide ones and for prefill, 128x128 where
# 128x256 tiles would not give every SM two (o and down at 512 rows: 64 tiles).
_SMALL = TileConfig(64, 128, 64, 4, 4, tma=True)
# 65-256 rows where 64x128 tiles are one wave or less (o and down: 128 tiles at 256 rows): 128-wide
# K steps, 3 stages, so each tile's long K loop keeps more bytes in flight: faster for o and down
# at 256 rows (qkv, 192 tiles: no gain).
_SMALL_DEEP = TileConfig(64, 128, 128, 4, 3, tma=True)
# 257-512 rows (a GRPO decode batch), the qkv projection: 64x128 tiles are more than two a SM,
# and 3 stages (72 KB of shared memory) let three share an SM where 4 stages fit two, so they
# run in one wave (o and down, fewer tiles: no change).
_SMALL_MANY = TileConfig(64, 128, 64, 4, 3, tma=True)
_LARGE = TileConfig(128, 256, 64, 8, 3, tma=True)
_LARGE_FEW = TileConfig(128, 128, 64, 8, 4, tma=True)
_SMS = 132  # an H100's and an H200's SM count; only where the tiles' count is weighed, never for the bits


def config_for(m: int, n: int, k: int = 0, fixed: TileConfig | None = None) -> TileConfig:
    """The tiles of an [m, k] x [n, k]^T call; `fixed` (KernelOptions.batch_invariant_tiles):
    that one config for every shape."""
    if fixed is not None:
        return fixed
    if m <= 16:
        return _STREAM_SPLIT if k > 4096 and n <= 32768 else _STREAM
    if m <= 64:
        return _MID_WIDE if n >= 16384 else _MID
    if m <= 256:
        if n >= 16384:
            return _LARGE
        return _SMALL_DEEP if _tiles(m, n, 64, 128) <= _SMS else _SMALL
    if m <= 512 and n < 16384 and k <= 4096 and _tiles(m, n, 64, 128) > 2 * _SMS:
        return _SMALL_MANY
    return _LARGE if _tiles(m, n, 128, 256) >= 2 * _SMS else _LARGE_FEW


# Shared memory a program's pipeline may take: Hopper gives a block 227 KB; the rest is left to
# the epilogue and the barriers. The tiles above were tuned for 16-bit inputs; a float32 engine
# on the GPU (dtype="float32", deterministic=True) would ask 294 KB of _SMALL_DEEP and _LARGE.
_SHARED_BUDGET = 200 * 1024


@functools.cache  # every eager call asks; a handful of configs x element sizes
def fit_shared_memory(c: TileConfig, element_size: int) -> TileConfig:
    """The config with its K step halved (then stages dropped) until its pipeline's tiles fit
    the budget at this element size. The K step never changes the bits (see above), so a
    float32 engine stays batch-invariant; 16-bit inputs fit every config as it is."""
    def need(t: TileConfig) -> int:
        return t.num_stages * (t.block_m + t.block_n) * t.block_k * element_size

    while need(c) > _SHARED_BUDGET and c.block_k > 32:
        c = replace(c, block_k=c.block_k // 2)
    while need(c) > _SHARED_BUDGET and c.num_stages > 2:
        c = replace(c, num_stages=c.num_stages - 1)
    return c


def _tiles(m: int, n: int, block_m: int, block_n: int) -> int:
    return -(-m // block_m) * -(-n // block_n)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           options: KernelOptions = DEFAULT_OPTIONS) -> torch.Tensor:
    """F.linear(x, weight, bias) whose every row is computed the same way whatever the other
    rows are and however many there are. x: [..., K], weight: [N, K] -> [..., N]. `options`:
    Triton or the blocked torch path (`deterministic_triton`; None: Triton on CUDA tensors, when
    it imports; True: on CPU tensors too, under TRITON_INTERPRET=1), and fixed tiles if any."""
    lead, k = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, k)
    if _triton_wanted(x, options.deterministic_triton):
        out = _triton_linear(rows, weight, bias, options.batch_invariant_tiles)
    else:
        out = _blocked_linear(rows, weight, bias)
    return out.reshape(*lead, weight.shape[0])


def warm_up(shapes: set[tuple[int, int]], max_rows: int, dtype: torch.dtype, device: torch.device,
            options: KernelOptions = DEFAULT_OPTIONS) -> int:
    """Compile, at engine start, every kernel a step may launch for these weight shapes ([N, K])
    and 1..max_rows rows; returns the number of calls made.

    Triton compiles a kernel per tile config and per specialization of its integer arguments
    (a row count of 1, or a multiple of 16, compiles apart), on first use. A deterministic
    engine's first decode step past its CUDA graphs (512 rows of a GRPO batch, say) otherwise
    compiled a tile config nothing had used yet inside that step, an RL run's step 1. One call
    per (config, specialization), at the fewest rows that reach it: about fifty calls for the
    Llama-3.1-8B shapes, seconds of compiling on a fresh machine; compiled kernels are cached on
    disk, so a later start only runs them."""
    if not (_triton_wanted(torch.empty(0, device=device), options.deterministic_triton) and device.type == "cuda"):
        return 0
    calls = 0
    for n, k in sorted(shapes):
        weight = torch.zeros(n, k, dtype=dtype, device=device)
        for m in warm_rows(n, k, max_rows, options.batch_invariant_tiles):
            linear(torch.zeros(m, k, dtype=dtype, device=device), weight, options=options)
            calls += 1
    torch.cuda.synchronize(device)
    return calls


def variant_of(m: int, n: int, k: int, fixed: TileConfig | None = None) -> tuple[TileConfig, bool, bool]:
    """What Triton compiles apart for an [m, k] x [n, k]^T call: the tile config, and the row
    count's specializations (== 1, a multiple of 16); N and K are the model's, fixed."""
    return config_for(m, n, k, fixed), m == 1, m % 16 == 0


def warm_rows(n: int, k: int, max_rows: int, fixed: TileConfig | None = None) -> list[int]:
    """The fewest rows that reach each kernel variant of 1..max_rows rows, rising."""
    first: dict[tuple, int] = {}
    for m in range(1, max_rows + 1):
        first.setdefault(variant_of(m, n, k, fixed), m)
    return sorted(first.values())


def _triton_wanted(x: torch.Tensor, triton: bool | None) -> bool:
    if triton is not None:
        return triton
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


def _triton_linear(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   fixed: TileConfig | None) -> torch.Tensor:
    import triton

    from rollout.kernels.batch_invariant_triton import matmul_kernel, reduce_kernel

    m, k = rows.shape
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"weight must be [N, {k}], got {tuple(weight.shape)}")
    out = torch.empty(m, n, dtype=rows.dtype, device=rows.device)
    if m == 0:
        return out
    c = fit_shared_memory(config_for(m, n, k, fixed), rows.element_size())
    if c.k_chunk % c.block_k:
        raise ValueError(f"k_chunk {c.k_chunk} must be a multiple of block_k {c.block_k}")
    chunks = triton.cdiv(k, c.k_chunk)
    split = c.split and chunks > 1
    # float32 chunk sums [chunks, m, n] (split only; a placeholder pointer otherwise)
    partial = torch.empty(chunks, m, n, dtype=torch.float32, device=rows.device) if split else out
    bias_arg = bias if bias is not None else out
    precision = "ieee" if rows.dtype == torch.float32 else "tf32"
    if c.tma and not split and tma_ok(rows, weight):
        from triton.tools.tensor_descriptor import TensorDescriptor

        from rollout.kernels.batch_invariant_triton import matmul_tma_kernel

        matmul_tma_kernel[(triton.cdiv(m, c.block_m) * triton.cdiv(n, c.block_n),)](
            TensorDescriptor.from_tensor(rows, [c.block_m, c.block_k]),
            TensorDescriptor.from_tensor(weight, [c.block_n, c.block_k]),
            bias_arg, out, m, n, k, out.stride(0), out.stride(1),
            HAS_BIAS=bias is not None, BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, K_CHUNK=c.k_chunk,
            GROUP_M=GROUP_M, PRECISION=precision, num_warps=c.num_warps, num_stages=c.num_stages,
        )
        return out
    grid = (triton.cdiv(m, c.block_m) * triton.cdiv(n, c.block_n), chunks if split else 1)
    matmul_kernel[grid](
        rows, weight, bias_arg, out, partial, m, n, k,
        rows.stride(0), rows.stride(1), weight.stride(0), weight.stride(1), out.stride(0), out.stride(1),
        HAS_BIAS=bias is not None, BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, K_CHUNK=c.k_chunk,
        SPLIT=split, GROUP_M=GROUP_M, PRECISION=precision,
        num_warps=c.num_warps, num_stages=c.num_stages,
    )
    if split:
        block = 256  # 2 floats a thread per chunk: every chunk's load in flight without spills
        reduce_kernel[(triton.cdiv(m * n, block),)](
            partial, bias_arg, out, m, n, out.stride(0), out.stride(1),
            CHUNKS=chunks, HAS_BIAS=bias is not None, BLOCK=block, num_warps=4,
        )
    return out
