"""A LoRA term must not cost the skinny GEMV occupancy: compiled for sm_90a on this machine
(Triton's compiler and its bundled cuobjdump, no GPU), every batch-1 projection of
Llama-3.1-8B with a rank-16 term fits as many programs an SM as without it. Holding h and B
through the K loop took 168 registers against 128: 6 programs an SM instead of 8
(benchmarks/diagnostics/gemv_regs.py, BENCHMARKS.md multi-LoRA, H100, 2026-12-06). The compile runs in a
child process: the other kernel tests run Triton under its interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton", reason="triton is not installed")

from rollout.kernels import skinny  # noqa: E402
from benchmarks.diagnostics.gemv_regs import CUOBJDUMP, FORMS, programs_per_sm  # noqa: E402

if not os.path.exists(CUOBJDUMP):
    pytest.skip("triton's nvidia backend (cuobjdump) is not installed", allow_module_level=True)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def test_lora_term_keeps_the_gemvs_programs_per_sm():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-m", "benchmarks.diagnostics.gemv_regs", "--json"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(got) == {f.name for f in FORMS}
    for form in FORMS:
        warps = skinny.tiles_for(form.n, form.k).num_warps
        plain, term = got[form.name]
        assert programs_per_sm(term, warps) == programs_per_sm(plain, warps), (form.name, plain, term)


def test_programs_per_sm_counts_register_blocks():
    assert programs_per_sm(128, 2) == 8 and programs_per_sm(168, 2) == 6 and programs_per_sm(176, 2) == 5
    assert programs_per_sm(16, 1) == 32  # capped by the SM's program slots
