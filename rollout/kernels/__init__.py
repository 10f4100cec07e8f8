"""Fused GPU kernels for the decoder's per-token elementwise work: RMSNorm with the residual
add and SiLU-and-mul in `rollout.kernels.fused`, the rotary embedding and the KV store in
`rollout.kernels.rotary` (Triton); the torch code in `rollout.model.llama` is both the CPU
path and their reference. Beside them,
`rollout.kernels.finite`: the one-launch NaN/Inf check of a weight update's tensors,
`rollout.kernels.kv_copy`: KV slots copied in every layer in one launch, and
`rollout.kernels.skinny`: the projections' matmul at a batch-1 decode's one row (`linear`
below picks it; F.linear is its reference).

`use_fused(x)` is the one dispatch test the model makes. It is cheap on the CPU path (no
triton import: `fused` is loaded lazily on first access), and by default true exactly for
CUDA tensors of a supported dtype when triton imports. Tests set `enabled` to run the
kernels on CPU tensors under TRITON_INTERPRET=1 (True) or the torch path on a GPU (False).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from rollout.cache.kv_pool import KVTarget
    from rollout.kernels.low_rank import LowRank
    from rollout.kernels import finite as finite
    from rollout.kernels import kv_copy as kv_copy
    from rollout.kernels import fused as fused
    from rollout.kernels import rotary as rotary
    from rollout.kernels import skinny as skinny

__all__ = ["available", "enabled", "linear", "linear_rope_kv", "linear_silu_mul", "one_row", "rope_epilogue",
           "rope_folds", "silu_epilogue", "silu_folds", "skinny_matmul", "use_fused"]

# None: automatic (CUDA tensors only). Tests only: True routes CPU tensors through the
# kernels too (needs TRITON_INTERPRET=1 set before triton is first imported); False keeps
# CUDA tensors on the torch path (the reference on a GPU).
enabled: bool | None = None

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_available: bool | None = None


def available() -> bool:
    """Whether triton imports (checked once)."""
    global _available
    if _available is None:
        try:
            import triton  # noqa: F401

            _available = True
        except ImportError:
            _available = False
    return _available


def use_fused(x: torch.Tensor) -> bool:
    # Cheapest test first: on the CPU path this is two attribute reads and no import.
    on = x.is_cuda if enabled is None else enabled
    return on and x.dtype in _DTYPES and available()


# One-row matmuls (16-bit, on GPU) run the skinny kernel instead of cuBLAS: one launch that
# streams the weight once (BENCHMARKS.md, "Batch 1, session 6"). Read when a matmul is issued,
# so a decode graph keeps the choice it was captured with; False: cuBLAS (benchmarks set it
# before building an engine to compare the two).
skinny_matmul: bool = True


# ... and the gate_up projection's GEMV writes silu(gate) * up itself (skinny.linear_silu_mul):
# one SiLU-mul launch a layer fewer. False: the two apart (A/B).
silu_epilogue: bool = True
# ... and the qkv projection's GEMV rotates q and k and stores k and v in the KV pool itself
# (skinny.linear_rope_kv): one rotary launch a layer fewer. False: the two apart (A/B).
rope_epilogue: bool = True


def one_row(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Does `linear(x, weight)` run the skinny kernel (one 16-bit row on the fused path)? Then it
    and the epilogue forms below take a low-rank term (rollout/kernels/low_rank.py)."""
    return x.shape[0] == 1 and x.dtype != torch.float32 and skinny_matmul and use_fused(x) and weight.is_contiguous() \
        and x.stride(-1) == 1


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           low_rank: LowRank | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias): a projection's matmul (x: [T, in], weight: [out, in]).
    `low_rank`: an adapter's term to add, only where `one_row(x, weight)`."""
    if one_row(x, weight):
        from rollout.kernels import skinny  # lazy, as below: the CPU path never imports triton

        return skinny.linear(x, weight, bias, low_rank=low_rank)
    if low_rank is not None:
        raise ValueError(f"kernels.linear: a low-rank term needs the skinny kernel's one row, got x "
                         f"{tuple(x.shape)} {x.dtype} on {x.device}")
    return F.linear(x, weight, bias)


def silu_folds(weight: torch.Tensor) -> bool:
    """Does `linear_silu_mul` fold SiLU-mul into a one-row matmul of this weight (gate | up)?"""
    return silu_epilogue and weight.shape[0] % 2 == 0


def linear_silu_mul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                    low_rank: LowRank | None = None) -> torch.Tensor | None:
    """silu(gate) * up of linear(x, weight, bias) (weight: gate's rows, then up's) in the
    matmul's one launch where `one_row(x, weight)` and `silu_folds(weight)`; None elsewhere
    (the caller runs the matmul, then SiLU-mul). `low_rank`: an adapter's term on gate_up."""
    if not (silu_folds(weight) and one_row(x, weight)):
        return None
    from rollout.kernels import skinny

    return skinny.linear_silu_mul(x, weight, bias, low_rank=low_rank)


def rope_folds(kv: KVTarget | None) -> bool:
    """Does `linear_rope_kv` fold the rotary and the K/V store into a one-row qkv matmul?"""
    return rope_epilogue and kv is not None


def linear_rope_kv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cos: torch.Tensor,
                   sin: torch.Tensor, positions: torch.Tensor, kv: KVTarget | None, n_q_heads: int,
                   n_kv_heads: int, low_rank: LowRank | None = None) -> torch.Tensor | None:
    """The qkv projection with the rotary of q and k and the K/V store into `kv` in the matmul's
    one launch, where `one_row(x, weight)` and `rope_folds(kv)` (there is a store to make): [1,
    (H + 2 Hkv) D] with q and k rotated; None elsewhere (the caller runs the matmul, then the
    rotary). `low_rank`: an adapter's term on qkv, added before the rotary."""
    if not (rope_folds(kv) and one_row(x, weight)):
        return None
    from rollout.kernels import skinny

    assert kv is not None
    rope = skinny.RopeKV(cos, sin, positions, kv.k_cache, kv.v_cache, kv.slots, n_q_heads, n_kv_heads)
    return skinny.linear_rope_kv(x, weight, bias, rope, low_rank=low_rank)


def __getattr__(name: str) -> Any:
    # Lazy `kernels.fused` / `finite` / `kv_copy` / `rotary` / `skinny` (PEP 562): importing the model never imports
    # triton. After the first access the submodule is a real attribute and this hook is not
    # called again.
    if name in ("fused", "finite", "kv_copy", "rotary", "skinny"):
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
