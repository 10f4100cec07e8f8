"""rollout/model/parallel.py without processes: which TP sizes a model allows (refused by
name, before any process group or spawn), what TP refuses, and the shard maps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rollout import Engine, EngineConfig
from rollout.distributed.tp import TensorParallel
from rollout.distributed.tp_engine import TPEngine
from rollout.model.config import ModelConfig
from rollout.model.parallel import check_tp_size, local_rows, shard_dim, take_shard

# SmolLM2-135M's config.json shapes (no weights needed: sizes are refused before loading)
SMOLLM2 = {"architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
           "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "tie_word_embeddings": True}


def test_smollm2_allows_tp_1_and_3_only() -> None:
    cfg = ModelConfig.from_dict(SMOLLM2)
    check_tp_size(cfg, 3)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2: the model's num_attention_heads=9, "
                                         r"num_key_value_heads=3 not divisible by 2; .* in \[1, 3\]"):
        check_tp_size(cfg, 2)
    with pytest.raises(ValueError, match=r"num_key_value_heads=3, intermediate_size=1536, vocab_size=49152 not divisible by 9"):
        check_tp_size(cfg, 9)  # 9 query heads divide, the KV heads do not (they are split, not replicated)


def test_engine_and_tp_engine_refuse_a_size_before_any_group(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2))
    for make in (Engine, TPEngine):
        with pytest.raises(ValueError, match="num_attention_heads=9"):
            make(EngineConfig(model=str(tmp_path), tensor_parallel_size=2))


def test_tp_without_a_process_group_says_how_to_launch(llama) -> None:
    with pytest.raises(ValueError, match="needs a process group: run every rank under torchrun .*TPEngine"):
        Engine(EngineConfig(model=llama.path, tensor_parallel_size=2))


def test_tp_refuses_the_speculation_governor(llama) -> None:
    """It decides from step times, which differ across ranks (SPMD needs the same decisions)."""
    with pytest.raises(ValueError, match=r"EngineConfig.speculative_governor=True with tensor_parallel_size=2: .* "
                                         r"set speculative_governor=False"):
        EngineConfig(model=llama.path, tensor_parallel_size=2, speculative="ngram")


def test_shards_tile_the_full_tensor() -> None:
    """Rank r's pieces of a fused qkv (q heads, then k, then v) and of a row-parallel weight,
    put back together, give the full tensor: every row/column on exactly one rank."""
    assert [shard_dim(n) for n in ("layers.0.self_attn.qkv_proj.weight", "layers.0.mlp.down_proj.weight",
                                   "embed_tokens.weight", "layers.0.input_layernorm.weight")] == [0, 1, 0, None]
    full = torch.arange(24.0).reshape(6, 4)
    for dim in (0, 1):
        parts = [take_shard(full, dim, TensorParallel(r, 2)) for r in range(2)]
        assert torch.equal(torch.cat(parts, dim), full)
    # q rows [0, 8), k [8, 12), v [12, 16) of the whole model -> [0, 4), [4, 6), [6, 8) per rank of 2
    assert [local_rows(s, TensorParallel(1, 2)) for s in (slice(0, 8), slice(8, 12), slice(12, 16))] == \
        [slice(0, 4), slice(4, 6), slice(6, 8)]
