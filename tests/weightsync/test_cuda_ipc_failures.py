"""CUDA IPC refusals and timeouts on CPU (CUDA-only calls faked, _ipc_fakes.py): a late or
malformed request is refused with every handle given back, and each side times out with a
clear error when the other is missing or stuck."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import zmq
from _ipc_fakes import _endpoint, _model, cpu_ipc  # noqa: F401
from _weightsync_helpers import FakeEngine

from weightsync.transports import WeightSyncError
from weightsync.transports.cuda_ipc import CudaIpcReceiver, CudaIpcSender
from weightsync.transports.flat_buffer import plan_flat
from weightsync.transports.ipc_wire import FlatRequest, decode_reply, encode_request


def test_stale_flat_request_is_refused(cpu_ipc):
    """A request that waited past the trainer's deadline is refused, never applied late."""
    fake = cpu_ipc
    endpoint = _endpoint()
    receiver = CudaIpcReceiver(endpoint, timeout_s=10)
    buffer = torch.zeros(64, dtype=torch.uint8)
    (meta,) = plan_flat([("w", torch.float32, (16,))])
    request = FlatRequest(((meta, fake.export(buffer)),), expires_at=time.time() - 1.0)
    trainer = zmq.Context.instance().socket(zmq.REQ)
    trainer.setsockopt(zmq.RCVTIMEO, 10000)
    trainer.connect(endpoint)
    try:
        trainer.send(encode_request(request))
        engine = FakeEngine()
        with pytest.raises(WeightSyncError, match="stopped waiting for this update"):
            receiver.serve_once(lambda stream: engine.update_weights(stream))
        reply = decode_reply(trainer.recv())
        assert not reply.ok and "stopped waiting" in reply.error and engine.updates == []
        assert fake.released == [request.buffers[0][1].storage_handle]
    finally:
        trainer.close(linger=0)
        receiver.close()
    fake.assert_balanced()


def test_malformed_request_gives_handles_back(cpu_ipc):
    fake = cpu_ipc
    endpoint = _endpoint()
    receiver = CudaIpcReceiver(endpoint, timeout_s=10)
    handle = fake.export(torch.zeros(64, dtype=torch.uint8))
    (meta,) = plan_flat([("w", torch.float32, (8,))])  # 32 bytes: the 64-byte handle does not match
    trainer = zmq.Context.instance().socket(zmq.REQ)
    trainer.setsockopt(zmq.RCVTIMEO, 10000)
    trainer.connect(endpoint)
    try:
        trainer.send(encode_request(FlatRequest(((meta, handle),), expires_at=time.time() + 60)))
        with pytest.raises(WeightSyncError, match="handle covers 64 bytes, header needs 32"):
            receiver.serve_once(lambda stream: FakeEngine().update_weights(stream))
        assert "handle covers" in decode_reply(trainer.recv()).error
        assert fake.released == [handle.storage_handle]
    finally:
        trainer.close(linger=0)
        receiver.close()
    fake.assert_balanced()


@pytest.mark.parametrize("flat", [True, False])
def test_no_engine_times_out(cpu_ipc, flat):
    fake = cpu_ipc
    sender = CudaIpcSender(_endpoint(), flat=flat, timeout_s=0.5)
    try:
        with pytest.raises(WeightSyncError, match="no engine took"):
            sender.send([("w", torch.ones(4))])
        # Never delivered: the trainer gave the handle's reference back itself.
        assert len(fake.exported) == 1 and len(fake.released) == 1
    finally:
        sender.close()
    fake.assert_balanced()


@pytest.mark.parametrize("zero_copy", [False, True], ids=["packed", "zero-copy"])
def test_stuck_engine_times_out(cpu_ipc, zero_copy):
    fake = cpu_ipc
    endpoint = _endpoint()
    receiver = CudaIpcReceiver(endpoint, timeout_s=10)
    sender = CudaIpcSender(endpoint, timeout_s=0.3, zero_copy=zero_copy)
    release = threading.Event()
    outcomes: list = []

    def stuck(stream):
        tensors = list(stream)
        release.wait(10)
        return len(tensors)

    thread = threading.Thread(target=lambda: outcomes.append(receiver.serve_once(stuck)))
    thread.start()
    try:
        with pytest.raises(WeightSyncError, match="did not answer the weight update within 0.3s") as error:
            sender.send(_model(0))
        assert sender.reserved_bytes == 0  # the engine may still read it: dropped, never reused
        # tensors sent in place cannot be dropped: the trainer is told not to write them yet
        assert ("may still be reading the 8 tensors sent in place" in str(error.value)) == zero_copy
    finally:
        release.set()
        thread.join()
        sender.close()
        receiver.close()
    assert outcomes == [len(_model(0))]
    fake.assert_balanced()


def test_silent_trainer_times_out(cpu_ipc):
    receiver = CudaIpcReceiver(_endpoint(), timeout_s=0.5)
    try:
        with pytest.raises(WeightSyncError, match="no weight update request within 0.5s"):
            receiver.serve_once(lambda stream: FakeEngine().update_weights(stream))
    finally:
        receiver.close()
