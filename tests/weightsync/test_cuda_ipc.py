"""CUDA IPC transport.

On CPU: the msgpack wire format, flat mode's packing, and the whole REQ/REP protocol of
both modes (flat: one request per update over persistent buffers; bucketed: double
buffering, acks), the engine's version or error coming back, with the CUDA-only calls
(export_handle, import_handle, release_handle) replaced by an in-process fake that counts
every IPC reference, so leaks and double releases fail the tests. With CUDA: the real
thing, trainer (this process) and engine (a spawned process) on one GPU.
"""

from __future__ import annotations

import ctypes
import gc
import json
import threading
import time
import warnings
import weakref
from pathlib import Path

import msgpack
import pytest
import torch
import torch.multiprocessing as mp
import zmq
from _weightsync_helpers import FakeEngine, assert_same_tensors, free_port

from weightsync.bucket import BucketMeta, pack_buckets
from weightsync.transports import WeightSyncError, cuda_ipc_handles, cuda_ipc_receiver
from weightsync.transports.cuda_ipc import CudaIpcReceiver, CudaIpcSender, release_ipc_endpoint
from weightsync.transports.flat_buffer import pack_flat, plan_flat
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


def _flat_request(count: int = 2, **changes) -> FlatRequest:
    buffers = tuple(
        (
            BucketMeta(i, _meta().entries, 4096, is_last=i == count - 1),
            _handle(storage_handle=bytes([i + 1]) * 64, **changes),
        )
        for i in range(count)
    )
    return FlatRequest(buffers, expires_at=time.time() + 60)


def test_flat_request_round_trip_and_known_body():
    request = _flat_request()
    decoded = decode_request(encode_request(request))
    assert decoded == request and decoded.body == encode_flat_buffers(request.buffers)
    # The same body as the last request served: its decoded headers are reused as they are.
    again = decode_request(encode_request(FlatRequest(request.buffers, time.time() + 5)), known=decoded)
    assert again.buffers is decoded.buffers and again.expires_at != decoded.expires_at
    empty = FlatRequest((), expires_at=1.5)
    assert decode_request(encode_request(empty)) == empty


def _flat_body(items) -> bytes:
    body = msgpack.packb(items, use_bin_type=True)
    return msgpack.packb({"op": "flat", "expires_at": time.time() + 60, "buffers": body}, use_bin_type=True)


def _flat_items(request: FlatRequest) -> list:
    return msgpack.unpackb(encode_flat_buffers(request.buffers), raw=False)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda items: items.reverse(), "header says index 1"),
        (lambda items: items[1].update(meta=items[1]["meta"].replace(b'"is_last":true', b'"is_last":false')), "is_last=False"),
        (lambda items: items[0]["handle"].update(nbytes=8), "handle covers 8 bytes, header needs 4096"),
        (lambda items: items[1]["handle"].update(storage_handle=items[0]["handle"]["storage_handle"]), "same handle"),
        (lambda items: items[0].update(extra=1), "must be a map of 'meta' and 'handle'"),
        (lambda items: items[0].update(meta="{}"), "'meta' must be JSON bytes"),
    ],
)
def test_malformed_flat_requests_are_refused(mutate, message):
    items = _flat_items(_flat_request())
    mutate(items)
    with pytest.raises(WeightSyncError, match=message):
        decode_request(_flat_body(items))


def test_flat_request_fields_are_checked():
    good = msgpack.unpackb(encode_request(_flat_request()), raw=False)
    for changes, message in (
        ({"expires_at": 5}, "'expires_at' must be a finite float"),
        ({"expires_at": float("nan")}, "'expires_at' must be a finite float"),
        ({"buffers": [1]}, "'buffers' must be msgpack bytes"),
        ({"buffers": msgpack.packb({"a": 1})}, "body must be a list"),
        ({"pickle": b"x"}, r"unexpected fields \['pickle'\]"),
    ):
        with pytest.raises(WeightSyncError, match=message):
            decode_request(msgpack.packb(good | changes, use_bin_type=True))


def test_handles_are_salvaged_from_refused_requests():
    request = _flat_request()
    items = _flat_items(request)
    items[0]["meta"] = b"not json"
    assert handles_in(_flat_body(items)) == [handle for _, handle in request.buffers]
    bucket = _bucket_body(nbytes=8)
    assert handles_in(msgpack.packb(bucket, use_bin_type=True)) == [_handle(nbytes=8)]
    assert handles_in(b"\xc1") == [] and handles_in(msgpack.packb({"op": "end"})) == []


