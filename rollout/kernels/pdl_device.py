"""The device side of programmatic dependent launch (rollout/kernels/pdl.py says when a
kernel may use it): what a kernel launched with `launch_pdl` calls, behind its USE_PDL
constexpr, before it touches what the kernel before it writes."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def launch_next_then_wait():
    # First let the next kernel launch (it waits for this one before reading what it writes),
    # then wait for the kernel before this one: everything after reads its outputs. For
    # kernels with nothing to do before their inputs are ready (norms, rotary, attention).
    tl.extra.cuda.gdc_launch_dependents()
    tl.extra.cuda.gdc_wait()
