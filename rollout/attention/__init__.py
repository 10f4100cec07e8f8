"""Attention backends: the interface (base), the torch reference, and fused kernels."""

from __future__ import annotations

from rollout.attention.base import AttentionBackend
from rollout.cache.kv_pool import KVPool


def make_backend(name: str, pool: KVPool, num_heads: int, num_kv_heads: int, head_dim: int, device: str) -> AttentionBackend:
    """`auto` picks Triton on CUDA when it imports, else the torch reference (the fast
    path on CPU). `triton` on CPU works only under TRITON_INTERPRET=1 (for tests)."""
    from rollout.attention.torch_backend import TorchAttention

    args = (pool, num_heads, num_kv_heads, head_dim)
    if name == "torch" or (name == "auto" and not device.startswith("cuda")):
        return TorchAttention(*args)
    if name in ("auto", "triton"):
        try:
            from rollout.attention.triton_backend import TritonAttention
        except ImportError as e:
            if name == "triton":
                raise ValueError(f"attention backend 'triton' is not available: {e}") from e
            return TorchAttention(*args)
        return TritonAttention(*args)
    raise ValueError(f"attention backend {name!r} is not available on {device}")
