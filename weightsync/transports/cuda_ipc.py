"""CUDA IPC transport: trainer and engine are different processes on the same GPU.

Per bucket, the trainer packs the bytes into one of two reusable GPU buffers, sends a
CUDA IPC handle for it (msgpack over a ZMQ REQ socket, see ipc_wire.py), and the engine
maps the buffer, copies it into memory of its own, and replies. The two buffers alternate,
so the trainer packs bucket k+1 while the engine copies bucket k; a buffer is reused only
after the engine has acknowledged the copy out of it.

Why the engine copies instead of reading in place: `update_weights` validates the whole
update before applying any of it, so it holds every tensor of the update at once, while
the trainer must get its buffers back to go on. One device-to-device copy per bucket is
cheap next to that.

The reply to the final `end` message is held back until the engine has applied (or
rejected) the update, so `send()` returns the engine's new version or raises its error.
Use `CudaIpcReceiver.serve_once(apply)` on the engine side to get that right.

The engine binds (it is the long-lived side, at a well-known loopback endpoint); the
trainer connects. Only loopback TCP or ipc:// paths are accepted.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator

import torch
import zmq

from weightsync.bucket import DEFAULT_BUCKET_BYTES, pack_bucket, plan_buckets, unpack_bucket
from weightsync.transports.base import SendStats, StreamCounter, WeightSyncError
from weightsync.transports.ipc_wire import (
    BucketRequest,
    CudaIpcHandle,
    EndRequest,
    Reply,
    check_loopback_endpoint,
    decode_reply,
    decode_request,
    encode_reply,
    encode_request,
)


def export_handle(buffer: torch.Tensor) -> CudaIpcHandle:
    """CUDA IPC handle for a 1-D uint8 CUDA tensor (its bytes must be final: see send())."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

    if buffer.device.type != "cuda" or buffer.dtype != torch.uint8 or buffer.dim() != 1 or not buffer.is_contiguous():
        raise ValueError(f"export_handle needs a contiguous 1-D uint8 CUDA tensor, got {buffer.dtype} on {buffer.device}")
    rebuild, args = reduce_tensor(buffer)
    # reduce_tensor's argument tuple is positional; pin its shape so a torch change fails here.
    if rebuild is not rebuild_cuda_tensor or len(args) != 15:
        raise WeightSyncError("torch.multiprocessing.reductions.reduce_tensor changed shape; update export_handle")
    (_, _, _, tensor_offset, _, _, device_index, storage_handle, storage_size_bytes, storage_offset_bytes, _,
     ref_counter_handle, ref_counter_offset, event_handle, event_sync_required) = args  # fmt: skip
    return CudaIpcHandle(
        device_index=int(device_index),
        device_uuid=_device_uuid(int(device_index)),
        storage_handle=bytes(storage_handle),
        storage_size_bytes=int(storage_size_bytes),
        storage_offset_bytes=int(storage_offset_bytes),
        ref_counter_handle=bytes(ref_counter_handle),
        ref_counter_offset=int(ref_counter_offset),
        event_handle=bytes(event_handle) if event_handle is not None else None,
        event_sync_required=bool(event_sync_required),
        tensor_offset=int(tensor_offset),
        nbytes=buffer.numel(),
    )


