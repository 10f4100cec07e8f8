"""Attention backends: the interface (base), the torch reference, and fused kernels."""

from __future__ import annotations

from rollout.attention.base import AttentionBackend
from rollout.cache.kv_pool import KVPool


def make_backend(name: str, pool: KVPool, num_heads: int, num_kv_heads: int, head_dim: int, device: str) -> AttentionBackend:
    """`auto` picks the fastest backend that works on the device (only torch on CPU)."""
    from rollout.attention.torch_backend import TorchAttention

    if name in ("auto", "torch"):
        return TorchAttention(pool, num_heads, num_kv_heads, head_dim)
    raise ValueError(f"attention backend {name!r} is not available on {device}")
