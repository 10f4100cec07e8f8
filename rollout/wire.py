"""RolloutOutputs <-> one uint8 tensor, to cross processes (torch.distributed, later a socket)
without pickle.

Layout (little-endian):
    uint64  header length H
    H bytes JSON header: {"version", "fields", "outputs"}; per output every RolloutOutput
            field except the bulk arrays, plus prompt_len and num_tokens
    pad to a multiple of 8
    int64   token section: for each output, its prompt ids then its generated ids
    float64 logprobs of the generated tokens, in the same order

Tokens and logprobs are the bulk and travel as raw arrays; float64 keeps the engine's
float32-derived Python floats bit-exact. The JSON carries the rest, whatever fields
RolloutOutput has: they are read from `dataclasses.fields`, and values come back in the
types the field annotations name (tuples inside lists, `X | None`), so a field added to
RolloutOutput travels without a change here. A field value must be JSON-representable
(numbers, strings, None, lists/tuples of them); anything else fails to pack, loudly.

The receiver checks the version and that the header names exactly its own fields: sender
and receiver built from different RolloutOutput definitions fail with the names that
differ, rather than drop or invent data.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from rollout.request import RolloutOutput

WIRE_VERSION = 2  # 2: header fields derived from the dataclass (1 had a fixed list)
_BULK_FIELDS = ("prompt_ids", "token_ids", "logprobs")
_LENGTH_KEYS = ("prompt_len", "num_tokens")


def header_fields(output_type: type = RolloutOutput) -> tuple[str, ...]:
    """The fields the JSON header carries: every dataclass field but the bulk arrays."""
    return tuple(f.name for f in dataclasses.fields(output_type) if f.name not in _BULK_FIELDS)


def pack_outputs(outputs: Sequence[RolloutOutput], output_type: type = RolloutOutput) -> torch.Tensor:
    names = header_fields(output_type)
    header = {
        "version": WIRE_VERSION,
        "fields": list(names),
        "outputs": [
            {**{name: getattr(o, name) for name in names}, "prompt_len": len(o.prompt_ids), "num_tokens": len(o.token_ids)}
            for o in outputs
        ],
    }
    head = json.dumps(header, separators=(",", ":")).encode()
    pad = -(8 + len(head)) % 8
    tokens = np.fromiter((t for o in outputs for t in (*o.prompt_ids, *o.token_ids)), dtype=np.int64)
    logprobs = np.fromiter((x for o in outputs for x in o.logprobs), dtype=np.float64)
    blob = b"".join([np.uint64(len(head)).tobytes(), head, b"\0" * pad, tokens.tobytes(), logprobs.tobytes()])
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8)


def unpack_outputs(buf: torch.Tensor, output_type: type = RolloutOutput) -> list[RolloutOutput]:
    raw = buf.cpu().numpy().tobytes()
    head_len = int(np.frombuffer(raw[:8], dtype=np.uint64)[0])
    header = json.loads(raw[8 : 8 + head_len])
    if header.get("version") != WIRE_VERSION:
        raise ValueError(f"rollout buffer version {header.get('version')!r}, expected {WIRE_VERSION}")
    names = header_fields(output_type)
    _check_fields(header.get("fields"), names, output_type)
    hints = typing.get_type_hints(output_type)
    metas = header["outputs"]
    start = 8 + head_len + (-(8 + head_len) % 8)
    num_ids = sum(m["prompt_len"] + m["num_tokens"] for m in metas)
    num_lp = sum(m["num_tokens"] for m in metas)
    ids = np.frombuffer(raw, dtype=np.int64, count=num_ids, offset=start).tolist()
    lps = np.frombuffer(raw, dtype=np.float64, count=num_lp, offset=start + 8 * num_ids).tolist()
    outputs, i, j = [], 0, 0
    for m in metas:
        p, n = m["prompt_len"], m["num_tokens"]
        small = {name: _as_annotated(m[name], hints[name]) for name in names}
        outputs.append(output_type(prompt_ids=ids[i : i + p], token_ids=ids[i + p : i + p + n], logprobs=lps[j : j + n], **small))
        i, j = i + p + n, j + n
    return outputs


def output_to_json(o: RolloutOutput) -> dict:
    """A plain dict of every field (tuples as JSON writes them: lists), for result files."""
    return dataclasses.asdict(o)


def _check_fields(sent: Any, expected: tuple[str, ...], output_type: type) -> None:
    if not isinstance(sent, list) or sorted(sent) != sorted(expected):
        sent_set = set(sent) if isinstance(sent, list) else set()
        raise ValueError(f"rollout buffer fields differ from this {output_type.__name__}: "
                         f"unknown {sorted(sent_set - set(expected))}, missing {sorted(set(expected) - sent_set)}")


def _as_annotated(value: Any, hint: Any) -> Any:
    """A JSON value in the type the annotation names: JSON has no tuples, so lists become
    tuples where the annotation says tuple, at any depth; everything else passes as is."""
    if value is None:
        return None
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in args if a is not type(None)]
        return _as_annotated(value, options[0]) if len(options) == 1 else value
    if origin is list and args and isinstance(value, list):
        return [_as_annotated(v, args[0]) for v in value]
    if origin is tuple and isinstance(value, list):
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_as_annotated(v, args[0]) for v in value)
        if len(args) == len(value):
            return tuple(_as_annotated(v, a) for v, a in zip(value, args))
        return tuple(value)
    return value
