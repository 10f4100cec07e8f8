"""lora.adapter / lora.config against real peft adapters on the tiny checkpoints: the exact
tensors round-trip, peft's own target matching and scaling are mirrored, and every refusal
names its field or tensor. CPU only, no engine."""

from __future__ import annotations

import copy
import json
import pickle

import pytest
import torch
from conftest import TinyModel

from lora.adapter import (
    LoraAdapterConfig,
    apply_adapter_update,
    load_adapter_dir,
    parse_adapter,
    plan_adapter_update,
)
from lora.config import TARGET_MODULES
from rollout.model.config import ModelConfig

peft = pytest.importorskip("peft")

MAX_RANK = 16
PREFIX = "base_model.model.model.layers"


def _peft(tiny: TinyModel, **lora_kwargs):
    lora_kwargs.setdefault("init_lora_weights", False)  # random B: a real, non-zero adapter
    torch.manual_seed(0)
    return peft.get_peft_model(copy.deepcopy(tiny.hf), peft.LoraConfig(**lora_kwargs))


def _wrapped(model) -> set[tuple[int, str]]:
    """(layer, module) of every LoRA layer peft created."""
    out = set()
    for name, module in model.named_modules():
        if isinstance(module, peft.tuners.lora.LoraLayer):
            parts = name.split(".")
            out.add((int(parts[parts.index("layers") + 1]), parts[-1]))
    return out


def _parsed(model, mc: ModelConfig):
    config = LoraAdapterConfig.from_dict(model.peft_config["default"], max_rank=MAX_RANK)
    return config, parse_adapter(config, peft.get_peft_model_state_dict(model), mc)


@pytest.fixture(scope="module")
def mc(llama) -> ModelConfig:
    return ModelConfig.from_dir(llama.path)


