"""One step's LoRA segments, planned on the host: which token rows run which adapter slot.

The SGMV ops (``lora.ops``) apply every adapter of a batch in one call per projection, over
segments of rows that share an adapter. Grouping rows by slot, rather than by request, is
what makes them cheap: with 8 adapters in a decode batch of 256, each adapter's A and B are
read once per step instead of once per request, and a segment fills a matrix-multiply tile
with ~32 rows instead of 1. Rows of base-model requests (slot -1) are left out entirely, so
they cost the kernels nothing.

Planning is numpy on the host (a few vector ops, no loop over tokens, no device work); the
runner copies the three arrays into device tensors (ForwardBatch.lora, rollout/batch.py;
static buffers for CUDA graphs, which ``num_rows`` / ``num_segments`` pad to fixed sizes).
It is part of the runner's layout of a step, so it sits in the model layer, below lora/.
This module knows nothing about what a slot holds or its rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["SegmentPlan", "plan_segments"]


@dataclass(frozen=True)
class SegmentPlan:
    """Rows ``row_ids[seg_indptr[g] : seg_indptr[g+1]]`` of x / out run slot ``seg_slots[g]``.

    Rows of one slot are contiguous and ascending; one segment per distinct slot. Padding:
    ``row_ids`` past ``seg_indptr[-1]`` hold a valid row index (0) that no segment covers,
    extra segments are empty with slot -1.
    """

    row_ids: np.ndarray  # int32 [R]
    seg_indptr: np.ndarray  # int32 [G + 1]
    seg_slots: np.ndarray  # int32 [G]

    @property
    def num_rows(self) -> int:
        """R, padding included (the kernels' grid is sized by it)."""
        return int(self.row_ids.shape[0])

    @property
    def num_segments(self) -> int:
        """G, padding included."""
        return int(self.seg_slots.shape[0])

    @property
    def num_lora_rows(self) -> int:
        """Rows that run an adapter (R without padding)."""
        return int(self.seg_indptr[-1])


def plan_segments(slots: Sequence[int], extend_lens: Sequence[int], *, num_rows: int | None = None,
                  num_segments: int | None = None) -> SegmentPlan:
    """Group a step's token rows by adapter slot.

    ``slots[b]``: request b's slot (-1: base model); ``extend_lens[b]``: its tokens this step,
    which are rows ``sum(extend_lens[:b]) ...`` of the batch. ``num_rows`` / ``num_segments``
    pad the plan to fixed sizes (>= what the batch needs), for CUDA-graph static buffers.

    About a dozen numpy calls whatever the batch (a decode step of 256 plans in ~15-50 us
    depending on the host); numpy arrays for ``slots`` / ``extend_lens`` skip the list
    conversion, the largest single cost.
    """
    request_slots = np.asarray(slots, dtype=np.int32)  # [B]
    lens = np.asarray(extend_lens, dtype=np.int64)  # [B]
    if request_slots.ndim != 1 or lens.shape != request_slots.shape:
        raise ValueError(f"slots and extend_lens must be flat and of one length, got shapes "
                         f"{request_slots.shape} and {lens.shape}")
    decode = bool((lens == 1).all())  # one row per request: the request order is the row order
    if not decode and lens.size and lens.min() < 0:
        raise ValueError(f"extend_lens must be >= 0, got {lens.min()}")
    try:  # [1 + max slot + 1]: rows of base requests, then of each slot
        slot_rows = np.bincount(request_slots + 1, weights=None if decode else lens)
    except ValueError:
        raise ValueError(f"slots must be >= -1, got {request_slots.min()}") from None
    if not decode:
        slot_rows = slot_rows.astype(np.int64)  # weighted counts come back as float64
    present = np.flatnonzero(slot_rows[1:])  # [G] slots with rows this step, ascending
    ends = np.cumsum(slot_rows[1:])[present]  # [G] each segment's end in row_ids
    num_lora_rows, used = int(ends[-1]) if ends.size else 0, int(present.size)
    padded_rows = num_lora_rows if num_rows is None else num_rows
    padded_segments = used if num_segments is None else num_segments
    if padded_rows < num_lora_rows or padded_segments < used:
        raise ValueError(f"padding to num_rows={num_rows}, num_segments={num_segments} is less than the batch "
                         f"needs: {num_lora_rows} rows, {used} slots")

    row_ids = np.zeros(padded_rows, dtype=np.int32)
    if num_lora_rows:
        # Requests (not tokens) sorted stably by slot, -1 read as uint32 2^32-1 so base
        # requests sort last; a request's rows are contiguous, so this orders the rows too.
        by_slot = np.argsort(request_slots.view(np.uint32), kind="stable")
        row_ids[:num_lora_rows] = (by_slot[:num_lora_rows] if decode
                                   else _request_rows(by_slot[: int((request_slots >= 0).sum())], lens))
    seg_indptr = np.empty(padded_segments + 1, dtype=np.int32)
    seg_indptr[0] = 0
    seg_indptr[1 : used + 1] = ends
    seg_indptr[used + 1 :] = num_lora_rows
    seg_slots = np.empty(padded_segments, dtype=np.int32)
    seg_slots[:used] = present
    seg_slots[used:] = -1
    return SegmentPlan(row_ids, seg_indptr, seg_slots)


def _request_rows(requests: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """The rows of ``requests`` in that order, each request's rows ascending: vector ops
    over requests and one arange over rows, no loop over tokens."""
    first_row = np.cumsum(lens) - lens  # [B] each request's first row in the batch
    taken_lens = lens[requests]
    # output position p of request r holds row first_row[r] + (p - r's first position)
    shift = first_row[requests] - (np.cumsum(taken_lens) - taken_lens)
    return np.arange(int(taken_lens.sum())) + np.repeat(shift, taken_lens)
