"""A low-rank term for the one-row GEMV's epilogue (rollout/kernels/skinny.py): how a LoRA
adapter's delta rides in the base projection's own launch at batch 1.

At batch 1 the adapter's shrink and expand are tiny (a few hundred KB of A and B against tens of
MB of W), so what they cost is launches and the waits between them: two kernels a projection,
128 a Llama-3-8B step, each behind a GEMV that holds every SM (BENCHMARKS.md, multi-LoRA, "H200,
2026-12-02: (a) without compiles in the timing; batch 1 behind the skinny GEMV"). With the term,
the shrink ``h = x A^T`` is one small kernel before the GEMV (lora/kernels/row.py, launched
under PDL like the GEMV), and the expand is the GEMV's epilogue: each program adds ``h . B[n]``
to its own rows, so the expand's launch is gone and the epilogues that follow (SiLU-mul, the
rotary with the K/V store) still fold in.

This module is the data the two sides share and the torch reference; it imports no triton.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["MAX_SPLIT", "LowRank", "OneRow", "reference"]

# h's partials at most: each GEMV program loads all of its slice's at once.
MAX_SPLIT = 32


@dataclass(frozen=True)
class LowRank:
    """``out[n] = round(round(x . W[n] + bias[n]) + sum_r h[j(n)*max_rank + r] * b[slot, n, r])``
    over ``r < ranks[slot]``, where row n lies in slice j(n) (``slice_offsets``); nothing is
    added when ``slot`` is -1 or its rank is 0. The first rounding is the plain GEMV's output,
    the second the in-place expand's (lora/hook.py), so a base row is bit-equal to no term.

    h: fp32 [SPLIT, num_slices * max_rank] partial sums over SPLIT slices of K (summed by the
    epilogue; unwritten past the rank, never read there), written by the kernel right before
    the GEMV (lora/kernels/row.py; the GEMV loads it beside x, after its PDL wait). b:
    [num_slots, N, max_rank] in the GEMV's dtype (a layer's view, scaling folded in), zero
    past each slot's rank (the pool's slots are; the GEMV reads b without waiting for the
    rank, skinny._low_rank_start), finite everywhere; slot:
    int32 [1] on the device (the row's slot, read in the kernel: a CUDA graph replays any
    adapter); ranks: int32 [num_slots]."""

    h: torch.Tensor
    b: torch.Tensor
    slot: torch.Tensor
    ranks: torch.Tensor
    slice_offsets: tuple[int, ...]
    max_rank: int

    @property
    def num_slices(self) -> int:
        return len(self.slice_offsets) - 1


@dataclass(frozen=True)
class OneRow:
    """A projection's one-row matmul runs as the skinny GEMV with everything the projection
    adds in its launch, so the kernel after it may fold in too (rollout/model/llama.py):
    `term` is its adapter's part (None: no adapter runs this step)."""

    term: LowRank | None = None


def reference(y: torch.Tensor, term: LowRank) -> torch.Tensor:
    """Torch twin of the epilogue: y [1, N] (the GEMV's rounded output) with the term added,
    rounded once. Syncs (reads the slot): tests only."""
    slot = int(term.slot[0])
    rank = int(term.ranks[slot]) if slot >= 0 else 0
    if rank == 0:
        return y.clone()
    hs = term.h.sum(0).view(term.num_slices, term.max_rank)[:, :rank]  # [slices, rank]
    delta = torch.empty(y.shape[1], dtype=torch.float32, device=y.device)
    for j, (lo, hi) in enumerate(zip(term.slice_offsets[:-1], term.slice_offsets[1:])):
        delta[lo:hi] = term.b[slot, lo:hi, :rank].float() @ hs[j]
    return (y.float() + delta).to(y.dtype)