@pytest.fixture(scope="module")
def saved(llama, tmp_path_factory):
    """A saved adapter on q/v/down (r=4) and its peft model."""
    model = _peft(llama, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    path = tmp_path_factory.mktemp("adapter")
    model.save_pretrained(path)
    return model, path


# ---- round trip -----------------------------------------------------------------------
def test_saved_adapter_round_trips_exact_tensors(tiny_model, tmp_path):
    model = _peft(tiny_model, r=8, lora_alpha=16, target_modules="all-linear")
    model.save_pretrained(tmp_path)
    mc = ModelConfig.from_dir(tiny_model.path)
    config_dict, tensors = load_adapter_dir(tmp_path)
    config = LoraAdapterConfig.from_dict(config_dict, max_rank=MAX_RANK)
    weights = parse_adapter(config, tensors, mc)

    assert config.target_modules == frozenset(TARGET_MODULES) and weights.rank == 8
    expected = peft.get_peft_model_state_dict(model)
    assert dict(weights.named_tensors()).keys() == expected.keys()
    for name, tensor in weights.named_tensors():
        assert tensor.device.type == "cpu" and torch.equal(tensor, expected[name]), name
    assert set(weights.modules) == _wrapped(model)
    (a, b) = weights.modules[1, "k_proj"]
    assert a.shape == (8, mc.hidden_size) and b.shape == (mc.kv_size, 8)
    assert weights.scaling == model.base_model.model.model.layers[0].self_attn.q_proj.scaling["default"] == 2.0


@pytest.mark.parametrize("use_rslora", [False, True])
def test_scaling_matches_peft(llama, mc, use_rslora):
    model = _peft(llama, r=4, lora_alpha=6, use_rslora=use_rslora, target_modules=["o_proj"])
    config, weights = _parsed(model, mc)
    peft_scaling = model.base_model.model.model.layers[1].self_attn.o_proj.scaling["default"]
    assert config.scaling == weights.scaling == pytest.approx(peft_scaling, rel=0, abs=0)
    assert peft_scaling == (3.0 if use_rslora else 1.5)


@pytest.mark.parametrize(
    "spec",
    [
        dict(target_modules=["gate_proj", "k_proj"], layers_to_transform=[1]),
        dict(target_modules=["q_proj", "up_proj"], layers_to_transform=0, layers_pattern="layers"),
        dict(target_modules=r".*\.layers\.1\.self_attn\.(q|v)_proj"),  # regex: layers_to_transform n/a
        dict(target_modules=r".*(o|down)_proj"),
        dict(target_modules=["self_attn.q_proj", "model.layers.0.mlp.up_proj"]),
        dict(target_modules="all-linear", exclude_modules=["k_proj", "model.layers.1.mlp.down_proj"]),
        dict(target_modules=["q_proj", "v_proj"], exclude_modules=r".*\.0\..*q_proj"),
    ],
)
def test_targets_mirror_peft_matching(llama, mc, spec):
    model = _peft(llama, r=2, **spec)
    config, weights = _parsed(model, mc)
    assert config.targets(mc.num_layers) == _wrapped(model) == set(weights.modules)
    assert config.target_modules == {module for _, module in _wrapped(model)}


def test_lenient_names_adapter_segment_and_no_prefix(saved, mc):
    model, _ = saved
    config, reference = _parsed(model, mc)
    live = {n: t for n, t in model.state_dict().items() if ".lora_" in n}
    assert all(".default.weight" in n for n in live)
    stripped = {n.removeprefix("base_model.model."): t for n, t in peft.get_peft_model_state_dict(model).items()}
    for tensors in (live, stripped, list(stripped.items())):
        weights = parse_adapter(config, tensors, mc)
        assert weights.modules.keys() == reference.modules.keys()
        assert all(torch.equal(x, y) for k in reference.modules for x, y in zip(weights.modules[k], reference.modules[k]))


def test_parsed_tensors_are_copies_in_the_given_dtype(saved, mc):
    model, _ = saved
    config = LoraAdapterConfig.from_dict(model.peft_config["default"], max_rank=MAX_RANK)
    state = {n: t.to(torch.bfloat16) for n, t in peft.get_peft_model_state_dict(model).items()}
    weights = parse_adapter(config, state, mc)
    a, _ = weights.modules[0, "q_proj"]
    assert a.dtype == torch.bfloat16
    state[f"{PREFIX}.0.self_attn.q_proj.lora_A.weight"].add_(1.0)  # the caller's tensor, not ours
    assert not torch.equal(a, state[f"{PREFIX}.0.self_attn.q_proj.lora_A.weight"])


def test_config_from_lora_config_object_and_plain_dict(saved):
    model, path = saved
    from_object = LoraAdapterConfig.from_dict(model.peft_config["default"], max_rank=MAX_RANK)
    from_json = LoraAdapterConfig.from_dict(json.loads((path / "adapter_config.json").read_text()), max_rank=MAX_RANK)
    from_dict = LoraAdapterConfig.from_dict({"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]},
                                            max_rank=MAX_RANK)
    assert from_object == from_json == from_dict


# ---- config refusals ------------------------------------------------------------------
BASE = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}


@pytest.mark.parametrize(
    "change, message",
    [
        ({"r": 32}, r"r=32 is above max_lora_rank=16"),
        ({"r": 0}, r"r=0 must be >= 1"),
        ({"r": None}, r"r is missing"),
        ({"r": 2.0}, r"r=2.0 must be an int"),
        ({"lora_alpha": float("nan")}, r"lora_alpha=nan"),
        ({"use_rslora": "yes"}, r"use_rslora='yes'"),
        ({"use_dora": True}, r"use_dora=True: DoRA"),
        ({"modules_to_save": ["lm_head"]}, r"modules_to_save=\['lm_head'\]"),
        ({"target_modules": ["q_proj", "embed_tokens"]}, r"'embed_tokens': embedding/lm_head LoRA is not supported"),
        ({"target_modules": ["lm_head"]}, r"'lm_head': embedding/lm_head LoRA is not supported"),
        ({"target_modules": r".*(q_proj|embed_tokens)"}, r"embedding/lm_head LoRA is not supported"),
        ({"target_modules": ["q_proj", "qkv_proj"]}, r"target_modules entry 'qkv_proj' is not a module"),
        ({"target_modules": r".*\.mlp"}, r"target_modules='.*\\\\.mlp' matches none"),
        ({"target_modules": None}, r"target_modules is missing"),
        ({"rank_pattern": {"q_proj": 8}}, r"rank_pattern=.*per-module ranks"),
        ({"alpha_pattern": {"q_proj": 8}}, r"alpha_pattern=.*per-module alphas"),
        ({"bias": "all"}, r"bias='all'"),
        ({"lora_bias": True}, r"lora_bias=True"),
        ({"fan_in_fan_out": True}, r"fan_in_fan_out=True"),
        ({"peft_type": "PREFIX_TUNING"}, r"peft_type='PREFIX_TUNING'"),
        ({"init_lora_weights": "pissa"}, r"init_lora_weights='pissa' rewrites the base weights"),
        ({"trainable_token_indices": [1, 2]}, r"trainable_token_indices=.*embedding/lm_head"),
        ({"layers_pattern": "blocks", "layers_to_transform": [0]}, r"layers_pattern='blocks'"),
        ({"brand_new_option": 3}, r"unknown field brand_new_option=3"),
    ],
)
def test_config_refusals_name_the_field(change, message):
    with pytest.raises(ValueError, match=message):
        LoraAdapterConfig.from_dict({**BASE, **change}, max_rank=MAX_RANK)


def test_ignored_and_empty_fields_are_accepted():
    config = LoraAdapterConfig.from_dict(
        {**BASE, "lora_dropout": 0.1, "task_type": "CAUSAL_LM", "modules_to_save": None, "rank_pattern": {},
         "use_dora": False, "init_lora_weights": "gaussian", "peft_version": "0.99"},
        max_rank=MAX_RANK,
    )
    assert config.target_modules == {"q_proj", "v_proj"} and config.scaling == 2.0


def test_dora_and_embedding_adapters_from_peft_are_refused(llama, tmp_path):
    dora = _peft(llama, r=4, target_modules=["q_proj"], use_dora=True)
    dora.save_pretrained(tmp_path / "dora")
    config, _ = load_adapter_dir(tmp_path / "dora")
    with pytest.raises(ValueError, match="use_dora=True: DoRA"):
        LoraAdapterConfig.from_dict(config, max_rank=MAX_RANK)
    embed = _peft(llama, r=4, target_modules=["q_proj", "embed_tokens"])
    with pytest.raises(ValueError, match="'embed_tokens': embedding/lm_head LoRA"):
        LoraAdapterConfig.from_dict(embed.peft_config["default"], max_rank=MAX_RANK)


# ---- tensor refusals ------------------------------------------------------------------
def _state(saved) -> tuple[LoraAdapterConfig, dict[str, torch.Tensor]]:
    model, _ = saved
    config = LoraAdapterConfig.from_dict(model.peft_config["default"], max_rank=MAX_RANK)
    return config, {n: t.clone() for n, t in peft.get_peft_model_state_dict(model).items()}


Q_A = f"{PREFIX}.0.self_attn.q_proj.lora_A.weight"
Q_B = f"{PREFIX}.0.self_attn.q_proj.lora_B.weight"


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda s: s[Q_A].view(-1)[3].fill_(float("nan")), f"{Q_A}' has non-finite values"),
        (lambda s: s[Q_B].view(-1)[0].fill_(float("inf")), f"{Q_B}' has non-finite values"),
        (lambda s: s.__setitem__(Q_A, torch.zeros(4, 65)), r"shape \(4, 65\) does not match lora_A of q_proj with r=4 \(4, 64\)"),
        (lambda s: s.__setitem__(Q_B, torch.zeros(64, 8)), r"shape \(64, 8\) does not match lora_B"),
        (lambda s: s.__setitem__(Q_A, torch.zeros(4, 64, dtype=torch.int32)), r"dtype torch.int32 is not a floating"),
        (lambda s: s.__setitem__(Q_A, [[0.0]]), r"expected a torch.Tensor, got list"),
        (lambda s: s.pop(Q_B), f"missing for the config's targets: \\['{Q_B}'\\]"),
        (lambda s: s.__setitem__(Q_A.replace("lora_A.weight", "lora_A.default.weight"), s[Q_A]), r"given twice"),
        (lambda s: s.__setitem__(f"{PREFIX}.0.self_attn.k_proj.lora_A.weight", torch.zeros(4, 64)),
         r"k_proj of layer 0 is not targeted by the adapter config"),
        (lambda s: s.__setitem__(f"{PREFIX}.7.self_attn.q_proj.lora_A.weight", torch.zeros(4, 64)),
         r"layer 7 is out of range; the model has 2 layers"),
        (lambda s: s.__setitem__(f"{PREFIX}.0.self_attn.qkv_proj.lora_A.weight", torch.zeros(4, 64)),
         r"unknown target module self_attn.qkv_proj"),
        (lambda s: s.__setitem__(f"{PREFIX}.0.mlp.q_proj.lora_A.weight", torch.zeros(4, 64)),
         r"unknown target module mlp.q_proj"),
        (lambda s: s.__setitem__(f"{PREFIX}.0.self_attn.q_proj.lora_magnitude_vector", torch.ones(64)), r"DoRA"),
        (lambda s: s.__setitem__("base_model.model.model.embed_tokens.lora_embedding_A", torch.ones(4, 160)),
         r"embed_tokens.lora_embedding_A': embedding/lm_head LoRA is not supported"),
        (lambda s: s.__setitem__("base_model.model.lm_head.lora_A.weight", torch.ones(4, 64)),
         r"lm_head.lora_A.weight': embedding/lm_head LoRA is not supported"),
        (lambda s: s.__setitem__("base_model.model.lm_head.modules_to_save.weight", torch.ones(4, 64)),
         r"embedding/lm_head LoRA"),
        (lambda s: s.__setitem__(f"{PREFIX}.0.self_attn.q_proj.lora_B.bias", torch.ones(64)), r"lora_bias"),
        (lambda s: s.__setitem__(f"{PREFIX}.0.input_layernorm.weight", torch.ones(64)), r"input_layernorm.weight': not a LoRA weight"),
    ],
)
def test_tensor_refusals_name_the_tensor(saved, mc, edit, message):
    config, state = _state(saved)
    edit(state)
    with pytest.raises(ValueError, match=message):
        parse_adapter(config, state, mc)