# --- flat packing (trainer side), CPU tensors ----------------------------------------


def test_plan_flat_aligns_and_splits():
    specs = [("a", torch.float32, (3,)), ("b", torch.bfloat16, (2, 2)), ("c", torch.float32, (1000,)), ("d", torch.int8, ())]
    (one,) = plan_flat(specs)
    assert [e.offset for e in one.entries] == [0, 256, 512, 4608] and one.total_bytes == 4609 and one.is_last
    split = plan_flat(specs, max_buffer_bytes=1024)
    assert [[e.name for e in m.entries] for m in split] == [["a", "b"], ["c"], ["d"]]
    assert [m.oversized for m in split] == [False, True, False] and [m.is_last for m in split] == [False, False, True]
    assert plan_flat([]) == []
    with pytest.raises(ValueError, match="max_buffer_bytes"):
        plan_flat(specs, max_buffer_bytes=0)


def _tensors(seed: int, shapes=((8, 8), (3,), (4, 5))) -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [(f"w{i}", torch.randn(*shape, generator=generator)) for i, shape in enumerate(shapes)]


def _unpacked(pack) -> list[tuple[str, torch.Tensor]]:
    return [(slot.name, slot.view) for slot in pack.slots]


def test_pack_flat_reuses_or_rebuilds():
    cpu = torch.device("cpu")
    first = pack_flat(_tensors(0), None, device=cpu)
    assert len(first.buffers) == 1 and first.nbytes == first.metas[0].total_bytes
    assert_same_tensors(_unpacked(first), _tensors(0))
    ptr = first.buffers[0].data_ptr()
    # Same names, dtypes and shapes: the same buffer, new values.
    assert pack_flat(_tensors(1), first, device=cpu) is first and first.buffers[0].data_ptr() == ptr
    assert_same_tensors(_unpacked(first), _tensors(1))
    # A change part-way: a new pack, the part already copied carried over from the old one.
    changed = _tensors(2, shapes=((8, 8), (3,), (5, 4)))
    second = pack_flat(changed, first, device=cpu)
    assert second is not first
    assert_same_tensors(_unpacked(second), changed)
    shorter = _tensors(3, shapes=((8, 8),))
    assert_same_tensors(_unpacked(pack_flat(shorter, second, device=cpu)), shorter)
    longer = _tensors(4, shapes=((8, 8), (3,), (5, 4), (2,)))
    assert_same_tensors(_unpacked(pack_flat(longer, second, device=cpu)), longer)
    renamed = [("other", t) if i == 1 else (n, t) for i, (n, t) in enumerate(_tensors(5))]
    assert_same_tensors(_unpacked(pack_flat(renamed, first, device=cpu)), renamed)
    retyped = [(n, t.double()) for n, t in _tensors(6)]
    assert_same_tensors(_unpacked(pack_flat(retyped, first, device=cpu)), retyped)
    assert pack_flat([], None, device=cpu).buffers == []
    with pytest.raises(TypeError, match="expected a torch.Tensor"):
        pack_flat([("w0", [1.0])], first, device=cpu)


# --- protocol on CPU, CUDA calls faked -----------------------------------------------


