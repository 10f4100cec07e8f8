"""The default process group, set up from torchrun's environment with a timeout on every
collective, and this process's place in it (DistContext).

With gloo a collective whose peer died or hangs raises after `timeout_s` (or at once, on a
closed connection). With NCCL we set TORCH_NCCL_BLOCKING_WAIT=1 before the group exists,
so a timed-out collective raises in the calling thread too (instead of the watchdog
aborting the process before we can say which peer was missing). Either way the caller's
`phase()` turns the error into one clear report (see phases.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from rollout.distributed.phases import PhaseTracker, phase
from rollout.distributed.ports import free_port


@dataclass(frozen=True)
class DistContext:
    """This process's place in the default group, and where collectives' tensors live."""

    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device  # engine / model device (cuda:LOCAL_RANK or cpu)
    comm_device: torch.device  # where tensors must be to cross the default group
    timeout_s: float
    tracker: PhaseTracker


def init_distributed(backend: str, device: str, timeout_s: float, role_of: Callable[[int], str]) -> DistContext:
    """Default group from torchrun's environment (or a world of one without torchrun).

    The rendezvous is done here rather than inside init_process_group so that we keep the
    store for the phase log; the group itself gets a "default_pg" prefix exactly as
    init_process_group would give it.
    """
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"--backend must be gloo or nccl, got {backend!r}")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"--device must be cpu or cuda, got {device!r}")
    if backend == "nccl" and device != "cuda":
        raise ValueError("--backend nccl moves CUDA tensors: use it with --device cuda")
    if not timeout_s > 0:
        raise ValueError(f"--timeout-s must be > 0, got {timeout_s}")
    if "RANK" not in os.environ:  # plain `python launch_x.py`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda: this process sees no CUDA device")
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    if backend == "nccl":
        # A timed-out NCCL collective then raises in our thread (see the module docstring).
        os.environ.setdefault("TORCH_NCCL_BLOCKING_WAIT", "1")
    timeout = timedelta(seconds=timeout_s)
    store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
    store.set_timeout(timeout)
    dist.init_process_group(
        backend, store=dist.PrefixStore("default_pg", store), rank=rank, world_size=world_size, timeout=timeout,
        device_id=dev if backend == "nccl" else None,
    )
    tracker = PhaseTracker(dist.PrefixStore("launcher", store), rank, world_size, role_of)
    comm_device = dev if backend == "nccl" else torch.device("cpu")
    return DistContext(rank, world_size, local_rank, backend, dev, comm_device, timeout_s, tracker)


def shutdown(ctx: DistContext) -> None:
    with phase(ctx, "shutdown barrier"):
        dist.barrier()
    dist.destroy_process_group()
