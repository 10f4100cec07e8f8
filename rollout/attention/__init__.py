"""Attention backends: the interface (base), the torch reference, and fused kernels."""

from __future__ import annotations

import torch

from rollout.attention.base import AttentionBackend
from rollout.cache.kv_pool import KVPool
from rollout.kernels.options import DEFAULT_OPTIONS, KernelOptions


# Decode graphs of at most this many rows run Triton's decode kernel under `auto` (small_decode.py;
# KernelOptions.small_decode_rows replaces it).
# A replayed FlashInfer graph re-plans on the host first (its split-KV schedule, pinned copies):
# without overlap, and in every verify step, that host time is exposed. Triton's kernel needs
# no host plan, so up to a few dozen rows its graphs win; past that FlashInfer's faster kernel
# makes up for its plan, and this is about where the two drew level (BENCHMARKS.md,
# speculative decoding, "H200, 2026-12-02: the verify step's host time; ...").
SMALL_DECODE_ROWS = 48


def make_backend(name: str, pool: KVPool, num_heads: int, num_kv_heads: int, head_dim: int, device: str,
                 options: KernelOptions = DEFAULT_OPTIONS) -> AttentionBackend:
    """`auto` on CUDA picks FlashInfer (bf16/fp16 KV, when it imports) with Triton's decode
    kernel for the decode graphs of SMALL_DECODE_ROWS rows (small_decode.py), then Triton,
    then the torch reference; on CPU the torch reference (its fast path there). `triton` on
    CPU works only under TRITON_INTERPRET=1 (for tests). `options`: the engine's kernel
    choices, which the backend keeps."""
    from rollout.attention.torch_backend import TorchAttention

    args = (pool, num_heads, num_kv_heads, head_dim, options)
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
            flashinfer = FlashInferAttention(*args)
            if name == "flashinfer":
                return flashinfer
            try:
                from rollout.attention.triton_backend import TritonAttention
            except ImportError:
                return flashinfer
            from rollout.attention.small_decode import SmallDecode

            small = SMALL_DECODE_ROWS if options.small_decode_rows is None else options.small_decode_rows
            return SmallDecode(flashinfer, TritonAttention(*args), max_rows=small)
    try:
        from rollout.attention.triton_backend import TritonAttention
    except ImportError as e:
        if name == "triton":
            raise ValueError(f"attention backend 'triton' is not available: {e}") from e
        return TorchAttention(*args)
    return TritonAttention(*args)
