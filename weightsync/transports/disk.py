"""Safetensors directory transport: the slow, universal path (and checkpoint format).

Layout is Hugging Face's: `model-00001-of-00003.safetensors` ... plus
`model.safetensors.index.json` ({"metadata": {"total_size": N}, "weight_map": {name: file}}).
A directory written elsewhere with a single `model.safetensors` and no index reads too.

The writer fills one shard at a time (lazy, like bucket packing) and renames the finished
directory into place, so a reader never sees half an update.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from weightsync.transports.base import SendStats, StreamCounter, WeightSyncError

INDEX_NAME = "model.safetensors.index.json"
DEFAULT_SHARD_BYTES = 5 << 30  # Hugging Face's default


def save_safetensors_dir(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    path: str | os.PathLike[str],
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    *,
    overwrite: bool = False,
) -> list[Path]:
    """Write tensors as HF-style shards + index into `path`; returns the shard paths.

    `path` must not exist, be empty, or (with overwrite=True) is replaced whole.
    """
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be > 0, got {max_shard_bytes}")
    target = Path(path)
    if target.exists() and not target.is_dir():
        raise ValueError(f"{target} exists and is not a directory")
    if target.exists() and any(target.iterdir()) and not overwrite:
        raise ValueError(f"{target} is not empty; pass overwrite=True to replace it, or write to a fresh directory")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.writing-", dir=target.parent))
    try:
        shard_names, weight_map, total_size = _write_shards(named_tensors, staging, max_shard_bytes)
        final_names = _final_shard_names(len(shard_names))
        for temporary, final in zip(shard_names, final_names):
            os.replace(staging / temporary, staging / final)
        index = {
            "metadata": {"total_size": total_size},
            "weight_map": {name: final_names[shard] for name, shard in weight_map.items()},
        }
        (staging / INDEX_NAME).write_text(json.dumps(index, indent=2))
        _move_into_place(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return [target / name for name in final_names]


def iter_safetensors_dir(
    path: str | os.PathLike[str], device: torch.device | str = "cpu"
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) from every shard of a safetensors directory, one tensor at a time."""
    directory = Path(path)
    if not directory.is_dir():
        raise FileNotFoundError(f"safetensors directory {directory} does not exist")
    shards, weight_map = _shard_files(directory)
    seen: dict[str, Path] = {}
    for shard in shards:
        with safe_open(str(shard), framework="pt", device=str(device)) as reader:
            names = list(reader.keys())  # sorted by safetensors, not in writing order
            if weight_map is not None:
                # The index keeps the writer's order; it must agree with the shard exactly.
                indexed = [name for name, file in weight_map.items() if file == shard.name]
                if set(indexed) != set(names):
                    raise WeightSyncError(
                        f"{shard.name} and {INDEX_NAME} disagree: only in the shard "
                        f"{sorted(set(names) - set(indexed))[:10]}, only in the index {sorted(set(indexed) - set(names))[:10]}"
                    )
                names = indexed
            for name in names:
                if name in seen:
                    raise WeightSyncError(f"tensor {name!r} appears in both {seen[name].name} and {shard.name}")
                seen[name] = shard
                yield name, reader.get_tensor(name)


class SafetensorsDirSender:
    """Trainer side: each send() replaces the directory with the new weights."""

    def __init__(self, path: str | os.PathLike[str], *, max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> None:
        self.path = Path(path)
        self.max_shard_bytes = max_shard_bytes

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> SendStats:
        counter = StreamCounter()
        shards = save_safetensors_dir(counter.wrap(named_tensors), self.path, self.max_shard_bytes, overwrite=True)
        return counter.stats(num_buckets=len(shards))


def _write_shards(
    named_tensors: Iterable[tuple[str, torch.Tensor]], staging: Path, max_shard_bytes: int
) -> tuple[list[str], dict[str, int], int]:
    shard_names: list[str] = []
    weight_map: dict[str, int] = {}
    total_size = 0
    current: dict[str, torch.Tensor] = {}
    current_bytes = 0
    storages: set[int] = set()

    def flush() -> None:
        nonlocal current, current_bytes
        name = f"shard-{len(shard_names):05d}.safetensors"
        save_file(current, str(staging / name), metadata={"format": "pt"})
        shard_names.append(name)
        current, current_bytes = {}, 0
        storages.clear()

    for name, tensor in named_tensors:
        if not isinstance(name, str) or not name:
            raise TypeError(f"weight names must be non-empty strings, got {name!r}")
        if name in weight_map:
            raise ValueError(f"weight {name!r} appears twice in the stream")
        tensor = tensor.detach().to("cpu").contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        if current and current_bytes + nbytes > max_shard_bytes:
            flush()
        # safetensors refuses two names on one storage (tied weights): give the second its own.
        storage = tensor.untyped_storage().data_ptr()
        if nbytes and storage in storages:
            tensor = tensor.clone()
        storages.add(tensor.untyped_storage().data_ptr())
        current[name] = tensor
        current_bytes += nbytes
        total_size += nbytes
        weight_map[name] = len(shard_names)
    if current or not shard_names:
        flush()
    return shard_names, weight_map, total_size


def _final_shard_names(count: int) -> list[str]:
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def _move_into_place(staging: Path, target: Path) -> None:
    if not target.exists():
        os.replace(staging, target)
        return
    # Swap via a sibling so the old weights disappear only once the new ones are complete.
    retired = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
    os.replace(target, retired / "weights")
    os.replace(staging, target)
    shutil.rmtree(retired, ignore_errors=True)


def _shard_files(directory: Path) -> tuple[list[Path], dict[str, str] | None]:
    """The shards to read, in order, and the index's weight map when there is an index."""
    index_path = directory / INDEX_NAME
    if index_path.exists():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise TypeError("weight_map must map names to file names")
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            raise WeightSyncError(f"{index_path} is not a valid safetensors index: {error!r}") from None
        files = list(dict.fromkeys(weight_map.values()))  # first-appearance order, no repeats
        missing = [name for name in files if not (directory / name).is_file()]
        if missing:
            raise WeightSyncError(f"{index_path} names shards that do not exist: {missing}")
        return [directory / name for name in files], weight_map
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise WeightSyncError(f"no *.safetensors files in {directory}")
    return files, None
