"""LoRA adapters through RolloutClient: load from a PEFT directory and from tensors (raw
frames) with a config, list, generate under an adapter (equal to in-process, adapters mixed
with the base model in one call), update (the adapter's version in the outputs goes up),
unload; refusals are the in-process ones."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_prompts
from safetensors.torch import save_file
from server_fixtures import reference, same_output, server, text_model  # noqa: F401 (fixtures)

from lora.flat import FlatLoraAdapter
from rollout import SamplingParams

SAMPLED = SamplingParams(temperature=1.0, max_new_tokens=10, seed=23, ignore_eos=True, logprobs_mode="raw")
CONFIG = dict(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"])


def _adapter(text_model, seed: int) -> dict[str, torch.Tensor]:
    """Random rank-4 LoRA tensors on q_proj and down_proj, under PEFT state-dict names."""
    cfg, g = text_model.hf.config, torch.Generator().manual_seed(seed)
    h, i = cfg.hidden_size, cfg.intermediate_size
    out = {}
    for layer in range(cfg.num_hidden_layers):
        for module, part, fan_in, fan_out in (("q_proj", "self_attn", h, h), ("down_proj", "mlp", i, h)):
            name = f"base_model.model.model.layers.{layer}.{part}.{module}"
            out[f"{name}.lora_A.weight"] = torch.randn(4, fan_in, generator=g) * 0.5
            out[f"{name}.lora_B.weight"] = torch.randn(fan_out, 4, generator=g) * 0.5
    return out


@pytest.fixture(scope="module")
def adapter_dir(text_model, tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("adapter")
    (path / "adapter_config.json").write_text(json.dumps({**CONFIG, "peft_type": "LORA"}))
    save_file(_adapter(text_model, seed=1), str(path / "adapter_model.safetensors"))
    return str(path)


@pytest.fixture(scope="module", autouse=True)
def unload_all(server, reference):
    yield
    for engine in (server, reference):
        for info in engine.list_lora_adapters():
            engine.unload_lora_adapter(info.name)


def _generate_both(server, reference, **kwargs):
    got = server.generate(**kwargs)
    want = reference.generate(**kwargs)
    for g, w in zip(got, want, strict=True):
        same_output(g, w)
    return got


def test_adapters_load_generate_update_and_unload(server, reference, text_model, adapter_dir) -> None:
    assert server.load_lora_adapter("disk", adapter_dir) == reference.load_lora_adapter("disk", adapter_dir)
    tensors = _adapter(text_model, seed=2)
    info = server.load_lora_adapter("sent", tensors=tensors, config=CONFIG)
    assert info == reference.load_lora_adapter("sent", tensors=tensors, config=CONFIG)
    assert info.name == "sent" and info.rank == 4 and info.version == 0
    assert server.list_lora_adapters() == reference.list_lora_adapters()
    assert sorted(a.name for a in server.list_lora_adapters()) == ["disk", "sent"]

    prompts = make_prompts(text_model.vocab_size, [6, 6, 9], seed=40)
    names = ["disk", None, "sent"]
    outs = _generate_both(server, reference, input_ids=prompts, sampling_params=SAMPLED, lora_name=names)
    base = _generate_both(server, reference, input_ids=prompts, sampling_params=SAMPLED)
    assert [o.lora_name for o in outs] == names and outs[1].lora_versions is None
    assert outs[0].token_ids != base[0].token_ids and outs[2].token_ids != base[2].token_ids, "adapters do nothing?"
    assert outs[1].token_ids == base[1].token_ids

    update = list(_adapter(text_model, seed=3).items())
    assert server.update_lora_adapter("sent", update) == reference.update_lora_adapter("sent", update) == 1
    after = _generate_both(server, reference, input_ids=prompts[2:], sampling_params=SAMPLED, lora_name="sent")[0]
    assert after.lora_versions == [(1, 0, 10)] and after.token_ids != outs[2].token_ids
    assert after.weight_version == outs[2].weight_version  # the base weights did not change
    flat = FlatLoraAdapter.pack(_adapter(text_model, seed=4))  # one buffer: its views travel by name
    assert server.update_lora_adapter("sent", flat) == reference.update_lora_adapter("sent", flat) == 2
    _generate_both(server, reference, input_ids=prompts[2:], sampling_params=SAMPLED, lora_name="sent")

    server.unload_lora_adapter("disk")
    reference.unload_lora_adapter("disk")
    assert [a.name for a in server.list_lora_adapters()] == ["sent"]
    with pytest.raises(ValueError, match="'disk' is not loaded"):
        server.generate(input_ids=prompts[:1], sampling_params=SAMPLED, lora_name="disk")


def test_adapter_from_disk_update_by_lora_name(server, reference, text_model, adapter_dir, tmp_path) -> None:
    server.load_lora_adapter("upd", tensors=_adapter(text_model, seed=5), config=CONFIG)
    reference.load_lora_adapter("upd", tensors=_adapter(text_model, seed=5), config=CONFIG)
    version = server.update_weights_from_disk(adapter_dir, lora_name="upd")
    assert version == reference.update_weights_from_disk(adapter_dir, lora_name="upd") == 1
    prompts = make_prompts(text_model.vocab_size, [8], seed=41)
    out = _generate_both(server, reference, input_ids=prompts, sampling_params=SAMPLED, lora_name="upd")[0]
    assert out.lora_versions == [(1, 0, 10)]
    server.unload_lora_adapter("upd")
    reference.unload_lora_adapter("upd")


def test_lora_refusals_are_the_in_process_ones(server, reference, text_model, adapter_dir, tmp_path) -> None:
    tensors = _adapter(text_model, seed=6)
    bad_rank = {k: (v[:, :2] if "lora_B" in k else v[:2]) for k, v in tensors.items()}
    cases = [
        lambda e: e.load_lora_adapter("x", adapter_dir, tensors=tensors, config=CONFIG),  # both
        lambda e: e.load_lora_adapter("x", tensors=bad_rank, config=CONFIG),  # shapes do not match r
        lambda e: e.load_lora_adapter("x", tensors=tensors, config=dict(CONFIG, r=64)),  # above max_lora_rank
        lambda e: e.unload_lora_adapter("never"),
        lambda e: e.update_lora_adapter("never", tensors.items()),
        lambda e: e.load_lora_adapter("", tensors=tensors, config=CONFIG),
    ]
    for i, case in enumerate(cases):
        with pytest.raises((ValueError, TypeError)) as want:
            case(reference)
        with pytest.raises(type(want.value)) as got:
            case(server)
        assert str(got.value) == str(want.value), i
    assert server.list_lora_adapters() == reference.list_lora_adapters()
    assert "x" not in [a.name for a in server.list_lora_adapters()]
    with pytest.raises(FileNotFoundError, match="adapter directory not found"):
        server.load_lora_adapter("x", str(tmp_path / "missing"))


def test_several_adapters_update_in_one_call_as_in_process(server, reference, text_model) -> None:
    for engine in (server, reference):
        engine.load_lora_adapter("one", tensors=_adapter(text_model, seed=7), config=CONFIG)
        engine.load_lora_adapter("two", tensors=_adapter(text_model, seed=8), config=CONFIG)
    updates = {"one": list(_adapter(text_model, seed=9).items()), "two": FlatLoraAdapter.pack(_adapter(text_model, seed=10))}
    assert server.update_lora_adapters(updates) == reference.update_lora_adapters(updates) == {"one": 1, "two": 1}
    prompts = make_prompts(text_model.vocab_size, [7, 7], seed=42)
    outs = _generate_both(server, reference, input_ids=prompts, sampling_params=SAMPLED, lora_name=["one", "two"])
    assert [o.lora_versions for o in outs] == [[(1, 0, 10)], [(1, 0, 10)]]
    # a bad tensor in one adapter leaves both as they were, refused as in-process
    bad = {"one": list(_adapter(text_model, seed=11).items()), "two": [("nope.lora_A.weight", torch.zeros(4, 4))]}
    with pytest.raises(ValueError) as want:
        reference.update_lora_adapters(bad)
    with pytest.raises(ValueError) as got:
        server.update_lora_adapters(bad)
    assert str(got.value) == str(want.value)
    assert server.list_lora_adapters() == reference.list_lora_adapters()
    assert {a.name: a.version for a in server.list_lora_adapters() if a.name in updates} == {"one": 1, "two": 1}
    for engine in (server, reference):
        engine.unload_lora_adapter("one")
        engine.unload_lora_adapter("two")
