"""Fused GPU kernels for the decoder's per-token elementwise work: RMSNorm with the residual
add and SiLU-and-mul in `rollout.kernels.fused`, the rotary embedding and the KV store in
`rollout.kernels.rotary` (Triton); the torch code in `rollout.model.llama` is both the CPU
path and their reference. Beside them,
`rollout.kernels.finite`: the one-launch NaN/Inf check of a weight update's tensors,
`rollout.kernels.kv_copy`: KV slots copied in every layer in one launch, and
`rollout.kernels.skinny`: the projections' matmul at a batch-1 decode's one row (`linear`
below picks it; F.linear is its reference).

Each kernel's caller-facing form is here, picking the kernel or its torch reference:
`linear` and its epilogue forms, `KVTarget.write` (a layer's new K/V into the KV pool) and
`first_non_finite` (a weight update's NaN/Inf check).

`use_fused(x, fused)` is the one dispatch test the model makes. It is cheap on the CPU path (no
triton import: `fused` is loaded lazily on first access), and by default (`fused=None`) true
exactly for CUDA tensors of a supported dtype when triton imports. Which kernels run is the
caller's KernelOptions (rollout/kernels/options.py), passed in; its `fused=True` runs the
kernels on CPU tensors under TRITON_INTERPRET=1 (tests), False the torch path on a GPU.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from rollout.kernels.low_rank import LowRank
    from rollout.kernels import finite as finite
    from rollout.kernels import kv_copy as kv_copy
    from rollout.kernels import fused as fused
    from rollout.kernels import rotary as rotary
    from rollout.kernels import skinny as skinny

from rollout.kernels.options import DEFAULT_OPTIONS, KernelOptions

__all__ = ["DEFAULT_OPTIONS", "KVTarget", "KernelOptions", "available", "first_non_finite", "linear", "linear_rope_kv",
           "linear_silu_mul", "one_row", "rope_folds", "silu_folds", "use_fused"]

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


def use_fused(x: torch.Tensor, fused: bool | None = None) -> bool:
    """Does x take the Triton kernels (`fused`: KernelOptions.fused)?"""
    # Cheapest test first: on the CPU path this is two attribute reads and no import.
    on = x.is_cuda if fused is None else fused
    return on and x.dtype in _DTYPES and available()


@dataclass(frozen=True)
class KVTarget:
    """Where one layer's new K/V of a step go: that layer's pool buffers, at the step's slots.
    The kernel that makes K (the rotary, rollout.model.llama.Rotary) writes them there in its
    own launch on GPU; `write` is the same store on its own (and the CPU path). The KV pool
    (rollout/cache/kv_pool.py) hands them out."""

    k_cache: torch.Tensor  # [num_slots, Hkv, D]
    v_cache: torch.Tensor
    slots: torch.Tensor  # [T], device
    fused: bool | None = None  # KernelOptions.fused of the pool's engine

    def write(self, k: torch.Tensor, v: torch.Tensor) -> None:
        # k, v: [T, Hkv, D]
        if use_fused(k, self.fused):  # GPU: K and V in one launch
            from rollout.kernels import rotary

            rotary.store_kv(self.k_cache, self.v_cache, self.slots, k, v)
            return
        self.k_cache.index_copy_(0, self.slots, k.to(self.k_cache.dtype))
        self.v_cache.index_copy_(0, self.slots, v.to(self.v_cache.dtype))


# One-row matmuls (16-bit, on GPU) run the skinny kernel instead of cuBLAS: one launch that
# streams the weight once (BENCHMARKS.md, "Batch 1, H200, 2026-12-01 (issue #16 (b)): a one-row
# GEMV, ..."); KernelOptions.skinny_matmul. The gate_up projection's GEMV then writes
# silu(gate) * up itself (skinny.linear_silu_mul: one SiLU-mul launch a layer fewer,
# `silu_epilogue`), and the qkv projection's rotates q and k and stores k and v in the KV pool
# itself (skinny.linear_rope_kv: one rotary launch a layer fewer, `rope_epilogue`). The options
# are the layer's, so a decode graph keeps the choice it was captured with.


def one_row(x: torch.Tensor, weight: torch.Tensor, options: KernelOptions = DEFAULT_OPTIONS) -> bool:
    """Does `linear(x, weight, options=options)` run the skinny kernel (one 16-bit row on the
    fused path)? Then it and the epilogue forms below take a low-rank term
    (rollout/kernels/low_rank.py)."""
    return x.shape[0] == 1 and x.dtype != torch.float32 and options.skinny_matmul and use_fused(x, options.fused) \
        and weight.is_contiguous() and x.stride(-1) == 1


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           options: KernelOptions = DEFAULT_OPTIONS, low_rank: LowRank | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias): a projection's matmul (x: [T, in], weight: [out, in]).
    `low_rank`: an adapter's term to add, only where `one_row(x, weight, options)`."""
    if one_row(x, weight, options):
        from rollout.kernels import skinny  # lazy, as below: the CPU path never imports triton

        return skinny.linear(x, weight, bias, low_rank=low_rank, pdl=options.pdl)
    if low_rank is not None:
        raise ValueError(f"kernels.linear: a low-rank term needs the skinny kernel's one row, got x "
                         f"{tuple(x.shape)} {x.dtype} on {x.device}")
    return F.linear(x, weight, bias)


