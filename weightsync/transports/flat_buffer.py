"""Flat mode's trainer side: a whole update packed into persistent uint8 buffers.

`CudaIpcSender(flat=True)` keeps one `FlatPack` across sends. The first send plans a
layout (each tensor at a 256-byte aligned offset, in stream order, a new buffer whenever
the next tensor would cross `max_buffer_bytes`), allocates the buffers and copies the
tensors in. A later send whose stream has the same names, dtypes and shapes in the same
order copies each tensor into the same place, so the buffers, and the CUDA IPC handles
exported for them, stay valid: nothing is allocated or exported again. A stream that
differs gets a new pack; what was already copied into the old one is carried over.

Memory: the pack is one more copy of the model, kept between sends. A first send (or a
send after a layout change) must know every size before it can allocate, so it holds a
reference to each tensor of the stream until it has seen them all; free for live
parameters, one more model copy for a stream that materializes tensors (FSDP's
full_tensor()). Steady-state sends copy each tensor as it arrives and hold none.

No GPU and no sockets here: the tests run it on CPU tensors.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from weightsync.bucket import BucketEntry, BucketMeta, _align_up, _check_named_tensor, unpack_bucket
from weightsync.dtypes import dtype_to_name

TensorSpec = tuple[str, torch.dtype, tuple[int, ...]]


@dataclass(frozen=True)
class _Slot:
    name: str
    dtype: torch.dtype
    shape: torch.Size
    view: torch.Tensor  # where the tensor goes in its buffer


class FlatPack:
    """Buffers holding one update's tensors, their headers, and a destination view per tensor."""

    def __init__(self, specs: Sequence[TensorSpec], device: torch.device, max_buffer_bytes: int | None) -> None:
        self.device = device
        self.metas: list[BucketMeta] = plan_flat(specs, max_buffer_bytes)
        self.buffers: list[torch.Tensor] = [
            torch.empty(max(meta.total_bytes, 1), dtype=torch.uint8, device=device) for meta in self.metas
        ]
        self.slots: list[_Slot] = [
            _Slot(name, view.dtype, view.shape, view)
            for meta, buffer in zip(self.metas, self.buffers)
            for name, view in unpack_bucket(meta, buffer)
        ]

    @property
    def nbytes(self) -> int:
        return sum(buffer.numel() for buffer in self.buffers)

    def exported_views(self) -> list[torch.Tensor]:
        """Each buffer cut to its header's size: what a handle is exported for."""
        return [buffer[: meta.total_bytes] for meta, buffer in zip(self.metas, self.buffers)]


def plan_flat(specs: Sequence[TensorSpec], max_buffer_bytes: int | None = None) -> list[BucketMeta]:
    """Headers for the buffers holding `specs` in order; one buffer unless max_buffer_bytes splits them.

    A tensor larger than max_buffer_bytes gets a buffer of its own (marked oversized).
    """
    if max_buffer_bytes is not None and (
        isinstance(max_buffer_bytes, bool) or not isinstance(max_buffer_bytes, int) or max_buffer_bytes <= 0
    ):
        raise ValueError(f"max_buffer_bytes must be a positive int or None, got {max_buffer_bytes!r}")
    groups: list[tuple[list[BucketEntry], int]] = []
    entries: list[BucketEntry] = []
    end = 0
    for name, dtype, shape in specs:
        nbytes = math.prod(shape) * dtype.itemsize
        offset = _align_up(end)
        if entries and max_buffer_bytes is not None and offset + nbytes > max_buffer_bytes:
            groups.append((entries, end))
            entries, offset = [], 0
        entries.append(BucketEntry(name, dtype_to_name(dtype), tuple(shape), offset, nbytes))
        end = offset + nbytes
    if entries:
        groups.append((entries, end))
    return [
        BucketMeta(
            index,
            tuple(group),
            total,
            is_last=index == len(groups) - 1,
            oversized=max_buffer_bytes is not None and total > max_buffer_bytes,
        )
        for index, (group, total) in enumerate(groups)
    ]


def pack_flat(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    current: FlatPack | None,
    *,
    device: torch.device,
    max_buffer_bytes: int | None = None,
) -> FlatPack:
    """Copy the stream into `current` and return it if the layout is unchanged; otherwise
    return a new pack holding the stream (`current` is left to the caller to drop).

    The copies are queued on the current stream; the caller synchronizes before another
    process reads the buffers. `current` must not be in use by anyone else during the call.
    """
    if current is not None and current.device != device:
        current = None
    slots = current.slots if current is not None else []
    packed = 0  # tensors copied into `current` in place
    rest: list[tuple[str, torch.Tensor]] | None = None if current is not None else []
    with torch.no_grad():
        for name, tensor in named_tensors:
            _check_named_tensor(name, tensor)
            if rest is None:
                if packed < len(slots):
                    slot = slots[packed]
                    if slot.name == name and slot.dtype == tensor.dtype and slot.shape == tensor.shape:
                        slot.view.copy_(tensor)
                        packed += 1
                        continue
                rest = []  # the layout changed here: keep the remaining tensors until sizes are known
            rest.append((name, tensor))
        if rest is None and packed == len(slots):
            assert current is not None
            return current
        rest = rest or []
        kept = slots[:packed]
        specs = [(slot.name, slot.dtype, tuple(slot.shape)) for slot in kept]
        specs += [(name, tensor.dtype, tuple(tensor.shape)) for name, tensor in rest]
        fresh = FlatPack(specs, device, max_buffer_bytes)
        for old, new in zip(kept, fresh.slots):
            new.view.copy_(old.view)
        for (_, tensor), new in zip(rest, fresh.slots[packed:]):
            new.view.copy_(tensor)
    return fresh
