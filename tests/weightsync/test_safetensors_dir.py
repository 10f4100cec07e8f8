from __future__ import annotations

import json

import pytest
import torch
from _weightsync_helpers import FakeEngine, assert_same_tensors
from safetensors.torch import save_file

from weightsync.transports import SafetensorsDirSender, WeightSyncError, iter_safetensors_dir, save_safetensors_dir
from weightsync.transports.disk import INDEX_NAME


def _weights() -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [
        ("model.embed_tokens.weight", torch.randn(64, 16, generator=generator)),
        ("model.layers.0.input_layernorm.weight", torch.randn(16, generator=generator).bfloat16()),
        ("model.layers.0.self_attn.q_proj.weight", torch.randn(16, 16, generator=generator).half()),
        ("model.scalar", torch.tensor(3, dtype=torch.int64)),
        ("model.empty", torch.empty(0, 4)),
        ("lm_head.weight", torch.randn(64, 16, generator=generator)),
    ]


def test_round_trip_with_shards_and_index(tmp_path):
    weights = _weights()
    shards = save_safetensors_dir(iter(weights), tmp_path / "step1", max_shard_bytes=4096)
    assert len(shards) == 3 and shards[0].name == "model-00001-of-00003.safetensors"
    index = json.loads((tmp_path / "step1" / INDEX_NAME).read_text())
    assert list(index["weight_map"]) == [name for name, _ in weights]
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for _, t in weights)
    assert_same_tensors(list(iter_safetensors_dir(tmp_path / "step1")), weights)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "staging directories left behind"


def test_tied_and_bucket_view_tensors_are_saved(tmp_path):
    shared = torch.randn(8, 4)
    storage = torch.arange(10, dtype=torch.float32)
    weights = [("embed", shared), ("lm_head", shared), ("a", storage[:4]), ("b", storage[4:])]
    save_safetensors_dir(weights, tmp_path / "w")
    assert_same_tensors(list(iter_safetensors_dir(tmp_path / "w")), weights)


def test_reads_directory_without_index(tmp_path):
    save_file({"b": torch.ones(2), "a": torch.zeros(3)}, str(tmp_path / "model.safetensors"))
    assert [name for name, _ in iter_safetensors_dir(tmp_path)] == ["a", "b"]


def test_errors_name_the_problem(tmp_path):
    with pytest.raises(WeightSyncError, match=r"no \*\.safetensors files"):
        list(iter_safetensors_dir(tmp_path))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        list(iter_safetensors_dir(tmp_path / "missing"))

    save_safetensors_dir(_weights(), tmp_path / "w", max_shard_bytes=4096)
    with pytest.raises(ValueError, match="not empty"):
        save_safetensors_dir(_weights(), tmp_path / "w")
    with pytest.raises(ValueError, match="appears twice"):
        save_safetensors_dir([("a", torch.ones(1)), ("a", torch.ones(1))], tmp_path / "dup")
    assert not (tmp_path / "dup").exists()

    index_path = tmp_path / "w" / INDEX_NAME
    index = json.loads(index_path.read_text())
    index["weight_map"]["ghost"] = "model-00001-of-00003.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(WeightSyncError, match=r"disagree: .*only in the index \['ghost'\]"):
        list(iter_safetensors_dir(tmp_path / "w"))
    index["weight_map"]["ghost"] = "model-00009-of-00009.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(WeightSyncError, match="shards that do not exist"):
        list(iter_safetensors_dir(tmp_path / "w"))


def test_sender_replaces_directory_each_step(tmp_path):
    sender = SafetensorsDirSender(tmp_path / "latest", max_shard_bytes=4096)
    first = _weights()
    assert sender.send(first).num_buckets == 3
    second = [("only", torch.ones(2))]
    stats = sender.send(second)
    assert stats.num_tensors == 1 and stats.total_bytes == 8
    engine = FakeEngine()
    engine.update_weights(iter_safetensors_dir(tmp_path / "latest"))
    assert_same_tensors(engine.last, second)
    assert sorted(p.name for p in (tmp_path / "latest").iterdir()) == sorted([INDEX_NAME, "model.safetensors"])
