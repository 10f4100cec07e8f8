"""Micro-benchmark of the fused kernels against their torch twins on a GPU (bf16).

    python -m benchmarks.kernels.fused [--hidden 4096 --inter 14336 --heads 32 --kv-heads 8 --head-dim 128]

Prints, per op and token count, the median time of each path and the fused kernel's
effective bandwidth (bytes it must move / time); these ops are memory-bound, so the
bandwidth against the GPU's peak (H200: ~4.8 TB/s) is the figure of merit.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F


def _time_us(fn: Callable[[], object]) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=100)) * 1e3  # ms -> us


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--inter", type=int, default=14336)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 256, 1024, 8192])
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA")
    from rollout.kernels import fused, rotary
    from rollout.model.llama import _rotate

    dev, bf16, eps = "cuda", torch.bfloat16, 1e-6
    hd, nq, nkv = args.head_dim, args.heads, args.kv_heads
    w = torch.ones(args.hidden, device=dev, dtype=bf16)
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, hd, 2, device=dev, dtype=torch.float32) / hd))
    freqs = torch.outer(torch.arange(8192, device=dev, dtype=torch.float32), inv_freq)
    cos, sin = freqs.cos(), freqs.sin()

    def torch_norm(x: torch.Tensor, res: torch.Tensor) -> torch.Tensor:
        r = res + x
        h = r.float()
        return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(bf16)

    def torch_rope(q: torch.Tensor, k: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c, s = cos[pos].unsqueeze(1).to(bf16), sin[pos].unsqueeze(1).to(bf16)
        return _rotate(q, c, s), _rotate(k, c, s)

    print(f"{'op':<22}{'T':>6}{'torch us':>11}{'fused us':>11}{'speedup':>9}{'fused GB/s':>12}")
    for t in args.tokens:
        x, res = (torch.randn(t, args.hidden, device=dev, dtype=bf16) for _ in range(2))
        gate_up = torch.randn(t, 2 * args.inter, device=dev, dtype=bf16)
        qkv = torch.randn(t, (nq + 2 * nkv) * hd, device=dev, dtype=bf16)
        q, k = qkv[:, : nq * hd].view(t, nq, hd), qkv[:, nq * hd : (nq + nkv) * hd].view(t, nkv, hd)
        pos = torch.randint(0, 8192, (t,), device=dev)
        cases: list[tuple[str, Callable[[], object], Callable[[], object], int]] = [
            # bytes moved: reads + writes of the fused kernel (bf16 = 2 bytes)
            ("add+rms_norm", lambda: torch_norm(x, res), lambda: fused.rms_norm(x, w, eps, residual=res),
             2 * 4 * t * args.hidden),
            ("silu_and_mul", lambda: F.silu(gate_up[:, : args.inter]) * gate_up[:, args.inter :],
             lambda: fused.silu_and_mul(gate_up), 2 * 3 * t * args.inter),
            ("rotary q+k", lambda: torch_rope(q, k, pos), lambda: rotary.rotary_embedding(q, k, cos, sin, pos),
             2 * 2 * t * (nq + nkv) * hd),
        ]
        for name, ref, fast, nbytes in cases:
            t_ref, t_fast = _time_us(ref), _time_us(fast)
            print(f"{name:<22}{t:>6}{t_ref:>11.1f}{t_fast:>11.1f}{t_ref / t_fast:>8.1f}x{nbytes / t_fast / 1e3:>12.0f}")


if __name__ == "__main__":
    main()
