"""CUDA IPC transport.

On CPU: the msgpack wire format, and the whole REQ/REP protocol (double buffering, acks,
the engine's version or error coming back) with the two CUDA-only calls, export_handle
and import_handle, replaced by an in-process registry. With CUDA: the real thing, trainer
(this process) and engine (a spawned process) on one GPU.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import msgpack
import pytest
import torch
import torch.multiprocessing as mp
from _weightsync_helpers import FakeEngine, assert_same_tensors, free_port

from weightsync.bucket import BucketMeta, pack_buckets
from weightsync.transports import WeightSyncError, cuda_ipc
from weightsync.transports.cuda_ipc import CudaIpcReceiver, CudaIpcSender
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


def _handle(**overrides) -> CudaIpcHandle:
    fields = dict(
        device_index=0,
        device_uuid="GPU-1234",
        storage_handle=b"\x01" * 64,
        storage_size_bytes=1 << 20,
        storage_offset_bytes=512,
        ref_counter_handle=b"/torch_123_456",
        ref_counter_offset=3,
        event_handle=b"\x02" * 64,
        event_sync_required=True,
        tensor_offset=256,
        nbytes=4096,
    )
    return CudaIpcHandle(**(fields | overrides))


def _meta(total_bytes: int = 4096) -> BucketMeta:
    (meta, _), = list(pack_buckets([("w", torch.zeros(total_bytes // 4))], 1 << 20))
    return meta


# --- wire format ---------------------------------------------------------------------


def test_requests_round_trip():
    request = BucketRequest(_meta(), _handle())
    assert decode_request(encode_request(request)) == request
    assert decode_request(encode_request(EndRequest(7))) == EndRequest(7)
    no_event = BucketRequest(_meta(), _handle(event_handle=None, event_sync_required=False))
    assert decode_request(encode_request(no_event)) == no_event


def test_replies_round_trip():
    for reply in (Reply(True), Reply(True, version=3), Reply(False, error="bad shape")):
        assert decode_reply(encode_reply(reply)) == reply


def _bucket_body(**handle_changes) -> dict:
    handle = _handle().to_wire() | handle_changes
    return {"op": "bucket", "meta": _meta().to_json(), "handle": handle}


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"op": "pickle"}, "unknown op 'pickle'"),
        ({"op": "end", "num_buckets": True}, "'num_buckets' must be an int"),
        ({"op": "bucket", "meta": "{}", "handle": {}}, "'meta' must be JSON bytes"),
        (_bucket_body(storage_handle="not bytes"), "'storage_handle' must be bytes"),
        (_bucket_body(nbytes=True), "'nbytes' must be int"),
        (_bucket_body(event_handle=5), "'event_handle' must be bytes or None"),
        (_bucket_body(tensor_offset=-1), "'tensor_offset' must be >= 0"),
        (_bucket_body(tensor_offset=(1 << 20) - 100), "outside its 1048576-byte storage"),
        (_bucket_body(nbytes=8), "handle covers 8 bytes, header needs 4096"),
        (_bucket_body(storage_class="torch.Tensor"), r"unexpected \['storage_class'\]"),
    ],
)
def test_malformed_requests_are_refused(body, message):
    with pytest.raises(WeightSyncError, match=message):
        decode_request(msgpack.packb(body, use_bin_type=True))


def test_missing_handle_field_and_garbage():
    body = _bucket_body()
    del body["handle"]["ref_counter_handle"]
    with pytest.raises(WeightSyncError, match=r"missing \['ref_counter_handle'\]"):
        decode_request(msgpack.packb(body, use_bin_type=True))
    with pytest.raises(WeightSyncError, match="not valid msgpack"):
        decode_request(b"\xc1\xc1\xc1")
    with pytest.raises(WeightSyncError, match="must be a map"):
        decode_request(msgpack.packb([1, 2, 3]))
    with pytest.raises(WeightSyncError, match="'ok' must be a bool"):
        decode_reply(msgpack.packb({"ok": 1}))


@pytest.mark.parametrize("endpoint", ["ipc:///tmp/weightsync.sock", "tcp://127.0.0.1:5555", "tcp://localhost:5555", "tcp://[::1]:5555"])
def test_loopback_endpoints_accepted(endpoint):
    assert check_loopback_endpoint(endpoint) == endpoint


@pytest.mark.parametrize("endpoint", ["tcp://0.0.0.0:5555", "tcp://10.0.0.2:5555", "tcp://127.0.0.1:*", "tcp://*:5555", "ipc://"])
def test_non_loopback_endpoints_refused(endpoint):
    with pytest.raises(ValueError, match="must be loopback"):
        check_loopback_endpoint(endpoint)


# --- protocol on CPU, CUDA calls faked -----------------------------------------------


@pytest.fixture
def cpu_ipc(monkeypatch):
    """Make export/import an in-process registry and let 'CUDA' be the CPU."""
    registry: dict[bytes, torch.Tensor] = {}
    exported: list[int] = []
    released: list[bytes] = []  # handles refused without being mapped

    def fake_export(buffer: torch.Tensor) -> CudaIpcHandle:
        key = buffer.untyped_storage().data_ptr().to_bytes(8, "little")
        registry[key] = buffer.untyped_storage()
        exported.append(buffer.untyped_storage().data_ptr())
        return CudaIpcHandle(
            device_index=0, device_uuid="", storage_handle=key,
            storage_size_bytes=buffer.untyped_storage().nbytes(), storage_offset_bytes=0,
            ref_counter_handle=b"", ref_counter_offset=0, event_handle=None, event_sync_required=False,
            tensor_offset=buffer.storage_offset(), nbytes=buffer.numel(),
        )  # fmt: skip

    def fake_import(handle: CudaIpcHandle) -> torch.Tensor:
        storage = registry[handle.storage_handle]
        view = torch.empty(0, dtype=torch.uint8).set_(storage, handle.tensor_offset, (handle.nbytes,), (1,))
        return view

    monkeypatch.setattr(cuda_ipc, "export_handle", fake_export)
    monkeypatch.setattr(cuda_ipc, "import_handle", fake_import)
    monkeypatch.setattr(cuda_ipc, "release_handle", lambda handle: released.append(handle.storage_handle))
    monkeypatch.setattr(cuda_ipc, "_resolve_cuda_device", lambda device: torch.device("cpu"))
    return exported, released


def _serve(receiver: CudaIpcReceiver, engine: FakeEngine, outcomes: list) -> None:
    try:
        outcomes.append(receiver.serve_once(lambda stream: engine.update_weights(stream, full=True)))
    except Exception as error:
        outcomes.append(error)


def test_protocol_on_cpu(cpu_ipc):
    exported, released = cpu_ipc
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    receiver = CudaIpcReceiver(endpoint, timeout_s=10)
    sender = CudaIpcSender(endpoint, bucket_bytes=1024, timeout_s=10)
    generator = torch.Generator().manual_seed(0)
    # 256-byte tensors, four to a bucket, and one oversized tensor after the first bucket.
    weights = [(f"layer{i}.weight", torch.randn(8, 8, generator=generator)) for i in range(20)]
    weights.insert(4, ("embed.weight", torch.randn(64, 16, generator=generator)))
    engine = FakeEngine()
    try:
        outcomes: list = []
        thread = threading.Thread(target=_serve, args=(receiver, engine, outcomes))
        thread.start()
        stats = sender.send(weights)
        thread.join()
        assert outcomes == [1] and stats.engine_version == 1 and stats.num_buckets > 4
        assert_same_tensors(engine.last, weights)
        # Two alternating buffers for regular buckets; the oversized one is the tensor itself.
        embed_ptr = weights[4][1].untyped_storage().data_ptr()
        assert stats.num_buckets == 6 and exported.count(embed_ptr) == 1
        assert len({ptr for ptr in exported if ptr != embed_ptr}) == 2

        # The engine rejects the next update part-way: the trainer hears why, and both
        # sides are ready for the update after it.
        # A bucket refused unmapped gives its IPC reference back; the end message has none.
        for failing_engine, expected, refused in (
            (FakeEngine(fail_after=2), "failed on bucket", 1),
            (FakeEngine(fail_after=20), "rejected", 0),
        ):
            released.clear()
            outcomes = []
            thread = threading.Thread(target=_serve, args=(receiver, failing_engine, outcomes))
            thread.start()
            with pytest.raises(WeightSyncError, match=f"{expected}.*fake engine rejects"):
                sender.send(weights)
            thread.join()
            assert isinstance(outcomes[0], ValueError) and len(released) == refused

        outcomes = []
        thread = threading.Thread(target=_serve, args=(receiver, engine, outcomes))
        thread.start()
        assert sender.send(weights[:3]).engine_version == 2
        thread.join()
        assert_same_tensors(engine.last, weights[:3])
    finally:
        sender.close()
        receiver.close()


def test_no_engine_times_out(cpu_ipc):
    sender = CudaIpcSender(f"tcp://127.0.0.1:{free_port()}", timeout_s=0.5)
    try:
        with pytest.raises(WeightSyncError, match="did not answer|no engine took"):
            sender.send([("w", torch.ones(4))])
    finally:
        sender.close()


def test_silent_trainer_times_out(cpu_ipc):
    receiver = CudaIpcReceiver(f"tcp://127.0.0.1:{free_port()}", timeout_s=0.5)
    try:
        with pytest.raises(WeightSyncError, match="no message for bucket 0 within 0.5s"):
            receiver.serve_once(lambda stream: FakeEngine().update_weights(stream))
    finally:
        receiver.close()


# --- real CUDA IPC: two processes, one GPU -------------------------------------------


def _engine_main(endpoint: str, out_dir: str) -> None:
    from weightsync.transports import save_safetensors_dir

    receiver = CudaIpcReceiver(endpoint, device="cuda:0", timeout_s=60)
    engine = FakeEngine()
    results = []
    for fail_after in (None, 3):
        engine.fail_after = fail_after
        try:
            results.append(receiver.serve_once(lambda stream: engine.update_weights(stream, full=True)))
        except ValueError as error:
            results.append(str(error))
    receiver.close()
    save_safetensors_dir(engine.last, Path(out_dir) / "received")
    (Path(out_dir) / "results.json").write_text(json.dumps(results))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a CUDA device (untestable on CPU)")
def test_cuda_ipc_between_processes(tmp_path):
    from _weightsync_helpers import tiny_llama

    endpoint = f"tcp://127.0.0.1:{free_port()}"
    engine = mp.get_context("spawn").Process(target=_engine_main, args=(endpoint, str(tmp_path)), daemon=True)
    engine.start()
    model = tiny_llama(dtype=torch.bfloat16).cuda()
    weights = [(name, parameter.detach()) for name, parameter in model.named_parameters()]
    weights.append(("extra.fp32", torch.randn(3, 5, device="cuda")))
    sender = CudaIpcSender(endpoint, bucket_bytes=4096, timeout_s=60)  # the 8 KiB embedding is oversized
    try:
        stats = sender.send(weights)
        assert stats.engine_version == 1 and stats.num_buckets > 3
        with pytest.raises(WeightSyncError, match="fake engine rejects"):
            sender.send(weights)
    finally:
        sender.close()
    engine.join(timeout=120)
    assert engine.exitcode == 0
    assert json.loads((tmp_path / "results.json").read_text())[0] == 1
    from weightsync.transports import iter_safetensors_dir

    assert_same_tensors(list(iter_safetensors_dir(tmp_path / "received")), weights)
