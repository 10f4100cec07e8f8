"""Wire format of the CUDA IPC transport: msgpack messages, never pickle.

Requests (trainer -> engine): `flat` (flat mode: the whole update in one message, a header
and a handle per persistent buffer), `bucket` and `end` (bucketed mode). Replies carry ok,
the engine's new version or its error.

torch's own CUDA sharing (`reduce_tensor`) is built for pickle: it returns a rebuild
function plus Python objects (tensor class, storage class, dtype). We keep only the plain
fields (ints, bytes, a bool) and pin the rest, since a bucket is always a 1-D uint8 CUDA
tensor. A peer therefore cannot make us call anything: the receiver validates every field
and always rebuilds with the same function and classes.

This module needs no GPU; exporting and importing handles (which do) live in cuda_ipc_handles.py.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import msgpack

from weightsync.bucket import BucketMeta
from weightsync.transports.base import WeightSyncError

# A bucket header is ~100 bytes per tensor; this leaves room for huge models while
# refusing absurd input before msgpack allocates it.
MAX_MESSAGE_BYTES = 64 << 20


@dataclass(frozen=True)
class CudaIpcHandle:
    """The fields of `storage._share_cuda_()` for one bucket buffer, plus where it sits."""

    device_index: int  # the trainer's CUDA index, used when the UUID is unavailable
    device_uuid: str  # identifies the physical GPU across different CUDA_VISIBLE_DEVICES
    storage_handle: bytes  # cudaIpcMemHandle of the allocation holding the storage
    storage_size_bytes: int
    storage_offset_bytes: int  # the storage's offset within that allocation
    ref_counter_handle: bytes  # shared-memory file torch uses to keep the block alive
    ref_counter_offset: int
    event_handle: bytes | None
    event_sync_required: bool
    tensor_offset: int  # where the bucket starts in the storage (bytes: it is uint8)
    nbytes: int

    def __post_init__(self) -> None:
        for spec in fields(self):
            value = getattr(self, spec.name)
            expected = _FIELD_TYPES[spec.name]
            if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
                raise WeightSyncError(
                    f"CUDA IPC handle: field {spec.name!r} must be {_type_names(expected)}, got {type(value).__name__}"
                )
        for name in ("device_index", "storage_size_bytes", "storage_offset_bytes", "ref_counter_offset", "tensor_offset", "nbytes"):
            if getattr(self, name) < 0:
                raise WeightSyncError(f"CUDA IPC handle: field {name!r} must be >= 0, got {getattr(self, name)}")
        if self.tensor_offset + self.nbytes > self.storage_size_bytes:
            raise WeightSyncError(
                f"CUDA IPC handle: bucket at {self.tensor_offset} (+{self.nbytes} bytes) lies outside "
                f"its {self.storage_size_bytes}-byte storage"
            )

    def to_wire(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_wire(cls, raw: object) -> CudaIpcHandle:
        if not isinstance(raw, dict):
            raise WeightSyncError(f"CUDA IPC handle must be a map, got {type(raw).__name__}")
        expected = {spec.name for spec in fields(cls)}
        if set(raw) != expected:
            raise WeightSyncError(
                f"CUDA IPC handle fields: missing {sorted(expected - set(raw))}, unexpected {sorted(set(raw) - expected)}"
            )
        return cls(**raw)


_FIELD_TYPES: dict[str, type | tuple[type, ...]] = {
    "device_index": int,
    "device_uuid": str,
    "storage_handle": bytes,
    "storage_size_bytes": int,
    "storage_offset_bytes": int,
    "ref_counter_handle": bytes,
    "ref_counter_offset": int,
    "event_handle": (bytes, type(None)),
    "event_sync_required": bool,
    "tensor_offset": int,
    "nbytes": int,
}


def _type_names(expected: type | tuple[type, ...]) -> str:
    kinds = expected if isinstance(expected, tuple) else (expected,)
    return " or ".join("None" if kind is type(None) else kind.__name__ for kind in kinds)


# Requests (trainer -> engine) and replies (engine -> trainer).


@dataclass(frozen=True)
class BucketRequest:
    meta: BucketMeta
    handle: CudaIpcHandle


@dataclass(frozen=True)
class EndRequest:
    num_buckets: int


FlatBufferHeaders = tuple[tuple[BucketMeta, CudaIpcHandle], ...]


@dataclass(frozen=True)
class FlatRequest:
    """Flat mode: a whole update, as (header, handle) for each of the trainer's persistent buffers.

    `buffers` travels as one opaque msgpack blob, `body`: it is the same every step while
    the trainer keeps its buffers, so the trainer encodes it once and the engine decodes it
    once (an 8B model's header takes milliseconds to check). `expires_at` (time.time() on
    this host) is when the trainer stops waiting: a request read later is refused, never
    applied behind the trainer's back.
    """

    buffers: FlatBufferHeaders
    expires_at: float
    body: bytes = field(default=b"", compare=False, repr=False)  # encode_flat_buffers(buffers); filled when empty


@dataclass(frozen=True)
class Reply:
    ok: bool
    version: int | None = None  # set on the reply to EndRequest when the engine applied
    error: str | None = None


def encode_flat_buffers(buffers: FlatBufferHeaders) -> bytes:
    return msgpack.packb(
        [{"meta": meta.to_json(), "handle": handle.to_wire()} for meta, handle in buffers], use_bin_type=True
    )


def decode_flat_buffers(body: bytes) -> FlatBufferHeaders:
    raw = _unpack(body, "flat request body", kind=list)
    buffers = []
    for position, item in enumerate(raw):
        where = f"CUDA IPC flat request buffer {position}"
        if not isinstance(item, dict) or set(item) != {"meta", "handle"}:
            raise WeightSyncError(f"{where}: must be a map of 'meta' and 'handle'")
        meta = _decode_meta(item["meta"], where)
        if meta.index != position or meta.is_last != (position == len(raw) - 1):
            raise WeightSyncError(
                f"{where}: header says index {meta.index}, is_last={meta.is_last} (buffers must come in order)"
            )
        buffers.append((meta, _decode_handle(item["handle"], meta)))
    handles = [handle for _, handle in buffers]
    if len(set(handles)) != len(handles):
        raise WeightSyncError("CUDA IPC flat request: the same handle is given for two buffers")
    return tuple(buffers)


def encode_request(request: BucketRequest | EndRequest | FlatRequest) -> bytes:
    if isinstance(request, FlatRequest):
        body = request.body or encode_flat_buffers(request.buffers)
        message = {"op": "flat", "expires_at": request.expires_at, "buffers": body}
    elif isinstance(request, BucketRequest):
        message = {"op": "bucket", "meta": request.meta.to_json(), "handle": request.handle.to_wire()}
    else:
        message = {"op": "end", "num_buckets": request.num_buckets}
    return msgpack.packb(message, use_bin_type=True)


def decode_request(data: bytes, *, known: FlatRequest | None = None) -> BucketRequest | EndRequest | FlatRequest:
    """Parse and check one request. A flat request whose body equals `known`'s (the last
    one this endpoint served) reuses `known.buffers` instead of decoding them again."""
    raw = _unpack(data, "request")
    op = raw.get("op")
    if op == "flat":
        expires_at, body = raw.get("expires_at"), raw.get("buffers")
        if not isinstance(expires_at, float) or not math.isfinite(expires_at):
            raise WeightSyncError(f"CUDA IPC flat request: 'expires_at' must be a finite float, got {expires_at!r}")
        if not isinstance(body, bytes):
            raise WeightSyncError("CUDA IPC flat request: 'buffers' must be msgpack bytes")
        if set(raw) != {"op", "expires_at", "buffers"}:
            raise WeightSyncError(f"CUDA IPC flat request: unexpected fields {sorted(set(raw) - {'op', 'expires_at', 'buffers'})}")
        buffers = known.buffers if known is not None and body == known.body else decode_flat_buffers(body)
        return FlatRequest(buffers, expires_at, body)
    if op == "bucket":
        meta = _decode_meta(raw.get("meta"), "CUDA IPC bucket request")
        return BucketRequest(meta, _decode_handle(raw.get("handle"), meta))
    if op == "end":
        num_buckets = raw.get("num_buckets")
        if not isinstance(num_buckets, int) or isinstance(num_buckets, bool) or num_buckets < 0:
            raise WeightSyncError(f"CUDA IPC end request: 'num_buckets' must be an int >= 0, got {num_buckets!r}")
        return EndRequest(num_buckets)
    raise WeightSyncError(f"CUDA IPC request: unknown op {op!r} (expected 'flat', 'bucket' or 'end')")


def handles_in(data: bytes) -> list[CudaIpcHandle]:
    """Best effort: the well-formed handles in a request that failed to decode.

    Each exported handle holds a reference on the trainer's memory that only the receiver
    can give back, so a refused request must give back whatever handles it carried.
    """
    try:
        raw = _unpack(data, "request")
        if raw.get("op") == "bucket":
            candidates = [raw.get("handle")]
        elif raw.get("op") == "flat" and isinstance(raw.get("buffers"), bytes):
            items = _unpack(raw["buffers"], "flat request body", kind=list)
            candidates = [item.get("handle") for item in items if isinstance(item, dict)]
        else:
            return []
    except WeightSyncError:
        return []
    handles = []
    for candidate in candidates:
        try:
            handles.append(CudaIpcHandle.from_wire(candidate))
        except (WeightSyncError, TypeError):
            continue
    return handles


def _decode_meta(meta_json: object, where: str) -> BucketMeta:
    if not isinstance(meta_json, bytes):
        raise WeightSyncError(f"{where}: 'meta' must be JSON bytes")
    try:
        return BucketMeta.from_json(meta_json)
    except ValueError as error:
        raise WeightSyncError(f"{where}: {error}") from None


def _decode_handle(raw: object, meta: BucketMeta) -> CudaIpcHandle:
    handle = CudaIpcHandle.from_wire(raw)
    if handle.nbytes != meta.total_bytes:
        raise WeightSyncError(
            f"CUDA IPC bucket {meta.index}: handle covers {handle.nbytes} bytes, header needs {meta.total_bytes}"
        )
    return handle


def encode_reply(reply: Reply) -> bytes:
    return msgpack.packb({"ok": reply.ok, "version": reply.version, "error": reply.error}, use_bin_type=True)


def decode_reply(data: bytes) -> Reply:
    raw = _unpack(data, "reply")
    ok, version, error = raw.get("ok"), raw.get("version"), raw.get("error")
    if not isinstance(ok, bool):
        raise WeightSyncError(f"CUDA IPC reply: 'ok' must be a bool, got {ok!r}")
    if version is not None and (not isinstance(version, int) or isinstance(version, bool)):
        raise WeightSyncError(f"CUDA IPC reply: 'version' must be an int or nil, got {version!r}")
    if error is not None and not isinstance(error, str):
        raise WeightSyncError(f"CUDA IPC reply: 'error' must be a string or nil, got {error!r}")
    return Reply(ok, version, error)


def _unpack(data: bytes, what: str, kind: type = dict) -> Any:
    if len(data) > MAX_MESSAGE_BYTES:
        raise WeightSyncError(f"CUDA IPC {what} of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True)
    except Exception as error:  # msgpack raises several unrelated types for bad input
        raise WeightSyncError(f"CUDA IPC {what} is not valid msgpack: {error}") from None
    if not isinstance(raw, kind):
        raise WeightSyncError(f"CUDA IPC {what} must be a {'map' if kind is dict else 'list'}, got {type(raw).__name__}")
    return raw


def check_loopback_endpoint(endpoint: str) -> str:
    """CUDA IPC only works on one host, so its control socket never leaves it."""
    if not isinstance(endpoint, str):
        raise ValueError(f"endpoint must be a string, got {type(endpoint).__name__}")
    if endpoint.startswith("ipc://") and len(endpoint) > len("ipc://"):
        return endpoint
    for prefix in ("tcp://127.0.0.1:", "tcp://localhost:", "tcp://[::1]:"):
        if endpoint.startswith(prefix) and endpoint[len(prefix) :].isdigit():
            return endpoint
    raise ValueError(
        f"CUDA IPC endpoint {endpoint!r} must be loopback: 'tcp://127.0.0.1:PORT', 'tcp://localhost:PORT', "
        "'tcp://[::1]:PORT' or 'ipc:///path'"
    )
