"""CUDA IPC transport: trainer and engine are different processes on the same GPU.

Two modes, picked by the trainer (`CudaIpcSender(flat=...)`); the engine's receiver serves
both.

Flat (the default): one round trip per update, no copy on the engine side. Zero-copy (the
default): each contiguous tensor on the trainer's GPU (its parameters) is exported where it
lies, once, and read in place on every send while it stays at that address; the rest (and
with `zero_copy=False` everything) is packed into one persistent buffer (a few with
`max_buffer_bytes`; see flat_buffer.py) that the trainer keeps across sends and exports once.
One request carries all the headers plus the handles. The engine maps each handle once (the
mapping is cached per endpoint, keyed by the handle, across updates and receivers) and hands
`apply` views straight into the trainer's memory. That memory must stay as it is while the
engine reads it: the trainer does not touch it until the engine answers, and the engine
answers only after `apply` has returned and its device is synchronized. Cost: no trainer
memory for what goes out in place; one buffer for what is packed, kept between steps.

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

Layout: cuda_ipc_handles.py (export/import/release a handle, device checks),
cuda_ipc_sender.py (the trainer side), cuda_ipc_receiver.py (the engine side),
zmq_lifetime.py (how the sender's context and socket end, dropped or not). This module is
the public import surface.
"""

from __future__ import annotations

from weightsync.transports.cuda_ipc_handles import export_handle, import_handle, release_handle
from weightsync.transports.cuda_ipc_receiver import CudaIpcReceiver, release_ipc_endpoint
from weightsync.transports.cuda_ipc_sender import CudaIpcSender

__all__ = [
    "CudaIpcReceiver",
    "CudaIpcSender",
    "export_handle",
    "import_handle",
    "release_handle",
    "release_ipc_endpoint",
]
