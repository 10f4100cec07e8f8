"""ModelConfig: the shapes of a Llama-family decoder, read from a HF config.json.

Knows Llama 2/3 (incl. Llama-3 rope scaling), Qwen2/2.5 (qkv bias), Qwen3 (q/k RMSNorm,
explicit head_dim) and SmolLM2 (a Llama). Anything else is refused by name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# architecture -> (q/k/v always biased, q/k norm). Qwen2 hard-codes its qkv bias; the
# others follow config.attention_bias.
_ARCHS: dict[str, tuple[bool, bool]] = {
    "LlamaForCausalLM": (False, False),
    "Qwen2ForCausalLM": (True, False),
    "Qwen3ForCausalLM": (False, True),
}
# config.json files without `architectures` (written from GGUF files, some older exports):
# transformers falls back to model_type, and so do we.
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    rope_scaling: dict[str, Any] | None = None
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise FileNotFoundError(f"model config not found: {cfg_file}")
        cfg = json.loads(cfg_file.read_text())
        gen_file = path / "generation_config.json"
        gen = json.loads(gen_file.read_text()) if gen_file.is_file() else {}
        return cls.from_dict(cfg, gen)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], generation: dict[str, Any] | None = None) -> ModelConfig:
        archs = cfg.get("architectures") or []
        if archs:
            arch = next((a for a in archs if a in _ARCHS), None)
            if arch is None:
                raise ValueError(f"unsupported architecture {archs!r} in config.json; supported: {sorted(_ARCHS)}")
        else:
            model_type = cfg.get("model_type")
            arch = _MODEL_TYPES.get(model_type)  # type: ignore[arg-type]
            if arch is None:
                raise ValueError(
                    f"config.json has no `architectures` and model_type {model_type!r} is not supported; "
                    f"supported model types: {sorted(_MODEL_TYPES)}"
                )
        always_bias, qk_norm = _ARCHS[arch]
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        eos: list[int] = []
        for source in (generation or {}, cfg):
            value = source.get("eos_token_id")
            if value is not None:
                eos = [value] if isinstance(value, int) else list(value)
                break
        rope_scaling = cfg.get("rope_scaling") or None
        rope_theta = cfg.get("rope_theta")
        if rope_theta is None and isinstance(cfg.get("rope_parameters"), dict):
            # transformers >= 5 folds theta and scaling into rope_parameters
            params = cfg["rope_parameters"]
            rope_theta = params.get("rope_theta")
            if params.get("rope_type", "default") != "default":
                rope_scaling = params
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=always_bias or bool(cfg.get("attention_bias")),
            qk_norm=qk_norm,
            rope_scaling=rope_scaling,
            eos_token_ids=tuple(int(e) for e in eos),
        )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim
