"""Batched multi-LoRA ops (SGMV, as in Punica / S-LoRA / SGLang): one call applies every
adapter of a mixed batch to one projection.

A LoRA projection is ``out = base(x) + (x @ A^T) @ B^T * scaling``, done in two steps:
``h = sgmv_shrink(x, A...)`` then ``sgmv_expand(h, B..., out)`` (the scaling is folded
into B). The rows that run an adapter are listed in ``row_ids`` (token rows of x and out),
grouped in G segments of one slot each: segment g is ``row_ids[seg_indptr[g] :
seg_indptr[g+1]]`` under slot ``seg_slots[g]`` (``rollout.model.lora_segments.plan_segments``
builds them, one segment per slot in use, base rows left out). A fused projection (q/k/v: 3
slices, gate/up: 2, o or down: 1) is one call: each slice has its own A and B, stacked in
the slot's weights.

Layouts (S slots, each padded to ``max_rank``; rows/columns past a slot's rank are zero):
* A: ``[S, num_slices * max_rank, K]``; slice j's ``lora_A [rank, K]`` is rows
  ``j*max_rank : j*max_rank + rank``.
* B: ``[S, N_out, max_rank]``; slice j owns out's columns ``slice_offsets[j] :
  slice_offsets[j+1]`` and reads h's slice-j columns.
* h: opaque between the two calls: fp32 ``[SPLIT_K, R, num_slices * max_rank]``, partial
  sums over SPLIT_K slices of K, indexed by position in ``row_ids`` (not by token row).
  The kernels split K so that small batches still spread over the GPU (``lora.kernels.
  tiling``); the references use SPLIT_K = 1. Expand sums the partials.

The kernels leave h unwritten (``torch.empty``: stale memory, possibly NaN) at padding
positions and at columns past a slot's rank; expand never reads those, and never touches
out's rows outside every segment (not even as out + 0). The references write zeros there.
Both accumulate in fp32 and round each output element once.

The kernel path is CUDA-graph capturable: argument checks are on shapes and dtypes only,
the grid depends on shapes (R = ``row_ids.numel()``, G = ``seg_slots.numel()``), and
nothing reads device values on the host; the contents of the segment tensors may change
between replays. This module knows nothing about where adapters live or how segments are
formed.

Dispatch: Triton for CUDA tensors (when triton is installed), the torch reference
otherwise. The caller's KernelOptions (``options``; the LoRA pool's, built from the engine's)
may force one path (``lora_triton``, default from ROLLOUT_LORA_TRITON=1/0): True sends CPU
tensors through the kernels (tests; needs TRITON_INTERPRET=1 set before triton's first
import), False keeps CUDA tensors on the reference (which syncs: not for graph capture). They
also carry the kernels' forced split-K and column block (benchmark sweeps, tests) and PDL.
"""

from __future__ import annotations

import importlib.util

import torch

from lora.kernels import MAX_SLICES
from rollout.kernels.options import DEFAULT_OPTIONS, KernelOptions

__all__ = ["expand_reference", "sgmv_expand", "sgmv_shrink", "shrink_reference", "shrink_row",
           "shrink_row_reference", "use_triton"]

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_HAS_TRITON = importlib.util.find_spec("triton") is not None  # found, not imported


def use_triton(x: torch.Tensor, forced: bool | None = None) -> bool:
    """Do x's LoRA ops run the Triton kernels? `forced`: KernelOptions.lora_triton (None:
    exactly for CUDA tensors). See the module docstring."""
    return (x.is_cuda and _HAS_TRITON) if forced is None else forced


# ------------------------------------------------------------------------------ dispatch


