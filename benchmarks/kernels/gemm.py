"""The projections' matmuls at the row counts of a batch-256 decode step and a prefill chunk,
through each BLAS path torch offers, against the device's matmul peak (issue #16 (a)/(d)).

    python -m benchmarks.kernels.gemm [--shape llama8b] [--rows 128 256 512 8192]  # GPU, bf16
    python -m benchmarks.kernels.gemm --device cpu                                 # smoke (tiny)

At M = 256 a Llama-3.1-8B step's projections are compute-bound (3.6 TFLOP a step), and the
profile of workload (a) put them at ~590 TFLOP/s against ~790 for an 8192^3 matmul
(BENCHMARKS.md, "Where a batch-256 decode step goes"). This asks whether another path picks
better kernels for those shapes:

  cublas    F.linear with torch's default BLAS (cublasGemmEx: the engine's path)
  cublaslt  F.linear with torch.backends.cuda.preferred_blas_library("cublaslt")
  nn        x @ W^T with W^T stored [K, N] (a different cuBLAS layout, so other heuristics)
  bias0     F.linear with a zero bias: torch's addmm then takes cuBLASLt's gemm-and-bias path
            without the process-wide switch (which would also change a colocated trainer's)
  --triton  benchmarks.experiments.stream_k configs, e.g. `sk:256x128x64w8s3` (a program per SM, the
            iterations shared evenly), `tiles:128x256x64w8s3` (a program per output tile),
            `sk100:...` (100 programs)

Each projection gets one weight per layer (distinct memory, nothing served from L2), and a
timing runs it once per layer inside one CUDA graph (what a decode graph replays), reported
per call. Every variant's output is checked against fp32 first. Prints us and TFLOP/s per
(projection, rows), then a step's projections summed per variant.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from benchmarks.common.kernel_device import kernel_bench_device
from benchmarks.kernels.skinny import _us_per_call, projections
from benchmarks.experiments.stream_k import StreamKConfig

VARIANTS = ("cublas", "cublaslt", "nn", "bias0")
DEFAULT_TRITON = ("sk:256x128x64w8s3", "sk:256x128x64w8s4", "sk:128x256x64w8s3", "sk:256x64x64w4s4",
                  "sk:128x128x64w4s4", "tiles:128x256x64w8s3", "tiles:256x128x64w8s3")


def parse_config(text: str) -> StreamKConfig:
    """`sk:256x128x64w8s3` -> StreamKConfig(256, 128, 64, 8 warps, 3 stages, a program per SM)."""
    grid, _, tile = text.partition(":")
    m = re.fullmatch(r"(\d+)x(\d+)x(\d+)w(\d+)s(\d+)", tile)
    g = re.fullmatch(r"sk(\d*)|tiles", grid)
    if m is None or g is None:
        raise argparse.ArgumentTypeError(f"a config is sk[N]:BMxBNxBKwWARPSsSTAGES or tiles:..., got {text!r}")
    programs = 0 if grid == "tiles" else (int(g.group(1)) if g.group(1) else None)
    return StreamKConfig(*(int(v) for v in m.groups()), programs=programs)


def _set_blas(name: str, gpu: bool) -> None:
    if gpu:  # a process-wide choice, read at each matmul call (and so at capture)
        torch.backends.cuda.preferred_blas_library("cublaslt" if name == "cublaslt" else "cublas")


def _call(variant: str, x: torch.Tensor, w: torch.Tensor, wt: torch.Tensor, zero: torch.Tensor,
          triton: dict[str, StreamKConfig]) -> torch.Tensor:
    if variant in triton:
        from benchmarks.experiments import stream_k

        return stream_k.linear(x, w, triton[variant])
    if variant == "nn":
        return x @ wt
    return F.linear(x, w, zero if variant == "bias0" else None)


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default=None, help="rollout.model.shapes name (default llama8b; cpu: tiny)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--rows", type=int, nargs="+", default=None, help="M values (default 128 256 512 8192; cpu: 4 16)")
    p.add_argument("--only", nargs="+", default=None, help="projections (default all)")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--triton", nargs="*", type=parse_config, default=None,
                   help=f"stream_k configs (default on a GPU: {' '.join(DEFAULT_TRITON)}; cpu: two tiny ones)")
    args = p.parse_args(argv)
    device, shape, dtype = kernel_bench_device(args.device, args.shape)
    gpu = device.type == "cuda"
    rows = args.rows or ([128, 256, 512, 8192] if gpu else [4, 16])
    projs = {k: v for k, v in projections(shape).items() if args.only is None or k in args.only}
    if gpu:
        n = 8192
        a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
        from triton.testing import do_bench

        peak = 2 * n**3 / (float(do_bench(lambda: a @ b)) * 1e-3) / 1e12
        del a, b
        print(f"{shape}, {str(dtype).removeprefix('torch.')}; {n}^3 matmul {peak:.0f} TFLOP/s; torch's default BLAS "
              f"{torch.backends.cuda.preferred_blas_library()}", flush=True)
    configs = args.triton if args.triton is not None else [
        parse_config(c) for c in (DEFAULT_TRITON if gpu else ("sk:16x32x32w4s2", "tiles:16x32x32w4s2"))]
    triton = {c.name: c for c in configs}
    variants = [*args.variants, *triton]
    print(f"{'proj':>8} {'N':>6} {'K':>6} {'M':>5} | " + " | ".join(f"{v:>21}" for v in variants))
    totals: dict[int, dict[str, float]] = {m: dict.fromkeys(variants, 0.0) for m in rows}
    for name, (n, k, copies) in projs.items():
        # CPU smoke: one weight (host-timed, no L2 to defeat); each call of a Triton variant is
        # one interpreted run of every program
        layers = copies if gpu else 1
        weights = [torch.randn(n, k, device=device, dtype=dtype) * 0.02 for _ in range(layers)]
        transposed = [w.t().contiguous() for w in weights] if "nn" in args.variants else [None] * layers
        zero = torch.zeros(n, device=device, dtype=dtype)
        for m in rows:
            calls = layers if m <= 1024 else min(layers, 4)  # a prefill's M: fewer copies (each call's output is kept)
            x = torch.randn(m, k, device=device, dtype=dtype)
            ref = F.linear(x.float(), weights[0].float())
            cells = []
            for v in variants:
                _set_blas(v, gpu)
                try:  # a Triton config can fail to compile (shared memory) on one card and not another
                    y = _call(v, x, weights[0], transposed[0], zero, triton)
                except Exception as e:  # noqa: BLE001 - reported in the table, the other variants go on
                    if v not in triton:
                        raise
                    print(f"{v}: {type(e).__name__}: {str(e)[:160]}", flush=True)
                    totals[m][v] = float("nan")
                    cells.append(f"{'failed':>21}")
                    continue
                err = (y.float() - ref).abs().max().item()
                assert err <= 2e-2 * ref.abs().max().item() + 1e-2, f"{name} M={m} {v}: max error {err}"
                fn: Callable[[], object] = lambda v=v: [_call(v, x, w, t, zero, triton) for w, t in
                                                        zip(weights[:calls], transposed[:calls])]
                us = _us_per_call(fn, calls, gpu)
                totals[m][v] += copies * us
                cells.append(f"{us:9.1f} us {2 * m * n * k / us / 1e6:4.0f} TF")
            print(f"{name:>8} {n:>6} {k:>6} {m:>5} | " + " | ".join(cells), flush=True)
            del x, ref
        del weights, transposed
    _set_blas("cublas", gpu)
    for m, per in totals.items():
        print(f"a step's projections at M={m}: " + ", ".join(f"{v} {us / 1e3:.3f} ms" for v, us in per.items()))


if __name__ == "__main__":
    main()
