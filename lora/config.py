"""LoraAdapterConfig: the part of a PEFT LoRA config the engine serves, validated.

Reads a peft `adapter_config.json` dict, a `LoraConfig`-style dict or a `peft.LoraConfig`.
Knows the seven projections of a Llama-family decoder layer (q/k/v/o under `self_attn`,
gate/up/down under `mlp`) and which of them, in which layers, the adapter targets (peft's
own matching rules, mirrored in `targets`); it knows nothing of tensors (adapter.py).

Whatever peft can express that the engine would not serve exactly as peft does is refused
with a ValueError naming the field (DoRA, modules_to_save, embedding/lm_head LoRA,
per-module ranks, biases, initialisations that rewrite the base weights, ...), never
dropped. An unknown field with a non-empty value is refused too: a newer peft option
could change what the adapter computes.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# HF module name -> its parent in a decoder layer (model.layers.{i}.{parent}.{name})
MODULE_PARENTS: dict[str, str] = {
    "q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
    "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp",
}
TARGET_MODULES = tuple(MODULE_PARENTS)
EMBEDDING_MODULES = ("model.embed_tokens", "lm_head")
EMBEDDING_ERROR = "embedding/lm_head LoRA is not supported"
# peft's `target_modules="all-linear"`: every linear layer but the output head.
ALL_LINEAR = "all-linear"
# Initialisations that leave the base weights alone. The others (pissa, corda, olora, loftq,
# lora_ga) subtract B @ A from the base at init, so their adapters only fit a modified base
# (peft's save_pretrained(path_initial_model_for_weight_conversion=...) converts them).
_BASE_PRESERVING_INITS = (True, False, "gaussian", "eva", "orthogonal", "mica")
# Fields that are metadata, or that only matter for training or initialisation.
_IGNORED_FIELDS = frozenset({
    "task_type", "peft_type", "auto_mapping", "peft_version", "base_model_name_or_path", "revision",
    "inference_mode", "lora_dropout", "init_lora_weights", "megatron_core", "qalora_group_size",
    "loftq_config", "eva_config", "corda_config", "lora_ga_config", "ensure_weight_tying",
})
# Fields that are fine while empty / off and refused otherwise, with the reason.
_REFUSED_WHEN_SET: dict[str, str] = {
    "use_dora": "DoRA adapters are not supported",
    "modules_to_save": "fully trained module copies (modules_to_save) are not supported, only LoRA A/B",
    "rank_pattern": "per-module ranks are not supported; use one r for every module",
    "alpha_pattern": "per-module alphas are not supported; use one lora_alpha for every module",
    "lora_bias": "a bias on lora_B is not supported",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D-style transposed weights) is not supported",
    "trainable_token_indices": EMBEDDING_ERROR + " (trainable_token_indices trains embedding rows)",
    "layer_replication": "layer_replication is not supported",
    "target_parameters": "LoRA on parameters (target_parameters) is not supported",
    "megatron_config": "Megatron parallel LoRA layers are not supported",
    "use_qalora": "QALoRA is not supported",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens) is not supported",
    "velora_config": "VeLoRA is not supported",
    "monteclora_config": "MonteCLoRA is not supported",
    "kasa_config": "KaSA is not supported",
    "use_bdlora": "BD-LoRA is not supported",
    "arrow_config": "Arrow routing is not supported",
}
_CHECKED_FIELDS = frozenset({
    "r", "lora_alpha", "use_rslora", "target_modules", "exclude_modules", "layers_to_transform",
    "layers_pattern", "bias",
})
_KNOWN_FIELDS = _IGNORED_FIELDS | _CHECKED_FIELDS | frozenset(_REFUSED_WHEN_SET)
# Target resolution probes this many layers when the model's depth is not known yet.
_PROBE_LAYERS = 1024


def module_key(layer: int, module: str) -> str:
    """The module's name in the HF model, as peft matches target_modules against it."""
    return f"model.layers.{layer}.{MODULE_PARENTS[module]}.{module}"


