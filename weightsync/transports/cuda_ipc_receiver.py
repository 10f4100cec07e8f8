"""CUDA IPC, engine side: `CudaIpcReceiver`, the per-endpoint flat mappings and bound
sockets it keeps between receivers, and `release_ipc_endpoint()` (see cuda_ipc.py)."""

from __future__ import annotations

import atexit
import multiprocessing.util
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import zmq

from weightsync.bucket import unpack_bucket
from weightsync.transports import cuda_ipc_handles as ipc
from weightsync.transports.base import WeightSyncError
from weightsync.transports.ipc_wire import (
    BucketRequest,
    CudaIpcHandle,
    EndRequest,
    FlatRequest,
    Reply,
    check_loopback_endpoint,
    decode_request,
    encode_reply,
    handles_in,
)


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
# A receiver's socket closes with this linger: a reply just sent may still be queued, and
# gets a moment instead of being dropped (nothing waits for it: the context is never ended).
_CLOSE_LINGER_MS = 1000


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
        # Dropped without close() (in a reference cycle too), its socket is closed as close()
        # closes one it does not keep bound, by a finalizer that holds the socket and not the
        # receiver. The module's context is never ended, so no collection can wait on it.
        self._closer = weakref.finalize(self, self._socket.close, _CLOSE_LINGER_MS)
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
        device = ipc.resolve_cuda_device(self._device)
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
                ipc.release_handle(handle)
                raise WeightSyncError(f"CUDA IPC: expected bucket {index}, got bucket {meta.index}")
            key = (handle.storage_handle, handle.storage_offset_bytes)
            source = ipc.import_handle(handle)
            # Keeping the trainer's two alternating buffers mapped avoids reopening the
            # same handles every bucket (torch's cache keys on the storage, held weakly).
            imported[key] = source
            imported.move_to_end(key)
            while len(imported) > 2:
                imported.popitem(last=False)
            local = torch.empty(meta.total_bytes, dtype=torch.uint8, device=device)
            local.copy_(source)
            del source
            ipc.synchronize(device)  # copied out before the trainer reuses the buffer
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
        endpoint in this process unless keep_bound=False (see cuda_ipc.py's docstring);
        cached flat mappings stay until release_ipc_endpoint()."""
        if self._socket is None:
            return
        if self._owes_reply:
            try:
                self.finish(error="the engine closed its CUDA IPC receiver without answering")
            except zmq.ZMQError:
                keep_bound = False
        socket, self._socket = self._socket, None
        self._closer.detach()
        if keep_bound and not self._owes_reply:
            with _lock:
                if self.endpoint not in _bound_sockets:
                    _bound_sockets[self.endpoint] = socket
                    return
        socket.close(linger=_CLOSE_LINGER_MS)

    def _bound(self) -> zmq.Socket:
        if self._socket is None:
            raise WeightSyncError(f"CUDA IPC receiver at {self.endpoint} is closed")
        return self._socket

    def _map_flat(self, request: FlatRequest, device: torch.device) -> list[tuple[str, torch.Tensor]]:
        with _lock:
            cache = _flat_mappings.setdefault(self.endpoint, _FlatMappings())
        same = cache.request is not None and request.buffers is cache.request.buffers and cache.views is not None
        # The usual step: the trainer's buffers as last time (decode_request reused them),
        # all mapped already. Zero-copy sends a buffer per parameter: hundreds of handles.
        handles = [] if same else [handle for _, handle in request.buffers]
        fresh = [handle for handle in handles if handle not in cache.mapped]
        try:
            if time.time() > request.expires_at:
                raise WeightSyncError(
                    f"CUDA IPC: the trainer stopped waiting for this update {time.time() - request.expires_at:.1f}s ago"
                )
            for handle in fresh:
                ipc.check_flat_device(handle, device)
        except BaseException:
            self._release_unmapped(fresh)
            raise
        if same:
            return cache.views  # type: ignore[return-value]
        # Unmap what this update does not use (the trainer replaced those buffers), first:
        # then torch maps the new handles afresh rather than through an older storage.
        wanted = set(handles)
        if any(handle not in wanted for handle in cache.mapped):
            cache.mapped = {handle: tensor for handle, tensor in cache.mapped.items() if handle in wanted}
            cache.request = cache.views = None
        for position, handle in enumerate(fresh):
            try:
                cache.mapped[handle] = ipc.import_handle(handle)
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
                ipc.release_quietly(handle)

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
                ipc.configure_socket(socket, timeout_s, endpoint)
                socket.bind(endpoint)
            except BaseException:
                socket.close(linger=0)
                raise
            return socket
    ipc.configure_socket(socket, timeout_s, endpoint)
    return socket

