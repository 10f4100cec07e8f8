"""The sampler's exponential race in one launch: argmax over v of scores[b, v] - log(-log u(b, v)).

rollout.sampling draws a sampled row's token as the argmax of log p - log E with E = -log U, U a
counter-based hash of (seed, position, vocab id) (sampling.uniform_noise). In torch that is a
dozen or more elementwise passes over [B, V] (the lowbias32 rounds, the float conversion, two
logs, the subtraction, the argmax), each reading and writing [B, V]: at a GRPO step's rows and a
128k vocabulary they outweighed every GEMM of the step (BENCHMARKS.md, "GRPO's decode step:
shared-prefix attention and the sampler's race (H100, 2026-12-06)"). Here each program hashes a
chunk of one row in registers and keeps its best (value, index); a [B, chunks] argmax picks each
row's winner. Nothing [B, V] is written.

Bit for bit the torch path's: the same integer rounds (int64 lanes masked to 32 bits, the
hash's definition), the same float32 rounding of u, libdevice's logf (what torch's CUDA `log`
calls) and the first index among equal maxima (torch.argmax's tie rule). Tests run the
kernel under TRITON_INTERPRET=1 against sampling.uniform_noise's race; on a GPU they compare
the compiled kernel with torch on the device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["race_argmax"]

CHUNK = 8192  # vocab ids per program: a 128k vocabulary is 16 programs a row
BLOCK = 1024  # ids per load
NUM_WARPS = 4


@triton.jit
def _mix32(x):
    # lowbias32 on int64 lanes holding 32-bit values (sampling._mix32)
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


@triton.jit
def _log(x, PRECISE: tl.constexpr):
    if PRECISE:  # logf, as torch's CUDA log (Triton's own tl.log is an approximation there)
        return tl.extra.cuda.libdevice.log(x)
    return tl.log(x)  # the interpreter: numpy's float32 log


@triton.jit
def _race_kernel(scores_ptr, seeds_ptr, positions_ptr, best_val_ptr, best_idx_ptr, V, stride_s, num_chunks,
                 CHUNK: tl.constexpr, BLOCK: tl.constexpr, PRECISE: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    # the row's 32-bit key (sampling.row_keys), here rather than in a dozen [B] torch launches
    # whose host time a batch-1 step would pay
    seed = tl.load(seeds_ptr + row)
    position = tl.load(positions_ptr + row)
    key = _mix32((seed & 0xFFFFFFFF) ^ _mix32(((seed >> 32) & 0xFFFFFFFF) ^ _mix32(position & 0xFFFFFFFF)))
    lo = chunk * CHUNK
    best_val = float("-inf")
    best_idx = lo
    for start in range(lo, lo + CHUNK, BLOCK):
        ids = start + tl.arange(0, BLOCK)
        ok = ids < V
        s = tl.load(scores_ptr + row.to(tl.int64) * stride_s + ids, mask=ok, other=float("-inf"))
        v = ids.to(tl.int64)
        h = _mix32((key ^ ((v * 0x9E3779B9) & 0xFFFFFFFF)) & 0xFFFFFFFF)
        h = _mix32(h ^ key)
        u = ((h >> 8).to(tl.float32) + 0.5) * (1.0 / (1 << 24))
        race = s - _log(-_log(u, PRECISE), PRECISE)
        race = tl.where(ok, race, float("-inf"))
        m = tl.max(race, axis=0)
        i = tl.argmax(race, axis=0, tie_break_left=True)
        better = m > best_val  # strictly: on a tie the earlier block's index stays
        best_idx = tl.where(better, start + i, best_idx)
        best_val = tl.where(better, m, best_val)
    tl.store(best_val_ptr + row * num_chunks + chunk, best_val)
    tl.store(best_idx_ptr + row * num_chunks + chunk, best_idx)


def race_argmax(scores: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[B] int64: argmax over v of scores[b, v] - log(-log(uniform_noise(seeds, positions)[b, v])),
    the first index among equal values. scores: float32 [B, V], contiguous in its last dim
    (-inf where a token is filtered out); seeds, positions: int64 [B] on its device."""
    if scores.dim() != 2 or scores.dtype != torch.float32 or scores.stride(1) != 1:
        raise ValueError(f"race_argmax: scores must be float32 [B, V] contiguous in V, got {scores.dtype} "
                         f"{tuple(scores.shape)} with strides {scores.stride()}")
    b, v = scores.shape
    if seeds.shape != (b,) or positions.shape != (b,) or seeds.dtype != torch.int64 or positions.dtype != torch.int64:
        raise ValueError(f"race_argmax: seeds and positions must be int64 [{b}], got {seeds.dtype} "
                         f"{tuple(seeds.shape)} and {positions.dtype} {tuple(positions.shape)}")
    if b == 0:
        return torch.empty(0, dtype=torch.int64, device=scores.device)
    chunks = triton.cdiv(max(v, 1), CHUNK)
    best_val = torch.empty((b, chunks), dtype=torch.float32, device=scores.device)
    best_idx = torch.empty((b, chunks), dtype=torch.int64, device=scores.device)
    _race_kernel[(b, chunks)](scores, seeds, positions, best_val, best_idx, v, scores.stride(0), chunks,
                              CHUNK=CHUNK, BLOCK=BLOCK, PRECISE=scores.is_cuda, num_warps=NUM_WARPS)
    # torch.argmax keeps the first of equal maxima: the earliest chunk, whose index is the smallest
    return best_idx.gather(1, best_val.argmax(dim=1, keepdim=True))[:, 0]