@dataclass(frozen=True)
class LoraAdapterConfig:
    r: int
    lora_alpha: float
    use_rslora: bool
    target_modules: frozenset[str]  # modules targeted in at least one layer (of at most 1024)
    # peft's matching inputs, kept to resolve `targets(num_layers)` exactly:
    target_spec: str | tuple[str, ...] = ()  # a regex (re.fullmatch) or names (suffix match)
    exclude_spec: str | tuple[str, ...] | None = None
    layers_to_transform: tuple[int, ...] | None = None  # list targets only, as in peft
    layers_pattern: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r < 1:
            raise ValueError(f"r={self.r!r}: must be an int >= 1")
        unknown = sorted(set(self.target_modules) - set(TARGET_MODULES))
        if unknown:
            raise ValueError(f"target_modules {unknown} are not modules the engine serves LoRA on: "
                             f"{list(TARGET_MODULES)}")
        if not self.target_spec:  # built directly from module names: peft's list semantics
            object.__setattr__(self, "target_spec", tuple(sorted(self.target_modules)))

    @property
    def scaling(self) -> float:
        """peft's LoraLayer.update_layer: alpha / sqrt(r) with rsLoRA, else alpha / r."""
        return self.lora_alpha / math.sqrt(self.r) if self.use_rslora else self.lora_alpha / self.r

    def targets(self, num_layers: int) -> frozenset[tuple[int, str]]:
        """Every (layer, module) of a `num_layers`-layer model that peft would wrap with LoRA."""
        return frozenset(
            (layer, module) for layer in range(num_layers) for module in TARGET_MODULES
            if self._matches(module_key(layer, module))
        )

    def _matches(self, key: str) -> bool:
        # Mirrors peft.tuners.tuners_utils.check_target_module_exists (peft 0.21).
        exclude = self.exclude_spec
        if exclude:
            if isinstance(exclude, str):
                if re.fullmatch(exclude, key):
                    return False
            elif key in exclude or any(key.endswith(f".{e}") for e in exclude):
                return False
        spec = self.target_spec
        if isinstance(spec, str):
            return re.fullmatch(spec, key) is not None
        if key in spec:
            return True
        if not any(key.endswith(f".{t}") for t in spec):
            return False
        if self.layers_to_transform is None:
            return True
        if not self.layers_pattern:
            match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", key)
        else:
            match = None
            for pattern in self.layers_pattern:
                match = re.match(rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.", key)
                if match is not None:
                    break
        return match is not None and int(match.group("idx")) in self.layers_to_transform

    @classmethod
    def from_dict(cls, config: Mapping[str, Any] | Any, *, max_rank: int) -> LoraAdapterConfig:
        """From adapter_config.json, a LoraConfig-style dict or a peft.LoraConfig (via
        `.to_dict()`). `r` and `target_modules` are required; `lora_alpha` defaults to
        peft's 8, `use_rslora` to False. Refused fields raise ValueError naming them."""
        if not isinstance(config, Mapping) and callable(getattr(config, "to_dict", None)):
            config = config.to_dict()
        if not isinstance(config, Mapping):
            raise ValueError(f"adapter config: expected a mapping or a peft LoraConfig, got {type(config).__name__}")
        if isinstance(max_rank, bool) or not isinstance(max_rank, int) or max_rank < 1:
            raise ValueError(f"max_rank={max_rank!r}: must be an int >= 1")
        d = dict(config)

        peft_type = _enum_value(d.get("peft_type", "LORA"))
        if peft_type != "LORA":
            raise ValueError(f"adapter config: peft_type={peft_type!r} is not supported; only LORA adapters are")
        for name, reason in _REFUSED_WHEN_SET.items():
            if _is_set(d.get(name)):
                raise ValueError(f"adapter config: {name}={d[name]!r}: {reason}")
        unknown = sorted(k for k in d if k not in _KNOWN_FIELDS and _is_set(d[k]))
        if unknown:
            raise ValueError(f"adapter config: unknown field {unknown[0]}={d[unknown[0]]!r} (not a LoRA option this "
                             f"engine knows); refused rather than ignored, since it may change the adapter's output")
        init = d.get("init_lora_weights", True)
        if init not in _BASE_PRESERVING_INITS:
            raise ValueError(f"adapter config: init_lora_weights={init!r} rewrites the base weights at init, so the "
                             "adapter only fits that modified base; convert it to plain LoRA with peft's "
                             "save_pretrained(path_initial_model_for_weight_conversion=...)")
        bias = d.get("bias", "none")
        if bias != "none":
            raise ValueError(f"adapter config: bias={bias!r}: trained biases are not supported; only bias='none'")

        r = d.get("r")
        if r is None:
            raise ValueError("adapter config: r is missing")
        if isinstance(r, bool) or not isinstance(r, int):
            raise ValueError(f"adapter config: r={r!r} must be an int")
        if r < 1:
            raise ValueError(f"adapter config: r={r} must be >= 1")
        if r > max_rank:
            raise ValueError(f"adapter config: r={r} is above max_lora_rank={max_rank}")
        alpha = d.get("lora_alpha", 8)
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha <= 0:
            raise ValueError(f"adapter config: lora_alpha={alpha!r} must be a finite number > 0")
        use_rslora = d.get("use_rslora", False)
        if not isinstance(use_rslora, bool):
            raise ValueError(f"adapter config: use_rslora={use_rslora!r} must be a bool")

        target_spec = _target_spec(d.get("target_modules"))
        exclude_spec = _exclude_spec(d.get("exclude_modules"))
        layers = _layers_to_transform(d.get("layers_to_transform"))
        pattern = _layers_pattern(d.get("layers_pattern"))
        probe = cls(r=r, lora_alpha=alpha, use_rslora=use_rslora, target_modules=frozenset(TARGET_MODULES),
                    target_spec=target_spec, exclude_spec=exclude_spec, layers_to_transform=layers,
                    layers_pattern=pattern)
        # The model's depth is not known here: probe more layers than any model served has.
        # parse_adapter resolves the exact (layer, module) set against the real depth.
        modules = frozenset(module for _, module in probe.targets(_PROBE_LAYERS))
        if not modules:
            raise ValueError(f"adapter config: target_modules={d.get('target_modules')!r} matches none of the modules "
                             f"the engine serves LoRA on: {list(TARGET_MODULES)}")
        return cls(r=r, lora_alpha=alpha, use_rslora=use_rslora, target_modules=modules, target_spec=target_spec,
                   exclude_spec=exclude_spec, layers_to_transform=layers, layers_pattern=pattern)


def _enum_value(value: Any) -> Any:
    return getattr(value, "value", value)


def _is_set(value: Any) -> bool:
    return value is not None and value is not False and not (hasattr(value, "__len__") and len(value) == 0)


def _target_spec(targets: Any) -> str | tuple[str, ...]:
    if targets is None:
        raise ValueError("adapter config: target_modules is missing (peft would infer it from the model type; "
                         "give it explicitly)")
    if isinstance(targets, str):
        if targets == ALL_LINEAR:
            return TARGET_MODULES
        try:
            pattern = re.compile(targets)
        except re.error as error:
            raise ValueError(f"adapter config: target_modules={targets!r} is not a valid regex: {error}") from None
        if any(pattern.fullmatch(key) for key in EMBEDDING_MODULES):
            raise ValueError(f"adapter config: target_modules={targets!r} matches {EMBEDDING_MODULES}: "
                             f"{EMBEDDING_ERROR}")
        return targets
    if not isinstance(targets, (list, tuple, set, frozenset)) or not all(isinstance(t, str) for t in targets):
        raise ValueError(f"adapter config: target_modules={targets!r} must be a string (regex or 'all-linear') "
                         "or a list of module names")
    names = tuple(sorted(targets))
    for name in names:
        if any(key == name or key.endswith(f".{name}") for key in EMBEDDING_MODULES):
            raise ValueError(f"adapter config: target_modules entry {name!r}: {EMBEDDING_ERROR}")
        if not any(_suffix_of_module_key(module).fullmatch(name) for module in TARGET_MODULES):
            raise ValueError(f"adapter config: target_modules entry {name!r} is not a module the engine serves LoRA "
                             f"on; known: {list(TARGET_MODULES)}")
    return names


def _suffix_of_module_key(module: str) -> re.Pattern[str]:
    """Matches every dotted suffix of `model.layers.{i}.{parent}.{module}` (peft's list match)."""
    parent = MODULE_PARENTS[module]
    return re.compile(rf"(?:(?:(?:(?:model\.)?layers\.)?\d+\.)?{parent}\.)?{module}")


def _exclude_spec(exclude: Any) -> str | tuple[str, ...] | None:
    if not _is_set(exclude):
        return None
    if isinstance(exclude, str):
        try:
            re.compile(exclude)
        except re.error as error:
            raise ValueError(f"adapter config: exclude_modules={exclude!r} is not a valid regex: {error}") from None
        return exclude
    if isinstance(exclude, (list, tuple, set, frozenset)) and all(isinstance(e, str) for e in exclude):
        return tuple(sorted(exclude))
    raise ValueError(f"adapter config: exclude_modules={exclude!r} must be a regex string or a list of names")


def _layers_to_transform(layers: Any) -> tuple[int, ...] | None:
    if layers is None or (isinstance(layers, (list, tuple)) and len(layers) == 0):
        return None
    if isinstance(layers, int) and not isinstance(layers, bool):
        layers = [layers]
    if not isinstance(layers, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool) for i in layers):
        raise ValueError(f"adapter config: layers_to_transform={layers!r} must be an int or a list of ints")
    if any(i < 0 for i in layers):
        raise ValueError(f"adapter config: layers_to_transform={list(layers)} has a negative layer index")
    return tuple(sorted(set(layers)))


def _layers_pattern(pattern: Any) -> tuple[str, ...] | None:
    if not _is_set(pattern):
        return None
    patterns = [pattern] if isinstance(pattern, str) else pattern
    if not isinstance(patterns, (list, tuple)) or not all(isinstance(p, str) for p in patterns):
        raise ValueError(f"adapter config: layers_pattern={pattern!r} must be a string or a list of strings")
    if "layers" not in patterns:
        raise ValueError(f"adapter config: layers_pattern={pattern!r}: the engine's decoder layers are "
                         "`model.layers.{i}`; only 'layers' is supported")
    return tuple(patterns)
