"""PEFT LoRA adapters in, validated LoraWeights out; and in-place adapter updates.

Pure CPU logic over tensors and names; knows the model only through ModelConfig (shapes),
nothing of the engine's fused layers, slots or devices (layout.py, pool.py, manager.py).

- `load_adapter_dir(path)`: adapter_config.json + adapter_model.safetensors. A pickled
  adapter (.bin, .pt, .pth, ...) is refused without being opened.
- `LoraAdapterConfig.from_dict(...)` (config.py): the config, validated.
- `parse_adapter(config, tensors, model)`: PEFT state-dict names -> {(layer, module):
  (A, B)}, everything checked before anything is returned.
- `plan_adapter_update` / `apply_adapter_update`: `engine.update_lora_adapter`'s two
  phases, as rollout/model/loader.py does for the base weights: plan and validate every
  write, then write.

Names accepted (what `peft.get_peft_model_state_dict` writes, and two lenient forms):
    base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight
    ... .lora_{A|B}.{adapter_name}.weight      (a live PeftModel's state_dict names)
    model.layers.{i}. ...                     (without the `base_model.model.` prefix)
Shapes: lora_A [r, in_features], lora_B [out_features, r]. Values are kept in the dtype
they came in (any floating dtype), as CPU copies; `scaling` is not folded in.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lora.config import EMBEDDING_ERROR, MODULE_PARENTS, LoraAdapterConfig, module_key
from rollout.kernels import first_non_finite
from rollout.model.config import ModelConfig

__all__ = [
    "AdapterWrite", "LoraAdapterConfig", "LoraWeights", "adapter_tensor_name", "apply_adapter_update",
    "load_adapter_dir", "module_shape", "parse_adapter", "plan_adapter_update",
]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
PEFT_PREFIX = "base_model.model."

_NAME = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(?P<layer>\d+)\.(?P<parent>self_attn|mlp)\.(?P<module>\w+)"
    r"\.lora_(?P<which>[AB])(?:\.[^.]+)?\.weight$"
)
_LORA_BIAS = re.compile(r"\.lora_B(?:\.[^.]+)?\.bias$")

Key = tuple[int, str]  # (layer index, HF module name)


# ---- files -------------------------------------------------------------------------------
def load_adapter_dir(path: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(adapter_config.json as a dict, {name: tensor}) of a PEFT adapter directory
    (`save_pretrained`). Pickled weights are never opened: with no safetensors file but a
    .bin/.pt/... one, this raises ValueError; with neither, FileNotFoundError."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"adapter directory not found: {path}")
    config_file, weights_file = path / ADAPTER_CONFIG, path / ADAPTER_WEIGHTS
    if not weights_file.is_file():
        pickled = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickled:
            raise ValueError(f"{path}: only pickled adapter weights found ({', '.join(pickled)}); pickled adapters are "
                             f"never loaded; convert to safetensors ({ADAPTER_WEIGHTS}, e.g. "
                             "save_pretrained(..., safe_serialization=True))")
    missing = [f.name for f in (config_file, weights_file) if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"{path}: not a PEFT adapter directory, missing {missing}")
    try:
        config = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{config_file}: not valid JSON: {error}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{config_file}: expected a JSON object, got {type(config).__name__}")
    try:
        with safe_open(str(weights_file), framework="pt") as f:
            tensors = {key: f.get_tensor(key) for key in f.keys()}
    except SafetensorError as error:
        raise ValueError(f"{weights_file}: not a readable safetensors file: {error}") from None
    return config, tensors


# ---- names and shapes ---------------------------------------------------------------------
def module_shape(model: ModelConfig, module: str) -> tuple[int, int]:
    """(in_features, out_features) of one HF projection."""
    h, i, q, kv = model.hidden_size, model.intermediate_size, model.q_size, model.kv_size
    return {
        "q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
        "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h),
    }[module]


def adapter_tensor_name(layer: int, module: str, which: str) -> str:
    """The name `get_peft_model_state_dict` gives this tensor."""
    return f"{PEFT_PREFIX}{module_key(layer, module)}.lora_{which}.weight"


def _parse_name(name: Any, model: ModelConfig) -> tuple[int, str, str]:
    """(layer, module, "A"|"B") for a PEFT tensor name, or a ValueError saying why not."""
    if not isinstance(name, str):
        raise ValueError(f"adapter tensor name {name!r}: expected a str, got {type(name).__name__}")
    if "lora_magnitude_vector" in name:
        raise ValueError(f"adapter tensor {name!r}: DoRA (use_dora, lora_magnitude_vector) is not supported")
    if "lora_embedding_" in name or "embed_tokens" in name or "lm_head" in name:
        raise ValueError(f"adapter tensor {name!r}: {EMBEDDING_ERROR}")
    if "modules_to_save" in name:
        raise ValueError(f"adapter tensor {name!r}: modules_to_save (a fully trained module copy) is not supported")
    if _LORA_BIAS.search(name):
        raise ValueError(f"adapter tensor {name!r}: a bias on lora_B (lora_bias) is not supported")
    m = _NAME.match(name)
    if m is None:
        raise ValueError(f"adapter tensor {name!r}: not a LoRA weight the engine knows (expected "
                         "[base_model.model.]model.layers.{i}.{self_attn|mlp}.{q,k,v,o,gate,up,down}_proj"
                         ".lora_{A|B}.weight)")
    layer, module, which = int(m["layer"]), m["module"], m["which"]
    if MODULE_PARENTS.get(module) != m["parent"]:
        raise ValueError(f"adapter tensor {name!r}: unknown target module {m['parent']}.{module}; the engine serves "
                         f"LoRA on {[f'{p}.{n}' for n, p in MODULE_PARENTS.items()]}")
    if layer >= model.num_layers:
        raise ValueError(f"adapter tensor {name!r}: layer {layer} is out of range; "
                         f"the model has {model.num_layers} layers")
    return layer, module, which


def _check_tensor(name: str, tensor: Any, want: tuple[int, ...], what: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"adapter tensor {name!r}: expected a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_floating_point():
        raise ValueError(f"adapter tensor {name!r}: dtype {tensor.dtype} is not a floating-point type")
    if tuple(tensor.shape) != want:
        raise ValueError(f"adapter tensor {name!r}: shape {tuple(tensor.shape)} does not match {what} {want}")


def _check_finite(named: list[tuple[str, torch.Tensor]]) -> None:
    bad = first_non_finite([tensor for _, tensor in named])
    if bad is not None:
        raise ValueError(f"adapter tensor {named[bad][0]!r} has non-finite values (NaN or Inf)")


def _items(tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, Any]]:
    items = list(tensors.items()) if isinstance(tensors, Mapping) else list(tensors)
    if set(map(type, items)) <= {tuple} and set(map(len, items)) <= {2}:  # C-level passes: 448 pairs a step
        return items
    for item in items:
        if not (isinstance(item, tuple) and len(item) == 2):
            raise ValueError(f"adapter tensors: expected (name, tensor) pairs, got {type(item).__name__}")
    return items


# ---- a whole adapter ----------------------------------------------------------------------
@dataclass
class LoraWeights:
    """One adapter's tensors as loaded. `modules[(layer, module)] = (A [r, in], B [out, r])`,
    CPU copies in the dtype they came in; the scaling is NOT folded into B."""

    config: LoraAdapterConfig
    modules: dict[Key, tuple[torch.Tensor, torch.Tensor]]
    # tensor name -> (layer, module, "A"|"B") for names seen in earlier updates: a trainer
    # pushes the same few hundred names every step, and parsing them costs more than copying
    name_index: dict[str, tuple[int, str, str]] = field(default_factory=dict, repr=False)
    # the last update's names in order, with their keys and shapes: the next update with the
    # same names checks its shapes against this in one comparison instead of name by name
    last_update: tuple[tuple[str, ...], list[tuple[int, str, str]], list[torch.Size]] | None = field(
        default=None, repr=False)
    # the last flat update's validated layout (lora/update.py FlatPlan): checked once per layout
    last_flat: Any = field(default=None, repr=False)

    @property
    def rank(self) -> int:
        return self.config.r

    @property
    def scaling(self) -> float:
        return self.config.scaling

    @property
    def module_names(self) -> frozenset[str]:
        """The HF modules present in some layer (a subset of config.target_modules)."""
        return frozenset(module for _, module in self.modules)

    @property
    def layers(self) -> list[int]:
        return sorted({layer for layer, _ in self.modules})

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in self.modules.values() for t in pair)

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """This adapter under `get_peft_model_state_dict` names (A then B per module)."""
        return [(adapter_tensor_name(layer, module, which), tensor)
                for (layer, module), pair in sorted(self.modules.items())
                for which, tensor in zip("AB", pair)]


def parse_adapter(config: LoraAdapterConfig,
                  tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                  model: ModelConfig) -> LoraWeights:
    """Map and validate a whole PEFT adapter; raises ValueError naming the first bad tensor.

    Every name must be recognised and in a (layer, module) the config targets; each such
    pair needs both lora_A [r, in] and lora_B [out, r], and every one of them must be
    present (a missing one would silently leave its layer without the adapter). Floating
    dtype, finite, no duplicates."""
    expected = config.targets(model.num_layers)
    too_deep = [i for i in config.layers_to_transform or () if i >= model.num_layers]
    if too_deep:
        raise ValueError(f"adapter config: layers_to_transform={list(config.layers_to_transform or ())}: layer "
                         f"{too_deep[0]} is out of range; the model has {model.num_layers} layers")
    if not expected:
        raise ValueError(f"adapter config: target_modules={config.target_spec!r} matches no module of this "
                         f"{model.num_layers}-layer model")
    found: dict[tuple[int, str, str], tuple[str, torch.Tensor]] = {}
    for name, tensor in _items(tensors):
        layer, module, which = _parse_name(name, model)
        if (layer, module) not in expected:
            raise ValueError(f"adapter tensor {name!r}: {module} of layer {layer} is not targeted by the adapter "
                             f"config (target_modules={config.target_spec!r}, "
                             f"layers_to_transform={config.layers_to_transform!r})")
        in_features, out_features = module_shape(model, module)
        want = (config.r, in_features) if which == "A" else (out_features, config.r)
        _check_tensor(name, tensor, want, f"lora_{which} of {module} with r={config.r}")
        previous = found.get((layer, module, which))
        if previous is not None:
            raise ValueError(f"adapter tensor {name!r}: lora_{which} of {module} in layer {layer} given twice "
                             f"(also as {previous[0]!r})")
        found[layer, module, which] = (name, tensor)
    missing = [adapter_tensor_name(layer, module, which)
               for layer, module in sorted(expected) for which in "AB" if (layer, module, which) not in found]
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ValueError(f"adapter tensors missing for the config's targets: {missing[:5]}{more}")
    _check_finite(list(found.values()))
    modules = {
        (layer, module): (_cpu_copy(found[layer, module, "A"][1]), _cpu_copy(found[layer, module, "B"][1]))
        for layer, module in sorted(expected)
    }
    return LoraWeights(config, modules)


def _cpu_copy(tensor: torch.Tensor) -> torch.Tensor:
    # A copy, never an alias: the caller (a trainer) may keep changing its tensors in place.
    return tensor.detach().to("cpu", copy=True).contiguous()


# ---- updates ------------------------------------------------------------------------------
@dataclass(slots=True)
class AdapterWrite:
    name: str  # as given
    layer: int
    module: str  # HF module name
    which: str  # "A" or "B"
    tensor: torch.Tensor  # the incoming value (any device, any floating dtype)
    target: torch.Tensor  # the LoraWeights tensor it replaces (same shape)


def plan_adapter_update(weights: LoraWeights,
                        named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                        model: ModelConfig, *, check_values: bool = True) -> list[AdapterWrite]:
    """Validate an update of a loaded adapter; nothing is written. Every name must be one of
    the adapter's tensors (same names as parse_adapter accepts), with the loaded shape, a
    floating dtype (cast on write) and finite values, each at most once. A partial update
    (any subset of the adapter's tensors) is allowed: the rest keep their values. Rank,
    alpha and target modules cannot change: load the adapter anew for that.
    `check_values=False` leaves the finiteness check to the caller (lora/update.py checks
    the values of many updates with one host sync)."""
    names, keys, tensors = plan_update_keys(weights, _items(named_tensors), model)
    writes = [AdapterWrite(name, layer, module, which, tensor, weights.modules[layer, module][which == "B"])
              for name, (layer, module, which), tensor in zip(names, keys, tensors)]
    if check_values:
        _check_finite([(w.name, w.tensor) for w in writes])
    return writes


def plan_update_keys(weights: LoraWeights, items: list[tuple[str, Any]],
                     model: ModelConfig) -> tuple[tuple[str, ...], list[tuple[int, str, str]], list[torch.Tensor]]:
    """(names, (layer, module, "A"|"B") of each, tensors) of a validated update (values not
    checked), as plan_adapter_update validates it. An update with the same names as the last
    one (a trainer's every step) is checked in one shape comparison and returns the same
    `keys` list object as the last time, so callers may cache work by its identity."""
    names = tuple(name for name, _ in items)
    tensors = [tensor for _, tensor in items]
    last = weights.last_update
    if (last is not None and names == last[0] and all(isinstance(t, torch.Tensor) for t in tensors)
            and all(d.is_floating_point for d in {t.dtype for t in tensors}) and [t.shape for t in tensors] == last[2]):
        return names, last[1], tensors  # the loaded shapes under the same names as last time
    writes = _plan_by_name(weights, items, model)
    keys = [(w.layer, w.module, w.which) for w in writes]
    weights.last_update = (names, keys, [w.tensor.shape for w in writes])
    return names, keys, tensors


def loaded_pair(weights: LoraWeights, name: Any, model: ModelConfig) -> tuple[int, str, str, tuple]:
    """(layer, module, "A"|"B", the loaded (A, B) pair) an update's tensor name goes to, or a
    ValueError naming it (shared by updates by name and flat layouts)."""
    parsed = weights.name_index.get(name) if isinstance(name, str) else None
    layer, module, which = parsed if parsed is not None else _parse_name(name, model)
    pair = weights.modules.get((layer, module))
    if pair is None:
        raise ValueError(f"adapter tensor {name!r}: the loaded adapter has no {module} in layer {layer} "
                         f"(it has {sorted(weights.module_names)} in layers {weights.layers})")
    weights.name_index[name] = (layer, module, which)  # the next update skips the parse
    return layer, module, which, pair


def _plan_by_name(weights: LoraWeights, items: list[tuple[str, Any]], model: ModelConfig) -> list[AdapterWrite]:
    writes: list[AdapterWrite] = []
    seen: dict[tuple[int, str, str], str] = {}
    for name, tensor in items:
        layer, module, which, pair = loaded_pair(weights, name, model)
        target = pair[0] if which == "A" else pair[1]
        _check_tensor(name, tensor, tuple(target.shape), f"the loaded lora_{which}")
        if (layer, module, which) in seen:
            raise ValueError(f"adapter tensor {name!r}: given twice in one update "
                             f"(also as {seen[layer, module, which]!r})")
        seen[layer, module, which] = name
        writes.append(AdapterWrite(name, layer, module, which, tensor, target))
    return writes


@torch.no_grad()
def apply_adapter_update(writes: list[AdapterWrite]) -> set[Key]:
    """Write a planned update into the LoraWeights tensors; returns the (layer, module)s changed."""
    for w in writes:
        w.target.copy_(w.tensor)
    return {(w.layer, w.module) for w in writes}
