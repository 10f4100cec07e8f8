"""A private torch.distributed group for weight broadcast: trainer rank 0 + engine ranks.

The trainer often runs under torchrun with its own default process group (FSDP, DDP).
This group must not touch that: it is built from its own TCPStore and a process-group
object constructed directly (`ProcessGroupGloo(...)` / `ProcessGroupNCCL(...)`), never via
`init_process_group` / `new_group`, so nothing is registered in torch's global state and
the two groups can even live side by side in one process.

Ranks: 0 is the trainer (the only sender, and the TCPStore host); engine processes take
ranks `rank_offset .. rank_offset + n - 1` (rank_offset >= 1; with one trainer and one
engine of n ranks, rank_offset = 1 and world_size = 1 + n).

Joining is bounded by `join_timeout_s` end to end: a peer that never shows up gives a
`WeightSyncError` naming who is missing, not a hang. Each collective is bounded by
`timeout_s` (gloo raises; NCCL's watchdog aborts the communicator, which by default also
takes the process down: that is NCCL's policy, not ours).
"""

from __future__ import annotations

import logging
import socket
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from weightsync.transports.base import WeightSyncError

logger = logging.getLogger(__name__)

TRAINER_RANK = 0
_JOIN_POLL_S = 0.05


@dataclass
class WeightGroup:
    """An open weight-sync group. `device` is where tensors must live to cross it."""

    backend: str
    rank: int
    world_size: int
    device: torch.device
    timeout_s: float
    address: str  # "host:port" of the store, for error messages
    _process_group: Any = field(repr=False)
    _store: Any = field(repr=False)
    # Set when a transfer stopped half-way: the byte stream is out of step, so the only
    # safe thing is to close and reopen.
    broken_reason: str | None = None
    closed: bool = False

    @property
    def is_trainer(self) -> bool:
        return self.rank == TRAINER_RANK

    def broadcast(self, tensor: torch.Tensor) -> Any:
        """Start a broadcast from the trainer; returns the torch Work to wait on."""
        self.check_usable()
        options = dist.BroadcastOptions()
        options.rootRank = TRAINER_RANK
        options.rootTensor = 0
        return self._process_group.broadcast([tensor], options)

    def check_usable(self) -> None:
        if self.closed:
            raise WeightSyncError(f"weight-sync group at {self.address} is closed")
        if self.broken_reason is not None:
            raise WeightSyncError(
                f"weight-sync group at {self.address} is out of step after an interrupted transfer "
                f"({self.broken_reason}); close_group() and open_group() again on every rank"
            )


def open_group(
    master_addr: str,
    master_port: int,
    rank: int,
    world_size: int,
    *,
    backend: str = "gloo",
    timeout_s: float = 300.0,
    join_timeout_s: float | None = None,
    device: torch.device | str | None = None,
) -> WeightGroup:
    """Join (rank 0: host) a weight-sync group; every rank calls this with the same address.

    `timeout_s` bounds each transfer step (a peer silent that long is taken as dead);
    `join_timeout_s` (default: timeout_s) bounds waiting for all ranks to show up, which
    can take much longer, e.g. while the trainer loads its model. `device` only matters
    for NCCL (default: the current CUDA device); gloo moves CPU tensors.
    """
    join_timeout_s = timeout_s if join_timeout_s is None else join_timeout_s
    _validate_args(master_addr, master_port, rank, world_size, backend, timeout_s)
    if not join_timeout_s > 0:
        raise ValueError(f"join_timeout_s must be > 0, got {join_timeout_s!r}")
    address = f"{master_addr}:{master_port}"
    deadline = time.monotonic() + join_timeout_s
    store = _connect_store(master_addr, master_port, rank, world_size, deadline, address)
    _rendezvous(store, rank, world_size, deadline, address)
    timeout = timedelta(seconds=timeout_s)
    try:
        if backend == "gloo":
            group_device = torch.device("cpu")
            process_group = _make_gloo(store, rank, world_size, timeout, master_addr)
        else:
            group_device = _cuda_device(device)
            process_group = _make_nccl(store, rank, world_size, timeout, group_device)
    except WeightSyncError:
        raise
    except Exception as error:
        raise WeightSyncError(
            f"rank {rank}: building the {backend} weight-sync group at {address} failed: {error}"
        ) from error
    group = WeightGroup(backend, rank, world_size, group_device, timeout_s, address, process_group, store)
    _first_broadcast(group)
    logger.info("weight-sync group %s: rank %d/%d joined (%s)", address, rank, world_size, backend)
    return group


def close_group(group: WeightGroup) -> None:
    """Release the group's connections; safe to call twice. Every rank should call it."""
    if group.closed:
        return
    group.closed = True
    try:
        group._process_group.shutdown()
    except Exception as error:  # a dead peer can make shutdown complain; we are leaving anyway
        logger.warning("weight-sync group %s: shutdown raised %s", group.address, error)
    group._process_group = None
    group._store = None


