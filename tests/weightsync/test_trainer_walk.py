"""iter_hf_weights / WeightSyncSender on plain, wrapped (DDP, compile, checkpoint) and PEFT models
(merged; the adapter-only path is in test_trainer_lora.py)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from _weightsync_helpers import FakeEngine, assert_same_tensors, tiny_llama

from weightsync.trainer import WeightSyncSender, iter_hf_weights
from weightsync.transports import InProcessSender


def _reference(model) -> list[tuple[str, torch.Tensor]]:
    return [(name, parameter.detach()) for name, parameter in model.named_parameters()]


def test_plain_model_yields_hf_names_in_order():
    model = tiny_llama()
    walked = list(iter_hf_weights(model))
    assert_same_tensors(walked, _reference(model))
    assert walked[-1][0] == "lm_head.weight"
    # Plain parameters are passed through without a copy.
    assert walked[0][1].data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_walking_leaves_grad_mode_alone_between_items():
    walker = iter_hf_weights(tiny_llama())
    _, first = next(walker)
    assert torch.is_grad_enabled() and not first.requires_grad


def test_tied_weights_once_or_under_every_name():
    model = tiny_llama(tie=True)
    names = [name for name, _ in iter_hf_weights(model)]
    assert "lm_head.weight" not in names and names[0] == "model.embed_tokens.weight"
    everything = dict(iter_hf_weights(model, skip_tied=False))
    assert list(everything)[-1] == "lm_head.weight"
    assert torch.equal(everything["lm_head.weight"], everything["model.embed_tokens.weight"])


def test_dtype_cast_applies_to_floating_weights_only():
    model = tiny_llama()
    model.register_parameter("step", torch.nn.Parameter(torch.tensor(3), requires_grad=False))
    walked = dict(iter_hf_weights(model, dtype=torch.bfloat16))
    assert walked["model.norm.weight"].dtype == torch.bfloat16
    assert walked["step"].dtype == torch.int64


def test_wrapper_prefixes_are_looked_through():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = tiny_llama()
    expected = _reference(model)
    for i, layer in enumerate(model.model.layers):
        model.model.layers[i] = checkpoint_wrapper(layer)
    compiled = torch.compile(model)  # an OptimizedModule; nothing compiles until forward
    names = [name for name, _ in compiled.named_parameters()]
    assert any("_orig_mod." in n for n in names) and any("_checkpoint_wrapped_module." in n for n in names)
    assert_same_tensors(list(iter_hf_weights(compiled)), expected)


def test_ddp_prefix_is_stripped():
    model = tiny_llama()
    expected = _reference(model)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
        assert next(wrapped.named_parameters())[0].startswith("module.")
        assert_same_tensors(list(iter_hf_weights(wrapped)), expected)
        engine = FakeEngine()
        stats = WeightSyncSender(InProcessSender(engine)).push(wrapped)  # rank from the default group
        assert stats.engine_version == 1 and stats.num_tensors == len(expected)
        assert_same_tensors(engine.last, expected)
    finally:
        dist.destroy_process_group()


def _peft_model(dtype: torch.dtype, **lora_kwargs):
    from peft import LoraConfig, get_peft_model

    base = tiny_llama(dtype=dtype)
    config = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj", "down_proj"],
        modules_to_save=["lm_head"],
        init_lora_weights=False,  # random B, so the merged weights really differ from the base
        **lora_kwargs,
    )
    model = get_peft_model(base, config)
    with torch.no_grad():  # make the trained copy of lm_head differ from the original
        model.base_model.model.lm_head.modules_to_save["default"].weight.add_(1.0)
    return model


def _state(model) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_peft_lora_yields_merged_weights_and_leaves_model_untouched(dtype):
    model = _peft_model(dtype).eval()
    tokens = torch.tensor([[1, 5, 9, 3, 7]])
    logits_before = model(tokens).logits
    state_before = _state(model)

    walked = [(name, tensor.clone()) for name, tensor in iter_hf_weights(model)]

    assert not any("lora_" in name or "base_layer" in name or "modules_to_save" in name for name, _ in walked)
    assert torch.equal(model(tokens).logits, logits_before)
    state_after = model.state_dict()
    assert state_after.keys() == state_before.keys()
    assert all(torch.equal(state_after[name], state_before[name]) for name in state_before)

    merged = copy.deepcopy(model).merge_and_unload()
    assert_same_tensors(walked, _reference(merged))
    # And the merged stream is not just the base weights.
    assert not torch.equal(dict(walked)["model.layers.0.self_attn.q_proj.weight"], model.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight)


def test_peft_disabled_adapters_yield_base_weights():
    model = _peft_model(torch.float32)
    with model.disable_adapter():
        walked = dict(iter_hf_weights(model))
    layer = model.base_model.model.model.layers[1]
    assert torch.equal(walked["model.layers.1.self_attn.q_proj.weight"], layer.self_attn.q_proj.base_layer.weight)
    assert torch.equal(walked["lm_head.weight"], model.base_model.model.lm_head.original_module.weight)


def test_peft_dora_is_refused_clearly():
    model = _peft_model(torch.float32, use_dora=True)
    with pytest.raises(NotImplementedError, match=r"model.layers.0.self_attn.q_proj: LoRA variant .*DoRA"):
        list(iter_hf_weights(model))


def test_sender_roles_and_failures():
    model = tiny_llama()
    assert WeightSyncSender(None, rank=1).push(model) is None
    with pytest.raises(ValueError, match="needs a transport"):
        WeightSyncSender(None, rank=0)
    engine = FakeEngine()
    stats = WeightSyncSender(InProcessSender(engine), rank=0).push(model)
    assert stats.num_buckets == 0 and stats.total_bytes == sum(p.numel() * 4 for p in model.parameters())
    assert engine.updates[0][1] is True  # a whole-model push is a full update
    with pytest.raises(ValueError, match="fake engine rejects"):
        WeightSyncSender(InProcessSender(FakeEngine(fail_after=3)), rank=0).push(model)
