"""The engine's batch-1 kernel choices as one call, for benchmarks that A/B them in one process
(benchmarks.rollout, benchmarks.batch1). Each is a module switch read as an engine captures its graphs
and on every eager step, so a run keeps the choice it was built with until it is done."""

from __future__ import annotations


def set_batch1_kernels(*, skinny: bool = True, pdl: bool | None = None, late_pdl: bool = True,
                       kv_in_rotary: bool = True, silu: bool = True, rope: bool = True) -> None:
    """skinny: the one-row GEMV (rollout.kernels.skinny_matmul), else cuBLAS; pdl: programmatic
    dependent launch for every kernel of rollout/ (rollout.kernels.pdl.ENV; None: as it is);
    late_pdl: PDL for the rotary and the Triton decode kernels too (session 7), else for the
    norms and the GEMV only; kv_in_rotary: the new K/V stored by the rotary
    (rollout.attention.base.FUSED_KV_STORE), else in a launch of their own; silu / rope: SiLU-mul
    and the rotary with the K/V store as the GEMV's epilogues (rollout.kernels.silu_epilogue,
    rope_epilogue)."""
    from rollout import kernels
    from rollout.attention import base, triton_kernels
    from rollout.kernels import pdl as pdl_switch
    from rollout.kernels import rotary

    kernels.skinny_matmul = skinny
    if pdl is not None:
        pdl_switch.ENV = pdl
    rotary.PDL = triton_kernels.PDL = None if late_pdl else False
    base.FUSED_KV_STORE = kv_in_rotary
    kernels.silu_epilogue = silu
    kernels.rope_epilogue = rope