def import_handle(handle: CudaIpcHandle) -> torch.Tensor:
    """Map the trainer's buffer into this process: a 1-D uint8 view of handle.nbytes."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    return rebuild_cuda_tensor(
        torch.Tensor,
        (handle.nbytes,),
        (1,),
        handle.tensor_offset,
        torch.UntypedStorage,  # always: the peer does not get to choose a class
        torch.uint8,
        _local_device_index(handle),
        handle.storage_handle,
        handle.storage_size_bytes,
        handle.storage_offset_bytes,
        False,
        handle.ref_counter_handle,
        handle.ref_counter_offset,
        handle.event_handle,
        handle.event_sync_required,
    )


def release_handle(handle: CudaIpcHandle) -> None:
    """Give back the reference an exported handle holds on the trainer's memory, unmapped.

    Every export counts one reference that only the receiver can drop (torch keeps the
    trainer's block alive until then); a bucket refused without being mapped must drop it
    here, or the trainer holds that memory until it exits.
    """
    torch.UntypedStorage._release_ipc_counter(
        handle.ref_counter_handle, handle.ref_counter_offset, device=_local_device_index(handle)
    )


class CudaIpcSender:
    """Trainer side. One `send()` per weight update; buffers live only during a send."""

    def __init__(
        self,
        endpoint: str,
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        timeout_s: float = 300.0,
        device: torch.device | str | None = None,
    ) -> None:
        self.endpoint = check_loopback_endpoint(endpoint)
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self._device = device
        self._context = zmq.Context()
        self._socket: zmq.Socket | None = None

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> SendStats:
        device = _resolve_cuda_device(self._device)
        counter = StreamCounter()
        slots: list[torch.Tensor | None] = [None, None]
        unacknowledged: list[torch.Tensor] = []  # the engine may still be reading it
        num_buckets = 0
        awaiting_reply = False
        try:
            for meta, tensors in plan_buckets(counter.wrap(named_tensors), self.bucket_bytes):
                slot = meta.index % 2
                # Slot `slot` last held bucket index-2, acknowledged before bucket index-1 went out.
                if meta.oversized and tensors[0].is_contiguous() and tensors[0].device == device:
                    buffer = pack_bucket(meta, tensors)  # a view of the tensor itself, no copy
                else:
                    if slots[slot] is None or slots[slot].numel() < meta.total_bytes:
                        slots[slot] = None  # free the old one before allocating the bigger one
                        slots[slot] = torch.empty(max(meta.total_bytes, 1), dtype=torch.uint8, device=device)
                    buffer = pack_bucket(meta, tensors, out=slots[slot])
                del tensors
                # The IPC event torch records is from the buffer's first export only; a
                # reused buffer's new bytes must be complete before the engine maps it.
                _synchronize(device)
                if awaiting_reply:
                    self._expect_ack(num_buckets - 1)
                # Export only now: each export holds a reference on our memory that only a
                # receiver can give back, so never export a bucket that may not go out.
                self._send_request(BucketRequest(meta, export_handle(buffer)))
                unacknowledged[:] = [buffer]
                del buffer
                awaiting_reply = True
                num_buckets += 1
            if awaiting_reply:
                self._expect_ack(num_buckets - 1)
                awaiting_reply = False
            unacknowledged.clear()
            self._send_request(EndRequest(num_buckets))
            reply = self._receive_reply("the end of the update")
        except BaseException:
            if awaiting_reply:
                # Our side failed with a bucket unacknowledged: the REQ socket is mid
                # exchange, so start over with a fresh one next time. The engine's
                # receive() times out on its own.
                self._reset_socket()
            raise
        # The engine has dropped its mappings by now; let torch free the blocks it kept
        # alive for them instead of holding them until some later allocation.
        if device.type == "cuda":
            torch.cuda.ipc_collect()
        if not reply.ok:
            raise WeightSyncError(f"engine at {self.endpoint} rejected the weight update: {reply.error}")
        return counter.stats(num_buckets, engine_version=reply.version)

    def close(self) -> None:
        self._reset_socket()
        self._context.term()

    def _connected(self) -> zmq.Socket:
        if self._socket is None:
            socket = self._context.socket(zmq.REQ)
            _configure(socket, self.timeout_s, self.endpoint)
            socket.connect(self.endpoint)
            self._socket = socket
        return self._socket

    def _reset_socket(self) -> None:
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None

    def _send_request(self, request: BucketRequest | EndRequest) -> None:
        try:
            self._connected().send(encode_request(request))
        except zmq.Again:
            self._reset_socket()
            raise WeightSyncError(f"no engine took a weight bucket at {self.endpoint} within {self.timeout_s}s") from None

    def _receive_reply(self, what: str) -> Reply:
        try:
            data = self._connected().recv()
        except zmq.Again:
            self._reset_socket()
            raise WeightSyncError(
                f"engine at {self.endpoint} did not answer {what} within {self.timeout_s}s (dead or stuck?)"
            ) from None
        return decode_reply(data)

    def _expect_ack(self, index: int) -> None:
        reply = self._receive_reply(f"bucket {index}")
        if not reply.ok:
            raise WeightSyncError(f"engine at {self.endpoint} failed on bucket {index}: {reply.error}")


class CudaIpcReceiver:
    """Engine side. Binds `endpoint`; `serve_once(apply)` handles one update."""

    def __init__(self, endpoint: str, *, device: torch.device | str | None = None, timeout_s: float = 300.0) -> None:
        self.endpoint = check_loopback_endpoint(endpoint)
        self.timeout_s = timeout_s
        self._device = device
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.REP)
        _configure(self._socket, timeout_s, self.endpoint)
        self._socket.bind(self.endpoint)
        self._owes_reply = False  # REP lockstep: a request was received and not answered
        self._trainer_silent = False  # the last wait for a request timed out

    def serve_once(self, apply: Callable[[Iterator[tuple[str, torch.Tensor]]], int]) -> int:
        """Receive one update and hand it to `apply` (e.g. `lambda s: engine.update_weights(s, full=True)`).

        The trainer's send() returns apply's result, or raises with apply's error.
        """
        stream = self.receive()
        try:
            version = apply(stream)
        except BaseException as error:
            # Unmap the trainer's buffers now; a traceback could keep the generator (and
            # with it torch's IPC ref counts on the trainer's memory) alive indefinitely.
            stream.close()
            self.finish(error=f"{type(error).__name__}: {error}")
            raise
        self.finish(version=version)
        return version

    def receive(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (name, tensor) for one update; tensors live in this process's memory.

        Leaves the trainer's final message unanswered: call finish() once applied.
        """
        device = _resolve_cuda_device(self._device)
        imported: OrderedDict[tuple[bytes, int], torch.Tensor] = OrderedDict()
        index = 0
        while True:
            request = self._receive_request(index)
            if isinstance(request, EndRequest):
                if request.num_buckets != index:
                    raise WeightSyncError(f"CUDA IPC: trainer sent {request.num_buckets} buckets, received {index}")
                return
            meta, handle = request.meta, request.handle
            if meta.index != index:
                release_handle(handle)
                raise WeightSyncError(f"CUDA IPC: expected bucket {index}, got bucket {meta.index}")
            key = (handle.storage_handle, handle.storage_offset_bytes)
            source = import_handle(handle)
            # Keeping the trainer's two alternating buffers mapped avoids reopening the
            # same handles every bucket (torch's cache keys on the storage, held weakly).
            imported[key] = source
            imported.move_to_end(key)
            while len(imported) > 2:
                imported.popitem(last=False)
            local = torch.empty(meta.total_bytes, dtype=torch.uint8, device=device)
            local.copy_(source)
            del source
            _synchronize(device)  # copied out before the trainer reuses the buffer
            self._reply(Reply(ok=True))
            yield from unpack_bucket(meta, local)
            index += 1

    def finish(self, *, version: int | None = None, error: str | None = None) -> None:
        """Answer the trainer's last message: the applied version, or why it failed."""
        if not self._owes_reply:
            if error is None:
                raise WeightSyncError("CUDA IPC finish(): no update is waiting for an answer")
            if self._trainer_silent:
                return  # the trainer went quiet; there is nothing to answer
            # The update was abandoned between buckets; the trainer's next message (a
            # bucket or the end) still needs an answer, so take it and refuse it.
            try:
                data = self._socket.recv()
            except zmq.Again:
                return
            self._owes_reply = True
            try:
                request = decode_request(data)
            except WeightSyncError:
                request = None
            if isinstance(request, BucketRequest):
                release_handle(request.handle)
        self._reply(Reply(ok=error is None, version=version, error=error))

    def close(self) -> None:
        self._socket.close(linger=0)
        self._context.term()

    def _receive_request(self, index: int) -> BucketRequest | EndRequest:
        self._trainer_silent = False
        try:
            data = self._socket.recv()
        except zmq.Again:
            self._trainer_silent = True
            raise WeightSyncError(
                f"CUDA IPC receiver at {self.endpoint}: no message for bucket {index} within {self.timeout_s}s "
                "(trainer dead or not sending?)"
            ) from None
        self._owes_reply = True
        try:
            return decode_request(data)
        except WeightSyncError as error:
            self._reply(Reply(ok=False, error=str(error)))
            raise

    def _reply(self, reply: Reply) -> None:
        self._socket.send(encode_reply(reply))
        self._owes_reply = False


def _configure(socket: zmq.Socket, timeout_s: float, endpoint: str) -> None:
    timeout_ms = max(int(timeout_s * 1000), 1)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.RCVTIMEO, timeout_ms)
    socket.setsockopt(zmq.SNDTIMEO, timeout_ms)
    if endpoint.startswith("tcp://["):
        socket.setsockopt(zmq.IPV6, 1)


def _resolve_cuda_device(device: torch.device | str | None) -> torch.device:
    if not torch.cuda.is_available():
        raise WeightSyncError("the CUDA IPC transport needs CUDA, and this process sees no CUDA device")
    resolved = torch.device(device) if device is not None else torch.device("cuda")
    if resolved.type != "cuda":
        raise ValueError(f"the CUDA IPC transport works on CUDA devices, got {resolved}")
    return torch.device("cuda", resolved.index if resolved.index is not None else torch.cuda.current_device())


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def _device_uuid(index: int) -> str:
    return str(getattr(torch.cuda.get_device_properties(index), "uuid", ""))


def _local_device_index(handle: CudaIpcHandle) -> int:
    # The trainer and the engine may see the GPU under different indices
    # (CUDA_VISIBLE_DEVICES); the UUID names the physical device.
    if handle.device_uuid:
        for index in range(torch.cuda.device_count()):
            if _device_uuid(index) == handle.device_uuid:
                return index
        raise WeightSyncError(
            f"the trainer's GPU (uuid {handle.device_uuid}) is not visible to this engine process; "
            "CUDA IPC needs both on the same GPU (check CUDA_VISIBLE_DEVICES)"
        )
    return handle.device_index
