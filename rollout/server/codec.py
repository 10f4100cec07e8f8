"""Bytes <-> values for the engine process's wire, never pickle.

A message is a msgpack header frame followed by raw frames. The header is parsed with no
extension types, string keys only and lists for arrays, after its size is checked against
a cap, so a peer can neither make us call anything (pickle's problem) nor make us allocate
much. Values are then checked field by field against the dataclass that names them:
`from_plain(SamplingParams, raw)` refuses unknown and missing fields and wrong types (an
int is not a bool, a float is not an int) naming the field, before the dataclass's own
`__post_init__` checks ranges.

Bulk data travels as raw frames the header describes: tensors (dtype and shape in the
header, their bytes in a frame, the size checked against both) and RolloutOutputs (their
bulk arrays as one int64 and one float64 frame, as rollout/wire.py lays them out; the other
fields in the header, derived from the dataclass so a new field travels unchanged).

Knows frames, dtypes and annotated types; not what any operation means (protocol.py).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np
import torch

from rollout.request import RolloutOutput
from rollout.server.errors import ProtocolError
from rollout.wire import header_fields

Buffer = bytes | bytearray | memoryview
MAX_DEPTH = 16  # nesting of free-form values (a LoRA config): msgpack's own stack is deeper

TENSOR_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64,
    "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8,
    "bool": torch.bool,
}
_DTYPE_NAMES = {dtype: name for name, dtype in TENSOR_DTYPES.items()}
MAX_TENSOR_DIMS = 8


# ---- msgpack ------------------------------------------------------------------------------
def pack(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def _refuse_ext(code: int, data: bytes) -> Any:
    raise ProtocolError(f"msgpack extension type {code} is not accepted")


def unpack(data: Buffer, what: str, max_bytes: int) -> Any:
    """Parse one header frame, refusing it unparsed when it is larger than `max_bytes`."""
    size = memoryview(data).nbytes
    if size > max_bytes:
        raise ProtocolError(f"{what} frame of {size} bytes exceeds the {max_bytes}-byte cap")
    try:
        # timestamp=0 would turn ext -1 into a Timestamp object; check_plain refuses it anyway
        return msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True, ext_hook=_refuse_ext)
    except ProtocolError:
        raise
    except Exception as error:  # msgpack raises several unrelated types for bad input
        raise ProtocolError(f"{what} frame is not valid msgpack ({type(error).__name__}: {error})") from None


# ---- plain values and annotated fields ------------------------------------------------------
def check_plain(value: Any, where: str, depth: int = 0) -> Any:
    """A free-form value (a LoRA config dict): nil, bool, int, float, str, bytes, and lists
    and str-keyed maps of those, at most MAX_DEPTH deep."""
    if depth > MAX_DEPTH:
        raise ProtocolError(f"{where}: nested more than {MAX_DEPTH} levels")
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    if isinstance(value, list):
        return [check_plain(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value)]
    if isinstance(value, dict):
        for key in value:
            if not isinstance(key, str):
                raise ProtocolError(f"{where}: map keys must be strings, got {type(key).__name__}")
        return {k: check_plain(v, f"{where}.{k}", depth + 1) for k, v in value.items()}
    raise ProtocolError(f"{where}: {type(value).__name__} is not a plain value")


def check_value(value: Any, hint: Any, where: str) -> Any:
    """`value` as the annotation `hint` declares it: checked, lists turned into tuples where
    the annotation says tuple, maps into dataclasses where it names one."""
    origin, args = _origin_args(hint)
    if hint is Any:
        return check_plain(value, where)
    if origin in (typing.Union, types.UnionType):
        if value is None:
            if type(None) in args:
                return None
            raise ProtocolError(f"{where}: must not be nil")
        options = [a for a in args if a is not type(None)]
        for option in options[:-1]:
            try:
                return check_value(value, option, where)
            except ProtocolError:
                continue
        return check_value(value, options[-1], where)
    if hint is type(None):
        if value is not None:
            raise ProtocolError(f"{where}: must be nil, got {type(value).__name__}")
        return None
    if hint is bool:
        if not isinstance(value, bool):
            raise ProtocolError(f"{where}: expected a bool, got {type(value).__name__}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ProtocolError(f"{where}: expected an int, got {type(value).__name__}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ProtocolError(f"{where}: expected a number, got {type(value).__name__}")
        return float(value)
    if hint in (str, bytes):
        if not isinstance(value, hint):
            raise ProtocolError(f"{where}: expected {hint.__name__}, got {type(value).__name__}")
        return value
    if hint is dict or origin is dict:
        if not isinstance(value, dict):
            raise ProtocolError(f"{where}: expected a map, got {type(value).__name__}")
        return check_plain(value, where)
    if origin in (list, tuple):
        if not isinstance(value, list):
            raise ProtocolError(f"{where}: expected a list, got {type(value).__name__}")
        if origin is list:
            if args[0] is int and all(type(v) is int for v in value):
                return value  # token ids: one C-speed pass (msgpack gives exact ints; a bool is no int here)
            return [check_value(v, args[0], f"{where}[{i}]") for i, v in enumerate(value)]
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(check_value(v, args[0], f"{where}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise ProtocolError(f"{where}: expected {len(args)} items, got {len(value)}")
        return tuple(check_value(v, a, f"{where}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if dataclasses.is_dataclass(hint):
        return from_plain(hint, value, where)
    raise TypeError(f"{where}: no wire form for annotation {hint!r}")  # a bug here, not the peer's


@functools.lru_cache(maxsize=None)
def _origin_args(hint: Any) -> tuple[Any, tuple]:
    """typing's view of an annotation, once per annotation (it is asked per value)."""
    return typing.get_origin(hint), typing.get_args(hint)


