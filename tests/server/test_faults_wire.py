"""Garbage on the engine's socket, from a raw zmq DEALER: an unreadable or non-map header,
an unknown op, wrong field types, missing and unknown fields, frames that do not match
their descriptors, an oversized header, a pickle payload. Each gets an error reply naming
what is wrong (with the call id when it was readable), nothing is unpickled, and the engine
keeps serving every client, this one included."""

from __future__ import annotations

import os
import pickle

import msgpack
import pytest
import zmq
from server_fixtures import server, text_model  # noqa: F401 (fixtures)

from rollout import SamplingParams
from rollout.server import protocol
from rollout.server.codec import to_plain

V = protocol.PROTOCOL_VERSION
GREEDY = to_plain(SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True))


class RawPeer:
    """A DEALER that sends whatever frames it is given and reads the engine's answers."""

    def __init__(self, address: str) -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.ROUTING_ID, b"raw-" + os.urandom(6))
        self.socket.connect(address)

    def ask(self, frames: list[bytes], timeout_s: float = 10.0) -> protocol.Message:
        self.socket.send_multipart(frames)
        deadline_ms = int(timeout_s * 1000)
        while self.socket.poll(deadline_ms):
            message = protocol.decode_message(self.socket.recv_multipart(), protocol.Limits())
            if not isinstance(message, protocol.Probe):
                return message
        raise AssertionError("no answer from the engine")

    def close(self) -> None:
        self.socket.close(linger=0)
        self.context.term()


@pytest.fixture
def peer(server):
    raw = RawPeer(server.address)
    yield raw
    raw.close()
    assert server.health().ok  # the engine survived it and serves the other client


def _header(op: str, args: dict, call_id: int = 7, **extra) -> bytes:
    return msgpack.packb({"v": V, "id": call_id, "op": op, "args": args, **extra}, use_bin_type=True)


def _error(peer: RawPeer, frames: list[bytes], call_id: int | None, *needles: str) -> str:
    reply = peer.ask(frames)
    assert isinstance(reply, protocol.ErrorReply), reply
    assert reply.call_id == call_id and reply.error_type in ("ProtocolError", "ValueError", "TypeError"), reply
    for needle in needles:
        assert needle in reply.message, (needle, reply.message)
    return reply.message


def _nested(depth: int) -> list:
    value: list = [1]
    for _ in range(depth):
        value = [value]
    return value


