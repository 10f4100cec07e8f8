"""Flatten a stream of named tensors into fixed-size byte buckets, and back.

A bucket is one contiguous uint8 tensor plus a JSON-able `BucketMeta` naming what lies
where. Transports move one bucket per transfer (a broadcast, an IPC handle) because the
fixed cost of a transfer dwarfs a small tensor's bytes; a model has hundreds of small
norms and biases.

Packing is lazy: `pack_buckets` pulls (name, tensor) pairs from its input only as it
fills the current bucket, so a trainer that materializes each FSDP parameter on the fly
holds about one bucket of weights at a time, never the whole model.

This module knows bytes, names, dtypes and shapes. It knows nothing about models,
devices other than "the source tensor's", or how buckets travel.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from weightsync.dtypes import dtype_to_name, name_to_dtype

# Every entry starts on a 256-byte boundary so each unpacked view is aligned for any
# dtype and for vectorized kernels that read it in place.
ALIGN_BYTES = 256
DEFAULT_BUCKET_BYTES = 512 << 20


@dataclass(frozen=True)
class BucketEntry:
    name: str
    dtype: str  # a name from weightsync.dtypes, e.g. "bfloat16"
    shape: tuple[int, ...]
    offset: int  # bytes from the start of the bucket buffer
    nbytes: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "offset": self.offset,
            "nbytes": self.nbytes,
        }


@dataclass(frozen=True)
class BucketMeta:
    """Header for one bucket: what lies where in its buffer."""

    index: int  # 0, 1, 2, ... within one transfer
    entries: tuple[BucketEntry, ...]
    total_bytes: int  # bytes of the buffer the entries occupy (padding included)
    is_last: bool  # no bucket follows in this transfer
    oversized: bool = False  # one tensor larger than the bucket size, alone

    def __post_init__(self) -> None:
        _validate_meta(self)

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "index": self.index,
                "total_bytes": self.total_bytes,
                "is_last": self.is_last,
                "oversized": self.oversized,
                "entries": [entry.to_dict() for entry in self.entries],
            },
            separators=(",", ":"),
        ).encode()

    @classmethod
    def from_json(cls, data: bytes | bytearray | memoryview | str) -> BucketMeta:
        try:
            raw = json.loads(bytes(data) if not isinstance(data, str) else data)
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ValueError(f"bucket header is not valid JSON: {error}") from None
        if not isinstance(raw, dict):
            raise ValueError(f"bucket header must be a JSON object, got {type(raw).__name__}")
        entries_raw = _field(raw, "entries", list, "bucket header")
        entries = tuple(_entry_from_dict(item, f"bucket header entries[{i}]") for i, item in enumerate(entries_raw))
        return cls(
            index=_field(raw, "index", int, "bucket header"),
            entries=entries,
            total_bytes=_field(raw, "total_bytes", int, "bucket header"),
            is_last=_field(raw, "is_last", bool, "bucket header"),
            oversized=_field(raw, "oversized", bool, "bucket header"),
        )


def plan_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> Iterator[tuple[BucketMeta, list[torch.Tensor]]]:
    """Group tensors into buckets without copying: yields each bucket's header and sources.

    A bucket closes when the next tensor does not fit, so whether it is the last one is
    known at that moment; only after an oversized tensor must we peek one item ahead.
    """
    _check_bucket_bytes(bucket_bytes)
    items = _Peekable(iter(named_tensors))
    index = 0
    entries: list[BucketEntry] = []
    tensors: list[torch.Tensor] = []
    end = 0
    for name, tensor in items:
        _check_named_tensor(name, tensor)
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes > bucket_bytes:
            if entries:
                yield _make_meta(index, entries, end, is_last=False), tensors
                index += 1
                entries, tensors, end = [], [], 0
            entry = _entry_for(name, tensor, offset=0, nbytes=nbytes)
            meta = BucketMeta(index, (entry,), nbytes, is_last=items.exhausted(), oversized=True)
            yield meta, [tensor]
            index += 1
            continue
        offset = _align_up(end)
        if entries and offset + nbytes > bucket_bytes:
            yield _make_meta(index, entries, end, is_last=False), tensors
            index += 1
            entries, tensors, offset = [], [], 0
        entries.append(_entry_for(name, tensor, offset=offset, nbytes=nbytes))
        tensors.append(tensor)
        end = offset + nbytes
    if entries:
        yield _make_meta(index, entries, end, is_last=True), tensors


def pack_bucket(
    meta: BucketMeta,
    tensors: list[torch.Tensor],
    out: torch.Tensor | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Copy one planned bucket's tensors into a uint8 buffer of `meta.total_bytes`.

    With `out` given (a reusable buffer, e.g. an IPC double buffer) the bytes go into its
    prefix. Without it, a fresh buffer is allocated on `device` (default: the first
    tensor's device; a transport names its wire device so no second copy is needed),
    except that an oversized contiguous tensor already there is returned as a zero-copy
    byte view of itself: the caller must not modify that tensor until the transfer is done.
    """
    if len(tensors) != len(meta.entries):
        raise ValueError(f"bucket {meta.index}: {len(meta.entries)} entries but {len(tensors)} tensors")
    if out is None:
        target = torch.device(device) if device is not None else tensors[0].device
        first = tensors[0]
        if meta.oversized and first.is_contiguous() and _same_device(first.device, target):
            return first.detach().reshape(-1).view(torch.uint8)
        out = torch.empty(meta.total_bytes, dtype=torch.uint8, device=target)
    else:
        _check_buffer(out, meta, "out")
        out = out[: meta.total_bytes]
    with torch.no_grad():
        for entry, tensor in zip(meta.entries, tensors):
            out[entry.offset : entry.offset + entry.nbytes].view(tensor.dtype).view(tensor.shape).copy_(tensor)
    return out


