"""Batched multi-LoRA ops (SGMV, as in Punica / S-LoRA / SGLang): one call applies every
adapter of a mixed batch to one projection.

A LoRA projection is ``out = base(x) + (x @ A^T) @ B^T * scaling``, done in two steps:
``h = sgmv_shrink(x, A...)`` then ``sgmv_expand(h, B..., out)`` (the scaling is folded
into B). The batch's tokens come in G contiguous segments (rows ``seg_indptr[g] :
seg_indptr[g+1]``), each with one adapter slot ``seg_slots[g]`` (-1: the base model). A
fused projection (q/k/v: 3 slices, gate/up: 2, o or down: 1) is one call: each slice has
its own A and B, stacked in the slot's weights.

Layouts (S slots, each padded to ``max_rank``; rows/columns past a slot's rank are zero):
* A: ``[S, num_slices * max_rank, K]``; slice j's ``lora_A [rank, K]`` is rows
  ``j*max_rank : j*max_rank + rank``.
* h: ``[T, num_slices * max_rank]`` in x's dtype; slice j's ranks are columns
  ``j*max_rank : j*max_rank + rank``.
* B: ``[S, N_out, max_rank]``; slice j owns out's columns ``slice_offsets[j] :
  slice_offsets[j+1]`` and reads h's slice-j columns.

The Triton kernels (``lora.kernels.sgmv``) leave h unwritten (``torch.empty``: stale
memory, possibly NaN) on rows of base segments and at columns past a slot's rank; expand
never reads those, and never touches out's rows of base segments. The references write
zeros there. Both accumulate in fp32 and round each output element once.

The kernel path is CUDA-graph capturable: argument checks are on shapes and dtypes only,
the grid depends on host ints (``max_seg_len``, shapes), and nothing reads device values
on the host; segment and slot tensors may change in place between replays. This module knows nothing about where adapters live or how segments are
formed; the caller owns slots, ranks and ``max_seg_len`` (>= the longest segment: the
kernels size their row blocks by it, so a loose bound costs speed, never rows; the
references raise on a segment longer than it, so tests catch a wrong bound).

Dispatch: Triton for CUDA tensors (when triton is installed), the torch reference
otherwise. ``enabled`` (or the environment variable ROLLOUT_LORA_TRITON=1/0, read at
import) forces one path: True sends CPU tensors through the kernels (tests; needs
TRITON_INTERPRET=1 set before triton's first import), False keeps CUDA tensors on the
reference (which syncs: not for graph capture).
"""

from __future__ import annotations

import importlib.util
import os

import torch

from lora.kernels import MAX_SLICES

__all__ = ["enabled", "expand_reference", "sgmv_expand", "sgmv_shrink", "shrink_reference", "use_triton"]

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def _env_flag(name: str) -> bool | None:
    value = os.environ.get(name, "").strip().lower()
    return {"1": True, "true": True, "0": False, "false": False}.get(value)


# None: automatic (Triton exactly for CUDA tensors). See the module docstring.
enabled: bool | None = _env_flag("ROLLOUT_LORA_TRITON")
_HAS_TRITON = importlib.util.find_spec("triton") is not None  # found, not imported


def use_triton(x: torch.Tensor) -> bool:
    return (x.is_cuda and _HAS_TRITON) if enabled is None else enabled


# ------------------------------------------------------------------------------ dispatch


def sgmv_shrink(x: torch.Tensor, weights: torch.Tensor, seg_indptr: torch.Tensor, seg_slots: torch.Tensor,
                slot_ranks: torch.Tensor, *, num_slices: int, max_rank: int, max_seg_len: int) -> torch.Tensor:
    """h [T, num_slices * max_rank] (x's dtype): ``h[t, j*max_rank + i] = x[t] . A_slot[j*max_rank + i]``
    for rows t of LoRA segments and i < the slot's rank; other entries are unspecified
    (see the module docstring).

    x: [T, K]; weights: [S, num_slices * max_rank, K] (x's dtype); seg_indptr: int32 [G+1];
    seg_slots: int32 [G] (-1: base); slot_ranks: int32 [S]; all on x's device.
    max_seg_len: host int >= the longest segment.
    """
    _check_shrink(x, weights, seg_indptr, seg_slots, slot_ranks, num_slices, max_rank, max_seg_len)
    if use_triton(x):
        from lora.kernels import sgmv

        return sgmv.sgmv_shrink(x, weights, seg_indptr, seg_slots, slot_ranks, num_slices=num_slices,
                                max_rank=max_rank, max_seg_len=max_seg_len)
    return shrink_reference(x, weights, seg_indptr, seg_slots, slot_ranks, num_slices=num_slices,
                            max_rank=max_rank, max_seg_len=max_seg_len)


