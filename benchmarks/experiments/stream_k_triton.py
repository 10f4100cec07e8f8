"""The Triton kernel behind benchmarks.experiments.stream_k (imported only when it runs: triton is
optional on CPU).

Stream-K (Osama et al., 2023): a fixed grid of G programs shares out the matmul's
(tile, K block) iterations evenly, each program a contiguous range. A decode step's
projections at M = 256 have 32-224 output tiles against 132 SMs (H100), so one program per
tile leaves part of the last wave idle (gate_up: 224 tiles = 1.7 waves, 15% of the SMs' time);
with even ranges every SM does the same work. A tile cut between programs is finished by
whichever of them arrives last: each writes its float32 partial sum to a workspace slot,
bumps the tile's counter, and the last one adds every partial in program order (so the bits
do not depend on who arrives last), stores the output and resets the counter for the next
call (a CUDA graph replays the kernel with the same counters). No program waits on another,
so nothing can deadlock when other kernels hold SMs."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _start(p, G, total):
    """Program p's first iteration: its range is [_start(p), _start(p + 1)). In 64 bits, since
    p * total passes 2^31 at prefill sizes (M = 8192: 7168 tiles x 64 K blocks x 7168 programs)."""
    return (p.to(tl.int64) * total // G).to(tl.int32)


@triton.jit
def _owner(it, G, total):
    """The program whose range holds iteration it."""
    return (((it.to(tl.int64) + 1) * G - 1) // total).to(tl.int32)


@triton.jit
def stream_k_kernel(
    x_desc, w_desc, Y, P, Counts, M, N, K, stride_ym, G,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Y[M, N] = X[M, K] @ W[N, K]^T in bf16/fp16/fp32 with float32 accumulation. Tiles are
    numbered row tile fastest, so the programs working at one time read neighbouring W tiles.
    P: [G, 2, BLOCK_M, BLOCK_N] float32 partials (slot 0: the tile a program starts inside,
    slot 1: the tile it stops inside); Counts: int32 [tiles], zero between calls."""
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    k_tiles = tl.cdiv(K, BLOCK_K)
    total = tiles_m * tl.cdiv(N, BLOCK_N) * k_tiles
    start = _start(pid, G, total)
    end = _start(pid + 1, G, total)
    rows = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    it = start
    while it < end:
        tile = it // k_tiles
        k0 = it - tile * k_tiles
        k1 = tl.minimum(k_tiles, k0 + end - it)
        pid_m = tile % tiles_m
        pid_n = tile // tiles_m
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for ki in range(k0, k1):
            x = x_desc.load([pid_m * BLOCK_M, ki * BLOCK_K])
            w = w_desc.load([pid_n * BLOCK_N, ki * BLOCK_K])
            acc = tl.dot(x, w.T, acc)
        offs_m = pid_m * BLOCK_M + rows
        offs_n = pid_n * BLOCK_N + cols
        out = Y + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
        mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
        if (k0 == 0) & (k1 == k_tiles):
            tl.store(out, acc.to(Y.dtype.element_ty), mask=mask)
        else:
            tile_start = tile * k_tiles
            here = P + ((pid * 2 + (it != start).to(tl.int32)) * BLOCK_M * BLOCK_N
                        + rows[:, None] * BLOCK_N + cols[None, :])
            tl.store(here, acc, cache_modifier=".cg")
            tl.debug_barrier()  # every warp's partial is stored before the counter says so
            first = _owner(tile_start, G, total)
            last = _owner(tile_start + k_tiles - 1, G, total)
            arrived = tl.atomic_add(Counts + tile, 1, sem="acq_rel")
            if arrived == last - first:
                # slot 1 only for `first`, and only if it started before this tile
                first_slot = (_start(first, G, total) < tile_start).to(tl.int32)
                acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                for p in range(first, last + 1):
                    slot = tl.where(p == first, first_slot, 0)
                    acc += tl.load(P + (p * 2 + slot) * BLOCK_M * BLOCK_N + rows[:, None] * BLOCK_N
                                   + cols[None, :], cache_modifier=".cg")
                tl.store(out, acc.to(Y.dtype.element_ty), mask=mask)
                tl.atomic_xchg(Counts + tile, 0)
        it += k1 - k0
