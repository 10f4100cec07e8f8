"""Attention backends: the interface (base), the torch reference, and fused kernels."""

from __future__ import annotations

import torch

from rollout.attention.base import AttentionBackend
from rollout.cache.kv_pool import KVPool


def make_backend(name: str, pool: KVPool, num_heads: int, num_kv_heads: int, head_dim: int, device: str) -> AttentionBackend:
    """`auto` on CUDA picks FlashInfer (bf16/fp16 KV, when it imports), then Triton, then the
    torch reference; on CPU the torch reference (its fast path there). `triton` on CPU works
    only under TRITON_INTERPRET=1 (for tests)."""
    from rollout.attention.torch_backend import TorchAttention

    args = (pool, num_heads, num_kv_heads, head_dim)
    if name == "deterministic":  # chosen by EngineConfig.deterministic, not by name
        from rollout.attention.deterministic_backend import DeterministicAttention

        return DeterministicAttention(*args)
    if name not in ("auto", "torch", "triton", "flashinfer"):
        raise ValueError(f"attention backend {name!r} is not one of auto, torch, triton, flashinfer")
    if name == "torch" or (name == "auto" and not device.startswith("cuda")):
        return TorchAttention(*args)
    half = pool.k_buffers[0].dtype in (torch.bfloat16, torch.float16)
    if name == "flashinfer" or (name == "auto" and half):
        try:
            from rollout.attention.flashinfer_backend import FlashInferAttention
        except ImportError as e:
            if name == "flashinfer":
                raise ValueError(f"attention backend 'flashinfer' is not available: {e}") from e
        else:
            return FlashInferAttention(*args)
    try:
        from rollout.attention.triton_backend import TritonAttention
    except ImportError as e:
        if name == "triton":
            raise ValueError(f"attention backend 'triton' is not available: {e}") from e
        return TorchAttention(*args)
    return TritonAttention(*args)