def pack_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> Iterator[tuple[BucketMeta, torch.Tensor]]:
    """Lazily yield (header, uint8 buffer) per bucket; order of tensors is preserved."""
    for meta, tensors in plan_buckets(named_tensors, bucket_bytes):
        yield meta, pack_bucket(meta, tensors)


def unpack_bucket(meta: BucketMeta, buffer: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Views into `buffer` (no copy), one per entry, in order."""
    _check_buffer(buffer, meta, "buffer")
    return [
        (
            entry.name,
            buffer[entry.offset : entry.offset + entry.nbytes].view(name_to_dtype(entry.dtype)).view(entry.shape),
        )
        for entry in meta.entries
    ]


def _same_device(a: torch.device, b: torch.device) -> bool:
    # "cuda" and "cuda:0" can be the same device; compare resolved indices.
    if a.type != b.type:
        return False
    if a.type == "cuda":
        current = torch.cuda.current_device()
        return (a.index if a.index is not None else current) == (b.index if b.index is not None else current)
    return a.index == b.index or a.index is None or b.index is None


def _make_meta(index: int, entries: list[BucketEntry], end: int, *, is_last: bool) -> BucketMeta:
    return BucketMeta(index, tuple(entries), end, is_last=is_last)


def _entry_for(name: str, tensor: torch.Tensor, *, offset: int, nbytes: int) -> BucketEntry:
    return BucketEntry(name, dtype_to_name(tensor.dtype), tuple(tensor.shape), offset, nbytes)


def _align_up(value: int) -> int:
    return (value + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES


def _check_bucket_bytes(bucket_bytes: int) -> None:
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be a positive int, got {bucket_bytes!r}")


def _check_named_tensor(name: object, tensor: object) -> None:
    if not isinstance(name, str) or not name:
        raise TypeError(f"weight names must be non-empty strings, got {name!r}")
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"weight {name!r}: expected a torch.Tensor, got {type(tensor).__name__}")
    if _is_dtensor(tensor):
        raise TypeError(f"weight {name!r} is a DTensor shard; call .full_tensor() first (iter_hf_weights does)")
    if tensor.layout != torch.strided:
        raise TypeError(f"weight {name!r}: only dense tensors can be sent, got layout {tensor.layout}")
    if tensor.is_meta:  # not tensor.device.type: a device object per call, 0.8 us of a ~2 us check
        raise ValueError(f"weight {name!r} is on the meta device and has no data")
    try:
        dtype_to_name(tensor.dtype)
    except ValueError as error:
        raise ValueError(f"weight {name!r}: {error}") from None


def _is_dtensor(tensor: torch.Tensor) -> bool:
    # No DTensor can exist unless its module was imported, and importing it costs ~1 s.
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def _check_buffer(buffer: object, meta: BucketMeta, what: str) -> None:
    if not isinstance(buffer, torch.Tensor):
        raise TypeError(f"bucket {meta.index}: {what} must be a torch.Tensor, got {type(buffer).__name__}")
    if buffer.dtype != torch.uint8 or buffer.dim() != 1 or not buffer.is_contiguous():
        raise ValueError(
            f"bucket {meta.index}: {what} must be a contiguous 1-D uint8 tensor, "
            f"got dtype={buffer.dtype} shape={tuple(buffer.shape)}"
        )
    if buffer.numel() < meta.total_bytes:
        raise ValueError(
            f"bucket {meta.index}: {what} holds {buffer.numel()} bytes but the header needs {meta.total_bytes}"
        )


def _validate_meta(meta: BucketMeta) -> None:
    where = f"bucket {meta.index}"
    if meta.index < 0 or meta.total_bytes < 0:
        raise ValueError(f"{where}: index and total_bytes must be >= 0, got {meta.index}, {meta.total_bytes}")
    if meta.oversized and len(meta.entries) != 1:
        raise ValueError(f"{where}: an oversized bucket holds exactly one tensor, got {len(meta.entries)}")
    for entry in meta.entries:
        dtype = name_to_dtype(entry.dtype)
        numel = 1
        for dim in entry.shape:
            if dim < 0:
                raise ValueError(f"{where}: {entry.name!r} has a negative dimension in shape {entry.shape}")
            numel *= dim
        itemsize = dtype.itemsize
        if entry.nbytes != numel * itemsize:
            raise ValueError(
                f"{where}: {entry.name!r} nbytes={entry.nbytes} does not match shape {entry.shape} x {entry.dtype}"
            )
        if entry.offset < 0 or entry.offset % itemsize or entry.offset + entry.nbytes > meta.total_bytes:
            raise ValueError(
                f"{where}: {entry.name!r} at offset {entry.offset} (+{entry.nbytes} bytes) "
                f"is misaligned or outside the bucket's {meta.total_bytes} bytes"
            )


def _field(raw: dict[str, Any], key: str, kind: type, where: str) -> Any:
    if key not in raw:
        raise ValueError(f"{where}: missing field {key!r}")
    value = raw[key]
    # bool is an int subclass in Python; a header with "index": true is malformed.
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ValueError(f"{where}: field {key!r} must be {kind.__name__}, got {value!r}")
    return value


def _entry_from_dict(raw: object, where: str) -> BucketEntry:
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: must be a JSON object, got {raw!r}")
    shape = _field(raw, "shape", list, where)
    if not all(isinstance(dim, int) and not isinstance(dim, bool) for dim in shape):
        raise ValueError(f"{where}: field 'shape' must be a list of ints, got {shape!r}")
    return BucketEntry(
        name=_field(raw, "name", str, where),
        dtype=_field(raw, "dtype", str, where),
        shape=tuple(shape),
        offset=_field(raw, "offset", int, where),
        nbytes=_field(raw, "nbytes", int, where),
    )


class _Peekable:
    """An iterator that can answer "is anything left?" by holding one item back."""

    _EMPTY = object()

    def __init__(self, iterator: Iterator[Any]) -> None:
        self._iterator = iterator
        self._next: Any = self._EMPTY

    def __iter__(self) -> _Peekable:
        return self

    def __next__(self) -> Any:
        if self._next is not self._EMPTY:
            item, self._next = self._next, self._EMPTY
            return item
        return next(self._iterator)

    def exhausted(self) -> bool:
        if self._next is self._EMPTY:
            try:
                self._next = next(self._iterator)
            except StopIteration:
                return True
        return False
