"""benchmarks.common.switches.set_batch1_kernels sets each module switch it names, and leaves PDL's
global switch alone unless asked."""

from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="triton is not installed")

from rollout import kernels  # noqa: E402
from rollout.attention import base, triton_kernels  # noqa: E402
from benchmarks.common.switches import set_batch1_kernels  # noqa: E402
from rollout.kernels import pdl, rotary  # noqa: E402


def test_set_batch1_kernels_sets_every_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    for mod, name in ((kernels, "skinny_matmul"), (kernels, "silu_epilogue"), (kernels, "rope_epilogue"),
                      (pdl, "ENV"), (rotary, "PDL"), (triton_kernels, "PDL"), (base, "FUSED_KV_STORE")):
        monkeypatch.setattr(mod, name, getattr(mod, name))  # restored after the test
    env = pdl.ENV
    set_batch1_kernels(skinny=False, late_pdl=False, kv_in_rotary=False, silu=False, rope=False)
    assert (kernels.skinny_matmul, kernels.silu_epilogue, kernels.rope_epilogue, base.FUSED_KV_STORE) == (False,) * 4
    assert rotary.PDL is False and triton_kernels.PDL is False and pdl.ENV == env
    set_batch1_kernels(pdl=not env)
    assert (kernels.skinny_matmul, kernels.silu_epilogue, kernels.rope_epilogue, base.FUSED_KV_STORE) == (True,) * 4
    assert rotary.PDL is None and triton_kernels.PDL is None and pdl.ENV == (not env)