def sgmv_shrink(x: torch.Tensor, weights: torch.Tensor, row_ids: torch.Tensor, seg_indptr: torch.Tensor,
                seg_slots: torch.Tensor, slot_ranks: torch.Tensor, *, num_slices: int, max_rank: int,
                options: KernelOptions = DEFAULT_OPTIONS) -> torch.Tensor:
    """h fp32 [SPLIT_K, R, num_slices * max_rank]: summed over its first dim,
    ``h[:, i, j*max_rank + r] = x[row_ids[i]] . A_slot[j*max_rank + r]`` for positions i of
    segments and r < the slot's rank; other entries are unspecified (see the module docstring).

    x: [T, K]; weights: [S, num_slices * max_rank, K] (x's dtype); row_ids: int32 [R];
    seg_indptr: int32 [G+1]; seg_slots: int32 [G] (-1: base); slot_ranks: int32 [S]; all on
    x's device.
    """
    _check_shrink(x, weights, row_ids, seg_indptr, seg_slots, slot_ranks, num_slices, max_rank)
    if use_triton(x, options.lora_triton):
        from lora.kernels import sgmv

        return sgmv.sgmv_shrink(x, weights, row_ids, seg_indptr, seg_slots, slot_ranks, num_slices=num_slices,
                                max_rank=max_rank, split_k=options.lora_split_k)
    return shrink_reference(x, weights, row_ids, seg_indptr, seg_slots, slot_ranks, num_slices=num_slices,
                            max_rank=max_rank)


def sgmv_expand(h: torch.Tensor, weights: torch.Tensor, out: torch.Tensor, row_ids: torch.Tensor,
                seg_indptr: torch.Tensor, seg_slots: torch.Tensor, slot_ranks: torch.Tensor, *,
                slice_offsets: tuple[int, ...], max_rank: int, options: KernelOptions = DEFAULT_OPTIONS) -> None:
    """In place: ``out[row_ids[i], n] += sum_s sum_{r < rank} h[s, i, j*max_rank + r] * B_slot[n, r]``
    for positions i of segments, n in slice j. Other rows of out are neither read nor written.

    h: from ``sgmv_shrink`` (fp32 [SPLIT_K, R, num_slices * max_rank]); weights: [S, N_out,
    max_rank] (scaling folded in); out: [T, N_out]; slice_offsets: host tuple [num_slices + 1]
    from 0 to N_out (slices may differ in width); segment tensors as in ``sgmv_shrink``.
    """
    _check_expand(h, weights, out, row_ids, seg_indptr, seg_slots, slot_ranks, slice_offsets, max_rank)
    if use_triton(h, options.lora_triton):
        from lora.kernels import sgmv

        sgmv.sgmv_expand(h, weights, out, row_ids, seg_indptr, seg_slots, slot_ranks, slice_offsets=slice_offsets,
                         max_rank=max_rank, block_n=options.lora_expand_block_n, pdl=options.lora_pdl)
    else:
        expand_reference(h, weights, out, row_ids, seg_indptr, seg_slots, slot_ranks, slice_offsets=slice_offsets,
                         max_rank=max_rank)


def shrink_row(x: torch.Tensor, weights: torch.Tensor, slot: torch.Tensor, slot_ranks: torch.Tensor, *,
               num_slices: int, max_rank: int, options: KernelOptions = DEFAULT_OPTIONS) -> torch.Tensor:
    """The shrink of a batch-1 step's one row under the slot on the device: h fp32 [SPLIT,
    num_slices * max_rank], summed over its first dim ``h[:, j*max_rank + r] = x[0] .
    A_slot[j*max_rank + r]`` for r < the slot's rank; other entries (and all of h when slot
    is -1) are unspecified. What `rollout.kernels.low_rank.LowRank` takes as h.

    x: [1, K]; weights: [S, num_slices * max_rank, K] (x's dtype); slot: int32 [1];
    slot_ranks: int32 [S]; all on x's device. Capturable: nothing is read on the host.
    """
    _check_shrink_row(x, weights, slot, slot_ranks, num_slices, max_rank)
    if use_triton(x, options.lora_triton):
        from lora.kernels import row

        return row.shrink_row(x, weights, slot, slot_ranks, num_slices=num_slices, max_rank=max_rank,
                              pdl=options.pdl)
    return shrink_row_reference(x, weights, slot, slot_ranks, num_slices=num_slices, max_rank=max_rank)


# ----------------------------------------------------------------------------- reference


