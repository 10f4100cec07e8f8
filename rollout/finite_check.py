"""FiniteCheck: which tensors of a weight update hold a NaN or an Inf, checked while the
update streams in, with one host sync at the end.

A weight update is validated whole before anything is written, and its NaN/Inf check reads
every byte (16 GB for an 8B model). Checking only once the stream is complete puts that read
after the trainer's walk of its model (~3 ms for 8B); `add()` launches the check of each
~1 GB of tensors as they arrive, so the device reads while the host walks on. CUDA tensors go
through one Triton launch per chunk (rollout/kernels/finite.py); the rest through torch's
multi-tensor inf-norm, which is also that kernel's reference. No sync until `bad()`.
"""

from __future__ import annotations

from typing import Any

import torch

from rollout import kernels

CHUNK_BYTES = 1 << 30  # launch a chunk's check once this much of one (device, dtype) is pending


class FiniteCheck:
    def __init__(self, chunk_bytes: int | None = CHUNK_BYTES) -> None:
        self.chunk_bytes = chunk_bytes  # None: one launch per group, at bad()
        self.count = 0  # tensors added
        self._added: dict[int, int] = {}  # id(tensor) -> its index (the caller keeps the tensors alive)
        self._pending: dict[tuple, tuple[list[int], list[torch.Tensor], list[int]]] = {}  # group -> (ids, tensors, [bytes])
        self._flags: dict[Any, list[tuple[list[int], torch.Tensor]]] = {}  # device -> (ids, bool flags on device)

    def add(self, tensor: torch.Tensor) -> int:
        """Queue one tensor; returns its index (the order of add() calls)."""
        index, self.count = self.count, self.count + 1
        self._added[id(tensor)] = index
        ids, tensors, size = self._pending.setdefault((tensor.device, tensor.dtype), ([], [], [0]))
        ids.append(index)
        tensors.append(tensor)
        size[0] += tensor.numel() * tensor.element_size()
        if self.chunk_bytes is not None and size[0] >= self.chunk_bytes:
            self._launch((tensor.device, tensor.dtype))
        return index

    def covers(self, tensor: torch.Tensor) -> bool:
        return id(tensor) in self._added

    def index_of(self, tensor: torch.Tensor) -> int:
        return self._added[id(tensor)]

    def bad(self) -> list[int]:
        """Indices of the tensors holding a NaN or an Inf, ascending (one sync per device)."""
        for group in list(self._pending):
            self._launch(group)
        hits: list[int] = []
        for entries in self._flags.values():
            flags = torch.cat([flag for _, flag in entries]).cpu()  # the device's one sync
            ids = [i for group_ids, _ in entries for i in group_ids]
            hits += [ids[i] for i in flags.nonzero().flatten().tolist()]
        self._flags.clear()
        return sorted(hits)

    def _launch(self, group: tuple) -> None:
        ids, tensors, _ = self._pending.pop(group)
        if kernels.use_fused(tensors[0]):
            flag = kernels.finite.non_finite_flags(tensors) != 0
        else:
            # the inf-norm is max |x|: inf for an Inf, NaN for a NaN, never an overflow
            flag = ~torch.stack(torch._foreach_norm(tensors, ord=float("inf"))).isfinite()
        self._flags.setdefault(group[0], []).append((ids, flag))