@functools.lru_cache(maxsize=None)
def _type_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


@functools.lru_cache(maxsize=None)
def wire_fields(cls: type) -> tuple[dataclasses.Field, ...]:
    """The fields a dataclass sends in its header (those marked frames=True go as frames)."""
    return tuple(f for f in dataclasses.fields(cls) if f.init and not f.metadata.get("frames"))


def from_plain(cls: type, raw: Any, where: str, extra: dict[str, Any] | None = None) -> Any:
    """Build dataclass `cls` from a decoded map: exactly its fields (those with defaults may
    be left out), each checked against its annotation, then `cls(...)` checks ranges."""
    if not isinstance(raw, dict):
        raise ProtocolError(f"{where}: expected a map, got {type(raw).__name__}")
    specs = {f.name: f for f in wire_fields(cls)}
    unknown = sorted(set(raw) - set(specs))
    if unknown:
        raise ProtocolError(f"{where}: unknown field(s) {unknown} (expected {sorted(specs)})")
    missing = sorted(name for name, f in specs.items() if name not in raw and _required(f))
    if missing:
        raise ProtocolError(f"{where}: missing field(s) {missing}")
    hints = _type_hints(cls)
    kwargs = {name: check_value(value, hints[name], f"{where}.{name}") for name, value in raw.items()}
    return cls(**kwargs, **(extra or {}))


def _required(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING  # type: ignore[misc]


def to_plain(value: Any) -> Any:
    """A dataclass (or list, tuple, map of them) as msgpack-ready plain values."""
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_plain(getattr(value, f.name)) for f in wire_fields(type(value))}
    if isinstance(value, (list, tuple)):
        if all(type(v) is int for v in value):
            return list(value)  # token ids: no call per element
        return [to_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): to_plain(v) for k, v in value.items()}
    raise TypeError(f"{type(value).__name__} has no wire form")


# ---- tensors --------------------------------------------------------------------------------
def tensors_to_frames(named_tensors: Sequence[tuple[str, torch.Tensor]]) -> tuple[list[dict], list[Any]]:
    """(header descriptors, one raw frame per tensor). CPU copies; no copy for CPU tensors
    already contiguous (the frame is a view zmq sends from)."""
    descriptors, frames = [], []
    for name, tensor in named_tensors:
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise TypeError(f"named tensors: expected (str, Tensor) pairs, got ({type(name).__name__}, {type(tensor).__name__})")
        if tensor.dtype not in _DTYPE_NAMES:
            raise TypeError(f"tensor {name!r}: dtype {tensor.dtype} cannot travel (supported: {sorted(TENSOR_DTYPES)})")
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        descriptors.append({"name": name, "dtype": _DTYPE_NAMES[tensor.dtype], "shape": list(tensor.shape)})
        frames.append(flat.view(torch.uint8).numpy() if flat.numel() else b"")
    return descriptors, frames