class FakeIpc:
    """export/import/release as an in-process registry, with torch's reference counting.

    Each export holds one reference on the trainer's memory; the engine gives it back by
    unmapping (the fake mapping dies with its last view, as torch's storage deleter does)
    or by release_handle. A reference given back twice is an error; one never given back
    is a leak (`assert_balanced`).
    """

    def __init__(self) -> None:
        self.storages: dict[bytes, torch.UntypedStorage] = {}
        self.exported: list[int] = []  # data_ptr of each export's storage
        self.imported: list[int] = []  # export id of each import
        self.released: list[bytes] = []  # storage handles given back unmapped
        self.references: dict[int, int] = {}  # export id -> references outstanding
        self.errors: list[str] = []

    def export(self, buffer: torch.Tensor) -> CudaIpcHandle:
        storage = buffer.untyped_storage()
        key = storage.data_ptr().to_bytes(8, "little")
        self.storages[key] = storage  # like torch's limbo: the memory outlives the trainer's use
        export_id = len(self.exported)
        self.exported.append(storage.data_ptr())
        self.references[export_id] = 1
        return CudaIpcHandle(
            device_index=0, device_uuid="", storage_handle=key, storage_size_bytes=storage.nbytes(),
            storage_offset_bytes=0, ref_counter_handle=b"/fake", ref_counter_offset=export_id,
            event_handle=None, event_sync_required=False, tensor_offset=buffer.storage_offset(), nbytes=buffer.numel(),
        )  # fmt: skip

    def import_(self, handle: CudaIpcHandle) -> torch.Tensor:
        export_id = handle.ref_counter_offset
        if self.references.get(export_id, 0) <= 0:
            self.errors.append(f"export {export_id} mapped after its reference was given back")
        self.imported.append(export_id)
        storage = self.storages[handle.storage_handle]
        raw = (ctypes.c_uint8 * max(handle.nbytes, 1)).from_address(storage.data_ptr() + handle.tensor_offset)
        weakref.finalize(raw, self._unref, export_id)  # unmapped when the last view goes
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.frombuffer(raw, dtype=torch.uint8)[: handle.nbytes]

    def release(self, handle: CudaIpcHandle) -> None:
        self.released.append(handle.storage_handle)
        self._unref(handle.ref_counter_offset)

    def _unref(self, export_id: int) -> None:
        self.references[export_id] -= 1
        if self.references[export_id] < 0:
            self.errors.append(f"export {export_id} given back twice")

    def outstanding(self) -> dict[int, int]:
        gc.collect()
        return {export_id: count for export_id, count in self.references.items() if count}

    def assert_balanced(self) -> None:
        release_ipc_endpoint()
        assert self.outstanding() == {} and self.errors == []


@pytest.fixture
def cpu_ipc(monkeypatch):
    """Make export/import/release a FakeIpc and let 'CUDA' be the CPU."""
    fake = FakeIpc()
    monkeypatch.setattr(cuda_ipc_handles, "export_handle", fake.export)
    monkeypatch.setattr(cuda_ipc_handles, "import_handle", fake.import_)
    monkeypatch.setattr(cuda_ipc_handles, "release_handle", fake.release)
    monkeypatch.setattr(cuda_ipc_handles, "resolve_cuda_device", lambda device: torch.device("cpu"))
    yield fake
    release_ipc_endpoint()
    assert fake.errors == []


def _serve(receiver: CudaIpcReceiver, engine: FakeEngine, outcomes: list) -> None:
    try:
        outcomes.append(receiver.serve_once(lambda stream: engine.update_weights(stream, full=True)))
    except Exception as error:
        outcomes.append(error)


def _serving(receiver: CudaIpcReceiver, engine: FakeEngine) -> tuple[threading.Thread, list]:
    outcomes: list = []
    thread = threading.Thread(target=_serve, args=(receiver, engine, outcomes))
    thread.start()
    return thread, outcomes


def _endpoint() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


def test_protocol_on_cpu(cpu_ipc):
    fake = cpu_ipc
    exported, released = fake.exported, fake.released
    endpoint = _endpoint()
    receiver = CudaIpcReceiver(endpoint, timeout_s=10)
    sender = CudaIpcSender(endpoint, flat=False, bucket_bytes=1024, timeout_s=10)
    generator = torch.Generator().manual_seed(0)
    # 256-byte tensors, four to a bucket, and one oversized tensor after the first bucket.
    weights = [(f"layer{i}.weight", torch.randn(8, 8, generator=generator)) for i in range(20)]
    weights.insert(4, ("embed.weight", torch.randn(64, 16, generator=generator)))
    engine = FakeEngine()
    try:
        thread, outcomes = _serving(receiver, engine)
        stats = sender.send(weights)
        thread.join()
        assert outcomes == [1] and stats.engine_version == 1 and stats.num_buckets > 4
        assert_same_tensors(engine.last, weights)
        # Two alternating buffers for regular buckets; the oversized one is the tensor itself.
        embed_ptr = weights[4][1].untyped_storage().data_ptr()
        assert stats.num_buckets == 6 and exported.count(embed_ptr) == 1
        assert len({ptr for ptr in exported if ptr != embed_ptr}) == 2
        assert sender.reserved_bytes == 0

        # The engine rejects the next update part-way: the trainer hears why, and both
        # sides are ready for the update after it.
        # A bucket refused unmapped gives its IPC reference back; the end message has none.
        for failing_engine, expected, refused in (
            (FakeEngine(fail_after=2), "failed on bucket", 1),
            (FakeEngine(fail_after=20), "rejected", 0),
        ):
            released.clear()
            thread, outcomes = _serving(receiver, failing_engine)
            with pytest.raises(WeightSyncError, match=f"{expected}.*fake engine rejects"):
                sender.send(weights)
            thread.join()
            assert isinstance(outcomes[0], ValueError) and len(released) == refused

        thread, outcomes = _serving(receiver, engine)
        assert sender.send(weights[:3]).engine_version == 2
        thread.join()
        assert_same_tensors(engine.last, weights[:3])
    finally:
        sender.close()
        receiver.close()
    fake.assert_balanced()