def _validate_args(
    master_addr: str, master_port: int, rank: int, world_size: int, backend: str, timeout_s: float
) -> None:
    if not isinstance(master_addr, str) or not master_addr:
        raise ValueError(f"master_addr must be a host name or address, got {master_addr!r}")
    if not isinstance(master_port, int) or not 0 < master_port < 65536:
        raise ValueError(f"master_port must be in 1..65535, got {master_port!r}")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size!r}")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in 0..{world_size - 1} (0 = trainer), got {rank!r}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")


def _remaining(deadline: float) -> float:
    return max(deadline - time.monotonic(), 0.0)


def _connect_store(
    master_addr: str, master_port: int, rank: int, world_size: int, deadline: float, address: str
) -> dist.Store:
    is_master = rank == TRAINER_RANK
    if not is_master:
        # TCPStore's own client retries can outlast its timeout (about twice over), so wait
        # for the trainer's port ourselves and only then connect.
        _wait_for_listener(master_addr, master_port, deadline, address, rank)
    try:
        store = dist.TCPStore(
            master_addr,
            master_port,
            world_size,
            is_master=is_master,
            timeout=timedelta(seconds=max(_remaining(deadline), 1.0)),
            wait_for_workers=False,  # we wait in _rendezvous, against our own deadline
        )
    except Exception as error:
        role = "host" if is_master else "reach"
        raise WeightSyncError(f"rank {rank}: could not {role} the weight-sync store at {address}: {error}") from error
    return dist.PrefixStore("weightsync", store)


def _wait_for_listener(host: str, port: int, deadline: float, address: str, rank: int) -> None:
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(min(_remaining(deadline), 1.0), 0.05)):
                return
        except OSError as error:
            if _remaining(deadline) <= 0:
                raise WeightSyncError(
                    f"rank {rank}: no trainer (rank 0) listening at {address} for the weight-sync group "
                    f"({error}); start the trainer side with the same master_addr/master_port"
                ) from None
            time.sleep(min(_JOIN_POLL_S * 4, _remaining(deadline)))


def _rendezvous(store: dist.Store, rank: int, world_size: int, deadline: float, address: str) -> None:
    if store.add(f"rank/{rank}", 1) != 1:
        raise WeightSyncError(f"rank {rank} of the weight-sync group at {address} is already taken by another process")
    joined = store.add("joined", 1)
    while joined < world_size:
        if _remaining(deadline) <= 0:
            missing = [r for r in range(world_size) if store.add(f"rank/{r}", 0) == 0]
            raise WeightSyncError(
                f"rank {rank}: only {joined}/{world_size} ranks joined the weight-sync group at {address} "
                f"before the timeout; missing ranks {missing} (rank 0 = trainer, engines from rank_offset)"
            )
        time.sleep(_JOIN_POLL_S)
        joined = store.add("joined", 0)


def _first_broadcast(group: WeightGroup) -> None:
    # Connections are made lazily on the first collective; make them here, so that the
    # first weight update is not slower than the rest and a broken path fails now.
    probe = torch.full((1,), group.rank, dtype=torch.int64, device=group.device)
    try:
        group.broadcast(probe).wait()
        ok = int(probe.item()) == TRAINER_RANK
    except Exception as error:
        close_group(group)
        raise WeightSyncError(f"rank {group.rank}: first broadcast on the weight-sync group at {group.address} failed: {error}") from error
    if not ok:
        close_group(group)
        raise WeightSyncError(f"rank {group.rank}: the weight-sync group at {group.address} delivered a wrong probe value")


def _is_loopback(host: str) -> bool:
    try:
        return socket.gethostbyname(host).startswith("127.")
    except OSError:
        return False


def _make_gloo(store: dist.Store, rank: int, world_size: int, timeout: timedelta, master_addr: str) -> Any:
    if not _is_loopback(master_addr):
        # torch's own choice of interface, honouring GLOO_SOCKET_IFNAME.
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    # Everyone is on this host; the default device resolves the hostname, which can point
    # at an interface a container does not route.
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    options._threads = 2
    return dist.ProcessGroupGloo(store, rank, world_size, options)


def _cuda_device(device: torch.device | str | None) -> torch.device:
    if not torch.cuda.is_available():
        raise WeightSyncError("backend='nccl' needs CUDA, and this process sees no CUDA device; use backend='gloo'")
    if device is None:
        return torch.device("cuda", torch.cuda.current_device())
    resolved = torch.device(device)
    if resolved.type != "cuda":
        raise ValueError(f"backend='nccl' moves CUDA tensors; device must be a CUDA device, got {resolved}")
    return torch.device("cuda", resolved.index if resolved.index is not None else torch.cuda.current_device())


def _make_nccl(store: dist.Store, rank: int, world_size: int, timeout: timedelta, device: torch.device) -> Any:
    if not dist.is_nccl_available():
        raise WeightSyncError("backend='nccl' requested but this torch build has no NCCL")
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    process_group = dist.ProcessGroupNCCL(store, rank, world_size, options)
    # Build the communicator now, so a broken NCCL setup fails in open_group rather than
    # in the middle of the first weight update.
    process_group.eager_connect_single_device(device)
    return process_group
