"""LoraHook: what a projection (`Linear.lora`) calls to add the step's adapter deltas.

A LoRA projection is ``y = x W^T + (x A^T) B^T``: the shrink ``h = x A^T`` needs only the
projection's input, the expand ``y += h B^T`` needs the base output. So the hook comes in
two halves around the base matmul: `begin(x)` launches the shrink, `finish(h, y)` the
expand. In a decode CUDA graph (`LoraPool.concurrent`, set by the capture's plan) the
shrink runs on a side stream, forked after x is ready and joined before the expand: it
overlaps the base GEMM, which even at batch 1 takes several times as long as the shrink, so
a decode step's critical path carries one LoRA launch per projection, not two. Outside
graphs the halves run in order on the current stream: forking costs host time per call,
and a long prefill's shrink is small beside its GEMM anyway. Graphs of more than
`lora.pool.CONCURRENT_MAX_ROWS` rows run in order too: their GEMMs fill the GPU, and the
branch only delays them (BENCHMARKS.md, multi-LoRA, "H200, 2026-12-01: no side stream past
192 rows"). The pool's KernelOptions say which kernels run (lora.ops takes them).

Streams and memory: h is allocated on the side stream and read on the main one. Each
begin() first makes the side stream wait for the main stream, so a later shrink that
reuses h's memory (the caching allocator hands a freed block back to the stream that
allocated it) is ordered after the expand that read it; captures take every allocation
from the graph's pool the same way.

Deferred deltas (`begin(x, defer=True)`, small batches in a graph): the expand also runs on
the side stream, into a zeroed fp32 delta [T, out] instead of into y, and `finish` hands the
delta to the caller, whose next kernel (the add-RMSNorm, SiLU-mul or rotary that consumes y)
adds it on load. At batch 1 the side work (shrink, memset, expand) fits under the base GEMV,
so the critical path carries no LoRA launch at all, where the in-place expand put one launch
per projection on it, each waiting for its GEMM (BENCHMARKS.md, multi-LoRA, "H200,
2026-12-01: where batch 1's adapter cost goes"). The consumer computes round(y + delta)
exactly as the in-place expand's round(y + acc) (the delta is acc, summed onto an fp32
zero), so both paths are bit-equal. At large batches the fp32 delta's extra traffic would
cost more than a launch saves, so only up to `LoraPool.defer_max_rows` rows defer; the rest
expand in place as before.

One row (`one_row`, a batch-1 step on the skinny GEMV): neither half runs apart. The side
stream lost there: the GEMV's thousands of programs, launched early under PDL, took every SM
before the shrink could start, so the shrink waited for the whole GEMV (BENCHMARKS.md,
multi-LoRA, "H200, 2026-12-02: (a) without compiles in the timing; batch 1 behind the skinny
GEMV"). Instead the shrink is one small kernel on the main stream (lora/kernels/row.py) and
the expand is the GEMV's epilogue (rollout/kernels/low_rank.py), so the projection stays one
launch plus the shrink, and the epilogues after it (SiLU-mul, the rotary with the K/V store)
still fold in (BENCHMARKS.md, multi-LoRA, "H200, 2026-12-02: batch 1, the adapter's expand in
the GEMV's epilogue"). Two other layouts were measured there and dropped: the shrink as the
GEMV's own first programs, the others waiting for them (slower), and the qkv and gate_up
shrink as extra programs of the add-RMSNorm before them (no gain).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from lora.ops import sgmv_expand, sgmv_shrink, shrink_row, use_triton
from rollout.kernels.low_rank import LowRank, OneRow

if TYPE_CHECKING:
    from lora.layout import ModuleShape
    from rollout.batch import LoraInputs
    from rollout.kernels.options import KernelOptions

__all__ = ["AdapterSlots", "Deferred", "LoraHook"]


class AdapterSlots(Protocol):
    """What a hook reads of the adapter pool that made it (lora/pool.py LoraPool): the slots'
    per-layer A and B views, the next forward's plan, and the kernels' options."""

    shapes: dict[str, ModuleShape]
    a: dict[tuple[int, str], torch.Tensor]  # (layer, module) -> [num_slots, ...] A views
    b: dict[tuple[int, str], torch.Tensor]
    slot_ranks: torch.Tensor
    max_rank: int
    options: KernelOptions
    batch: LoraInputs | None  # the next forward's segments; None: no adapter runs
    concurrent: bool  # the next forward's shrinks run on the side stream
    one_row_epilogue: bool

    def defers(self, num_rows: int) -> bool: ...

    def side_stream(self) -> torch.cuda.Stream: ...


@dataclass(frozen=True)
class Deferred:
    """What begin() returns when the delta is left to the consumer: fp32 [T, out] on the
    side stream (or the current one when the pool defers eagerly), ready after finish()."""

    delta: torch.Tensor


class LoraHook:
    """Installed on one projection: two batched kernels per call whatever the mix of adapters."""

    def __init__(self, pool: AdapterSlots, layer: int, module: str) -> None:
        self.pool, self.key = pool, (layer, module)
        shape = pool.shapes[module]
        self.num_slices, self.slice_offsets = shape.num_slices, shape.slice_offsets

    def begin(self, x: torch.Tensor, defer: bool = False) -> torch.Tensor | Deferred | None:
        """Launch the shrink of x [T, in]; returns what finish() takes, None when no adapter
        runs. `defer`: the caller can add a delta itself (see the module docstring); the
        pool decides whether this call does (a graph capture's side stream, few rows)."""
        pool, batch = self.pool, self.pool.batch
        if batch is None:
            return None
        args = (batch.row_ids, batch.seg_indptr, batch.seg_slots, pool.slot_ranks)
        launch = self._deferred if defer and pool.defers(x.shape[0]) else self._shrink
        if not pool.concurrent:
            return launch(x, args)
        side = pool.side_stream()
        side.wait_stream(torch.cuda.current_stream(x.device))  # x is ready; h's last reader is done
        with torch.cuda.stream(side):
            return launch(x, args)

    def _shrink(self, x: torch.Tensor, args: tuple) -> torch.Tensor:
        pool = self.pool
        return sgmv_shrink(x, pool.a[self.key], *args, num_slices=self.num_slices, max_rank=pool.max_rank,
                           options=pool.options)

    def _deferred(self, x: torch.Tensor, args: tuple) -> Deferred:
        pool = self.pool
        delta = torch.zeros((x.shape[0], self.slice_offsets[-1]), dtype=torch.float32, device=x.device)
        sgmv_expand(self._shrink(x, args), pool.b[self.key], delta, *args, slice_offsets=self.slice_offsets,
                    max_rank=pool.max_rank, options=pool.options)
        return Deferred(delta)

    def one_row(self, x: torch.Tensor) -> OneRow | None:
        """The adapter's term for the base GEMV's epilogue when x is one row (the caller runs
        the matmul as the skinny GEMV: `kernels.one_row`), its shrink launched here; OneRow(None)
        when no adapter runs this step; None when the halves run apart (begin / finish)."""
        pool, batch = self.pool, self.pool.batch
        if batch is None:
            return OneRow(None)
        if x.shape[0] != 1 or not pool.one_row_epilogue or not use_triton(x, pool.options.lora_triton):
            return None
        slot = batch.seg_slots[:1]  # one row: its slot is the first segment's (-1: a base request)
        h = shrink_row(x, pool.a[self.key], slot, pool.slot_ranks, num_slices=self.num_slices, max_rank=pool.max_rank,
                       options=pool.options)
        return OneRow(LowRank(h, pool.b[self.key], slot, pool.slot_ranks, self.slice_offsets, pool.max_rank))

    @property
    def concurrent(self) -> bool:
        """Do this step's adapter kernels run on the side stream, beside the base matmul?"""
        return self.pool.concurrent

    def finish(self, pending: torch.Tensor | Deferred | None, out: torch.Tensor) -> torch.Tensor | None:
        """Add the deltas to out [T, out] (the base projection's result) in place; or, for a
        deferred begin(), join the side stream and return the fp32 delta for the caller to
        add. None when nothing is left to add."""
        if pending is None:
            return None
        pool, batch = self.pool, self.pool.batch
        assert batch is not None, "LoraHook.finish without begin"
        if pool.concurrent:
            torch.cuda.current_stream(out.device).wait_stream(pool.side_stream())
        if isinstance(pending, Deferred):
            return pending.delta
        sgmv_expand(pending, pool.b[self.key], out, batch.row_ids, batch.seg_indptr, batch.seg_slots, pool.slot_ranks,
                    slice_offsets=self.slice_offsets, max_rank=pool.max_rank, options=pool.options)
        return None

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """Both halves in order, after the base matmul (x and out given together)."""
        self.finish(self.begin(x), out)