def frames_to_tensors(descriptors: Any, frames: Sequence[Buffer], max_tensor_bytes: int) -> list[tuple[str, torch.Tensor]]:
    if not isinstance(descriptors, list):
        raise ProtocolError(f"tensors: expected a list of descriptors, got {type(descriptors).__name__}")
    if len(descriptors) != len(frames):
        raise ProtocolError(f"tensors: the header describes {len(descriptors)} tensors but {len(frames)} frames follow")
    out = []
    for i, (desc, frame) in enumerate(zip(descriptors, frames)):
        where = f"tensors[{i}]"
        if not isinstance(desc, dict) or set(desc) != {"name", "dtype", "shape"}:
            raise ProtocolError(f"{where}: expected a map of exactly name, dtype, shape")
        name = check_value(desc["name"], str, f"{where}.name")
        dtype = TENSOR_DTYPES.get(desc["dtype"]) if isinstance(desc["dtype"], str) else None
        if dtype is None:
            raise ProtocolError(f"{where} ({name!r}): dtype {desc['dtype']!r} is not one of {sorted(TENSOR_DTYPES)}")
        shape = check_value(desc["shape"], list[int], f"{where}.shape")
        if len(shape) > MAX_TENSOR_DIMS or any(d < 0 for d in shape):
            raise ProtocolError(f"{where} ({name!r}): shape {shape} must have <= {MAX_TENSOR_DIMS} dims, none negative")
        size = memoryview(frame).nbytes
        if size > max_tensor_bytes:
            raise ProtocolError(f"{where} ({name!r}): frame of {size} bytes exceeds the {max_tensor_bytes}-byte cap")
        expected = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if size != expected:
            raise ProtocolError(f"{where} ({name!r}): {desc['dtype']} {shape} needs {expected} bytes, the frame has {size}")
        if expected == 0:
            tensor = torch.empty(shape, dtype=dtype)
        else:  # a private, writable copy: the frame's memory belongs to zmq
            tensor = torch.frombuffer(bytearray(frame), dtype=dtype).reshape(shape)
        out.append((name, tensor))
    return out


# ---- RolloutOutputs ------------------------------------------------------------------------
_LENGTHS = ("prompt_len", "num_tokens")


def outputs_to_wire(outputs: Sequence[RolloutOutput]) -> tuple[list[dict], list[bytes]]:
    """(per-output header maps, [int64 prompt+generated ids, float64 log-probs]). float64
    keeps the engine's Python floats bit-exact; msgpack would too, but an array is one copy
    where a list is one object per token."""
    names = header_fields(RolloutOutput)
    metas = [{**{name: to_plain(getattr(o, name)) for name in names},
              "prompt_len": len(o.prompt_ids), "num_tokens": len(o.token_ids)} for o in outputs]
    ids = np.fromiter((t for o in outputs for t in (*o.prompt_ids, *o.token_ids)), dtype=np.int64)
    logprobs = np.fromiter((x for o in outputs for x in o.logprobs), dtype=np.float64)
    return metas, [ids.tobytes(), logprobs.tobytes()]


def outputs_from_wire(metas: Any, frames: Sequence[Buffer], where: str = "outputs") -> list[RolloutOutput]:
    if not isinstance(metas, list):
        raise ProtocolError(f"{where}: expected a list, got {type(metas).__name__}")
    if len(frames) != 2:
        raise ProtocolError(f"{where}: expected 2 frames (token ids, log-probs), got {len(frames)}")
    hints = _type_hints(RolloutOutput)
    names = header_fields(RolloutOutput)
    checked = []
    for i, meta in enumerate(metas):
        at = f"{where}[{i}]"
        if not isinstance(meta, dict) or set(meta) != {*names, *_LENGTHS}:
            got = sorted(meta) if isinstance(meta, dict) else type(meta).__name__
            raise ProtocolError(f"{at}: expected the fields {sorted({*names, *_LENGTHS})}, got {got}")
        lengths = [check_value(meta[k], int, f"{at}.{k}") for k in _LENGTHS]
        if min(lengths) < 0:
            raise ProtocolError(f"{at}: negative length {lengths}")
        checked.append(({name: check_value(meta[name], hints[name], f"{at}.{name}") for name in names}, *lengths))
    num_ids = sum(p + n for _, p, n in checked)
    num_logprobs = sum(n for _, _, n in checked)
    for frame, count, what in ((frames[0], num_ids, "token ids"), (frames[1], num_logprobs, "log-probs")):
        if memoryview(frame).nbytes != 8 * count:
            raise ProtocolError(f"{where}: {what} frame has {memoryview(frame).nbytes} bytes, the header needs {8 * count}")
    ids = np.frombuffer(frames[0], dtype=np.int64).tolist()
    logprobs = np.frombuffer(frames[1], dtype=np.float64).tolist()
    outputs, i, j = [], 0, 0
    for small, p, n in checked:
        outputs.append(RolloutOutput(prompt_ids=ids[i : i + p], token_ids=ids[i + p : i + p + n],
                                     logprobs=logprobs[j : j + n], **small))
        i, j = i + p + n, j + n
    return outputs