def _segments(row_ids: torch.Tensor, seg_indptr: torch.Tensor, seg_slots: torch.Tensor,
              slot_ranks: torch.Tensor) -> list[tuple[int, int, int, int, torch.Tensor]]:
    """(first position, end position, slot, rank, rows [n] int64) of each segment with rows
    and a nonzero rank: a plan has one segment per slot in use, a handful, so the
    references do a few matmuls per segment and nothing per token."""
    indptr, slots, ranks = seg_indptr.tolist(), seg_slots.tolist(), slot_ranks.tolist()  # one sync each
    rows = row_ids.long()
    return [(lo, hi, slot, ranks[slot], rows[lo:hi]) for lo, hi, slot in zip(indptr[:-1], indptr[1:], slots)
            if hi > lo and slot >= 0 and ranks[slot] > 0]


def shrink_reference(x: torch.Tensor, weights: torch.Tensor, row_ids: torch.Tensor, seg_indptr: torch.Tensor,
                     seg_slots: torch.Tensor, slot_ranks: torch.Tensor, *, num_slices: int,
                     max_rank: int) -> torch.Tensor:
    """Torch twin of the shrink kernel (the CPU path): h [1, R, num_slices * max_rank], zeros
    where the kernel leaves h unwritten."""
    hidden = x.shape[1]
    h = torch.zeros((row_ids.shape[0], num_slices, max_rank), dtype=torch.float32, device=x.device)
    for lo, hi, slot, rank, rows in _segments(row_ids, seg_indptr, seg_slots, slot_ranks):
        a = weights[slot].view(num_slices, max_rank, hidden)[:, :rank]  # [num_slices, rank, K]
        hs = x[rows].float() @ a.reshape(num_slices * rank, hidden).float().T  # [n, num_slices * rank]
        h[lo:hi, :, :rank] = hs.view(hi - lo, num_slices, rank)
    return h.view(1, row_ids.shape[0], num_slices * max_rank)


def shrink_row_reference(x: torch.Tensor, weights: torch.Tensor, slot: torch.Tensor, slot_ranks: torch.Tensor, *,
                         num_slices: int, max_rank: int) -> torch.Tensor:
    """Torch twin of the one-row shrink: h [1, num_slices * max_rank], zeros where the kernel
    leaves h unwritten."""
    indptr = torch.tensor([0, 1], dtype=torch.int32, device=x.device)
    return shrink_reference(x, weights, torch.zeros(1, dtype=torch.int32, device=x.device), indptr, slot, slot_ranks,
                            num_slices=num_slices, max_rank=max_rank)[0]


def expand_reference(h: torch.Tensor, weights: torch.Tensor, out: torch.Tensor, row_ids: torch.Tensor,
                     seg_indptr: torch.Tensor, seg_slots: torch.Tensor, slot_ranks: torch.Tensor, *,
                     slice_offsets: tuple[int, ...], max_rank: int) -> None:
    """Torch twin of the expand kernel: h at padding positions and past a slot's rank is never
    read (it may be NaN), out's rows outside every segment are not touched."""
    n_out = out.shape[1]
    num_slices = len(slice_offsets) - 1
    for lo, hi, slot, rank, rows in _segments(row_ids, seg_indptr, seg_slots, slot_ranks):
        hs = h[:, lo:hi].view(h.shape[0], hi - lo, num_slices, max_rank)[..., :rank].float().sum(0)  # [n, slices, rank]
        delta = torch.empty((hi - lo, n_out), dtype=torch.float32, device=out.device)
        for j in range(num_slices):
            a, b = slice_offsets[j], slice_offsets[j + 1]
            delta[:, a:b] = hs[:, j] @ weights[slot, a:b, :rank].float().T
        out[rows] = (out[rows].float() + delta).to(out.dtype)


# -------------------------------------------------------------------------------- checks


def _check_segments(device: torch.device, row_ids: torch.Tensor, seg_indptr: torch.Tensor,
                    seg_slots: torch.Tensor, slot_ranks: torch.Tensor, num_rows: int, num_slots: int) -> None:
    num_segments = seg_slots.shape[0] if seg_slots.dim() == 1 else -1
    for name, t, length in (("row_ids", row_ids, num_rows), ("seg_indptr", seg_indptr, num_segments + 1),
                            ("seg_slots", seg_slots, num_segments), ("slot_ranks", slot_ranks, num_slots)):
        if t.dtype != torch.int32 or t.dim() != 1 or (length >= 0 and t.shape[0] != length) or t.device != device:
            want = "*" if length < 0 else length
            raise ValueError(f"{name} must be int32 [{want}] on {device}, got {t.dtype} "
                             f"{tuple(t.shape)} on {t.device}")
        if t.shape[0] > 1 and t.stride(0) != 1:
            raise ValueError(f"{name} must be contiguous, got stride {t.stride()}")