def sgmv_expand(h: torch.Tensor, weights: torch.Tensor, out: torch.Tensor, seg_indptr: torch.Tensor,
                seg_slots: torch.Tensor, slot_ranks: torch.Tensor, *, slice_offsets: tuple[int, ...], max_rank: int,
                max_seg_len: int) -> None:
    """In place: ``out[t, n] += sum_{i < rank} h[t, j*max_rank + i] * B_slot[n, i]`` for rows t
    of LoRA segments, n in slice j. Rows of base segments are neither read nor written.

    h: [T, num_slices * max_rank]; weights: [S, N_out, max_rank] (h's dtype, scaling folded
    in); out: [T, N_out] (any float dtype); slice_offsets: host tuple [num_slices + 1] from 0
    to N_out (slices may differ in width); segment tensors as in ``sgmv_shrink``.
    """
    _check_expand(h, weights, out, seg_indptr, seg_slots, slot_ranks, slice_offsets, max_rank, max_seg_len)
    if use_triton(h):
        from lora.kernels import sgmv

        sgmv.sgmv_expand(h, weights, out, seg_indptr, seg_slots, slot_ranks, slice_offsets=slice_offsets,
                         max_rank=max_rank, max_seg_len=max_seg_len)
    else:
        expand_reference(h, weights, out, seg_indptr, seg_slots, slot_ranks, slice_offsets=slice_offsets,
                         max_rank=max_rank, max_seg_len=max_seg_len)


# ----------------------------------------------------------------------------- reference


def _row_slots(seg_indptr: torch.Tensor, seg_slots: torch.Tensor, num_rows: int, max_seg_len: int) -> torch.Tensor:
    """[T] int64: each row's slot, -1 for rows of base segments and rows outside every segment."""
    indptr = seg_indptr.long()  # [G+1]
    num_segments = seg_slots.shape[0]
    if num_segments == 0:
        return torch.full((num_rows,), -1, dtype=torch.long, device=seg_slots.device)
    longest = int((indptr[1:] - indptr[:-1]).max())
    if longest > max_seg_len:
        raise ValueError(f"a segment has {longest} rows, more than max_seg_len={max_seg_len}")
    rows = torch.arange(num_rows, device=indptr.device)
    # The last segment starting at or before each row; empty segments share a start with
    # the next one, and right=True skips past them to it.
    seg = torch.searchsorted(indptr, rows, right=True) - 1  # [T]
    inside = (seg >= 0) & (rows < indptr[-1])
    slots = seg_slots.long()[seg.clamp(0, num_segments - 1)]
    return torch.where(inside, slots, -1)


def _slot_groups(row_slots: torch.Tensor, slot_ranks: torch.Tensor) -> list[tuple[int, int, torch.Tensor]]:
    """(slot, rank, row indices [n]) for each LoRA slot present with a nonzero rank: a batch
    has a handful of distinct slots, so the references do a few matmuls per slot."""
    groups = []
    for slot in row_slots.unique().tolist():
        rank = int(slot_ranks[slot]) if slot >= 0 else 0
        if rank > 0:
            groups.append((slot, rank, (row_slots == slot).nonzero().squeeze(1)))
    return groups


def shrink_reference(x: torch.Tensor, weights: torch.Tensor, seg_indptr: torch.Tensor, seg_slots: torch.Tensor,
                     slot_ranks: torch.Tensor, *, num_slices: int, max_rank: int, max_seg_len: int) -> torch.Tensor:
    """Torch twin of the shrink kernel (the CPU path): zeros where the kernel leaves h unwritten."""
    num_tokens, hidden = x.shape
    h = torch.zeros((num_tokens, num_slices, max_rank), dtype=x.dtype, device=x.device)
    row_slots = _row_slots(seg_indptr, seg_slots, num_tokens, max_seg_len)
    for slot, rank, rows in _slot_groups(row_slots, slot_ranks):
        a = weights[slot].view(num_slices, max_rank, hidden)[:, :rank].reshape(num_slices * rank, hidden)
        hs = x[rows].float() @ a.float().T  # [n, num_slices * rank]
        h[rows, :, :rank] = hs.view(-1, num_slices, rank).to(x.dtype)
    return h.view(num_tokens, num_slices * max_rank)


