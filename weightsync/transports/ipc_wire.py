"""Wire format of the CUDA IPC transport: msgpack messages, never pickle.

torch's own CUDA sharing (`reduce_tensor`) is built for pickle: it returns a rebuild
function plus Python objects (tensor class, storage class, dtype). We keep only the plain
fields (ints, bytes, a bool) and pin the rest, since a bucket is always a 1-D uint8 CUDA
tensor. A peer therefore cannot make us call anything: the receiver validates every field
and always rebuilds with the same function and classes.

This module needs no GPU; exporting and importing handles (which do) live in cuda_ipc.py.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
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


@dataclass(frozen=True)
class Reply:
    ok: bool
    version: int | None = None  # set on the reply to EndRequest when the engine applied
    error: str | None = None


def encode_request(request: BucketRequest | EndRequest) -> bytes:
    if isinstance(request, BucketRequest):
        body = {"op": "bucket", "meta": request.meta.to_json(), "handle": request.handle.to_wire()}
    else:
        body = {"op": "end", "num_buckets": request.num_buckets}
    return msgpack.packb(body, use_bin_type=True)


def decode_request(data: bytes) -> BucketRequest | EndRequest:
    raw = _unpack(data, "request")
    op = raw.get("op")
    if op == "bucket":
        meta_json = raw.get("meta")
        if not isinstance(meta_json, bytes):
            raise WeightSyncError("CUDA IPC bucket request: 'meta' must be JSON bytes")
        try:
            meta = BucketMeta.from_json(meta_json)
        except ValueError as error:
            raise WeightSyncError(f"CUDA IPC bucket request: {error}") from None
        handle = CudaIpcHandle.from_wire(raw.get("handle"))
        if handle.nbytes != meta.total_bytes:
            raise WeightSyncError(
                f"CUDA IPC bucket {meta.index}: handle covers {handle.nbytes} bytes, header needs {meta.total_bytes}"
            )
        return BucketRequest(meta, handle)
    if op == "end":
        num_buckets = raw.get("num_buckets")
        if not isinstance(num_buckets, int) or isinstance(num_buckets, bool) or num_buckets < 0:
            raise WeightSyncError(f"CUDA IPC end request: 'num_buckets' must be an int >= 0, got {num_buckets!r}")
        return EndRequest(num_buckets)
    raise WeightSyncError(f"CUDA IPC request: unknown op {op!r} (expected 'bucket' or 'end')")


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


def _unpack(data: bytes, what: str) -> dict[str, Any]:
    if len(data) > MAX_MESSAGE_BYTES:
        raise WeightSyncError(f"CUDA IPC {what} of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True)
    except Exception as error:  # msgpack raises several unrelated types for bad input
        raise WeightSyncError(f"CUDA IPC {what} is not valid msgpack: {error}") from None
    if not isinstance(raw, dict):
        raise WeightSyncError(f"CUDA IPC {what} must be a map, got {type(raw).__name__}")
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
