"""CUDA IPC, trainer side: `CudaIpcSender`, flat or bucketed (see cuda_ipc.py)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable

import torch
import zmq

from weightsync.bucket import DEFAULT_BUCKET_BYTES, BucketEntry, BucketMeta, _check_named_tensor, pack_bucket, plan_buckets
from weightsync.dtypes import dtype_to_name
from weightsync.transports import cuda_ipc_handles as ipc
from weightsync.transports.base import SendStats, StreamCounter, WeightSyncError
from weightsync.transports.flat_buffer import FlatPack, pack_flat
from weightsync.transports.ipc_wire import (
    BucketRequest,
    CudaIpcHandle,
    EndRequest,
    FlatBufferHeaders,
    FlatRequest,
    Reply,
    check_loopback_endpoint,
    decode_reply,
    encode_flat_buffers,
    encode_request,
)
from weightsync.transports.zmq_lifetime import ZmqSockets

# How often a trainer retries connecting to an engine that is not (yet) bound. ZMQ's
# default, 100 ms, was most of a back-to-back update's time when receivers re-bound.
RECONNECT_IVL_MS = 10


class CudaIpcSender:
    """Trainer side. One `send()` per weight update.

    flat=True (default): one round trip per update. With zero_copy=True (default), every
    contiguous tensor of the stream on this GPU is exported where it lies (the model's own
    parameters: no copy and no memory of ours); the rest (another device, strided views, and
    tensors found at a new address on a later send: a stream that materializes them, e.g. a
    dtype cast or FSDP gathers) are packed into one buffer (or several of at most
    `max_buffer_bytes`, default no limit) kept across sends. zero_copy=False packs every
    tensor: one model-size buffer on this GPU for as long as the sender lives, but the
    engine never maps the model's own memory.
    flat=False: buckets of `bucket_bytes` through two alternating buffers that live only
    during a send; one round trip per bucket, and the engine stages the whole update.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        flat: bool = True,
        max_buffer_bytes: int | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        timeout_s: float = 300.0,
        device: torch.device | str | None = None,
        zero_copy: bool = True,
    ) -> None:
        if max_buffer_bytes is not None and (
            isinstance(max_buffer_bytes, bool) or not isinstance(max_buffer_bytes, int) or max_buffer_bytes <= 0
        ):
            raise ValueError(f"max_buffer_bytes must be a positive int or None, got {max_buffer_bytes!r}")
        self.endpoint = check_loopback_endpoint(endpoint)
        self.flat = bool(flat)
        self.zero_copy = bool(zero_copy)
        self.max_buffer_bytes = max_buffer_bytes
        self.bucket_bytes = bucket_bytes  # bucketed mode only
        self.timeout_s = timeout_s
        self._device = device
        # Its context and REQ socket end with close(), or when the sender is dropped (in a
        # reference cycle too: zmq_lifetime.py says why that needs a finalizer).
        self._zmq = ZmqSockets(self, zmq.Context())
        self._socket: zmq.Socket | None = None
        # Flat mode: the pack kept across sends, its exported handles (None: export before
        # the next send) and their encoded headers.
        self._pack: FlatPack | None = None
        self._handles: list[CudaIpcHandle] | None = None
        self._body: bytes | None = None
        self._headers: FlatBufferHeaders = ()
        # Zero-copy: the tensors exported in place last time, as (name, dtype, shape, address)
        # (the same again: the same handles), and names seen to move between sends (packed).
        self._in_place: tuple[tuple[str, torch.dtype, tuple[int, ...], int], ...] = ()
        self._moving: set[str] = set()

    @property
    def reserved_bytes(self) -> int:
        """GPU memory this sender keeps between sends (flat mode's buffers; 0 when bucketed)."""
        return self._pack.nbytes if self._pack is not None else 0

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> SendStats:
        ipc.configure_socket(self._connected(), self.timeout_s, self.endpoint)  # timeout_s may have changed
        if self.flat:
            return self._send_flat(named_tensors)
        return self._send_bucketed(named_tensors)

    def close(self) -> None:
        """Drop the flat buffers and the socket. The engine unmaps the buffers on its next
        update on this endpoint or at release_ipc_endpoint(); until then torch keeps them
        reserved on this GPU."""
        self._drop_pack()
        self._socket = None
        self._zmq.close()

    # --- flat mode ----------------------------------------------------------------------

    def _send_flat(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> SendStats:
        device = ipc.resolve_cuda_device(self._device)
        counter = StreamCounter()
        self._connected()  # connects in the background while we pack
        in_place: list[tuple[str, torch.Tensor]] = []

        def to_pack():  # the stream minus what goes out where it lies
            for name, tensor in counter.wrap(named_tensors):
                _check_named_tensor(name, tensor)
                if self.zero_copy and name not in self._moving and _exportable_in_place(tensor, device):
                    in_place.append((name, tensor))
                else:
                    yield name, tensor

        # No request is outstanding, so the engine is not reading the pack: ours to write.
        pack = pack_flat(to_pack(), self._pack, device=device, max_buffer_bytes=self.max_buffer_bytes)
        signature = tuple((name, t.dtype, tuple(t.shape), t.data_ptr()) for name, t in in_place)
        if pack is not self._pack or signature != self._in_place:
            # New layout: new buffers, new handles. The old buffers go back to torch, which
            # keeps them reserved while the engine still maps them (it unmaps them when it
            # sees the new handles). A tensor at a new address is one the stream makes
            # afresh each send: from now on it is packed, or every send would map new memory.
            before = {name: address for name, _, _, address in self._in_place}
            self._moving |= {name for name, _, _, address in signature if before.get(name, address) != address}
            self._drop_pack()
            self._pack, self._in_place = pack, signature
        # The engine is another process: nothing orders its reads after our copies (or the
        # optimizer's writes), which are only queued on our stream. They must have landed
        # before the handle goes out (torch's IPC event covers a buffer's first export only,
        # at the engine's first mapping; later sends reuse both).
        ipc.synchronize(device)
        fresh = self._handles is None
        if fresh:
            self._handles = _export_all([_as_bytes(t) for _, t in in_place] + pack.exported_views())
            self._body = None
        if self._body is None:
            metas = _in_place_metas(in_place, len(pack.metas)) + [
                dataclasses.replace(meta, index=meta.index + len(in_place)) for meta in pack.metas
            ]
            self._headers = tuple(zip(metas, self._handles))
            self._body = encode_flat_buffers(self._headers)
        headers = self._headers
        request = FlatRequest(headers, expires_at=time.time() + self.timeout_s, body=self._body)
        try:
            self._send_request(request, "the weight update")
        except _NotDelivered:
            if fresh:  # no one else ever saw these handles: give their references back ourselves
                for handle in self._handles:
                    ipc.release_quietly(handle)
                self._handles = self._body = None
            raise
        except BaseException:
            self._abandon_pack()
            raise
        try:
            reply = self._receive_reply("the weight update")
        except WeightSyncError as error:
            # No answer: the engine may still be reading the buffers. Never write them
            # again; torch keeps them reserved until the engine unmaps them. Tensors sent in
            # place cannot be abandoned: the trainer must know not to write them yet.
            self._abandon_pack()
            if in_place:
                raise WeightSyncError(
                    f"{error}; it may still be reading the {len(in_place)} tensors sent in place (zero_copy): "
                    "do not modify them until the engine answers a later update or is gone"
                ) from None
            raise
        except BaseException:
            self._abandon_pack()
            raise
        # Frees earlier buffers the engine has now unmapped: it unmaps only when it gets new
        # handles, so a send that reused them has nothing to collect.
        if device.type == "cuda" and fresh:
            torch.cuda.ipc_collect()
        if not reply.ok:
            # The engine is done reading (it answers after apply), but it may or may not
            # have kept our handles mapped: export anew next time, and it swaps its mapping
            # for the new handles. That keeps every reference counted exactly once.
            self._handles = self._body = None
            raise WeightSyncError(f"engine at {self.endpoint} rejected the weight update: {reply.error}")
        return counter.stats(len(headers), engine_version=reply.version)

    def _drop_pack(self) -> None:
        self._pack = None
        self._handles = self._body = None
        self._in_place = ()

    def _abandon_pack(self) -> None:
        """The engine may hold the pack: drop it, and the REQ socket (mid-exchange)."""
        self._drop_pack()
        self._reset_socket()

    # --- bucketed mode ------------------------------------------------------------------

    def _send_bucketed(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> SendStats:
        device = ipc.resolve_cuda_device(self._device)
        # Switching from flat mode: the engine drops its mapping of our pack when it sees
        # this update; drop ours so torch can free the pack then.
        self._drop_pack()
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
                ipc.synchronize(device)
                if awaiting_reply:
                    self._expect_ack(num_buckets - 1)
                    awaiting_reply = False
                # Export only now: each export holds a reference on our memory that only a
                # receiver can give back, so never export a bucket that may not go out.
                handle = ipc.export_handle(buffer)
                try:
                    self._send_request(BucketRequest(meta, handle), f"bucket {meta.index}")
                except _NotDelivered:
                    ipc.release_quietly(handle)
                    raise
                unacknowledged[:] = [buffer]
                del buffer
                awaiting_reply = True
                num_buckets += 1
            if awaiting_reply:
                self._expect_ack(num_buckets - 1)
                awaiting_reply = False
            unacknowledged.clear()
            self._send_request(EndRequest(num_buckets), "the end of the update")
            awaiting_reply = True
            reply = self._receive_reply("the end of the update")
            awaiting_reply = False
        except BaseException:
            if awaiting_reply:
                # Our side failed with a message unanswered: the REQ socket is mid
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

    def _expect_ack(self, index: int) -> None:
        reply = self._receive_reply(f"bucket {index}")
        if not reply.ok:
            raise WeightSyncError(f"engine at {self.endpoint} failed on bucket {index}: {reply.error}")

    # --- socket -------------------------------------------------------------------------

    def _connected(self) -> zmq.Socket:
        if self._socket is None:
            if self._zmq.closed:
                raise WeightSyncError(f"the CUDA IPC sender for {self.endpoint} is closed")
            socket = self._zmq.socket(zmq.REQ)
            ipc.configure_socket(socket, self.timeout_s, self.endpoint)
            # Queue a message only on a completed connection: with no engine there, send()
            # times out instead, and we know for sure that the handles in it went nowhere.
            socket.setsockopt(zmq.IMMEDIATE, 1)
            socket.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
            socket.connect(self.endpoint)
            self._socket = socket
        return self._socket

    def _reset_socket(self) -> None:
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None

    def _send_request(self, request: BucketRequest | EndRequest | FlatRequest, what: str) -> None:
        try:
            self._connected().send(encode_request(request))
        except zmq.Again:
            self._reset_socket()
            raise _NotDelivered(
                f"no engine took {what} at {self.endpoint} within {self.timeout_s}s (engine not serving?)"
            ) from None

    def _receive_reply(self, what: str) -> Reply:
        try:
            data = self._connected().recv()
        except zmq.Again:
            self._reset_socket()
            raise WeightSyncError(
                f"engine at {self.endpoint} did not answer {what} within {self.timeout_s}s (dead or stuck?)"
            ) from None
        return decode_reply(data)


class _NotDelivered(WeightSyncError):
    """A request that was never queued: no engine saw it."""


def _exportable_in_place(tensor: torch.Tensor, device: torch.device) -> bool:
    # get_device() (-1 off CUDA), not tensor.device == device: no device object per tensor;
    # the tests' CPU twin sends from "cpu" (meta tensors were refused before this)
    want = device.index if device.type == "cuda" else -1
    return tensor.get_device() == want and tensor.is_contiguous() and tensor.numel() > 0


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().reshape(-1).view(torch.uint8)


def _in_place_metas(in_place: list[tuple[str, torch.Tensor]], packed_buffers: int) -> list[BucketMeta]:
    """A one-entry header per tensor exported where it lies (it is its own buffer)."""
    last = len(in_place) - 1
    return [
        BucketMeta(index, (BucketEntry(name, dtype_to_name(t.dtype), tuple(t.shape), 0, t.numel() * t.element_size()),),
                   t.numel() * t.element_size(), is_last=index == last and not packed_buffers)
        for index, (name, t) in enumerate(in_place)
    ]


def _export_all(views: list[torch.Tensor]) -> list[CudaIpcHandle]:
    handles: list[CudaIpcHandle] = []
    try:
        for view in views:
            handles.append(ipc.export_handle(view))
    except BaseException:
        for handle in handles:
            ipc.release_quietly(handle)
        raise
    return handles
