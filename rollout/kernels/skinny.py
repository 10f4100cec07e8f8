"""Skinny matmul: y = x @ W^T (+ bias) for the one row of a batch-1 decode step, one
launch that streams W once.

At batch 1 a decode step is the weights read once (15 GB for Llama-3.1-8B), and the GEMVs
are ~80% of the step. cuBLAS reads them at 3.86 TB/s on average on an H200 (BENCHMARKS.md:
3.1-3.2 TB/s on the narrow qkv and o projections, and o and down add a split-K reduce
kernel each). This kernel cuts W's rows into blocks of BLOCK_N, one program per block
that walks the whole of K (no split-K, so no second kernel), with every load a whole
[BLOCK_N, BLOCK_K] tile in flight; the products accumulate elementwise in an fp32 tile,
reduced once at the end (there is nothing for tensor cores to do at one row). The output
is rounded once, with the bias added in fp32 before, as cuBLAS's epilogue does: only the
order of the fp32 sums differs from cuBLAS.

Where PDL is available (rollout/kernels/pdl.py) it launches beside the tail of the kernel
before it and has its first tile of W in flight while that kernel finishes: W is written
by no kernel of a step, x is the only input it waits for.

`linear_silu_mul` is the gate_up projection with SiLU-mul as its epilogue: each program takes
rows j of gate and I + j of up, so it holds both halves of its outputs and writes
silu(gate) * up (rounded where fused.silu_and_mul rounds) instead of gate_up: the SiLU-mul
kernel and half of gate_up's writes are gone, and no work is repeated. (Folding a kernel into
the GEMV *after* it, the norm before qkv or SiLU-mul before down, was measured and dropped:
every program then redid it over the whole row, BENCHMARKS.md "Batch 1, session 7".)

A form for 2-16 rows (tl.dot, rows padded to 16) was measured and dropped: at the default
tiles it lost to cuBLAS on gate_up and down, and the best tiles per shape won 1-7% on the
narrow projections only (BENCHMARKS.md). The torch path (F.linear) is the reference;
tests run the kernel under TRITON_INTERPRET=1 on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from rollout.kernels import pdl

__all__ = ["Tiles", "linear", "linear_silu_mul", "tiles_for"]

PDL: bool | None = None  # launch early (rollout/kernels/pdl.py); None: where it is available, False: never
_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Tiles:
    block_n: int  # W rows per program
    block_k: int  # K per load
    num_warps: int
    num_stages: int = 1


def tiles_for(n: int, k: int) -> Tiles:
    """The launch shape for x [1, k] @ W [n, k]^T (chosen by `python -m
    rollout.kernels.bench_skinny` on an H200; BENCHMARKS.md has the sweep): the best of 36
    for Llama-3.1-8B's o and down, 1% off the best for gate_up, and a step's projections in
    3.63 ms against cuBLAS's 3.93."""
    return Tiles(block_n=4, block_k=1024, num_warps=2)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, N, K, stride_w, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr, SILU_MUL: tl.constexpr):
    pid = tl.program_id(0)
    if SILU_MUL:  # W is [gate; up], N = 2I: rows j and I + j side by side (even and odd lanes)
        half = N // 2
        lane = tl.arange(0, BLOCK_N)
        j = pid * (BLOCK_N // 2) + lane // 2
        rows = (tl.minimum(j, half - 1) + (lane % 2) * half).to(tl.int64)  # past I: re-read row I - 1's pair
    else:
        rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        # rows past N (the last block of an N that BLOCK_N does not divide) re-read row N - 1, so
        # the loads need no row mask; their results are not stored
        rows = tl.minimum(rn, N - 1).to(tl.int64)
    rk = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rows[:, None] * stride_w + rk[None, :]
    full = K // BLOCK_K * BLOCK_K  # whole tiles go unmasked (a K mask would stop vector loads)
    # the first tile of W is in flight before the wait: no kernel of the step writes W
    first = (rk < full)[None, :]
    w = tl.load(w_ptrs, mask=first, other=0.0)
    if USE_PDL:  # x is the output of the kernel right before this one
        tl.extra.cuda.gdc_wait()
    acc = w.to(tl.float32) * tl.load(x_ptr + rk, mask=rk < full, other=0.0).to(tl.float32)[None, :]
    for k in range(BLOCK_K, full, BLOCK_K):
        w = tl.load(w_ptrs + k)
        acc += w.to(tl.float32) * tl.load(x_ptr + k + rk).to(tl.float32)[None, :]
    if full < K:
        kk = full + rk
        w = tl.load(w_ptrs + full, mask=(kk < K)[None, :], other=0.0)
        acc += w.to(tl.float32) * tl.load(x_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)[None, :]
    if USE_PDL:  # the next kernel may launch now (it waits for this one before reading y)
        tl.extra.cuda.gdc_launch_dependents()
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows).to(tl.float32)
    dtype = y_ptr.dtype.element_ty
    if SILU_MUL:
        # gate_up rounded as the matmul's output is, then fused.silu_and_mul's two roundings
        gate, up = tl.split(tl.reshape(y.to(dtype).to(tl.float32), (BLOCK_N // 2, 2)))
        silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        jo = pid * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        tl.store(y_ptr + jo, (silu * up).to(dtype), mask=jo < half)
    else:
        tl.store(y_ptr + rn, y.to(dtype), mask=rn < N)


def _check(name: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"skinny.{name}: x {tuple(x.shape)} and weight {tuple(weight.shape)} must be [M, K] and [N, K]")
    m, k = x.shape
    n = weight.shape[0]
    if m != 1:
        raise ValueError(f"skinny.{name}: x has {m} rows, expected 1")
    if x.dtype not in _DTYPES or weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        raise ValueError(f"skinny.{name}: x, weight and bias must share float16 or bfloat16, got {x.dtype}, "
                         f"{weight.dtype}" + (f", {bias.dtype}" if bias is not None else ""))
    if (k > 1 and x.stride(1) != 1) or not weight.is_contiguous() or (bias is not None and bias.shape != (n,)):
        raise ValueError(f"skinny.{name}: x must be contiguous in its last dim, weight contiguous and bias [{n}]")


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tiles: Tiles | None,
            silu_mul: bool) -> torch.Tensor:
    n, k = weight.shape
    t = tiles or tiles_for(n, k)
    y = torch.empty(1, n // 2 if silu_mul else n, device=x.device, dtype=x.dtype)
    grid = (triton.cdiv(n, t.block_n),)
    b = bias if bias is not None else weight  # a valid pointer the kernel never reads
    _gemv_kernel[grid](x, weight, b, y, n, k, weight.stride(0), HAS_BIAS=bias is not None, BLOCK_N=t.block_n,
                       BLOCK_K=t.block_k, SILU_MUL=silu_mul, num_warps=t.num_warps, num_stages=t.num_stages,
                       **pdl.launch(x.device, env=PDL))
    return y


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           tiles: Tiles | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for one row: x [1, K] @ weight [N, K]^T -> [1, N].

    x: [1, K], contiguous in its last dim; weight: contiguous [N, K];
    bias: [N] or None; all one float16/bfloat16 dtype on one device. `tiles`: the launch
    shape (default `tiles_for`; benchmarks pass others)."""
    _check("linear", x, weight, bias)
    return _launch(x, weight, bias, tiles, silu_mul=False)


def linear_silu_mul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                    tiles: Tiles | None = None) -> torch.Tensor:
    """fused.silu_and_mul(linear(x, weight, bias)) in one launch: weight [2I, K] is gate's rows
    then up's (the fused gate_up projection), the result [1, I]. Tiles need an even block_n."""
    _check("linear_silu_mul", x, weight, bias)
    if weight.shape[0] % 2:
        raise ValueError(f"skinny.linear_silu_mul: weight must have an even number of rows (gate | up), "
                         f"got {weight.shape[0]}")
    if tiles is not None and tiles.block_n % 2:
        raise ValueError(f"skinny.linear_silu_mul: tiles.block_n must be even (gate and up rows in pairs), "
                         f"got {tiles.block_n}")
    return _launch(x, weight, bias, tiles, silu_mul=True)
