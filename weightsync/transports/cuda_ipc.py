"""CUDA IPC transport: trainer and engine are different processes on the same GPU.

Two modes, picked by the trainer (`CudaIpcSender(flat=...)`); the engine's receiver serves
both.

Flat (the default): one round trip per update, no copy on the engine side. The trainer
packs every tensor into one persistent buffer (a few with `max_buffer_bytes`; see
flat_buffer.py) that it keeps across sends, exports its CUDA IPC handle once, and sends one
request: all the headers plus the handle(s). The engine maps the buffer once (the mapping
is cached per endpoint, keyed by the handle, across updates and receivers) and hands
`apply` views straight into it. The buffer must stay as it is while the engine reads it:
the trainer does not touch it until the engine answers, and the engine answers only after
`apply` has returned and its device is synchronized. Cost: one model-size buffer on the
trainer, kept between steps.

Bucketed (`flat=False`): for trainers that cannot afford that buffer. Per bucket, the
trainer packs the bytes into one of two reusable GPU buffers, sends a handle for it, and
the engine maps the buffer, copies it into memory of its own, and acknowledges; the trainer
packs bucket k+1 while the engine copies bucket k. The engine copies (staging the whole
update) because `update_weights` validates the whole update before applying any of it,
while the trainer needs its two buffers back to go on.

Either way the reply to the last message waits for `apply`, so `send()` returns the
engine's new version or raises its error: use `CudaIpcReceiver.serve_once(apply)`.

Sockets: the engine binds (it is the long-lived side, at a well-known loopback endpoint),
the trainer connects; only loopback TCP or ipc:// paths are accepted. A receiver's socket
outlives it: close() keeps it bound for the next receiver on that endpoint in this process
(engines make one per update). Re-binding would make the trainer reconnect every update,
which costs up to ZMQ's 100 ms reconnect interval and can lose a request that reaches the
closing socket. `release_ipc_endpoint()` unbinds and unmaps for real.

Every export holds a reference on the trainer's memory that only a receiver gives back (by
unmapping, or `release_handle` for a handle it refuses unmapped). A trainer block still
referenced when the trainer frees it stays reserved (torch's "limbo") until then.
"""

from __future__ import annotations

import atexit
import multiprocessing.util
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch
import zmq

from weightsync.bucket import DEFAULT_BUCKET_BYTES, pack_bucket, plan_buckets, unpack_bucket
from weightsync.transports.base import SendStats, StreamCounter, WeightSyncError
from weightsync.transports.flat_buffer import FlatPack, pack_flat
from weightsync.transports.ipc_wire import (
    BucketRequest,
    CudaIpcHandle,
    EndRequest,
    FlatRequest,
    Reply,
    check_loopback_endpoint,
    decode_reply,
    decode_request,
    encode_flat_buffers,
    encode_reply,
    encode_request,
    handles_in,
)

