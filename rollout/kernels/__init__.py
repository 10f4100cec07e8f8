"""Fused GPU kernels for the decoder's per-token elementwise work (RMSNorm with the residual
add, SiLU-and-mul, rotary embedding). They live in `rollout.kernels.fused` (Triton); the
torch code in `rollout.model.llama` is both the CPU path and their reference. Beside them,
`rollout.kernels.finite`: the one-launch NaN/Inf check of a weight update's tensors.

`use_fused(x)` is the one dispatch test the model makes. It is cheap on the CPU path (no
triton import: `fused` is loaded lazily on first access), and by default true exactly for
CUDA tensors of a supported dtype when triton imports. Tests set `enabled` to run the
kernels on CPU tensors under TRITON_INTERPRET=1 (True) or the torch path on a GPU (False).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from rollout.kernels import finite as finite
    from rollout.kernels import fused as fused

__all__ = ["available", "enabled", "use_fused"]

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


def __getattr__(name: str) -> Any:
    # Lazy `kernels.fused` / `kernels.finite` (PEP 562): importing the model never imports
    # triton. After the first access the submodule is a real attribute and this hook is not
    # called again.
    if name in ("fused", "finite"):
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
