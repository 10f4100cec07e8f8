"""Model shapes for benchmarks: HF `config.json` contents of well-known models, to run with
random ("dummy") weights and no download.

Knows only the shapes (a dict per name, as `config.json` holds it) and how to write one into
a directory the engine and transformers can load. Knows nothing about weights.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

SHAPES: dict[str, dict[str, Any]] = {
    "llama8b": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5,
        rope_theta=500000.0, max_position_embeddings=8192, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
    ),
    # for smoke runs of the scripts on CPU
    "tiny": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=512, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
        rope_theta=10000.0, max_position_embeddings=4096, tie_word_embeddings=False,
    ),
    # a 0.6B draft for llama8b: Qwen3-0.6B's widths and depth as a Llama with Llama-3's vocabulary
    "draft06b": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=1024, intermediate_size=3072,
        num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5,
        rope_theta=500000.0, max_position_embeddings=8192, tie_word_embeddings=True,
    ),
    "qwen06b": dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
        num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
        rope_theta=1000000.0, max_position_embeddings=8192, tie_word_embeddings=True,
    ),
}


def write_shape_dir(name: str, prefix: str | None = None) -> str:
    """A fresh temp directory holding SHAPES[name] as config.json (load it with
    load_format="dummy" for random weights); its path."""
    if name not in SHAPES:
        raise ValueError(f"unknown model shape {name!r}: expected one of {sorted(SHAPES)}")
    path = tempfile.mkdtemp(prefix=prefix or f"shape-{name}-")
    (Path(path) / "config.json").write_text(json.dumps(SHAPES[name]))
    return path
