"""Weight broadcast over a WeightGroup: trainer (rank 0) -> every engine rank.

Wire protocol, per bucket, three broadcasts from rank 0:
  1. control: int64[3] = [MAGIC, header_nbytes, payload_nbytes]
  2. header:  uint8[header_nbytes], the bucket's BucketMeta as JSON
  3. payload: uint8[payload_nbytes], the bucket buffer
and after the last bucket one control tensor with header_nbytes = END (payload field =
number of buckets sent) or ABORT (the trainer's input failed; the group stays in step).

Overlap comes from the collectives being asynchronous: bucket k's broadcasts are issued
and the sender goes on to pack bucket k+1 (pulling, for FSDP, the next gathered
parameters) while they run on gloo's threads / NCCL's stream. At most `max_in_flight`
buckets are alive at once, which bounds memory to about that many buckets.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from weightsync.bucket import DEFAULT_BUCKET_BYTES, BucketMeta, pack_bucket, plan_buckets, unpack_bucket
from weightsync.transports.base import SendStats, StreamCounter, WeightSyncError
from weightsync.transports.group import WeightGroup

MAGIC = 0x57535943  # "WSYC": catches two peers speaking different protocols
END = 0
ABORT = -1


@dataclass
class _InFlight:
    what: str
    works: list[Any]
    tensors: list[torch.Tensor]  # kept alive until the collectives finish


class BroadcastSender:
    """Trainer side (rank 0 of `group`): `send()` once per weight update."""

    def __init__(self, group: WeightGroup, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES, max_in_flight: int = 2) -> None:
        if not group.is_trainer:
            raise ValueError(f"BroadcastSender runs on the trainer (rank 0), not on rank {group.rank}")
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        self.group = group
        self.bucket_bytes = bucket_bytes
        self.max_in_flight = max_in_flight

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> SendStats:
        group = self.group
        group.check_usable()
        counter = StreamCounter()
        in_flight: deque[_InFlight] = deque()
        num_buckets = 0
        buckets = plan_buckets(counter.wrap(named_tensors), self.bucket_bytes)
        while True:
            try:
                planned = next(buckets, None)
                if planned is None:
                    break
                meta, tensors = planned
                payload = pack_bucket(meta, tensors, device=group.device)
                del tensors, planned
                header = _bytes_to_tensor(meta.to_json(), group.device)
            except Exception:
                # The trainer's own side failed (a gather, a bad tensor, out of memory);
                # nothing of this bucket went out, so the engines can be told and the
                # group stays in step.
                self._drain(in_flight)
                self._issue_control(in_flight, ABORT, num_buckets, "abort marker")
                self._drain(in_flight)
                raise
            self._issue_control(in_flight, header.numel(), payload.numel(), f"bucket {meta.index}")
            in_flight[-1].works += [self._broadcast(header, meta.index), self._broadcast(payload, meta.index)]
            in_flight[-1].tensors += [header, payload]
            num_buckets += 1
            while len(in_flight) >= self.max_in_flight:
                self._wait(in_flight.popleft())
        self._issue_control(in_flight, END, num_buckets, "end marker")
        self._drain(in_flight)
        return counter.stats(num_buckets)

    def _issue_control(self, in_flight: deque[_InFlight], header_nbytes: int, payload_field: int, what: str) -> None:
        control = torch.tensor([MAGIC, header_nbytes, payload_field], dtype=torch.int64, device=self.group.device)
        in_flight.append(_InFlight(what, [self._broadcast(control, what)], [control]))

    def _broadcast(self, tensor: torch.Tensor, what: object) -> Any:
        try:
            return self.group.broadcast(tensor)
        except WeightSyncError:
            raise
        except Exception as error:
            self.group.broken_reason = f"sending {what} failed"
            raise WeightSyncError(f"weight broadcast on {self.group.address}: sending {what} failed: {error}") from error

    def _wait(self, item: _InFlight) -> None:
        try:
            for work in item.works:
                work.wait()
            if self.group.device.type == "cuda":
                # NCCL's wait() only orders streams; block the host too so that at most
                # max_in_flight buckets are ever allocated.
                torch.cuda.current_stream(self.group.device).synchronize()
        except Exception as error:
            self.group.broken_reason = f"sending {item.what} failed"
            raise WeightSyncError(
                f"weight broadcast on {self.group.address}: sending {item.what} failed "
                f"(an engine rank died or timed out after {self.group.timeout_s}s?): {error}"
            ) from error

    def _drain(self, in_flight: deque[_InFlight]) -> None:
        while in_flight:
            self._wait(in_flight.popleft())


def receive(group: WeightGroup, device: torch.device | str | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Engine side: yield (name, tensor) for one weight update, in the trainer's order.

    Tensors are views into per-bucket buffers on `device` (default: the group's device;
    another device costs one copy per bucket). Stopping the iteration half-way leaves the
    group out of step (it is then marked broken): consume it to the end.
    """
    if group.is_trainer:
        raise ValueError("receive() runs on engine ranks; rank 0 is the trainer (use BroadcastSender)")
    group.check_usable()
    target = torch.device(device) if device is not None else group.device
    index = 0
    finished = False
    try:
        while True:
            control = _receive_tensor(group, torch.empty(3, dtype=torch.int64, device=group.device), index, "control")
            magic, header_nbytes, payload_field = control.tolist()
            if magic != MAGIC:
                raise WeightSyncError(f"weight broadcast on {group.address}: bad magic {magic:#x}; is the trainer speaking another protocol?")
            if header_nbytes == END:
                if payload_field != index:
                    raise WeightSyncError(f"weight broadcast: trainer sent {payload_field} buckets, received {index}")
                finished = True
                return
            if header_nbytes == ABORT:
                finished = True
                raise WeightSyncError(
                    f"weight broadcast on {group.address}: the trainer aborted the transfer after {index} buckets "
                    "(its input failed); this update is incomplete and must not be applied"
                )
            header = _receive_tensor(group, torch.empty(header_nbytes, dtype=torch.uint8, device=group.device), index, "header")
            meta = BucketMeta.from_json(header.cpu().numpy().tobytes())
            if meta.index != index or meta.total_bytes != payload_field:
                raise WeightSyncError(
                    f"weight broadcast: expected bucket {index} of {payload_field} bytes, "
                    f"header says bucket {meta.index} of {meta.total_bytes}"
                )
            payload = torch.empty(payload_field, dtype=torch.uint8, device=group.device)
            payload = _receive_tensor(group, payload, index, "payload")
            if payload.device != target:
                payload = payload.to(target)
            yield from unpack_bucket(meta, payload)
            index += 1
    finally:
        if not finished:
            group.broken_reason = group.broken_reason or f"receiving bucket {index} did not finish"


def _receive_tensor(group: WeightGroup, tensor: torch.Tensor, index: int, what: str) -> torch.Tensor:
    try:
        group.broadcast(tensor).wait()
    except WeightSyncError:
        raise
    except Exception as error:
        raise WeightSyncError(
            f"weight broadcast on {group.address}: rank {group.rank} receiving the {what} of bucket {index} failed "
            f"(trainer died, or sent nothing for {group.timeout_s}s): {error}"
        ) from error
    return tensor


def _bytes_to_tensor(data: bytes, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(data, dtype=np.uint8).copy()).to(device)
