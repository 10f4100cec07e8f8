"""Random LoRA adapters of a benchmark shape, for the GPU benches (benchmarks/lora.py,
benchmarks/diagnostics/profile_step.py, benchmarks/kernels/lora_row.py): PEFT state-dict names, rank r on all
seven projections of every layer."""

from __future__ import annotations

import torch

MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def random_adapter(cfg: dict, rank: int, seed: int, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """PEFT state-dict names -> random lora_A / lora_B for every layer and all seven modules."""
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    d = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
              "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
    g = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for layer in range(cfg["num_hidden_layers"]):
        for m, (fan_in, fan_out) in shapes.items():
            part = "self_attn" if m in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            p = f"base_model.model.model.layers.{layer}.{part}.{m}"
            out[p + ".lora_A.weight"] = torch.randn(rank, fan_in, generator=g, device=device).to(dtype) * 0.01
            out[p + ".lora_B.weight"] = torch.randn(fan_out, rank, generator=g, device=device).to(dtype) * 0.01
    return out


def load_random_adapters(engine, cfg: dict, count: int, rank: int = 16) -> list[str]:
    """`count` random adapters (alpha 2 * rank) loaded into `engine`; their names."""
    names = [f"lora{i}" for i in range(count)]
    for i, name in enumerate(names):
        engine.load_lora_adapter(name, tensors=random_adapter(cfg, rank, i, engine.device, engine.config.torch_dtype),
                                 config=dict(r=rank, lora_alpha=2 * rank, target_modules=MODULES))
    return names