# How often a trainer retries connecting to an engine that is not (yet) bound. ZMQ's
# default, 100 ms, was most of a back-to-back update's time when receivers re-bound.
RECONNECT_IVL_MS = 10


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
    """Map the trainer's buffer into this process: a 1-D uint8 view of handle.nbytes.

    The mapping (and the reference it holds on the trainer's memory) lasts as long as the
    returned tensor or any view of it. torch reuses a mapping of the same storage that is
    still alive (and gives the new handle's reference back at once).
    """
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
    trainer's block alive until then); a handle refused without being mapped must drop it
    here, or the trainer holds that memory until it exits. Works in either process, and
    needs no access to the trainer's GPU (torch ignores the device).
    """
    torch.UntypedStorage._release_ipc_counter(
        handle.ref_counter_handle, handle.ref_counter_offset, device=handle.device_index
    )


class CudaIpcSender:
    """Trainer side. One `send()` per weight update.

    flat=True (default): every tensor is packed into one buffer (or several of at most
    `max_buffer_bytes`, default no limit) kept across sends, one round trip per update.
    The buffer costs one model-size copy on this GPU for as long as the sender lives.
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
    ) -> None:
        if max_buffer_bytes is not None and (
            isinstance(max_buffer_bytes, bool) or not isinstance(max_buffer_bytes, int) or max_buffer_bytes <= 0
        ):
            raise ValueError(f"max_buffer_bytes must be a positive int or None, got {max_buffer_bytes!r}")
        self.endpoint = check_loopback_endpoint(endpoint)
        self.flat = bool(flat)
        self.max_buffer_bytes = max_buffer_bytes
        self.bucket_bytes = bucket_bytes  # bucketed mode only
        self.timeout_s = timeout_s
        self._device = device
        self._context = zmq.Context()
        self._socket: zmq.Socket | None = None
        # Flat mode: the pack kept across sends, its exported handles (None: export before
        # the next send) and their encoded headers.
        self._pack: FlatPack | None = None
        self._handles: list[CudaIpcHandle] | None = None
        self._body: bytes | None = None

    @property
    def reserved_bytes(self) -> int:
        """GPU memory this sender keeps between sends (flat mode's buffers; 0 when bucketed)."""
        return self._pack.nbytes if self._pack is not None else 0

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> SendStats:
        _configure(self._connected(), self.timeout_s, self.endpoint)  # timeout_s may have changed
        if self.flat:
            return self._send_flat(named_tensors)
        return self._send_bucketed(named_tensors)

    def close(self) -> None:
        """Drop the flat buffers and the socket. The engine unmaps the buffers on its next
        update on this endpoint or at release_ipc_endpoint(); until then torch keeps them
        reserved on this GPU."""
        self._drop_pack()
        self._reset_socket()
        self._context.term()

    # --- flat mode ----------------------------------------------------------------------

    def _send_flat(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> SendStats:
        device = _resolve_cuda_device(self._device)
        counter = StreamCounter()
        self._connected()  # connects in the background while we pack
        # No request is outstanding, so the engine is not reading the pack: ours to write.
        pack = pack_flat(counter.wrap(named_tensors), self._pack, device=device, max_buffer_bytes=self.max_buffer_bytes)
        if pack is not self._pack:
            # New layout: new buffers, new handles. The old buffers go back to torch, which
            # keeps them reserved while the engine still maps them (it unmaps them when it
            # sees the new handles).
            self._drop_pack()
            self._pack = pack
        # The engine is another process: nothing orders its reads after our copies, which
        # are only queued on our stream. They must have landed before the handle goes out
        # (torch's IPC event covers a buffer's first export only, at the engine's first
        # mapping; later sends reuse both).
        _synchronize(device)
        fresh = self._handles is None
        if fresh:
            self._handles = _export_all(pack.exported_views())
            self._body = None
        headers = tuple(zip(pack.metas, self._handles))
        if self._body is None:
            self._body = encode_flat_buffers(headers)
        request = FlatRequest(headers, expires_at=time.time() + self.timeout_s, body=self._body)
        try:
            self._send_request(request, "the weight update")
        except _NotDelivered:
            if fresh:  # no one else ever saw these handles: give their references back ourselves
                for handle in self._handles:
                    _release_quietly(handle)
                self._handles = self._body = None
            raise
        except BaseException:
            self._abandon_pack()
            raise
        try:
            reply = self._receive_reply("the weight update")
        except BaseException:
            # No answer: the engine may still be reading the buffers. Never write them
            # again; torch keeps them reserved until the engine unmaps them.
            self._abandon_pack()
            raise
        # Frees earlier buffers the engine has now unmapped (after a layout change).
        if device.type == "cuda":
            torch.cuda.ipc_collect()
        if not reply.ok:
            # The engine is done reading (it answers after apply), but it may or may not
            # have kept our handles mapped: export anew next time, and it swaps its mapping
            # for the new handles. That keeps every reference counted exactly once.
            self._handles = self._body = None
            raise WeightSyncError(f"engine at {self.endpoint} rejected the weight update: {reply.error}")
        return counter.stats(len(pack.metas), engine_version=reply.version)

    def _drop_pack(self) -> None:
        self._pack = None
        self._handles = self._body = None

    def _abandon_pack(self) -> None:
        """The engine may hold the pack: drop it, and the REQ socket (mid-exchange)."""
        self._drop_pack()
        self._reset_socket()

    # --- bucketed mode ------------------------------------------------------------------

    def _send_bucketed(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> SendStats:
        device = _resolve_cuda_device(self._device)
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
                _synchronize(device)
                if awaiting_reply:
                    self._expect_ack(num_buckets - 1)
                    awaiting_reply = False
                # Export only now: each export holds a reference on our memory that only a
                # receiver can give back, so never export a bucket that may not go out.
                handle = export_handle(buffer)
                try:
                    self._send_request(BucketRequest(meta, handle), f"bucket {meta.index}")
                except _NotDelivered:
                    _release_quietly(handle)
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
            socket = self._context.socket(zmq.REQ)
            _configure(socket, self.timeout_s, self.endpoint)
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


def _export_all(views: list[torch.Tensor]) -> list[CudaIpcHandle]:
    handles: list[CudaIpcHandle] = []
    try:
        for view in views:
            handles.append(export_handle(view))
    except BaseException:
        for handle in handles:
            _release_quietly(handle)
        raise
    return handles


# --- engine side ----------------------------------------------------------------------


@dataclass
class _FlatMappings:
    """One endpoint's trainer buffers, mapped into this process, kept between updates."""

    mapped: dict[CudaIpcHandle, torch.Tensor] = field(default_factory=dict)
    request: FlatRequest | None = None  # the last request served from `mapped`...
    views: list[tuple[str, torch.Tensor]] | None = None  # ...and its tensors, views into `mapped`


_lock = threading.Lock()
_flat_mappings: dict[str, _FlatMappings] = {}
_bound_sockets: dict[str, zmq.Socket] = {}  # endpoint -> REP socket kept bound between receivers
_context: zmq.Context | None = None


def release_ipc_endpoint(endpoint: str | None = None) -> None:
    """Unmap the trainer buffers cached for `endpoint` (all endpoints when None) and unbind
    its idle socket. Unmapping gives the trainer its memory back (after its next
    torch.cuda.ipc_collect(), which every send runs). A receiver still open keeps its socket.
    """
    with _lock:
        endpoints = list(_flat_mappings.keys() | _bound_sockets.keys()) if endpoint is None else [endpoint]
        mappings = [_flat_mappings.pop(name, None) for name in endpoints]
        sockets = [_bound_sockets.pop(name, None) for name in endpoints]
    del mappings  # unmapped here (torch synchronizes and gives each reference back)
    for socket in sockets:
        if socket is not None:
            socket.close(linger=0)


# Unmap at exit, while CUDA is still up, so the trainer gets its memory back: atexit for
# a main process, multiprocessing's finalizers for a child (it leaves by os._exit).
atexit.register(release_ipc_endpoint)
multiprocessing.util.Finalize(None, release_ipc_endpoint, exitpriority=0)


class CudaIpcReceiver:
    """Engine side. Serves `endpoint`; `serve_once(apply)` handles one update, flat or bucketed."""

    def __init__(self, endpoint: str, *, device: torch.device | str | None = None, timeout_s: float = 300.0) -> None:
        self.endpoint = check_loopback_endpoint(endpoint)
        self.timeout_s = timeout_s
        self._device = device
        self._socket: zmq.Socket | None = _take_socket(self.endpoint, timeout_s)
        self._owes_reply = False  # REP lockstep: a request was received and not answered
        self._trainer_silent = False  # the last wait for a request timed out
        self._refused = False  # the last request was answered with an error already (it did not decode)
        self._reading_in_place: torch.device | None = None  # a flat update lent us the trainer's buffers

    def serve_once(self, apply: Callable[[Iterator[tuple[str, torch.Tensor]]], int]) -> int:
        """Receive one update and hand it to `apply` (e.g. `lambda s: engine.update_weights(s, full=True)`).

        The trainer's send() returns apply's result, or raises with apply's error. In flat
        mode the tensors are views into the trainer's buffers, valid until apply returns:
        apply must copy what it keeps.
        """
        stream = self.receive()
        try:
            version = apply(stream)
        except BaseException as error:
            # Unmap the trainer's bucket buffers now; a traceback could keep the generator
            # (and with it torch's IPC ref counts on the trainer's memory) alive indefinitely.
            stream.close()
            self.finish(error=f"{type(error).__name__}: {error}")
            raise
        self.finish(version=version)
        return version

    def receive(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (name, tensor) for one update. Bucketed: tensors in this process's memory.
        Flat: views into the trainer's buffers, valid until finish().

        Leaves the trainer's final message unanswered: call finish() once applied.
        """
        device = _resolve_cuda_device(self._device)
        request = self._receive_request(0)
        if isinstance(request, FlatRequest):
            self._reading_in_place = device  # finish() synchronizes it before answering
            yield from self._map_flat(request, device)
            return
        # The trainer switched to buckets: let go of the flat buffers it may have dropped.
        with _lock:
            stale = _flat_mappings.pop(self.endpoint, None)
        del stale
        imported: OrderedDict[tuple[bytes, int], torch.Tensor] = OrderedDict()
        index = 0
        while True:
            if isinstance(request, EndRequest):
                if request.num_buckets != index:
                    raise WeightSyncError(f"CUDA IPC: trainer sent {request.num_buckets} buckets, received {index}")
                return
            if isinstance(request, FlatRequest):
                self._release_unmapped([handle for _, handle in request.buffers])
                raise WeightSyncError(f"CUDA IPC: expected bucket {index}, got a flat update")
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
            request = self._receive_request(index)

    def finish(self, *, version: int | None = None, error: str | None = None) -> None:
        """Answer the trainer's last message: the applied version, or why it failed."""
        if not self._owes_reply:
            if error is None:
                raise WeightSyncError("CUDA IPC finish(): no update is waiting for an answer")
            if self._trainer_silent or self._refused:
                return  # the trainer went quiet, or already has its answer: nothing to answer
            # The update was abandoned between buckets; the trainer's next message (a
            # bucket or the end) still needs an answer, so take it and refuse it.
            try:
                data = self._bound().recv()
            except zmq.Again:
                return
            self._owes_reply = True
            self._release_unmapped(handles_in(data))
        if self._reading_in_place is not None:
            # apply read the trainer's buffers in place, maybe on several streams; the
            # trainer overwrites them as soon as it hears back.
            device, self._reading_in_place = self._reading_in_place, None
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        self._reply(Reply(ok=error is None, version=version, error=error))

    def close(self, *, keep_bound: bool = True) -> None:
        """Done with this receiver. Its socket stays bound for the next receiver on this
        endpoint in this process unless keep_bound=False (see the module docstring);
        cached flat mappings stay until release_ipc_endpoint()."""
        if self._socket is None:
            return
        if self._owes_reply:
            try:
                self.finish(error="the engine closed its CUDA IPC receiver without answering")
            except zmq.ZMQError:
                keep_bound = False
        socket, self._socket = self._socket, None
        if keep_bound and not self._owes_reply:
            with _lock:
                if self.endpoint not in _bound_sockets:
                    _bound_sockets[self.endpoint] = socket
                    return
        # A reply just sent may still be queued: give it a moment instead of dropping it.
        socket.close(linger=1000)

    def _bound(self) -> zmq.Socket:
        if self._socket is None:
            raise WeightSyncError(f"CUDA IPC receiver at {self.endpoint} is closed")
        return self._socket

    def _map_flat(self, request: FlatRequest, device: torch.device) -> list[tuple[str, torch.Tensor]]:
        handles = [handle for _, handle in request.buffers]
        with _lock:
            cache = _flat_mappings.setdefault(self.endpoint, _FlatMappings())
        fresh = [handle for handle in handles if handle not in cache.mapped]
        try:
            if time.time() > request.expires_at:
                raise WeightSyncError(
                    f"CUDA IPC: the trainer stopped waiting for this update {time.time() - request.expires_at:.1f}s ago"
                )
            for handle in fresh:
                _check_flat_device(handle, device)
        except BaseException:
            self._release_unmapped(fresh)
            raise
        # Unmap what this update does not use (the trainer replaced those buffers), first:
        # then torch maps the new handles afresh rather than through an older storage.
        if any(handle not in handles for handle in cache.mapped):
            cache.mapped = {handle: tensor for handle, tensor in cache.mapped.items() if handle in handles}
            cache.request = cache.views = None
        for position, handle in enumerate(fresh):
            try:
                cache.mapped[handle] = import_handle(handle)
            except BaseException as error:
                self._release_unmapped(fresh[position:])  # a failed import mapped nothing
                if isinstance(error, Exception) and not isinstance(error, WeightSyncError):
                    raise WeightSyncError(f"CUDA IPC: could not map the trainer's buffer: {error}") from error
                raise
        if fresh or cache.views is None or cache.request is None or request.buffers is not cache.request.buffers:
            cache.views = [view for meta, handle in request.buffers for view in unpack_bucket(meta, cache.mapped[handle])]
            cache.request = request
        return cache.views

    def _release_unmapped(self, handles: list[CudaIpcHandle]) -> None:
        """Give back the references of refused handles, except those we hold mapped."""
        with _lock:
            cache = _flat_mappings.get(self.endpoint)
        for handle in handles:
            if cache is None or handle not in cache.mapped:
                _release_quietly(handle)

    def _receive_request(self, index: int) -> BucketRequest | EndRequest | FlatRequest:
        self._trainer_silent = self._refused = False
        try:
            data = self._bound().recv()
        except zmq.Again:
            self._trainer_silent = True
            what = "no weight update request" if index == 0 else f"no message for bucket {index}"
            raise WeightSyncError(
                f"CUDA IPC receiver at {self.endpoint}: {what} within {self.timeout_s}s "
                "(trainer dead or not sending?)"
            ) from None
        self._owes_reply = True
        with _lock:
            cache = _flat_mappings.get(self.endpoint)
        try:
            return decode_request(data, known=cache.request if cache is not None else None)
        except WeightSyncError as error:
            self._release_unmapped(handles_in(data))
            self._reply(Reply(ok=False, error=str(error)))
            self._refused = True
            raise

    def _reply(self, reply: Reply) -> None:
        self._bound().send(encode_reply(reply))
        self._owes_reply = False


def _take_socket(endpoint: str, timeout_s: float) -> zmq.Socket:
    """The endpoint's bound REP socket: the one a closed receiver left, or a new one."""
    global _context
    with _lock:
        socket = _bound_sockets.pop(endpoint, None)
        if socket is None:
            if _context is None:
                _context = zmq.Context()
            socket = _context.socket(zmq.REP)
            try:
                _configure(socket, timeout_s, endpoint)
                socket.bind(endpoint)
            except BaseException:
                socket.close(linger=0)
                raise
            return socket
    _configure(socket, timeout_s, endpoint)
    return socket


def _check_flat_device(handle: CudaIpcHandle, device: torch.device) -> None:
    """Flat mode hands out views of the trainer's buffer: it must be on the engine's GPU."""
    if device.type != "cuda":
        return
    index = _local_device_index(handle)  # refuses a GPU this process cannot see
    if index != device.index:
        raise WeightSyncError(
            f"the trainer's buffer is on cuda:{index} of this process (uuid {handle.device_uuid or '?'}), the engine "
            f"on {device}: flat CUDA IPC reads it in place and needs both on one GPU"
        )


def _release_quietly(handle: CudaIpcHandle) -> None:
    try:
        release_handle(handle)
    except Exception:  # best effort, as torch's own release: the trainer may be gone
        pass


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