def _model(seed: int) -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    weights = [(f"layers.{i}.weight", torch.randn(16, 8, generator=generator)) for i in range(6)]
    weights.append(("norm.weight", torch.randn(7, generator=generator).bfloat16()))
    weights.append(("step", torch.tensor(seed)))
    return weights


def test_flat_round_trips_reuse_buffer_and_mapping(cpu_ipc):
    fake = cpu_ipc
    endpoint = _endpoint()
    receiver = CudaIpcReceiver(endpoint, timeout_s=10)
    sender = CudaIpcSender(endpoint, timeout_s=10)  # flat is the default
    engine = FakeEngine()
    # A trainer updates its parameters in place between sends.
    params = _model(0)
    try:
        for step in range(3):
            with torch.no_grad():
                for (_, param), (_, value) in zip(params, _model(step)):
                    param.copy_(value)
            thread, outcomes = _serving(receiver, engine)
            stats = sender.send(iter(params))
            thread.join()
            assert outcomes == [step + 1] and stats.engine_version == step + 1
            assert stats.num_buckets == 1 and stats.num_tensors == len(params)
            assert_same_tensors(engine.last, _model(step))
            if step == 0:
                pack, reserved = sender._pack, sender.reserved_bytes
        # One buffer, exported once, mapped once; the engine staged nothing.
        assert sender._pack is pack and sender.reserved_bytes == reserved > 0
        assert len(fake.exported) == 1 and fake.imported == [0] and fake.released == []
        assert fake.outstanding() == {0: 1}  # the engine still maps it, for the next update
        # Receivers come and go (an engine makes one per update): the mapping stays.
        receiver.close()
        receiver = CudaIpcReceiver(endpoint, timeout_s=10)
        thread, outcomes = _serving(receiver, engine)
        assert sender.send(params).engine_version == 4
        thread.join()
        assert len(fake.exported) == 1 and fake.imported == [0]
        # An empty update is a layout change like any other.
        thread, outcomes = _serving(receiver, engine)
        assert sender.send([]).num_buckets == 0
        thread.join()  # the serving thread records its outcome after the trainer hears back
        assert outcomes == [5] and engine.last == []
        assert fake.outstanding() == {}  # the engine let go of the old buffer
    finally:
        sender.close()
        receiver.close()
    fake.assert_balanced()


def test_flat_layout_change_reallocates(cpu_ipc):
    fake = cpu_ipc
    endpoint = _endpoint()
    receiver = CudaIpcReceiver(endpoint, timeout_s=10)
    sender = CudaIpcSender(endpoint, timeout_s=10, max_buffer_bytes=1024)
    engine = FakeEngine()
    reshaped = [(n, t.reshape(8, 16)) if n == "layers.2.weight" else (n, t) for n, t in _model(1)]
    extended = reshaped + [("lm_head.weight", torch.randn(40, 8))]  # 1280 bytes: a buffer of its own
    try:
        counts = []
        for weights in (_model(0), _model(0), reshaped, reshaped, extended, extended):
            thread, outcomes = _serving(receiver, engine)
            stats = sender.send(weights)
            thread.join()
            assert_same_tensors(engine.last, weights)
            counts.append((stats.num_buckets, len(fake.exported), len(fake.imported)))
            # Only the current buffers stay mapped: the engine dropped the replaced ones.
            assert set(fake.outstanding()) == set(range(len(fake.exported) - stats.num_buckets, len(fake.exported)))
        # 512-byte tensors, two to a 1024-byte buffer: 4 buffers, then 5 with the oversized one.
        assert counts == [(4, 4, 4), (4, 4, 4), (4, 8, 8), (4, 8, 8), (5, 13, 13), (5, 13, 13)]
    finally:
        sender.close()
        receiver.close()
    fake.assert_balanced()


