"""iter_hf_weights(adapter_only=True): a PEFT model's active adapter, exactly as
get_peft_model_state_dict has it, through wrappers (DDP, checkpointing, FSDP2) and across
training steps; and what it sends is what lora.adapter.parse_adapter accepts."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _weightsync_helpers import FakeEngine, assert_same_tensors, fsdp_unsupported_reason, tiny_llama

from weightsync.trainer import WeightSyncSender, iter_hf_weights
from weightsync.transports import InProcessSender, iter_safetensors_dir

peft = pytest.importorskip("peft")


def _lora(model=None, *, adapter_name: str = "default", **kwargs):
    kwargs = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"],
              "init_lora_weights": False, **kwargs}  # random B, so every tensor is non-trivial
    return peft.get_peft_model(model if model is not None else tiny_llama(), peft.LoraConfig(**kwargs),
                               adapter_name=adapter_name)


def _expected(model, adapter_name: str = "default") -> list[tuple[str, torch.Tensor]]:
    return list(peft.get_peft_model_state_dict(model, adapter_name=adapter_name).items())


def test_adapter_only_equals_get_peft_model_state_dict():
    model = _lora(target_modules=["q_proj", "k_proj", "o_proj", "gate_proj", "up_proj"], layers_to_transform=[1])
    walked = list(iter_hf_weights(model, adapter_only=True))
    assert_same_tensors(walked, _expected(model))
    assert walked[0][0] == "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"
    # Lazy and alias-free: live parameters, detached, grad mode untouched between items.
    walker = iter_hf_weights(model, adapter_only=True)
    _, first = next(walker)
    assert torch.is_grad_enabled() and not first.requires_grad
    assert first.data_ptr() == model.base_model.model.model.layers[1].self_attn.q_proj.lora_A["default"].weight.data_ptr()


def test_adapter_only_dtype_cast():
    model = _lora()
    walked = list(iter_hf_weights(model, adapter_only=True, dtype=torch.bfloat16))
    expected = [(name, tensor.to(torch.bfloat16)) for name, tensor in _expected(model)]
    assert_same_tensors(walked, expected)


def test_adapter_only_sends_the_active_adapter_of_several():
    model = _lora(adapter_name="first")
    model.add_adapter("second", peft.LoraConfig(r=2, target_modules=["o_proj"], init_lora_weights=False))
    assert_same_tensors(list(iter_hf_weights(model, adapter_only=True)), _expected(model, "first"))
    model.set_adapter("second")
    assert_same_tensors(list(iter_hf_weights(model, adapter_only=True)), _expected(model, "second"))
    model.base_model.set_adapter(["first", "second"])
    with pytest.raises(ValueError, match=r"sends one adapter, but 2 are active: \['first', 'second'\]"):
        iter_hf_weights(model, adapter_only=True)


def test_adapter_only_after_training_steps():
    model = _lora()
    before = [(name, tensor.clone()) for name, tensor in iter_hf_weights(model, adapter_only=True)]
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    tokens = torch.tensor([[1, 5, 9, 3, 7, 2]])
    for _ in range(2):
        optimizer.zero_grad()
        model(tokens, labels=tokens).loss.backward()
        optimizer.step()
    after = list(iter_hf_weights(model, adapter_only=True))
    assert_same_tensors(after, _expected(model))
    assert [n for n, _ in after] == [n for n, _ in before]
    assert all(not torch.equal(new, old) for (_, new), (_, old) in zip(after, before))


def test_adapter_only_through_ddp_and_checkpoint_wrappers():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = _lora()
    expected = _expected(model)
    layers = model.base_model.model.model.layers
    for i, layer in enumerate(layers):
        layers[i] = checkpoint_wrapper(layer)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
        assert any("module." in n and "_checkpoint_wrapped_module." in n for n, _ in wrapped.named_parameters())
        assert_same_tensors(list(iter_hf_weights(wrapped, adapter_only=True)), expected)
        engine = FakeEngine()
        stats = WeightSyncSender(InProcessSender(engine, full=False), adapter_only=True).push(wrapped)
        assert stats.num_tensors == len(expected) == 12
        assert stats.total_bytes == sum(t.numel() * 4 for _, t in expected)
        assert_same_tensors(engine.last, expected)
    finally:
        dist.destroy_process_group()


def test_what_the_trainer_sends_the_adapter_parser_accepts():
    from lora.adapter import LoraAdapterConfig, parse_adapter, plan_adapter_update
    from rollout.model.config import ModelConfig

    model = _lora(use_rslora=True, target_modules="all-linear")
    mc = ModelConfig.from_dict(model.base_model.model.config.to_dict())
    config = LoraAdapterConfig.from_dict(model.peft_config["default"], max_rank=8)
    weights = parse_adapter(config, iter_hf_weights(model, adapter_only=True), mc)
    assert len(weights.modules) == 7 * mc.num_layers
    assert len(plan_adapter_update(weights, iter_hf_weights(model, adapter_only=True, dtype=torch.bfloat16), mc)) == 28


def test_adapter_only_refusals():
    with pytest.raises(ValueError, match="adapter_only=True needs a PEFT LoRA model .* LlamaForCausalLM has no LoRA layers"):
        iter_hf_weights(tiny_llama(), adapter_only=True)
    with pytest.raises(ValueError, match="needs a PEFT LoRA model"):
        WeightSyncSender(InProcessSender(FakeEngine()), adapter_only=True).push(tiny_llama())
    dora = _lora(use_dora=True)
    with pytest.raises(NotImplementedError, match=r"model.layers.0.self_attn.q_proj: LoRA variant .*DoRA.* adapter-only"):
        list(iter_hf_weights(dora, adapter_only=True))
    saved = _lora(modules_to_save=["lm_head"])
    with pytest.raises(NotImplementedError, match=r"lm_head: modules_to_save cannot be synced adapter-only"):
        list(iter_hf_weights(saved, adapter_only=True))
    embedding = _lora(target_modules=["embed_tokens", "q_proj"])
    with pytest.raises(NotImplementedError, match=r"model.embed_tokens: embedding/lm_head LoRA"):
        list(iter_hf_weights(embedding, adapter_only=True))


# ---- FSDP2 ------------------------------------------------------------------------------
WORLD_SIZE = 2


def _rank_main(rank: int, out_dir: str) -> None:
    from _weightsync_helpers import tiny_hf_like
    from peft import LoraConfig, inject_adapter_in_model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from weightsync.transports import save_safetensors_dir

    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank, world_size=WORLD_SIZE)
    report: dict[str, object] = {}
    try:
        torch.manual_seed(0)
        model = inject_adapter_in_model(
            LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False), tiny_hf_like()
        )
        # The state-dict names get_peft_model_state_dict would give (no PeftModel here).
        reference = [
            ("base_model.model." + name.replace(".default.", "."), parameter.detach().clone())
            for name, parameter in model.named_parameters()
            if ".lora_" in name
        ]
        mesh = init_device_mesh("cpu", (WORLD_SIZE,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model(torch.tensor([[1, 2, 3]])).sum().backward()
        report["sharded"] = all(isinstance(p, DTensor) for p in model.parameters())
        walked = list(iter_hf_weights(model, adapter_only=True))  # every rank: the gathers are collectives
        report["num_tensors"] = len(walked)
        if rank == 0:
            save_safetensors_dir(walked, Path(out_dir) / "received")
            save_safetensors_dir(reference, Path(out_dir) / "reference")
    finally:
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(report))
        dist.barrier()
        dist.destroy_process_group()
    os._exit(0)  # as in test_fsdp2_walk.py: FSDP2 + gloo can abort during interpreter finalization


@pytest.mark.skipif(fsdp_unsupported_reason() is not None, reason=str(fsdp_unsupported_reason()))
def test_adapter_only_fsdp2_on_cpu_gloo(tmp_path):
    ranks = mp.start_processes(_rank_main, args=(str(tmp_path),), nprocs=WORLD_SIZE, start_method="spawn", join=False)
    deadline = time.monotonic() + 180
    while not ranks.join(timeout=1):
        if time.monotonic() > deadline:
            for process in ranks.processes:
                process.kill()
            pytest.fail("FSDP2 ranks did not finish within 180 s (a gather out of step?)")
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(WORLD_SIZE)]
    assert all(r["sharded"] and r["num_tensors"] == 8 for r in reports)
    assert_same_tensors(list(iter_safetensors_dir(tmp_path / "received")), list(iter_safetensors_dir(tmp_path / "reference")))