def _check_matrix(name: str, t: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype | None,
                  device: torch.device) -> None:
    # shape entries of -1 are free; the kernels address rows by stride, columns densely
    ok = t.dim() == len(shape) and all(want in (-1, got) for want, got in zip(shape, t.shape))
    if not ok or t.device != device or t.dtype not in _FLOATS or (dtype is not None and t.dtype != dtype):
        want = "x".join("*" if d < 0 else str(d) for d in shape)
        raise ValueError(f"{name} must be [{want}] {dtype or 'float'} on {device}, "
                         f"got {tuple(t.shape)} {t.dtype} on {t.device}")
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim, got strides {t.stride()}")


def _check_shrink(x: torch.Tensor, weights: torch.Tensor, row_ids: torch.Tensor, seg_indptr: torch.Tensor,
                  seg_slots: torch.Tensor, slot_ranks: torch.Tensor, num_slices: int, max_rank: int) -> None:
    if num_slices < 1 or max_rank < 1:
        raise ValueError(f"num_slices and max_rank must be >= 1, got {num_slices}, {max_rank}")
    _check_matrix("x", x, (-1, -1), None, x.device)
    _check_matrix("weights", weights, (-1, num_slices * max_rank, x.shape[1]), x.dtype, x.device)
    _check_segments(x.device, row_ids, seg_indptr, seg_slots, slot_ranks, -1, weights.shape[0])


def _check_shrink_row(x: torch.Tensor, weights: torch.Tensor, slot: torch.Tensor, slot_ranks: torch.Tensor,
                      num_slices: int, max_rank: int) -> None:
    if num_slices < 1 or max_rank < 1:
        raise ValueError(f"num_slices and max_rank must be >= 1, got {num_slices}, {max_rank}")
    _check_matrix("x", x, (1, -1), None, x.device)
    _check_matrix("weights", weights, (-1, num_slices * max_rank, x.shape[1]), x.dtype, x.device)
    for name, t, length in (("slot", slot, 1), ("slot_ranks", slot_ranks, weights.shape[0])):
        if t.dtype != torch.int32 or t.shape != (length,) or t.device != x.device:
            raise ValueError(f"{name} must be int32 [{length}] on {x.device}, got {t.dtype} {tuple(t.shape)} "
                             f"on {t.device}")


def _check_expand(h: torch.Tensor, weights: torch.Tensor, out: torch.Tensor, row_ids: torch.Tensor,
                  seg_indptr: torch.Tensor, seg_slots: torch.Tensor, slot_ranks: torch.Tensor,
                  slice_offsets: tuple[int, ...], max_rank: int) -> None:
    num_slices = len(slice_offsets) - 1
    if not 1 <= num_slices <= MAX_SLICES or max_rank < 1:
        raise ValueError(f"need 1..{MAX_SLICES} slices and max_rank >= 1, got slice_offsets={slice_offsets}, "
                         f"max_rank={max_rank}")
    _check_matrix("out", out, (-1, -1), None, h.device)
    n_out = out.shape[1]
    if slice_offsets[0] != 0 or slice_offsets[-1] != n_out or any(
            lo > hi for lo, hi in zip(slice_offsets[:-1], slice_offsets[1:])):
        raise ValueError(f"slice_offsets must rise from 0 to N_out={n_out}, got {slice_offsets}")
    want = (-1, row_ids.shape[0], num_slices * max_rank)
    _check_matrix("h", h, want, torch.float32, h.device)
    if h.shape[0] < 1 or not h.is_contiguous():
        raise ValueError(f"h must be a contiguous fp32 [SPLIT_K >= 1, R, num_slices * max_rank] from sgmv_shrink, "
                         f"got {tuple(h.shape)} with strides {h.stride()}")
    _check_matrix("weights", weights, (-1, n_out, max_rank), None, h.device)
    _check_segments(h.device, row_ids, seg_indptr, seg_slots, slot_ranks, -1, weights.shape[0])
