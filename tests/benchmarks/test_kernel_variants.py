"""The kernel variants the batch-1 benchmarks A/B become the engine's KernelOptions: every
switch a variant names is off in its options, the defaults are the engine's own, and PDL
itself is left to ROLLOUT_PDL unless a variant asks (benchmarks/batch1.py, benchmarks/rollout.py)."""

from __future__ import annotations

import pytest

from benchmarks.batch1 import variant_options
from benchmarks.rollout import kernel_options
from rollout.kernels.options import KernelOptions


def _switches(o: KernelOptions) -> tuple[bool, ...]:
    return o.skinny_matmul, o.silu_epilogue, o.rope_epilogue, o.rotary_kv_store


def test_rollout_switches_set_every_option_and_leave_pdl_to_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLOUT_PDL", "0")
    off = kernel_options(skinny="off", rotary_store="off", silu="off", rope="off", rows="off", small=16)
    assert _switches(off) == (False,) * 4 and off.pdl_rotary_attention is False and off.pdl is False
    assert (off.extend_rows_kv, off.small_decode_rows) == (0, 16)
    monkeypatch.setenv("ROLLOUT_PDL", "1")
    on = kernel_options()
    assert _switches(on) == (True,) * 4 and on.pdl_rotary_attention and on.pdl
    assert on == KernelOptions(), "all on: the engine's defaults (the figures before this change's engine)"


def test_batch1_variants_name_their_options() -> None:
    attention, old = variant_options("torch:cublas:pdl-mm:store:nosilu:norope")
    assert attention == "torch" and _switches(old) == (False,) * 4
    assert old.pdl and not old.pdl_rotary_attention  # PDL for the norms, SiLU-mul and the GEMV only
    attention, default = variant_options("auto:skinny:pdl")
    assert attention == "auto" and _switches(default) == (True,) * 4 and default.pdl and default.pdl_rotary_attention
    assert not variant_options("flashinfer:cublas:nopdl")[1].pdl
    with pytest.raises(SystemExit, match="variant 'auto:gemv:pdl'"):
        variant_options("auto:gemv:pdl")
