"""What every transport shares: the engine-facing protocol, send statistics, the error.

A transport has a trainer side with `send(named_tensors) -> SendStats` and an engine side
that yields (name, tensor) pairs for `engine.update_weights`. Nothing here moves bytes.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch


class WeightSyncError(RuntimeError):
    """A transfer failed: a peer is missing or dead, timed out, or spoke out of protocol."""


class SupportsUpdateWeights(Protocol):
    """The engine as this package sees it: one atomic, validating update call."""

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, full: bool = False) -> int: ...


class WeightSender(Protocol):
    """Trainer side of a transport: one call per training step."""

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> SendStats: ...


@dataclass(frozen=True)
class SendStats:
    num_tensors: int
    num_buckets: int  # 0 for transports that do not bucket (in-process)
    total_bytes: int  # tensor bytes, padding excluded
    seconds: float
    engine_version: int | None = None  # when the transport hears back from the engine


class StreamCounter:
    """Counts tensors and bytes as a stream is consumed, for SendStats."""

    def __init__(self) -> None:
        self.num_tensors = 0
        self.total_bytes = 0
        self.started = time.perf_counter()

    def wrap(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in named_tensors:
            self.num_tensors += 1
            if isinstance(tensor, torch.Tensor):  # anything else is refused, by name, where it is consumed
                self.total_bytes += tensor.numel() * tensor.element_size()
            yield name, tensor

    def stats(self, num_buckets: int, engine_version: int | None = None) -> SendStats:
        return SendStats(
            num_tensors=self.num_tensors,
            num_buckets=num_buckets,
            total_bytes=self.total_bytes,
            seconds=time.perf_counter() - self.started,
            engine_version=engine_version,
        )
