"""CUDA IPC without a GPU: the msgpack wire format (requests, replies, refusals, loopback-only
endpoints) and flat mode's packing of CPU tensors.
"""

from __future__ import annotations

import time

import msgpack
import pytest
import torch
from _weightsync_helpers import assert_same_tensors

from weightsync.bucket import BucketMeta
from _ipc_fakes import _handle, _meta

from weightsync.transports import WeightSyncError
from weightsync.transports.flat_buffer import pack_flat, plan_flat
from weightsync.transports.ipc_wire import (
    BucketRequest,
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