def test_layers_to_transform_beyond_the_model_is_refused(mc):
    config = LoraAdapterConfig.from_dict({**BASE, "layers_to_transform": [5]}, max_rank=MAX_RANK)
    with pytest.raises(ValueError, match=r"layers_to_transform=\[5\]: layer 5 is out of range; the model has 2 layers"):
        parse_adapter(config, {}, mc)


# ---- files ----------------------------------------------------------------------------
def test_pickled_adapter_is_refused_without_being_opened(saved, tmp_path, monkeypatch):
    _, good = saved
    (tmp_path / "adapter_config.json").write_text((good / "adapter_config.json").read_text())
    (tmp_path / "adapter_model.bin").write_bytes(b"\x00 not a pickle, and never read")

    def never(*args, **kwargs):
        raise AssertionError("a pickled adapter was opened")

    monkeypatch.setattr(pickle, "load", never)
    monkeypatch.setattr(pickle, "loads", never)
    monkeypatch.setattr(torch, "load", never)
    with pytest.raises(ValueError, match=r"adapter_model.bin\); pickled adapters are never loaded; convert to safetensors"):
        load_adapter_dir(tmp_path)


def test_missing_files_are_named(saved, tmp_path):
    _, good = saved
    with pytest.raises(FileNotFoundError, match="adapter directory not found"):
        load_adapter_dir(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match=r"missing \['adapter_config.json', 'adapter_model.safetensors'\]"):
        load_adapter_dir(tmp_path)
    (tmp_path / "adapter_model.safetensors").write_bytes((good / "adapter_model.safetensors").read_bytes())
    with pytest.raises(FileNotFoundError, match=r"missing \['adapter_config.json'\]"):
        load_adapter_dir(tmp_path)
    (tmp_path / "adapter_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="adapter_config.json: not valid JSON"):
        load_adapter_dir(tmp_path)


# ---- updates --------------------------------------------------------------------------
def _loaded(saved, mc):
    config, state = _state(saved)
    return state, parse_adapter(config, state, mc)


def test_update_full_and_partial(saved, mc):
    state, weights = _loaded(saved, mc)
    new = {n: torch.randn_like(t) for n, t in state.items()}
    changed = apply_adapter_update(plan_adapter_update(weights, new, mc))
    assert changed == set(weights.modules)
    assert all(torch.equal(t, new[n]) for n, t in weights.named_tensors())

    down_b = f"{PREFIX}.1.mlp.down_proj.lora_B.weight"
    partial = [(down_b.replace("lora_B.weight", "lora_B.default.weight"), torch.full((64, 4), 0.5, dtype=torch.bfloat16))]
    assert apply_adapter_update(plan_adapter_update(weights, partial, mc)) == {(1, "down_proj")}
    after = dict(weights.named_tensors())
    assert torch.equal(after[down_b], torch.full((64, 4), 0.5)) and after[down_b].dtype == torch.float32
    assert all(torch.equal(after[n], new[n]) for n in new if n != down_b)


@pytest.mark.parametrize(
    "bad, message",
    [
        (torch.full((4, 64), float("nan")), "non-finite"),
        (torch.zeros(4, 63), r"shape \(4, 63\) does not match the loaded lora_A \(4, 64\)"),
    ],
)
@pytest.mark.parametrize("repeated", [False, True], ids=["first", "repeated"])
def test_update_is_atomic(saved, mc, bad, message, repeated):
    """Refused whole, also when the same names came in a good update just before (a
    trainer's every step: the repeated-names fast path must check shapes and values too)."""
    state, weights = _loaded(saved, mc)
    last = f"{PREFIX}.1.self_attn.v_proj.lora_A.weight"
    names = [n for n in state if n != last] + [last]
    if repeated:
        apply_adapter_update(plan_adapter_update(weights, [(n, torch.randn_like(state[n])) for n in names], mc))
    before = [(n, t.clone()) for n, t in weights.named_tensors()]
    update = [(n, torch.randn_like(state[n])) for n in names[:-1]] + [(last, bad)]
    with pytest.raises(ValueError, match=message):
        plan_adapter_update(weights, update, mc)
    assert all(torch.equal(t, dict(weights.named_tensors())[n]) for n, t in before)


@pytest.mark.parametrize(
    "name, message",
    [
        (f"{PREFIX}.0.self_attn.k_proj.lora_A.weight", r"the loaded adapter has no k_proj in layer 0"),
        (f"{PREFIX}.0.self_attn.o_proj.lora_magnitude_vector", r"DoRA"),
        ("base_model.model.lm_head.lora_B.weight", r"embedding/lm_head"),
    ],
)
def test_update_refuses_tensors_the_adapter_lacks(saved, mc, name, message):
    _, weights = _loaded(saved, mc)
    with pytest.raises(ValueError, match=message):
        plan_adapter_update(weights, [(name, torch.zeros(4, 64))], mc)


def test_update_refuses_duplicates(saved, mc):
    _, weights = _loaded(saved, mc)
    twice = [(Q_A, torch.zeros(4, 64)), (Q_A.replace("base_model.model.", ""), torch.zeros(4, 64))]
    with pytest.raises(ValueError, match="given twice in one update"):
        plan_adapter_update(weights, twice, mc)