def test_flat_engine_rejection_propagates(cpu_ipc, monkeypatch):
    fake = cpu_ipc
    endpoint = _endpoint()
    receiver = CudaIpcReceiver(endpoint, timeout_s=10)
    sender = CudaIpcSender(endpoint, timeout_s=10)
    weights = _model(0)
    try:
        thread, outcomes = _serving(receiver, FakeEngine(fail_after=2))
        with pytest.raises(WeightSyncError, match="rejected the weight update: ValueError: fake engine rejects"):
            sender.send(weights)
        thread.join()
        assert isinstance(outcomes[0], ValueError)
        assert sender.reserved_bytes > 0  # the engine answered, so it is done reading: keep the buffer

        # Refused before mapping (a GPU the engine cannot use): the reference comes back.
        def wrong_gpu(handle, device):
            raise WeightSyncError("the trainer's buffer is on another GPU")

        monkeypatch.setattr(cuda_ipc_handles, "check_flat_device", wrong_gpu)
        thread, outcomes = _serving(receiver, FakeEngine())
        with pytest.raises(WeightSyncError, match="rejected the weight update: WeightSyncError: .*another GPU"):
            sender.send(weights)
        thread.join()
        assert len(fake.released) == 1
        monkeypatch.undo()
        monkeypatch.setattr(cuda_ipc_handles, "export_handle", fake.export)
        monkeypatch.setattr(cuda_ipc_handles, "import_handle", fake.import_)
        monkeypatch.setattr(cuda_ipc_handles, "release_handle", fake.release)
        monkeypatch.setattr(cuda_ipc_handles, "resolve_cuda_device", lambda device: torch.device("cpu"))

        engine = FakeEngine()
        thread, outcomes = _serving(receiver, engine)
        assert sender.send(weights).engine_version == 1
        thread.join()
        assert_same_tensors(engine.last, weights)
        # After each error the trainer exports anew (the engine may or may not have kept
        # the old handle): three exports, each reference given back exactly once.
        assert len(set(fake.exported)) == 1 and len(fake.exported) == 3
        assert fake.outstanding() == {2: 1}
    finally:
        sender.close()
        receiver.close()
    fake.assert_balanced()


def test_trainer_buffer_untouched_while_engine_reads(cpu_ipc):
    fake = cpu_ipc
    endpoint = _endpoint()
    receiver = CudaIpcReceiver(endpoint, timeout_s=10)
    sender = CudaIpcSender(endpoint, timeout_s=10)
    seen: list = []

    def slow_apply(stream):
        tensors = list(stream)
        at_start = [(name, tensor.clone()) for name, tensor in tensors]
        time.sleep(0.3 if len(seen) != 1 else 1.0)
        seen.append((at_start, [(name, tensor.clone()) for name, tensor in tensors], time.perf_counter()))
        return len(seen)

    def engine_loop(count: int, outcomes: list) -> None:
        for _ in range(count):
            try:
                outcomes.append(receiver.serve_once(slow_apply))
            except Exception as error:
                outcomes.append(error)

    outcomes: list = []
    thread = threading.Thread(target=engine_loop, args=(3, outcomes))
    thread.start()
    try:
        # Back to back: send() returns only once apply is over, so the next send's copies
        # cannot land under the engine's feet.
        assert sender.send(_model(0)).engine_version == 1
        returned = time.perf_counter()
        assert returned >= seen[0][2]
        # The trainer gives up on an update the engine is still reading: it must never
        # write that buffer again, so the next send packs into a new one.
        sender.timeout_s = 0.3
        with pytest.raises(WeightSyncError, match="did not answer the weight update within 0.3s"):
            sender.send(_model(1))
        assert sender.reserved_bytes == 0
        sender.timeout_s = 10
        assert sender.send(_model(2)).engine_version == 3
        thread.join()
        assert outcomes == [1, 2, 3]
        for (at_start, at_end, _), expected in zip(seen, (_model(0), _model(1), _model(2))):
            assert_same_tensors(at_start, expected)
            assert_same_tensors(at_end, expected)
        assert len(fake.exported) == 2 and len(set(fake.exported)) == 2
    finally:
        thread.join()
        sender.close()
        receiver.close()
    fake.assert_balanced()


