"""The engine process's wire: how each request (requests.py, one frozen dataclass per
operation) and each message back crosses the socket.

A client sends [header, *tensor frames]; the header is a msgpack map
    {"v": PROTOCOL_VERSION, "id": call id (int, the client's), "op": name, "args": {...},
     "tensors": [{"name", "dtype", "shape"}, ...]}        ("tensors" only for ops that carry any)
where "args" holds exactly the fields of the op's dataclass (requests.py) (those with defaults may
be left out). The engine answers [header, *frames] with "kind":
    "reply"  {"id", "result": plain value, "outputs": [...]?}   the call's answer
    "error"  {"id" (nil if unreadable), "error": type name, "message": str}
    "event"  {"id", "deltas": [...], "outputs": [...]}          streaming / add_request news
    "probe"  {}                                                 liveness probe: ignore it
Outputs travel as codec.outputs_to_wire lays them out: maps in the header, two raw frames.

Decoding checks the version, every field's type (codec.from_plain) and range (each
dataclass's __post_init__, with rollout.validate), and the frame sizes against Limits;
a failure raises ProtocolError (or the ValueError / TypeError of the field's own check),
which the engine turns into an "error" reply. Nothing is ever unpickled.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from rollout.request import RolloutOutput
from rollout.server import codec
from rollout.server.errors import ProtocolError
from rollout.server.requests import (  # the requests are the protocol's: protocol.Generate etc.
    FRAMES,
    REQUESTS,
    Request,
    Hello,
    Generate,
    Add,
    Abort,
    Cancel,
    UpdateWeights,
    UpdateWeightsFromDisk,
    UpdateWeightsFromIpc,
    UpdateWeightsFromDistributed,
    InitWeightSyncGroup,
    DestroyWeightSyncGroup,
    LoadLoraAdapter,
    UnloadLoraAdapter,
    UpdateLoraAdapter,
    UpdateLoraAdapters,
    ListLoraAdapters,
    Sleep,
    Wake,
    Stats,
    FlushCache,
    PauseGeneration,
    ContinueGeneration,
    Health,
    GetModelInfo,
    Shutdown,
)
from rollout.validate import check_int

PROTOCOL_VERSION = 1


@dataclass(frozen=True)
class Limits:
    """Caps on what a peer may send. A header frame above max_header_bytes is refused with
    an error reply; a frame above max(max_header_bytes, max_tensor_bytes) is never even
    received (zmq drops the connection: ZMQ_MAXMSGSIZE)."""

    max_header_bytes: int = 64 << 20
    max_tensor_bytes: int = 4 << 30  # one tensor (a whole model's weights go by disk, IPC or broadcast)
    max_tensors: int = 1 << 16

    def __post_init__(self) -> None:
        for name in ("max_header_bytes", "max_tensor_bytes", "max_tensors"):
            check_int(getattr(self, name), f"Limits.{name}", min=1)

    @property
    def max_frame_bytes(self) -> int:
        return max(self.max_header_bytes, self.max_tensor_bytes)



# ---- results (engine -> client, inside a reply) ------------------------------------------------
@dataclass(frozen=True)
class ModelInfo:
    model_path: str  # the checkpoint directory, as the engine process sees it (its tokenizer files too)
    vocab_size: int
    context_len: int
    has_tokenizer: bool  # False: prompts= and stop strings are refused; outputs carry no text
    eos_token_ids: list[int]
    device: str
    dtype: str
    enable_lora: bool
    max_lora_rank: int | None


@dataclass(frozen=True)
class ServerInfo:
    """The answer to hello: what a client checks before its first call."""

    protocol: int
    session: str  # this client's routing id (hex), which prefixes its request ids in the engine
    model: ModelInfo
    max_header_bytes: int  # the engine's Limits: a client refuses larger frames itself (above
    max_tensor_bytes: int  # them the engine would drop its connection unread)


@dataclass(frozen=True)
class HealthInfo:
    ok: bool
    weight_version: int
    num_running: int
    num_waiting: int
    num_clients: int  # clients with requests in the engine
    uptime_s: float


@dataclass(frozen=True)
class StreamDelta:
    """What a stream yields: the tokens (and their log-probs, and text when the engine has a
    tokenizer) since the last delta of this request; the last delta has finished=True and
    the whole `output`. Deltas of a request concatenate to its output's token_ids,
    logprobs and text."""

    request_id: str
    token_ids: list[int]
    logprobs: list[float]
    text: str | None
    finished: bool
    finish_reason: str | None
    output: RolloutOutput | None = field(default=None, metadata=FRAMES)  # travels in the event's outputs


# ---- messages (engine -> client) ---------------------------------------------------------------
@dataclass(frozen=True)
class Reply:
    call_id: int
    result: Any = None
    outputs: list[RolloutOutput] | None = None


@dataclass(frozen=True)
class ErrorReply:
    call_id: int | None
    error_type: str
    message: str


@dataclass(frozen=True)
class Event:
    call_id: int
    deltas: list[StreamDelta] = field(default_factory=list)
    outputs: list[RolloutOutput] = field(default_factory=list)  # finished samples (with or without deltas)


@dataclass(frozen=True)
class Probe:
    pass


Message = Reply | ErrorReply | Event | Probe


# ---- encoding ----------------------------------------------------------------------------------
def encode_request(call_id: int, request: Request) -> list[Any]:
    header: dict[str, Any] = {"v": PROTOCOL_VERSION, "id": call_id, "op": request.op, "args": codec.to_plain(request)}
    frames: list[Any] = []
    carrier = _tensor_field(type(request))
    tensors = getattr(request, carrier) if carrier is not None else None
    if tensors is not None:
        header["tensors"], frames = codec.tensors_to_frames(tensors)
    return [codec.pack(header), *frames]


def _tensor_field(cls: type) -> str | None:
    """The field whose tensors travel as frames, if the op carries any."""
    return next((f.name for f in dataclasses.fields(cls) if f.metadata.get("frames")), None)


def decode_request(frames: list[codec.Buffer], limits: Limits) -> tuple[int, Request]:
    """(call id, request) from one message's frames. Raises ProtocolError (malformed; its
    `call_id` attribute is set when the id was readable) or the field checks' ValueError /
    TypeError, with `call_id` set too."""
    if not frames:
        raise ProtocolError("empty message")
    header = codec.unpack(frames[0], "header", limits.max_header_bytes)
    if not isinstance(header, dict):
        raise ProtocolError(f"header must be a map, got {type(header).__name__}")
    call_id = header.get("id")
    call_id = call_id if isinstance(call_id, int) and not isinstance(call_id, bool) else None
    try:
        return call_id, _decode_request(header, frames[1:], limits)  # type: ignore[return-value]
    except (ProtocolError, ValueError, TypeError) as error:
        error.call_id = call_id  # type: ignore[attr-defined]
        raise


def _decode_request(header: dict, tensor_frames: list[codec.Buffer], limits: Limits) -> Request:
    unknown = sorted(set(header) - {"v", "id", "op", "args", "tensors"})
    if unknown:
        raise ProtocolError(f"header: unknown field(s) {unknown}")
    if header.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(f"header: protocol version {header.get('v')!r}, this engine speaks {PROTOCOL_VERSION}")
    if not isinstance(header.get("id"), int) or isinstance(header.get("id"), bool) or not 0 <= header["id"] < 2**63:
        raise ProtocolError(f"header: 'id' must be an int in [0, 2**63), got {header.get('id')!r}")
    op = header.get("op")
    cls = REQUESTS.get(op) if isinstance(op, str) else None
    if cls is None:
        raise ProtocolError(f"header: unknown op {op!r} (expected one of {sorted(REQUESTS)})")
    carrier = _tensor_field(cls)
    extra: dict[str, Any] = {}
    if "tensors" in header:
        if carrier is None:
            raise ProtocolError(f"{op}: carries no tensors, got a 'tensors' field")
        if not isinstance(header["tensors"], list) or len(header["tensors"]) > limits.max_tensors:
            raise ProtocolError(f"{op}: 'tensors' must be a list of at most {limits.max_tensors} descriptors")
        extra[carrier] = codec.frames_to_tensors(header["tensors"], tensor_frames, limits.max_tensor_bytes)
    elif tensor_frames:
        raise ProtocolError(f"{op}: {len(tensor_frames)} frames follow a header that describes none")
    return codec.from_plain(cls, header.get("args", {}), op, extra)


def encode_message(message: Message) -> list[Any]:
    if isinstance(message, Probe):
        return [codec.pack({"v": PROTOCOL_VERSION, "id": None, "kind": "probe"})]
    if isinstance(message, ErrorReply):
        return [codec.pack({"v": PROTOCOL_VERSION, "id": message.call_id, "kind": "error",
                            "error": message.error_type, "message": message.message})]
    if isinstance(message, Reply):
        header = {"v": PROTOCOL_VERSION, "id": message.call_id, "kind": "reply", "result": codec.to_plain(message.result)}
        outputs = message.outputs
    else:
        header = {"v": PROTOCOL_VERSION, "id": message.call_id, "kind": "event",
                  "deltas": [codec.to_plain(d) for d in message.deltas]}
        outputs = message.outputs
    if outputs is None:
        return [codec.pack(header)]
    header["outputs"], frames = codec.outputs_to_wire(outputs)
    return [codec.pack(header), *frames]


def decode_message(frames: list[codec.Buffer], limits: Limits) -> Message:
    """What the client reads: checked like a request (a confused or hostile engine must not
    crash the caller with a KeyError)."""
    if not frames:
        raise ProtocolError("empty message from the engine")
    header = codec.unpack(frames[0], "engine message header", limits.max_header_bytes)
    if not isinstance(header, dict) or header.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(f"engine message: not a protocol-{PROTOCOL_VERSION} header")
    kind, call_id = header.get("kind"), header.get("id")
    keys = {"probe": set(), "error": {"error", "message"}, "reply": {"result", "outputs"}, "event": {"deltas", "outputs"}}
    if kind not in keys:
        raise ProtocolError(f"engine message: unknown kind {kind!r}")
    unknown = set(header) - {"v", "id", "kind"} - keys[kind]
    if unknown:
        raise ProtocolError(f"engine message ({kind}): unknown field(s) {sorted(unknown)}")
    if kind == "probe":
        return Probe()
    if call_id is not None:
        call_id = codec.check_value(call_id, int, "engine message id")
    if kind == "error":
        return ErrorReply(call_id, codec.check_value(header.get("error"), str, "error"),
                          codec.check_value(header.get("message"), str, "message"))
    if call_id is None:
        raise ProtocolError(f"engine message ({kind}) without a call id")
    outputs = codec.outputs_from_wire(header["outputs"], frames[1:]) if "outputs" in header else None
    if outputs is None and len(frames) > 1:
        raise ProtocolError(f"engine message ({kind}): {len(frames) - 1} unexpected frames")
    if kind == "reply":
        return Reply(call_id, codec.check_plain(header.get("result"), "result"), outputs)
    deltas = header.get("deltas")
    if not isinstance(deltas, list):
        raise ProtocolError("engine event: 'deltas' must be a list")
    by_id = {o.request_id: o for o in outputs or []}
    checked = [codec.from_plain(StreamDelta, d, f"deltas[{i}]") for i, d in enumerate(deltas)]
    checked = [dataclasses.replace(d, output=by_id.get(d.request_id)) if d.finished else d for d in checked]
    return Event(call_id, checked, outputs or [])
