"""The GRPO loop's view of data parallelism: which rank am I, how many are we, and the four
collectives the loop needs (gather a vector, sum / max a number, wrap the model in DDP).

A single process is a world of one: every collective is the identity, the model is not
wrapped and phases are plain blocks, so the colocated run and the torchrun run go through
the same step code. Under torchrun the default group comes from rollout.distributed
(timeouts on every collective; a failing rank reports which peer is missing and in which
phase, then exits 1 instead of hanging). Nothing here pickles.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from rollout.distributed.group import DistContext, init_distributed, shutdown
from rollout.distributed.phases import phase


class World:
    def __init__(self, ctx: DistContext | None = None) -> None:
        self.ctx = ctx
        self.rank = ctx.rank if ctx else 0
        self.size = ctx.world_size if ctx else 1
        self.comm_device = ctx.comm_device if ctx else torch.device("cpu")

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """A named phase of the step: under torchrun, an error inside it (a peer gone, a
        collective timed out) becomes one report naming the peers' phases, and exit 1."""
        if self.ctx is None:
            yield
            return
        with phase(self.ctx, name):
            yield

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1

    def gather(self, values: torch.Tensor) -> torch.Tensor:
        """Concatenate a 1-D float tensor of any length from every rank, in rank order (float64)."""
        values = values.detach().reshape(-1).to(torch.float64)
        if not self.distributed:
            return values
        size = torch.tensor([values.numel()], dtype=torch.int64, device=self.comm_device)
        sizes = [torch.zeros_like(size) for _ in range(self.size)]
        dist.all_gather(sizes, size)
        lengths = [int(s.item()) for s in sizes]
        padded = torch.zeros(max(max(lengths), 1), dtype=torch.float64, device=self.comm_device)
        padded[: values.numel()] = values.to(self.comm_device)
        chunks = [torch.empty_like(padded) for _ in range(self.size)]
        dist.all_gather(chunks, padded)
        return torch.cat([c[:n].cpu() for c, n in zip(chunks, lengths)])

    def sum(self, value: float) -> float:
        return self._reduce(value, dist.ReduceOp.SUM)

    def max(self, value: float) -> float:
        return self._reduce(value, dist.ReduceOp.MAX)

    def mean(self, value: float) -> float:
        return self.sum(value) / self.size

    def _reduce(self, value: float, op: dist.ReduceOp) -> float:
        if not self.distributed:
            return float(value)
        t = torch.tensor([float(value)], dtype=torch.float64, device=self.comm_device)
        dist.all_reduce(t, op=op)
        return float(t.item())

    def wrap(self, model: nn.Module) -> nn.Module:
        """DDP over the default group when there is more than one rank (gradients averaged in
        backward, so every replica stays identical); the model itself otherwise."""
        if not self.distributed:
            return model
        device = next(model.parameters()).device
        return nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()


def init_world(backend: str = "gloo", device: str = "cpu", timeout_s: float = 300.0) -> World:
    """A world from torchrun's environment (RANK / WORLD_SIZE / MASTER_*), or a world of one
    (no process group at all) in a plain process."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return World()
    return World(init_distributed(backend, device, timeout_s, lambda rank: f"GRPO trainer+engine rank {rank}"))


def close_world(world: World) -> None:
    if world.ctx is not None:
        shutdown(world.ctx)