def test_switching_to_buckets_unmaps_flat_buffers(cpu_ipc):
    fake = cpu_ipc
    endpoint = _endpoint()
    receiver = CudaIpcReceiver(endpoint, timeout_s=10)
    flat = CudaIpcSender(endpoint, timeout_s=10)
    bucketed = CudaIpcSender(endpoint, flat=False, bucket_bytes=1024, timeout_s=10)
    engine = FakeEngine()
    try:
        thread, _ = _serving(receiver, engine)
        flat.send(_model(0))
        thread.join()
        flat.close()
        assert fake.outstanding() == {0: 1}  # closed, but the engine still maps its buffer
        thread, outcomes = _serving(receiver, engine)
        bucketed.send(_model(1))
        thread.join()
        assert outcomes == [2] and fake.outstanding() == {}
        assert_same_tensors(engine.last, _model(1))
    finally:
        bucketed.close()
        receiver.close()
    fake.assert_balanced()


def test_receiver_socket_outlives_receiver(cpu_ipc):
    endpoint = _endpoint()
    sender = CudaIpcSender(endpoint, timeout_s=10)
    engine = FakeEngine()
    try:
        for version in (1, 2, 3):
            # A new receiver per update, as Engine.update_weights_from_ipc makes.
            receiver = CudaIpcReceiver(endpoint, timeout_s=10)
            thread, outcomes = _serving(receiver, engine)
            assert sender.send(_model(version)).engine_version == version
            thread.join()
            receiver.close()
            assert outcomes == [version]
        # The trainer may ask before the engine serves: the request waits at the bound socket.
        result: list = []
        asker = threading.Thread(target=lambda: result.append(sender.send(_model(4))))
        asker.start()
        time.sleep(0.2)
        receiver = CudaIpcReceiver(endpoint, timeout_s=10)
        assert receiver.serve_once(lambda stream: engine.update_weights(stream)) == 4
        asker.join()
        assert result[0].engine_version == 4
        receiver.close(keep_bound=False)
        release_ipc_endpoint(endpoint)
        # Unbound for real: the port is free again (ZMQ closes in the background).
        probe = zmq.Context.instance().socket(zmq.REP)
        try:
            for attempt in range(100):
                try:
                    probe.bind(endpoint)
                    break
                except zmq.ZMQError:
                    time.sleep(0.02)
            else:
                pytest.fail(f"{endpoint} still bound after release_ipc_endpoint()")
        finally:
            probe.close(linger=0)
    finally:
        sender.close()


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


def test_stuck_engine_times_out(cpu_ipc):
    fake = cpu_ipc
    endpoint = _endpoint()
    receiver = CudaIpcReceiver(endpoint, timeout_s=10)
    sender = CudaIpcSender(endpoint, timeout_s=0.3)
    release = threading.Event()
    outcomes: list = []

    def stuck(stream):
        tensors = list(stream)
        release.wait(10)
        return len(tensors)

    thread = threading.Thread(target=lambda: outcomes.append(receiver.serve_once(stuck)))
    thread.start()
    try:
        with pytest.raises(WeightSyncError, match="did not answer the weight update within 0.3s"):
            sender.send(_model(0))
        assert sender.reserved_bytes == 0  # the engine may still read it: dropped, never reused
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


