"""Read the history records of an offline W&B run (`run-<id>.wandb`) without the network.

wandb >= 0.19 dropped its Python reader; the file is still a LevelDB-style log (a 7-byte
header, then 32 KiB blocks of records: crc32, length, type, data; FULL / FIRST / MIDDLE /
LAST types) of wandb's protobuf `Record`s, which wandb.proto still parses.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

_BLOCK = 32768
_HEADER = 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _records(path: Path) -> list[bytes]:
    data = path.read_bytes()
    if not data.startswith(b":W&B"):
        raise ValueError(f"{path}: not a W&B run file")
    out, pending, pos = [], b"", _HEADER
    while pos + 7 <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < 7:  # block trailer padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == _FULL:
            out.append(chunk)
        elif kind == _FIRST:
            pending = chunk
        elif kind == _MIDDLE:
            pending += chunk
        elif kind == _LAST:
            out.append(pending + chunk)
    return out


def read_history(run_dir: str | Path) -> list[dict[str, object]]:
    """One dict per logged step: key -> decoded JSON value (nested keys joined by '/')."""
    from wandb.proto import wandb_internal_pb2 as pb

    (run_file,) = Path(run_dir).glob("run-*.wandb")
    rows = []
    for raw in _records(run_file):
        record = pb.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            rows.append({(item.key or "/".join(item.nested_key)): json.loads(item.value_json)
                         for item in record.history.item})
    return rows
