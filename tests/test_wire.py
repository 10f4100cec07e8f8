"""rollout/wire.py: RolloutOutputs round-trip through one uint8 tensor, bit-exact, with no
pickle; fields added to RolloutOutput travel without a change to the codec."""

from __future__ import annotations

import dataclasses
import json
import types
import typing

import numpy as np
import pytest
import torch

from rollout.request import RolloutOutput
from rollout.wire import WIRE_VERSION, header_fields, output_to_json, pack_outputs, unpack_outputs


def _outputs() -> list[RolloutOutput]:
    return [
        RolloutOutput("a", 3, 1, [1, 2, 3], [7, 8], [-0.1234567, -2.5], "length", "hé", 2, 1, [(0, 0, 1), (1, 1, 2)],
                      top_logprobs=[[(7, -0.1), (9, -3.0)], [(8, -2.5)]]),
        RolloutOutput("b", 0, 0, [4], [], [], "abort", None, 0, 0, []),
    ]


def _header(buf: torch.Tensor) -> dict:
    raw = buf.numpy().tobytes()
    return json.loads(raw[8 : 8 + int(np.frombuffer(raw[:8], dtype=np.uint64)[0])])


def test_round_trip_is_exact() -> None:
    outs = _outputs()
    back = unpack_outputs(pack_outputs(outs))
    assert back == outs
    assert isinstance(back[0].weight_versions[0], tuple) and isinstance(back[0].top_logprobs[0][0], tuple)
    assert unpack_outputs(pack_outputs([])) == []


def test_logprobs_survive_bit_exact() -> None:
    lp = float(np.float32(-1.0) / np.float32(3.0))  # a float32-derived value, as the engine makes
    out = RolloutOutput("x", 0, 0, [1], [2], [lp], "stop", None, 0, 0, [(0, 0, 1)])
    assert unpack_outputs(pack_outputs([out]))[0].logprobs[0] == lp


def test_header_carries_every_field_but_the_bulk_arrays() -> None:
    names = header_fields()
    assert set(names) == {f.name for f in dataclasses.fields(RolloutOutput)} - {"prompt_ids", "token_ids", "logprobs"}
    header = _header(pack_outputs(_outputs()))
    assert header["version"] == WIRE_VERSION and header["fields"] == list(names)
    assert "token_ids" not in header["outputs"][0]


def _sample(hint):
    """A non-default value of the annotated type (the first option of a union)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return _sample(next(a for a in args if a is not type(None)))
    if origin is list:
        return [_sample(args[0]), _sample(args[0])]
    if origin is tuple:
        return tuple(_sample(a) for a in args)
    return {str: "s", int: 7, float: -0.25, bool: True}[hint]


def test_every_field_round_trips_whatever_fields_there_are() -> None:
    """Fills every field of today's RolloutOutput from its annotation (fields added later
    included), so a new field whose type JSON cannot carry back fails here."""
    hints = typing.get_type_hints(RolloutOutput)
    out = RolloutOutput(**{f.name: _sample(hints[f.name]) for f in dataclasses.fields(RolloutOutput)})
    out.prompt_ids, out.token_ids, out.logprobs = [1, 2], [3, 4], [-0.5, -1.5]
    assert unpack_outputs(pack_outputs([out])) == [out]


# A RolloutOutput that has grown fields: the codec carries them unchanged.
GrownOutput = dataclasses.make_dataclass(
    "GrownOutput",
    [("adapter_tag", "str | None", dataclasses.field(default=None)),
     ("adapter_spans", "list[tuple[int, int, int]]", dataclasses.field(default_factory=list))],
    bases=(RolloutOutput,),
)


def _grown(base: RolloutOutput, **extra) -> GrownOutput:
    return GrownOutput(**{f.name: getattr(base, f.name) for f in dataclasses.fields(RolloutOutput)}, **extra)


def test_new_fields_travel_without_codec_changes() -> None:
    out = _grown(_outputs()[0], adapter_tag="math", adapter_spans=[(3, 0, 2)])
    back = unpack_outputs(pack_outputs([out], GrownOutput), GrownOutput)
    assert back == [out] and back[0].adapter_spans == [(3, 0, 2)]


def test_sender_and_receiver_fields_must_agree() -> None:
    with pytest.raises(ValueError, match=r"unknown \['adapter_spans', 'adapter_tag'\], missing \[\]"):
        unpack_outputs(pack_outputs([_grown(_outputs()[1])], GrownOutput))


def test_other_versions_are_refused() -> None:
    buf = pack_outputs(_outputs())
    raw = bytearray(buf.numpy().tobytes())
    raw[8:] = raw[8:].replace(f'"version":{WIRE_VERSION}'.encode(), b'"version":9', 1)
    with pytest.raises(ValueError, match="version 9"):
        unpack_outputs(torch.frombuffer(raw, dtype=torch.uint8))


def test_a_value_json_cannot_carry_fails_to_pack() -> None:
    out = dataclasses.replace(_outputs()[1], text=object())  # never pickled instead
    with pytest.raises(TypeError):
        pack_outputs([out])


def test_output_to_json_is_plain() -> None:
    doc = output_to_json(_outputs()[0])
    assert json.loads(json.dumps(doc))["weight_versions"] == [[0, 0, 1], [1, 1, 2]]