BAD = {
    "not msgpack": ([b"\xc1\xc1 not msgpack"], None, ["not valid msgpack"]),
    "truncated msgpack": ([msgpack.packb({"v": V, "id": 1, "op": "health"})[:-3]], None, ["not valid msgpack"]),
    "a list header": ([msgpack.packb([V, 1, "health"])], None, ["header must be a map"]),
    "int map keys": ([msgpack.packb({1: 2})], None, []),
    "msgpack ext type": ([msgpack.packb({"v": V, "id": 3, "op": msgpack.ExtType(5, b"x")})], None, ["extension type 5"]),
    "empty frame": ([b""], None, []),
    "wrong version": ([msgpack.packb({"v": 99, "id": 4, "op": "health", "args": {}})], 4, ["protocol version 99"]),
    "bool call id": ([msgpack.packb({"v": V, "id": True, "op": "health", "args": {}})], None, ["'id'"]),
    "unknown op": ([_header("rm_rf", {})], 7, ["unknown op 'rm_rf'"]),
    "unknown header field": ([_header("health", {}, exec="x")], 7, ["unknown field(s) ['exec']"]),
    "unknown arg": ([_header("abort", {"request_id": "a", "force": True})], 7, ["abort: unknown field(s) ['force']"]),
    "missing arg": ([_header("abort", {})], 7, ["abort: missing field(s) ['request_id']"]),
    "int for str": ([_header("abort", {"request_id": 5})], 7, ["abort.request_id: expected str, got int"]),
    "str for int": ([_header("sleep", {"level": "1"})], 7, ["sleep.level: expected an int, got str"]),
    "bool for int": ([_header("sleep", {"level": True})], 7, ["sleep.level: expected an int, got bool"]),
    "str params": ([_header("add", {"sampling_params": "greedy", "input_ids": [1]})], 7, ["add.sampling_params: expected a map"]),
    "str temperature": ([_header("add", {"sampling_params": {**GREEDY, "temperature": "hot"}, "input_ids": [1]})], 7,
                        ["add.sampling_params.temperature: expected a number, got str"]),
    "unknown sampling field": ([_header("add", {"sampling_params": {"evil": 1}, "input_ids": [1]})], 7, ["evil"]),
    "float token": ([_header("add", {"sampling_params": GREEDY, "input_ids": [1.5]})], 7, ["add.input_ids[0]: expected an int"]),
    "negative max_new_tokens": ([_header("add", {"sampling_params": {**GREEDY, "max_new_tokens": -1}, "input_ids": [1]})], 7,
                                ["max_new_tokens"]),
    "nested too deep": ([_header("load_lora_adapter", {"name": "x", "config": {"a": _nested(20)}})], 7, ["nested more than"]),
    "tensors on an op without": ([_header("health", {}, tensors=[])], 7, ["health: carries no tensors"]),
    "frames without descriptors": ([_header("update_weights", {}), b"\0" * 8], 7, ["1 frames follow a header that describes none"]),
    "descriptor without frame": ([_header("update_weights", {}, tensors=[{"name": "w", "dtype": "float32", "shape": [2]}])], 7,
                                 ["describes 1 tensors but 0 frames follow"]),
    "frame size mismatch": ([_header("update_weights", {}, tensors=[{"name": "w", "dtype": "float32", "shape": [4]}]), b"\0" * 8],
                            7, ["float32 [4] needs 16 bytes, the frame has 8"]),
    "unknown dtype": ([_header("update_weights", {}, tensors=[{"name": "w", "dtype": "object", "shape": [1]}]), b"\0" * 8], 7,
                      ["dtype 'object'"]),
    "negative shape": ([_header("update_weights", {}, tensors=[{"name": "w", "dtype": "uint8", "shape": [-1]}]), b""], 7,
                       ["none negative"]),
    "descriptor extra key": ([_header("update_weights", {}, tensors=[{"name": "w", "dtype": "uint8", "shape": [1], "x": 1}]),
                              b"\0"], 7, ["exactly name, dtype, shape"]),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_message_gets_an_error_reply(peer, case) -> None:
    frames, call_id, needles = BAD[case]
    _error(peer, frames, call_id, *needles)
    # the same connection is still served
    ok = peer.ask([_header("health", {}, call_id=8)])
    assert isinstance(ok, protocol.Reply) and ok.call_id == 8 and ok.result["ok"] is True


class WritesMarker:
    """Unpickling this would run os.system and create the marker file."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


def test_pickle_payloads_are_never_unpickled(peer, tmp_path) -> None:
    marker = tmp_path / "unpickled"
    payload = pickle.dumps(WritesMarker(str(marker)))
    pickle.loads(pickle.dumps(WritesMarker(str(tmp_path / "probe"))))  # the payload does what it says when unpickled
    assert (tmp_path / "probe").exists()
    _error(peer, [payload], None, "not valid msgpack")  # as the header
    _error(peer, [_header("abort", {"request_id": payload})], 7, "abort.request_id: expected str, got bytes")  # a bin field
    _error(peer, [_header("load_lora_adapter", {"name": "p", "config": {"x": payload}, "path": "/nonexistent"})], 7)
    # as a tensor's bytes: taken as raw uint8 data (the name is refused), never interpreted
    reply = peer.ask([_header("update_weights", {}, tensors=[{"name": "evil", "dtype": "uint8", "shape": [len(payload)]}]),
                      payload])
    assert isinstance(reply, protocol.ErrorReply) and "evil" in reply.message
    assert not marker.exists()


def test_an_oversized_header_is_refused_unread(peer, server) -> None:
    cap = server.info.max_header_bytes  # the shared engine's: 1 MiB (SERVER_ARGS)
    big = _header("abort", {"request_id": "x" * (cap + 10)})
    _error(peer, [big], None, f"exceeds the {cap}-byte cap")
    with pytest.raises(ValueError, match="exceeds the engine's"):  # the client refuses to send it at all
        server.abort("x" * (cap + 10))


def test_other_clients_are_served_while_garbage_arrives(peer, server) -> None:
    peer.socket.send_multipart([b"\xc1"])
    peer.socket.send_multipart([_header("rm_rf", {})])
    out = server.generate(input_ids=[[1, 2, 3]], sampling_params=SamplingParams(temperature=0, max_new_tokens=4))
    assert len(out[0].token_ids) == 4
