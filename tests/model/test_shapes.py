"""The benchmark shapes are configs the engine and transformers both read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollout.model.config import ModelConfig
from rollout.model.shapes import SHAPES, write_shape_dir


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_shape_dir_loads_as_a_model_config(name: str) -> None:
    path = write_shape_dir(name)
    assert json.loads((Path(path) / "config.json").read_text()) == SHAPES[name]
    cfg = ModelConfig.from_dir(path)
    assert cfg.vocab_size == SHAPES[name]["vocab_size"] and cfg.num_layers == SHAPES[name]["num_hidden_layers"]


def test_unknown_shape_is_named() -> None:
    with pytest.raises(ValueError, match="'llama70b'"):
        write_shape_dir("llama70b")