def silu_folds(weight: torch.Tensor, options: KernelOptions = DEFAULT_OPTIONS) -> bool:
    """Does `linear_silu_mul` fold SiLU-mul into a one-row matmul of this weight (gate | up)?"""
    return options.silu_epilogue and weight.shape[0] % 2 == 0


def linear_silu_mul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                    options: KernelOptions = DEFAULT_OPTIONS, low_rank: LowRank | None = None) -> torch.Tensor | None:
    """silu(gate) * up of linear(x, weight, bias) (weight: gate's rows, then up's) in the
    matmul's one launch where `one_row(x, weight, options)` and `silu_folds(weight, options)`;
    None elsewhere (the caller runs the matmul, then SiLU-mul). `low_rank`: an adapter's term
    on gate_up."""
    if not (silu_folds(weight, options) and one_row(x, weight, options)):
        return None
    from rollout.kernels import skinny

    return skinny.linear_silu_mul(x, weight, bias, low_rank=low_rank, pdl=options.pdl)


def rope_folds(kv: KVTarget | None, options: KernelOptions = DEFAULT_OPTIONS) -> bool:
    """Does `linear_rope_kv` fold the rotary and the K/V store into a one-row qkv matmul?"""
    return options.rope_epilogue and kv is not None


def linear_rope_kv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cos: torch.Tensor,
                   sin: torch.Tensor, positions: torch.Tensor, kv: KVTarget | None, n_q_heads: int,
                   n_kv_heads: int, options: KernelOptions = DEFAULT_OPTIONS,
                   low_rank: LowRank | None = None) -> torch.Tensor | None:
    """The qkv projection with the rotary of q and k and the K/V store into `kv` in the matmul's
    one launch, where `one_row(x, weight, options)` and `rope_folds(kv, options)` (there is a
    store to make): [1, (H + 2 Hkv) D] with q and k rotated; None elsewhere (the caller runs the
    matmul, then the rotary). `low_rank`: an adapter's term on qkv, added before the rotary."""
    if not (rope_folds(kv, options) and one_row(x, weight, options)):
        return None
    from rollout.kernels import skinny

    assert kv is not None
    rope = skinny.RopeKV(cos, sin, positions, kv.k_cache, kv.v_cache, kv.slots, n_q_heads, n_kv_heads)
    return skinny.linear_rope_kv(x, weight, bias, rope, low_rank=low_rank, pdl=options.pdl)


def first_non_finite(tensors: Sequence[Any], fused: bool | None = None) -> int | None:
    """Index of the first tensor holding a NaN or an Inf, or None. One multi-tensor check
    per (device, dtype) group and one host sync per device for the whole list, not one per
    tensor: a weight update has hundreds of tensors (448 in an 8B LoRA adapter). CUDA
    groups go through one Triton launch that reads at bandwidth (rollout/kernels/finite.py);
    the rest through torch's multi-tensor inf-norm, which is also that kernel's reference.
    `fused`: KernelOptions.fused (None: the kernel for CUDA groups)."""
    groups: dict[tuple, list[int]] = {}
    for i, tensor in enumerate(tensors):
        groups.setdefault((tensor.device, tensor.dtype), []).append(i)
    flags: dict[Any, list[Any]] = {}  # device -> a bool flag per tensor of each of its groups
    order: dict[Any, list[int]] = {}  # device -> the tensor index of each flag
    for (device, _), indices in groups.items():
        members = [tensors[i] for i in indices]
        if use_fused(members[0], fused):
            from rollout.kernels import finite

            flag = finite.non_finite_flags(members) != 0
        else:
            # the inf-norm is max |x|: inf for an Inf, NaN for a NaN, never an overflow
            flag = ~torch.stack(torch._foreach_norm(members, ord=float("inf"))).isfinite()
        flags.setdefault(device, []).append(flag)
        order.setdefault(device, []).extend(indices)
    hits: list[int] = []
    for device, device_flags in flags.items():
        bad = torch.cat(device_flags).cpu()  # the device's one sync
        hits += [order[device][i] for i in bad.nonzero().flatten().tolist()]
    return min(hits) if hits else None


def __getattr__(name: str) -> Any:
    # Lazy `kernels.fused` / `finite` / `kv_copy` / `rotary` / `skinny` (PEP 562): importing the model never imports
    # triton. After the first access the submodule is a real attribute and this hook is not
    # called again.
    if name in ("fused", "finite", "kv_copy", "rotary", "skinny"):
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