def test_engine_updates_from_flat_ipc(cpu_ipc, llama):
    """The real engine path (a new receiver per update, validate everything, then copy into
    the parameters) reading the trainer's flat buffer in place; greedy output follows the
    trainer's weights, and a bad update is refused whole and reported to the trainer."""
    import copy

    from rollout import Engine, EngineConfig, SamplingParams
    from weightsync.trainer import iter_hf_weights

    greedy = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
    prompts = [[3, 14, 15, 92, 65], [35, 89, 79, 32, 38, 46, 26]]
    engine = Engine(EngineConfig(model=llama.path))
    trainer = copy.deepcopy(llama.hf)
    endpoint = _endpoint()
    sender = CudaIpcSender(endpoint, timeout_s=30)

    def hf_greedy(prompt):
        with torch.no_grad():
            out = trainer.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=None,
                                   pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        return out[0, len(prompt):].tolist()

    def push(weights) -> tuple:
        """(what the trainer's send() gave, what the engine's update gave)."""
        sent: list = []

        def run():
            try:
                sent.append(sender.send(weights))
            except Exception as error:
                sent.append(error)

        thread = threading.Thread(target=run)
        thread.start()
        try:
            applied = engine.update_weights_from_ipc(endpoint, full=True, timeout_s=30)
        except Exception as error:
            applied = error
        thread.join()
        return sent[0], applied

    try:
        before = [o.token_ids for o in engine.generate(input_ids=prompts, sampling_params=greedy)]
        for version, scale in ((1, 1.5), (2, -1.0)):
            with torch.no_grad():
                for name, parameter in trainer.named_parameters():
                    if "norm" not in name:
                        parameter.mul_(scale)
            stats, applied = push(iter_hf_weights(trainer))
            assert applied == stats.engine_version == version and stats.num_buckets == 1
            outputs = [o.token_ids for o in engine.generate(input_ids=prompts, sampling_params=greedy)]
            assert outputs == [hf_greedy(prompt) for prompt in prompts]
        assert outputs != before
        bad = [(name, tensor.clone().fill_(float("nan")) if name.endswith("norm.weight") else tensor)
               for name, tensor in iter_hf_weights(trainer)]
        error, refused = push(bad)
        assert isinstance(refused, ValueError) and "non-finite" in str(refused)
        assert isinstance(error, WeightSyncError) and "non-finite" in str(error)
        del error, refused  # their tracebacks hold views of the mapped buffer
        assert [o.token_ids for o in engine.generate(input_ids=prompts, sampling_params=greedy)] == outputs
        stats, applied = push(iter_hf_weights(trainer))
        assert applied == stats.engine_version == 3
        assert len(cpu_ipc.exported) == 2 and cpu_ipc.imported == [0, 1]  # exported anew after the refusal
    finally:
        sender.close()
    cpu_ipc.assert_balanced()


def _child_keeps_a_mapping(marker: str) -> None:
    # An engine process that ends with a flat mapping still cached (no release call).
    raw = (ctypes.c_uint8 * 16)()
    weakref.finalize(raw, Path(marker).write_text, "unmapped")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mapped = torch.frombuffer(raw, dtype=torch.uint8)
    cuda_ipc_receiver._flat_mappings["ipc:///nowhere"] = cuda_ipc_receiver._FlatMappings(mapped={_handle(): mapped})


def test_engine_child_unmaps_at_exit(tmp_path):
    """A spawned child leaves by os._exit (no atexit): its cached mappings must still go,
    or the trainer's buffer stays reserved until the trainer exits."""
    marker = tmp_path / "marker"
    child = mp.get_context("spawn").Process(target=_child_keeps_a_mapping, args=(str(marker),))
    child.start()
    child.join(timeout=120)
    assert child.exitcode == 0 and marker.read_text() == "unmapped"


# --- real CUDA IPC: two processes, one GPU -------------------------------------------


