"""Sweep of the skinny matmul (rollout/kernels/skinny.py) against cuBLAS (F.linear) on a
model's projections, at the one row of a batch-1 decode step.

    python -m benchmarks.kernels.skinny [--shape llama8b] [--quick]   # GPU, bf16
    python -m benchmarks.kernels.skinny --device cpu                  # smoke (tiny, interpreter)

Each projection gets one weight per layer (distinct memory, so nothing is served from L2
as it is not in a real step), and a timing runs the projection once per layer inside one
CUDA graph (no launch gaps; what a decode graph replays), reported per call. Prints, per
projection, cuBLAS and every launch shape (us, GB/s of weight reads), then
the best shape, and what a whole step's projections (layers x qkv/o/gate_up/down + the
lm_head) take with cuBLAS, the default shapes and the best ones, beside the device's copy.
"""

from __future__ import annotations

import argparse
import itertools
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from benchmarks.common.kernel_device import kernel_bench_device


def _us_per_call(fn: Callable[[], object], calls: int, gpu: bool) -> float:
    if gpu:
        from triton.testing import do_bench_cudagraph

        return 1e3 * float(do_bench_cudagraph(fn, rep=40)) / calls
    start = time.perf_counter()
    fn()
    return 1e6 * (time.perf_counter() - start) / calls


def projections(shape: str) -> dict[str, tuple[int, int, int]]:
    """name -> (N, K, copies per step) of the shape's matmuls in a decode step."""
    from rollout.model.config import ModelConfig
    from rollout.model.shapes import SHAPES

    cfg = ModelConfig.from_dict(SHAPES[shape])
    h, i, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
    return {"qkv": (cfg.q_size + 2 * cfg.kv_size, h, layers), "o": (h, cfg.q_size, layers),
            "gate_up": (2 * i, h, layers), "down": (h, i, layers), "lm_head": (cfg.vocab_size, h, 1)}


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default=None, help="rollout.model.shapes name (default llama8b; cpu: tiny)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--only", nargs="+", default=None, help="projections to sweep (default all)")
    p.add_argument("--quick", action="store_true", help="the default launch shape only")
    args = p.parse_args(argv)
    device, shape, dtype = kernel_bench_device(args.device, args.shape)  # before triton's import
    from rollout.kernels import skinny

    gpu = device.type == "cuda"
    projs = {k: v for k, v in projections(shape).items() if args.only is None or k in args.only}
    if gpu:
        src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        from triton.testing import do_bench

        copy_gbs = 2 * src.numel() / (float(do_bench(lambda: dst.copy_(src))) * 1e-3) / 1e9
        del src, dst
        print(f"{shape}, {str(dtype).removeprefix('torch.')}; copy (read + write) {copy_gbs:.0f} GB/s", flush=True)
    sweep = [skinny.Tiles(bn, bk, nw) for bn, bk, nw in
             itertools.product((4, 8, 16, 32), (256, 512, 1024), (2, 4, 8))] if gpu else []
    totals = [0.0, 0.0, 0.0]  # a step's cuBLAS, default, best us
    for name, (n, k, copies) in projs.items():
        layers = copies if gpu else 2
        weights = [torch.randn(n, k, device=device, dtype=dtype) * 0.02 for _ in range(layers)]
        gb = n * k * dtype.itemsize / 1e9
        x = torch.randn(1, k, device=device, dtype=dtype)
        ref = F.linear(x.float(), weights[0].float())
        cublas = _us_per_call(lambda: [F.linear(x, w) for w in weights], layers, gpu)
        default = skinny.tiles_for(n, k) if gpu else skinny.Tiles(16, 32, 4)  # interpreter-sized on CPU
        cands = [default] + ([] if args.quick else [t for t in sweep if t != default])
        results = []
        for t in cands:
            if t != default and (t.block_n * t.block_k > 64 * 1024 or t.block_n * t.block_k < 1024):
                continue  # register blow-up, or too little in flight per program
            try:
                y = skinny.linear(x, weights[0], tiles=t)  # compiles the variant, checks it
            except Exception as e:  # an infeasible shape (shared memory): skip it, say so
                print(f"  {name} {t}: {type(e).__name__}", flush=True)
                continue
            err = (y.float() - ref).abs().max().item()
            assert err <= 2e-2 * ref.abs().max().item() + 1e-2, f"{name} {t}: max error {err}"
            us = _us_per_call(lambda t=t: [skinny.linear(x, w, tiles=t) for w in weights], layers, gpu)
            results.append((us, t))
        best_us, best = min(results, key=lambda r: r[0])
        default_us = next(us for us, t in results if t == default)
        print(f"{name:>8} N={n:>6} K={k:>6}: cuBLAS {cublas:7.1f} us ({gb / cublas * 1e6:5.0f} GB/s)"
              f"  default {default_us:7.1f} us ({gb / default_us * 1e6:5.0f})  best {best_us:7.1f} us "
              f"({gb / best_us * 1e6:5.0f}) {best}", flush=True)
        if not args.quick:
            for us, t in sorted(results, key=lambda r: r[0])[:5]:
                print(f"{'':>10}{us:8.1f} us {gb / us * 1e6:6.0f} GB/s  {t}")
        for i, v in enumerate((cublas, default_us, best_us)):
            totals[i] += copies * v
        del weights
    c, d, b = totals
    print(f"a step's projections: cuBLAS {c / 1e3:.3f} ms, default {d / 1e3:.3f} ms, best {b / 1e3:.3f} ms")


if __name__ == "__main__":
    main()
