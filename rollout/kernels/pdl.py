"""Programmatic dependent launch (PDL, Hopper and later): whether a Triton kernel here may
be launched early, beside the tail of the kernel before it.

A kernel launched with `launch_pdl=True` may start as soon as the kernel before it has
let it (`gdc_launch_dependents()`, or by exiting); it must call `gdc_wait()`, which returns
once that kernel has finished and its writes are visible, before it reads anything the
kernel before it may write, and before it writes anything. What it may do first: read what
no kernel of the step writes (weights), compute addresses, and launch. A kernel that calls
`gdc_launch_dependents()` early lets the next one start; a kernel launched without the flag
waits for the one before it whole, as usual, so the two sides can be adopted one by one.
Both instructions are sm_90 PTX: kernels take them behind a constexpr from `enabled`.
Whether an engine uses it at all is its KernelOptions' (`pdl`, default from ROLLOUT_PDL):
the launchers take that as `on`.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["enabled", "launch", "triton_has_pdl"]

@functools.cache
def triton_has_pdl() -> bool:
    try:
        import triton.language as tl
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {}) and hasattr(tl.extra.cuda, "gdc_wait")


@functools.cache
def _device_has_pdl(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 9  # griddepcontrol: sm_90+


def enabled(device: torch.device, on: bool = True) -> bool:
    """May kernels on `device` use PDL (`on`, CUDA, sm_90+, a Triton that supports it)? Never
    under the interpreter (CPU tensors)."""
    return on and device.type == "cuda" and triton_has_pdl() and _device_has_pdl(device)


def launch(device: torch.device, on: bool = True) -> dict:
    """The launch keywords of a kernel written for PDL: its USE_PDL constexpr, and Triton's
    `launch_pdl` where `enabled(device, on)`."""
    return {"USE_PDL": True, "launch_pdl": True} if enabled(device, on) else {"USE_PDL": False}
