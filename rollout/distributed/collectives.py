"""Collectives over the default group for what is not a fixed-shape tensor: variable-length
byte buffers (gather, broadcast) and small lists of numbers. Bytes, not pickled objects:
what crosses is packed by its owner (rollout/wire.py for outputs).

Every rank of the group must call each function, in the same order.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from rollout.distributed.group import DistContext


def gather_bytes(buf: torch.Tensor, ctx: DistContext, dst: int = 0) -> list[torch.Tensor] | None:
    """Gather one variable-length uint8 buffer per rank of the default group onto `dst`.
    Two collectives: the sizes (everyone needs the max, to pad), then the padded buffers."""
    device = ctx.comm_device
    size = torch.tensor([buf.numel()], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(ctx.world_size)]
    dist.all_gather(sizes, size)
    lengths = [int(s.item()) for s in sizes]
    padded = torch.zeros(max(lengths), dtype=torch.uint8, device=device)
    padded[: buf.numel()] = buf.to(device)
    chunks = [torch.empty_like(padded) for _ in range(ctx.world_size)] if ctx.rank == dst else None
    dist.gather(padded, chunks, dst=dst)
    if chunks is None:
        return None
    return [chunk[:n].cpu() for chunk, n in zip(chunks, lengths)]


def broadcast_bytes(buf: torch.Tensor | None, ctx: DistContext, src: int, group: Any = None) -> torch.Tensor:
    """Broadcast a uint8 buffer from global rank `src` to the ranks of `group`."""
    device = ctx.comm_device
    size = torch.tensor([buf.numel() if buf is not None else 0], dtype=torch.int64, device=device)
    dist.broadcast(size, src=src, group=group)
    data = buf.to(device) if buf is not None else torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(data, src=src, group=group)
    return data.cpu()


def broadcast_int(value: int | None, ctx: DistContext, src: int = 0) -> int:
    t = torch.tensor([value if value is not None else 0], dtype=torch.int64, device=ctx.comm_device)
    dist.broadcast(t, src=src)
    return int(t.item())


def gather_floats(values: list[float], ctx: DistContext) -> list[list[float]]:
    """all_gather a fixed-length float list from every rank (timings, counters)."""
    t = torch.tensor(values, dtype=torch.float64, device=ctx.comm_device)
    out = [torch.empty_like(t) for _ in range(ctx.world_size)]
    dist.all_gather(out, t)
    return [o.cpu().tolist() for o in out]
