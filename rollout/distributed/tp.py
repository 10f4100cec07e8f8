"""The tensor-parallel group of an engine: which rank of how many this process is, and the
few collectives a sharded model and its weight updates need.

Every rank of a TP group runs the same engine code on the same inputs (SPMD): the same
scheduler makes the same decisions, so the ranks issue the same collectives in the same
order and never exchange step inputs. What crosses the group is tensors (activations,
logits, ok-flags) and, for errors and commands, msgpack bytes in a uint8 tensor; never
pickled objects.

Knows torch.distributed; not the model (rollout/model/parallel.py) nor the engine.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")
# torch 2.13 renamed all_gather_into_tensor (deprecated there); the GPU image has torch 2.11
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in its TP group. size 1 (SINGLE): no group, every collective
    is the identity, so the model has one code path."""

    rank: int
    size: int
    group: Any = None  # a torch.distributed ProcessGroup (None when size == 1)
    device: torch.device = torch.device("cpu")  # where the group's tensors live (cuda for NCCL)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the group, in place (row-parallel outputs, vocab-parallel embeddings)."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] on every rank -> [..., size * n], rank r's part at r * n (vocab shards of
        the logits). All ranks get the same bytes, so they sample the same tokens."""
        if self.size == 1:
            return x
        out = self.all_gather_flat(x).reshape(self.size, *x.shape)  # [size, ..., n]
        return out.movedim(0, -2).reshape(*x.shape[:-1], self.size * x.shape[-1])

    def all_gather_flat(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x`, flattened and concatenated in rank order: [size * x.numel()]."""
        out = torch.empty(self.size * x.numel(), dtype=x.dtype, device=x.device)  # 1-D: what gloo accepts
        _all_gather_flat(out, x.contiguous().reshape(-1), group=self.group)
        return out

    def min_int(self, value: int) -> int:
        """The smallest `value` over the group (a KV budget every rank can hold)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        """Bytes from TP rank 0 to every rank (a command, an error message)."""
        return self._broadcast_bytes(data, 0)

    def _broadcast_bytes(self, data: bytes | None, src: int) -> bytes:
        src_global = dist.get_global_rank(self.group, src)
        size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64, device=self.device)
        dist.broadcast(size, src=src_global, group=self.group)
        if self.rank == src:
            raw = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
            buf = raw.to(self.device)
        else:
            buf = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        dist.broadcast(buf, src=src_global, group=self.group)
        return buf.cpu().numpy().tobytes()

    def agree(self, plan: Callable[[], T], what: str) -> T:
        """Run `plan` (validation) on every rank, then agree: if any rank's plan raised, every
        rank raises a ValueError naming the first failing rank and its error, so that all
        ranks then write or none does (an update stays atomic across the group)."""
        error: Exception | None = None
        result: T | None = None
        try:
            result = plan()
        except Exception as e:  # any failure, or the other ranks would wait in the all-reduce below
            error = e
        if self.size == 1:
            if error is not None:
                raise error
            return result  # type: ignore[return-value]
        flags = torch.zeros(self.size, dtype=torch.int64, device=self.device)
        flags[self.rank] = 1 if error is not None else 0
        dist.all_reduce(flags, group=self.group)
        failed = [r for r, f in enumerate(flags.tolist()) if f]
        if not failed:
            return result  # type: ignore[return-value]
        first = failed[0]
        text = self._broadcast_bytes(str(error).encode() if self.rank == first else None, first).decode(errors="replace")
        message = f"{what} refused on every TP rank: TP rank {first} of {self.size} failed validation: {text}"
        raise ValueError(message) from error


SINGLE = TensorParallel(0, 1)


def check_tp_world(size: int) -> tuple[int, int]:
    """(world rank, world size) of a default group that TP groups of `size` can tile."""
    if not dist.is_initialized():
        raise ValueError(f"EngineConfig.tensor_parallel_size={size} needs a process group: run every rank under "
                         "torchrun (each builds Engine(config)), or use rollout.distributed.tp_engine.TPEngine(config), "
                         "which spawns its TP workers from this process")
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % size:
        raise ValueError(f"EngineConfig.tensor_parallel_size={size} does not divide the world size {world} "
                         "(torchrun --nproc-per-node = data-parallel engines x tensor_parallel_size)")
    return rank, world


def tp_from_world(size: int, device: torch.device) -> TensorParallel:
    """TP groups of `size` consecutive ranks of the default group (ranks 0..size-1 are
    engine 0, the next size ranks engine 1, ...: DP x TP). Every rank of the world must
    call this (new_group is collective), with the same size."""
    if size == 1:
        return SINGLE
    rank, world = check_tp_world(size)
    mine = None
    with nonblocking_nccl():
        for first in range(0, world, size):  # every rank creates every group, in the same order
            group = dist.new_group(list(range(first, first + size)))
            if first <= rank < first + size:
                mine = group
    comm = device if dist.get_backend(mine) == "nccl" else torch.device("cpu")
    return TensorParallel(rank % size, size, mine, comm)


@contextmanager
def nonblocking_nccl() -> Iterator[None]:
    """NCCL groups made inside are asynchronous whatever TORCH_NCCL_BLOCKING_WAIT says (the
    launchers set it for their default group, rollout/distributed/group.py): a TP group's
    collectives run in every layer and inside decode CUDA graphs, where a blocking wait
    would stall the host per collective, and would query events during graph capture,
    which CUDA forbids. ProcessGroupNCCL reads the variable when it is built."""
    before = os.environ.get("TORCH_NCCL_BLOCKING_WAIT")
    os.environ["TORCH_NCCL_BLOCKING_WAIT"] = "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ["TORCH_NCCL_BLOCKING_WAIT"]
        else:
            os.environ["TORCH_NCCL_BLOCKING_WAIT"] = before

