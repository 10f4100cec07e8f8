"""Stream-K matmul for a decode step's projections (issue #16 (a)/(d)): Y = X @ W^T with the
(tile, K block) iterations shared evenly by a fixed grid of programs, so the few output tiles
of an M = 256 GEMM fill every SM instead of leaving part of a last wave idle (the kernel and
why: stream_k_triton.py). Triton with TMA descriptors, so Hopper and later on a GPU; on CPU
the interpreter runs it (tests).

`linear(x, w, config)` is the whole interface; `config.programs = 0` runs one program per tile
(no K cut: the plain tiled kernel, the comparison benchmarks.kernels.gemm makes). The engine
does not use it: on an H100 it was slower than cuBLAS at every decode shape (a step's
projections at M = 256: 9.7 against 7.1 ms; BENCHMARKS.md, H100, 2026-12-07, "... a stream-K
GEMM"), so it lives as benchmarks.kernels.gemm's `--triton` variants, the measured answer to
"would balancing the last wave pay?"."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rollout.kernels.tma import tma_ok

@dataclass(frozen=True)
class StreamKConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    programs: int | None = None  # None: one per SM; 0: one per output tile

    @property
    def name(self) -> str:
        grid = {None: "sk", 0: "tiles"}.get(self.programs, f"sk{self.programs}")
        return f"{grid} {self.block_m}x{self.block_n}x{self.block_k} w{self.num_warps} s{self.num_stages}"


# float32 partials [programs, 2, block_m, block_n] and the tiles' arrival counters, kept per
# (device, programs, block shape): allocated on the first call (before a graph captures it),
# the counters left at zero by every call.
_workspaces: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _workspace(device: torch.device, programs: int, c: StreamKConfig, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    key = (device, programs, c.block_m, c.block_n)
    found = _workspaces.get(key)
    if found is None or found[1].numel() < tiles:
        found = (torch.empty(programs, 2, c.block_m, c.block_n, dtype=torch.float32, device=device),
                 torch.zeros(max(tiles, found[1].numel() if found else 0), dtype=torch.int32, device=device))
        _workspaces[key] = found
    return found


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: a few programs, so tiles get cut between them


def linear(x: torch.Tensor, w: torch.Tensor, config: StreamKConfig) -> torch.Tensor:
    """x [M, K] @ w[N, K]^T -> [M, N] in x's dtype (float32 accumulation)."""
    import triton
    from triton.tools.tensor_descriptor import TensorDescriptor

    from benchmarks.experiments.stream_k_triton import stream_k_kernel

    m, k = x.shape
    n = w.shape[0]
    if w.shape[1] != k or w.dtype != x.dtype:
        raise ValueError(f"weight must be [N, {k}] in {x.dtype}, got {tuple(w.shape)} in {w.dtype}")
    if not tma_ok(x, w):
        raise ValueError(f"x and weight need contiguous rows of a multiple of 16 bytes at 16-byte aligned "
                         f"addresses on a GPU with TMA (compute capability 9+), got strides {x.stride()} and "
                         f"{w.stride()} of {x.element_size()}-byte elements")
    c = config
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    tiles = triton.cdiv(m, c.block_m) * triton.cdiv(n, c.block_n)
    programs = tiles if c.programs == 0 else min(c.programs or _sm_count(x.device), tiles * triton.cdiv(k, c.block_k))
    partials, counts = _workspace(x.device, programs, c, tiles)
    stream_k_kernel[(programs,)](
        TensorDescriptor.from_tensor(x, [c.block_m, c.block_k]),
        TensorDescriptor.from_tensor(w, [c.block_n, c.block_k]),
        out, partials, counts, m, n, k, out.stride(0), programs,
        BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, num_warps=c.num_warps, num_stages=c.num_stages,
    )
    return out
