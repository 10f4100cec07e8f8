"""LoraHook: what a projection (`Linear.lora`) calls to add the step's adapter deltas.

A LoRA projection is ``y = x W^T + (x A^T) B^T``: the shrink ``h = x A^T`` needs only the
projection's input, the expand ``y += h B^T`` needs the base output. So the hook comes in
two halves around the base matmul: `begin(x)` launches the shrink, `finish(h, y)` the
expand. In a decode CUDA graph (`LoraPool.concurrent`, set by the capture's plan) the
shrink runs on a side stream, forked after x is ready and joined before the expand: it
overlaps the base GEMM (10-60 us at batch 1 on Llama-3-8B, against a few us of shrink), so
a decode step's critical path carries one LoRA launch per projection, not two. Outside
graphs the halves run in order on the current stream: forking costs host time per call,
and a long prefill's shrink is small beside its GEMM anyway.

Streams and memory: h is allocated on the side stream and read on the main one. Each
begin() first makes the side stream wait for the main stream, so a later shrink that
reuses h's memory (the caching allocator hands a freed block back to the stream that
allocated it) is ordered after the expand that read it; captures take every allocation
from the graph's pool the same way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from lora.ops import sgmv_expand, sgmv_shrink

if TYPE_CHECKING:
    from lora.pool import LoraPool

__all__ = ["LoraHook"]


class LoraHook:
    """Installed on one projection: two batched kernels per call whatever the mix of adapters."""

    def __init__(self, pool: LoraPool, layer: int, module: str) -> None:
        self.pool, self.key = pool, (layer, module)
        shape = pool.shapes[module]
        self.num_slices, self.slice_offsets = shape.num_slices, shape.slice_offsets

    def begin(self, x: torch.Tensor) -> torch.Tensor | None:
        """Launch the shrink of x [T, in]; returns h for finish(), None when no adapter runs."""
        pool, batch = self.pool, self.pool.batch
        if batch is None:
            return None
        args = (batch.row_ids, batch.seg_indptr, batch.seg_slots, pool.slot_ranks)
        if not pool.concurrent:
            return sgmv_shrink(x, pool.a[self.key], *args, num_slices=self.num_slices, max_rank=pool.max_rank)
        side = pool.side_stream()
        side.wait_stream(torch.cuda.current_stream(x.device))  # x is ready; h's last reader is done
        with torch.cuda.stream(side):
            return sgmv_shrink(x, pool.a[self.key], *args, num_slices=self.num_slices, max_rank=pool.max_rank)

    def finish(self, h: torch.Tensor | None, out: torch.Tensor) -> None:
        """Add the deltas to out [T, out] (the base projection's result) in place."""
        if h is None:
            return
        pool, batch = self.pool, self.pool.batch
        assert batch is not None, "LoraHook.finish without begin"
        if pool.concurrent:
            torch.cuda.current_stream(out.device).wait_stream(pool.side_stream())
        sgmv_expand(h, pool.b[self.key], out, batch.row_ids, batch.seg_indptr, batch.seg_slots, pool.slot_ranks,
                    slice_offsets=self.slice_offsets, max_rank=pool.max_rank)

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """Both halves in order, after the base matmul (x and out given together)."""
        self.finish(self.begin(x), out)
