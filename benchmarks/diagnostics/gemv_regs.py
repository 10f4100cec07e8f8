"""Registers a thread of the skinny GEMV (rollout/kernels/skinny.py) takes, with and without a
LoRA term, compiled for the H100/H200 (sm_90a) on this machine: no GPU needed.

The GEMV is latency-bound: what keeps HBM busy is how many programs an SM holds, and at two
warps a program that is set by registers (65536 an SM). The term's h and B rows held through
the K loop took 168 registers against the plain GEMV's 128: 6 programs an SM instead of 8 on
every projection of a batch-1 LoRA step (BENCHMARKS.md, multi-LoRA, "H100, 2026-12-06: where batch
1's adapter cost goes, ...").

    python -m benchmarks.diagnostics.gemv_regs

Uses Triton's own compiler and its bundled cuobjdump (the nvidia backend of the triton wheel).
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from dataclasses import dataclass

import triton

REGS_PER_SM = 65536
MAX_PROGRAMS_PER_SM = 32
THREADS_PER_SM = 2048
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


@dataclass(frozen=True)
class Form:
    """One projection of Llama-3.1-8B as the batch-1 step runs it."""

    name: str
    n: int
    k: int
    silu_mul: bool = False
    rope: bool = False
    slices: int = 1  # the LoRA term's (q/k/v: 3, gate/up: 2)


FORMS = (Form("qkv + rotary/KV store", 6144, 4096, rope=True, slices=3), Form("o", 4096, 4096),
         Form("gate_up + SiLU-mul", 28672, 4096, silu_mul=True, slices=2), Form("down", 4096, 14336))
_I32_PTRS = {"lslot_ptr", "lranks_ptr"}
_I64_PTRS = {"pos_ptr", "slot_ptr"}


def cubin(form: Form, low_rank: bool, max_rank: int = 16) -> bytes:
    """The kernel as skinny._launch compiles it for this form (default tiles, PDL on, bf16)."""
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from lora.kernels.row import splits
    from rollout.kernels import skinny

    fn = skinny._gemv_kernel
    tiles = skinny.tiles_for(form.n, form.k)
    split = splits(form.k, torch.device("cuda"))  # h's partials for this K on a GPU
    constexprs = dict(HAS_BIAS=False, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, USE_PDL=True,
                      SILU_MUL=form.silu_mul, ROPE=form.rope, HALF=64, LOW_RANK=low_rank,
                      L_COLS=form.slices * max_rank if low_rank else 1, L_MAX_RANK=max_rank if low_rank else 1,
                      L_SPLIT=triton.next_power_of_2(split) if low_rank else 1,
                      L_RANK_P2=triton.next_power_of_2(max_rank) if low_rank else 1)
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = ("*i32" if name in _I32_PTRS else "*i64" if name in _I64_PTRS
                               else "*fp32" if name == "lh_ptr" else "*bf16")
            attrs[(i,)] = [["tt.divisibility", 16]]  # torch's allocations are 16-byte aligned
        else:
            signature[name] = "i32"
            if name in ("N", "K", "stride_w"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    options = dict(num_warps=tiles.num_warps, num_stages=tiles.num_stages,
                   enable_fp_fusion=not (form.rope or low_rank))  # as _launch sets it
    compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                              options=options)
    return compiled.asm["cubin"]


def registers(form: Form, low_rank: bool) -> int:
    """Registers a thread, as cuobjdump reads them from the compiled kernel."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin(form, low_rank))
        f.flush()
        out = subprocess.run([CUOBJDUMP, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    return int(re.search(r"REG:(\d+)", out).group(1))


def programs_per_sm(regs: int, num_warps: int) -> int:
    """Programs an SM holds at `regs` a thread (registers go to warps in blocks of 256)."""
    per_warp = -(-regs * 32 // 256) * 256
    return min(REGS_PER_SM // (per_warp * num_warps), MAX_PROGRAMS_PER_SM, THREADS_PER_SM // (32 * num_warps))


def main() -> None:
    import argparse
    import json

    from rollout.kernels import skinny

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="{projection: [plain, with the term]} registers, for tests")
    args = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("gemv_regs compiles the kernel: run it without TRITON_INTERPRET=1")
    got = {form.name: [registers(form, False), registers(form, True)] for form in FORMS}
    if args.json:
        print(json.dumps(got))
        return
    print("| projection | plain GEMV regs (programs an SM) | with a rank-16 LoRA term |")
    print("|---|---:|---:|")
    for form in FORMS:
        warps = skinny.tiles_for(form.n, form.k).num_warps
        print(f"| {form.name} | " + " | ".join(f"{r} ({programs_per_sm(r, warps)})" for r in got[form.name]) + " |")


if __name__ == "__main__":
    main()