def _engine_main(endpoint: str, out_dir: str) -> None:
    from weightsync.transports import save_safetensors_dir

    imports: list[int] = []
    import_handle = cuda_ipc_handles.import_handle
    cuda_ipc_handles.import_handle = lambda handle: imports.append(handle.nbytes) or import_handle(handle)
    receiver = CudaIpcReceiver(endpoint, device="cuda:0", timeout_s=60)
    engine = FakeEngine()
    results = []
    # Updates 0-3 and 5 flat, 4 bucketed; update 2 is rejected.
    for step, fail_after in enumerate((None, None, 3, None, None, None)):
        engine.fail_after = fail_after
        staged: list[int] = []

        def apply(stream):
            before = torch.cuda.memory_allocated()
            tensors = list(stream)  # flat: views into the trainer's buffer; bucketed: copies
            staged.append(torch.cuda.memory_allocated() - before)
            return engine.update_weights(tensors, full=True)

        try:
            version = receiver.serve_once(apply)
            save_safetensors_dir(engine.last, Path(out_dir) / f"update{step}")
            results.append({"version": version, "imports": len(imports), "staged": staged[0]})
        except ValueError as error:
            results.append({"error": str(error), "imports": len(imports)})
        # An engine makes a receiver per update (Engine.update_weights_from_ipc).
        receiver.close()
        receiver = CudaIpcReceiver(endpoint, device="cuda:0", timeout_s=60)
    receiver.close()
    (Path(out_dir) / "results.json").write_text(json.dumps(results))
    # Leaves with update 5's buffer still mapped: unmapped at exit (see the trainer's check).


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a CUDA device (untestable on CPU)")
def test_cuda_ipc_between_processes(tmp_path, monkeypatch):
    from _weightsync_helpers import tiny_llama

    from weightsync.transports import iter_safetensors_dir

    endpoint = f"tcp://127.0.0.1:{free_port()}"
    engine = mp.get_context("spawn").Process(target=_engine_main, args=(endpoint, str(tmp_path)), daemon=True)
    engine.start()
    model = tiny_llama(dtype=torch.bfloat16).cuda()
    params = [(name, parameter) for name, parameter in model.named_parameters()]
    extra = torch.randn(3, 5, device="cuda")

    def weights():
        return [(name, parameter.detach()) for name, parameter in params] + [("extra.fp32", extra)]

    def snapshot():
        return [(name, tensor.cpu()) for name, tensor in weights()]

    def step(change):
        with torch.no_grad():
            for _, parameter in params:
                change(parameter)

    exports: list[int] = []
    export_handle = cuda_ipc_handles.export_handle
    monkeypatch.setattr(
        cuda_ipc_handles, "export_handle", lambda buffer: exports.append(buffer.numel()) or export_handle(buffer)
    )
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    expected = {}
    sender = CudaIpcSender(endpoint, timeout_s=60)  # flat
    try:
        stats = sender.send(weights())
        assert stats.engine_version == 1 and stats.num_buckets == 1 and len(exports) == 1
        assert sender.reserved_bytes >= stats.total_bytes
        expected[0] = snapshot()
        step(lambda p: p.add_(1))  # same layout, new values: same buffer, same handle
        assert sender.send(weights()).engine_version == 2 and len(exports) == 1
        expected[1] = snapshot()
        with pytest.raises(WeightSyncError, match="rejected the weight update: ValueError: fake engine rejects"):
            sender.send(weights())
        step(lambda p: p.mul_(0.5))  # after an error the handle is exported anew
        assert sender.send(weights()).engine_version == 3 and len(exports) == 2
        expected[3] = snapshot()
        sender.close()
        bucketed = CudaIpcSender(endpoint, flat=False, bucket_bytes=4096, timeout_s=60)  # the 8 KiB embedding is oversized
        stats = bucketed.send(weights())
        assert stats.engine_version == 4 and stats.num_buckets > 3
        expected[4] = snapshot()
        bucketed.close()
        # The bucketed update made the engine unmap the closed flat sender's buffer: freed.
        torch.cuda.ipc_collect()
        assert torch.cuda.memory_allocated() == baseline
        again = CudaIpcSender(endpoint, timeout_s=60)
        step(lambda p: p.sub_(2))
        assert again.send(weights()).engine_version == 5
        expected[5] = snapshot()
        again.close()
    finally:
        sender.close()
    engine.join(timeout=120)
    assert engine.exitcode == 0
    # The engine exited with update 5's buffer mapped, and unmapped it on the way out.
    torch.cuda.ipc_collect()
    assert torch.cuda.memory_allocated() == baseline
    results = json.loads((tmp_path / "results.json").read_text())
    assert [result.get("version") for result in results] == [1, 2, None, 3, 4, 5]
    assert "fake engine rejects" in results[2]["error"]
    # Mapped once, reused by update 1 and the rejected 2, mapped anew for 3 (new export).
    assert [result["imports"] for result in results[:4]] == [1, 1, 1, 2]
    assert results[5]["imports"] == results[4]["imports"] + 1
    # Flat: the engine stages nothing; bucketed: it copies the whole update.
    assert results[0]["staged"] == results[1]["staged"] == results[5]["staged"] == 0
    assert results[4]["staged"] >= stats.total_bytes
    for index, want in expected.items():
        assert_same_tensors(list(iter_safetensors_dir(tmp_path / f"update{index}")), want)
