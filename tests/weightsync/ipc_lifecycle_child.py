"""CUDA IPC senders (and a receiver) left in each state, dropped inside reference cycles: the
states for test_cuda_ipc_lifecycle.py, and run as a script, a process that leaves one of each
for its interpreter's exit, which must end. CUDA's calls are faked (_ipc_fakes.FakeIpc); the
sockets are real.

    python ipc_lifecycle_child.py   (prints "leaving N senders for the exit", then exits)

At exit, pyzmq's own exit hook makes a Context's __del__ do nothing; a collection before it
(an exit hook registered after zmq's import that collects, or allocates enough to) found, in a
dropped sender's garbage, a Context.__del__ that waited forever in term() (issue 49). The
script registers such a collection.
"""

from __future__ import annotations

import atexit
import faulthandler
import gc
import weakref
from collections.abc import Callable

import pytest
import torch
from _ipc_fakes import FakeIpc, _endpoint, _model, _serving
from _weightsync_helpers import FakeEngine

from weightsync.transports import WeightSyncError, cuda_ipc_handles
from weightsync.transports.cuda_ipc import CudaIpcReceiver, CudaIpcSender


def drop_in_cycle(*objects: object) -> None:
    cycle = list(objects)
    cycle.append(cycle)


def _idle() -> list[weakref.ref]:
    sender = CudaIpcSender(_endpoint(), timeout_s=10)
    drop_in_cycle(sender)
    return [weakref.ref(sender)]


def _sent(flat: bool) -> list[weakref.ref]:
    """An update went through: the sender's REQ socket is connected; its engine's receiver,
    not closed either, goes into the same cycle."""
    endpoint = _endpoint()
    receiver = CudaIpcReceiver(endpoint, timeout_s=10)
    sender = CudaIpcSender(endpoint, flat=flat, timeout_s=10)
    thread, outcomes = _serving(receiver, FakeEngine())
    stats = sender.send(_model(0))
    thread.join()
    assert outcomes == [stats.engine_version] == [1], outcomes
    drop_in_cycle(sender, receiver, thread)
    return [weakref.ref(sender), weakref.ref(receiver)]


def _bad_input() -> list[weakref.ref]:
    """send() refused the stream after it had connected: the socket is open, nothing sent."""
    sender = CudaIpcSender(_endpoint(), timeout_s=10)
    with pytest.raises(TypeError, match="weight names must be non-empty strings") as error:
        sender.send([("", torch.ones(4))])
    drop_in_cycle(sender, error)
    return [weakref.ref(sender)]


def _timed_out() -> list[weakref.ref]:
    """No engine at the endpoint: send() timed out."""
    sender = CudaIpcSender(_endpoint(), timeout_s=0.2)
    with pytest.raises(WeightSyncError, match="no engine took") as error:
        sender.send(_model(0))
    drop_in_cycle(sender, error)
    return [weakref.ref(sender)]


STATES: dict[str, Callable[[], list[weakref.ref]]] = {
    "idle": _idle,
    "sent_flat": lambda: _sent(flat=True),
    "sent_bucketed": lambda: _sent(flat=False),
    "bad_input": _bad_input,
    "timed_out": _timed_out,
}


def fake_cuda_ipc() -> FakeIpc:
    """What the cpu_ipc fixture does, for a process without pytest's monkeypatch."""
    fake = FakeIpc()
    cuda_ipc_handles.export_handle = fake.export
    cuda_ipc_handles.import_handle = fake.import_
    cuda_ipc_handles.release_handle = fake.release
    cuda_ipc_handles.resolve_cuda_device = lambda device: torch.device("cpu")
    return fake


if __name__ == "__main__":
    faulthandler.dump_traceback_later(30, exit=True)  # a hang shows where, then ends
    fake_cuda_ipc()
    gc.disable()  # the cycles wait for the exit
    left = [ref for make in STATES.values() for ref in make()]
    atexit.register(gc.collect)  # registered last, it runs first: before pyzmq's exit hook
    print(f"leaving {sum(isinstance(ref(), CudaIpcSender) for ref in left)} senders for the exit", flush=True)
