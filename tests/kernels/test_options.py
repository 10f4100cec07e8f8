"""KernelOptions (rollout/kernels/options.py): one frozen object per engine says which kernels it
launches. Checked here: bad fields are refused by name, the environment gives the PDL and LoRA
defaults when an object is made, the JSON form TPEngine's workers get comes back equal, and an
engine hands its one object to everything that launches a kernel, so two engines in one
process keep their own choices (nothing is read from a module switch)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from conftest import TinyModel
from rollout import Engine, EngineConfig
from rollout.kernels.batch_invariant_tiles import TileConfig
from rollout.kernels.options import DEFAULT_OPTIONS, KernelOptions
from rollout.model.llama import Linear, RMSNorm


@pytest.mark.parametrize(("field", "value", "match"), [
    ("skinny_matmul", None, "skinny_matmul=None: expected True or False"),
    ("pdl", 1, "pdl=1: expected True or False"),
    ("fused", "yes", "fused='yes': expected None, True or False"),
    ("extend_rows_kv", -1, "extend_rows_kv=-1: expected None or an int >= 0"),
    ("verify_rows_max", 2.5, "verify_rows_max=2.5: expected None or an int >= 0"),
    ("lora_split_k", 0, "lora_split_k=0: expected None or an int >= 1"),
    ("lora_expand_block_n", 24, "lora_expand_block_n=24: expected a power of 2 >= 16"),
    ("batch_invariant_tiles", (16, 16, 64, 4, 2), "batch_invariant_tiles=.*TileConfig"),
])
def test_bad_fields_are_refused_by_name(field: str, value: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        KernelOptions(**{field: value})


def test_defaults_are_the_engines_choices_and_the_environment_is_read_when_made(monkeypatch) -> None:
    for name in ("ROLLOUT_PDL", "ROLLOUT_LORA_PDL", "ROLLOUT_LORA_TRITON"):
        monkeypatch.delenv(name, raising=False)
    on = KernelOptions()
    assert (on.pdl, on.lora_pdl, on.lora_triton) == (True, True, None)
    assert (on.fused, on.skinny_matmul, on.silu_epilogue, on.rope_epilogue, on.rotary_kv_store) == (None, True, True,
                                                                                                   True, True)
    assert on.pdl_rotary_attention and on.lora_one_row_epilogue and not on.lora_defer_eager
    monkeypatch.setenv("ROLLOUT_PDL", "0")
    monkeypatch.setenv("ROLLOUT_LORA_PDL", "false")
    monkeypatch.setenv("ROLLOUT_LORA_TRITON", "1")
    off = KernelOptions()
    assert (off.pdl, off.lora_pdl, off.lora_triton) == (False, False, True)
    monkeypatch.delenv("ROLLOUT_LORA_TRITON")
    assert KernelOptions().lora_triton is None
    assert KernelOptions(pdl=True).pdl, "a field given wins over the environment"


def test_the_json_form_comes_back_equal() -> None:
    options = KernelOptions(skinny_matmul=False, extend_rows_kv=0, lora_split_k=2,
                            batch_invariant_tiles=TileConfig(16, 32, 64, 4, 2, split=True, k_chunk=128))
    config = EngineConfig(model="unused", kernel_options=options)
    back = EngineConfig(**json.loads(json.dumps(dataclasses.asdict(config))))  # what a TP worker builds
    assert back.kernel_options == options and back == config
    assert EngineConfig(model="unused").kernel_options == KernelOptions() == DEFAULT_OPTIONS
    with pytest.raises(ValueError, match="EngineConfig.kernel_options=.*KernelOptions or None"):
        EngineConfig(model="unused", kernel_options=["skinny_matmul"])


def _holders(engine: Engine) -> list[object]:
    """Everything of the engine that holds its kernel options."""
    model = engine.model
    layers = [m for m in model.modules() if isinstance(m, (Linear, RMSNorm))]
    return [model, *layers, model.layers[0].self_attn, model.layers[0].mlp, engine.runner.backend]


def test_an_engine_hands_its_one_options_object_to_every_kernel_holder(llama: TinyModel) -> None:
    mine = KernelOptions(skinny_matmul=False, rotary_kv_store=False, fused=False, extend_rows_kv=0, verify_rows_max=3,
                         lora_defer_max_rows=5, lora_concurrent_max_rows=7, lora_one_row_epilogue=False)
    engine = Engine(EngineConfig(model=llama.path, enable_lora=True, max_loras_per_batch=2, max_lora_rank=8,
                                 kernel_options=mine))
    plain = Engine(EngineConfig(model=llama.path, enable_lora=True, max_loras_per_batch=2, max_lora_rank=8))
    assert all(holder.options is mine for holder in _holders(engine))  # type: ignore[attr-defined]
    assert all(holder.options == KernelOptions() for holder in _holders(plain))  # type: ignore[attr-defined]
    assert engine.model.rotary.fused is False and engine.kv_pool.fused is False
    assert (engine.runner.extend_rows_kv, engine.runner.verify_rows_max) == (0, 3)
    assert (plain.runner.extend_rows_kv, plain.runner.verify_rows_max) == (None, None)
    pool = engine.lora.pool  # type: ignore[union-attr]
    assert pool.options is mine and (pool.defer_max_rows, pool.concurrent_max_rows, pool.one_row_epilogue) == (5, 7,
                                                                                                              False)
    default_pool = plain.lora.pool  # type: ignore[union-attr]
    assert (default_pool.defer_max_rows, default_pool.concurrent_max_rows, default_pool.one_row_epilogue) == (16, 192,
                                                                                                              True)
    engine.runner.backend.plan(_one_token_batch(engine))
    assert engine.runner.backend.kv_target(0) is None, "rotary_kv_store off: forward stores the K/V"


def _one_token_batch(engine: Engine):
    import torch

    from rollout.batch import ForwardBatch

    one = torch.tensor([1])
    return ForwardBatch(input_ids=one, positions=torch.tensor([0]), out_cache_loc=one,
                        qo_indptr=torch.tensor([0, 1], dtype=torch.int32), kv_indptr=torch.tensor([0, 1], dtype=torch.int32),
                        kv_indices=one, logits_indices=torch.tensor([0]), extend_lens=[1], seq_lens=[1], num_decode=0)


def test_the_draft_model_gets_the_engines_options(llama: TinyModel) -> None:
    mine = KernelOptions(skinny_matmul=False, draft_rows_max=0)
    engine = Engine(EngineConfig(model=llama.path, speculative="draft", draft_model=llama.path,
                                 speculative_governor=False, kernel_options=mine))
    runner = engine.draft
    assert runner is not None and runner.rows_max == 0 and runner.model.options is mine
    assert runner.backend.options is mine and runner.pool.fused is mine.fused