def expand_reference(h: torch.Tensor, weights: torch.Tensor, out: torch.Tensor, seg_indptr: torch.Tensor,
                     seg_slots: torch.Tensor, slot_ranks: torch.Tensor, *, slice_offsets: tuple[int, ...],
                     max_rank: int, max_seg_len: int) -> None:
    """Torch twin of the expand kernel: h past a slot's rank is never read (it may be NaN)."""
    num_tokens, n_out = out.shape
    num_slices = len(slice_offsets) - 1
    row_slots = _row_slots(seg_indptr, seg_slots, num_tokens, max_seg_len)
    for slot, rank, rows in _slot_groups(row_slots, slot_ranks):
        hs = h[rows].view(-1, num_slices, max_rank)[:, :, :rank].float()  # [n, num_slices, rank]
        delta = torch.empty((rows.shape[0], n_out), dtype=torch.float32, device=out.device)
        for j in range(num_slices):
            lo, hi = slice_offsets[j], slice_offsets[j + 1]
            delta[:, lo:hi] = hs[:, j] @ weights[slot, lo:hi, :rank].float().T
        out[rows] = (out[rows].float() + delta).to(out.dtype)


# -------------------------------------------------------------------------------- checks


def _check_segments(device: torch.device, seg_indptr: torch.Tensor, seg_slots: torch.Tensor,
                    slot_ranks: torch.Tensor, num_slots: int, max_seg_len: int) -> None:
    num_segments = seg_slots.shape[0] if seg_slots.dim() == 1 else -1
    for name, t, length in (("seg_indptr", seg_indptr, num_segments + 1), ("seg_slots", seg_slots, num_segments),
                            ("slot_ranks", slot_ranks, num_slots)):
        if t.dtype != torch.int32 or t.dim() != 1 or t.shape[0] != length or t.device != device:
            raise ValueError(f"{name} must be int32 [{length}] on {device}, got {t.dtype} "
                             f"{tuple(t.shape)} on {t.device}")
    if not isinstance(max_seg_len, int) or max_seg_len < 0:
        raise ValueError(f"max_seg_len must be a host int >= 0, got {max_seg_len!r}")


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


def _check_shrink(x: torch.Tensor, weights: torch.Tensor, seg_indptr: torch.Tensor, seg_slots: torch.Tensor,
                  slot_ranks: torch.Tensor, num_slices: int, max_rank: int, max_seg_len: int) -> None:
    if num_slices < 1 or max_rank < 1:
        raise ValueError(f"num_slices and max_rank must be >= 1, got {num_slices}, {max_rank}")
    _check_matrix("x", x, (-1, -1), None, x.device)
    _check_matrix("weights", weights, (-1, num_slices * max_rank, x.shape[1]), x.dtype, x.device)
    _check_segments(x.device, seg_indptr, seg_slots, slot_ranks, weights.shape[0], max_seg_len)


def _check_expand(h: torch.Tensor, weights: torch.Tensor, out: torch.Tensor, seg_indptr: torch.Tensor,
                  seg_slots: torch.Tensor, slot_ranks: torch.Tensor, slice_offsets: tuple[int, ...],
                  max_rank: int, max_seg_len: int) -> None:
    num_slices = len(slice_offsets) - 1
    if not 1 <= num_slices <= MAX_SLICES or max_rank < 1:
        raise ValueError(f"need 1..{MAX_SLICES} slices and max_rank >= 1, got slice_offsets={slice_offsets}, "
                         f"max_rank={max_rank}")
    _check_matrix("out", out, (-1, -1), None, h.device)
    num_tokens, n_out = out.shape
    if slice_offsets[0] != 0 or slice_offsets[-1] != n_out or any(
            lo > hi for lo, hi in zip(slice_offsets[:-1], slice_offsets[1:])):
        raise ValueError(f"slice_offsets must rise from 0 to N_out={n_out}, got {slice_offsets}")
    _check_matrix("h", h, (num_tokens, num_slices * max_rank), None, h.device)
    _check_matrix("weights", weights, (-1, n_out, max_rank), h.dtype, h.device)
    _check_segments(h.device, seg_indptr, seg_slots, slot_ranks, weights.shape[0], max_seg_len)
