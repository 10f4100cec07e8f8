"""Sweep of the one-launch NaN/Inf check (rollout/kernels/finite.py) over its block sizes.

    python -m benchmarks.kernels.finite [--shape llama8b]   # GPU: the model's tensors, bf16
    python -m benchmarks.kernels.finite --device cpu        # a smoke run (tiny shape, interpreter)

Every weight sync reads the whole update once for this check before anything is written, so
its time is on the sync's critical path. The tensors are the HF layout of the shape (291
for Llama-3.1-8B, 16 GB), laid out as a trainer's parameters are: one allocation each.
Prints, per (CHUNK, BLOCK, warps), the median GPU time and the read bandwidth, beside the
device's copy (read + write) and a flat amax over one buffer of the same bytes (a read
floor torch reaches), all in the same run.
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable, Sequence

import torch

from benchmarks.common.kernel_device import kernel_bench_device, kernel_ms


def _ms(fn: Callable[[], object], device: torch.device) -> float:
    return kernel_ms(fn, device)


def model_tensors(shape: str, device: torch.device, dtype: torch.dtype) -> list[torch.Tensor]:
    """One tensor per HF parameter of `shape` (random values, finite)."""
    from rollout.model.config import ModelConfig
    from rollout.model.loader import expected_hf_names
    from rollout.model.shapes import SHAPES

    cfg = ModelConfig.from_dict(SHAPES[shape])
    h, i, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size
    shapes = {"embed_tokens": (cfg.vocab_size, h), "lm_head": (cfg.vocab_size, h), "norm": (h,),
              "q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q), "gate_proj": (i, h),
              "up_proj": (i, h), "down_proj": (h, i), "layernorm": (h,)}
    out = []
    for name in expected_hf_names(cfg):
        key = next(k for k in shapes if f"{k}." in name or name.endswith(f"{k}.weight"))
        out.append(torch.randn(shapes[key], device=device, dtype=dtype))
    return out


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default=None, help="model shape (rollout.model.shapes; default llama8b, cpu: tiny)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--chunks", type=int, nargs="+", default=None, help="log2 of CHUNK (elements per program)")
    p.add_argument("--blocks", type=int, nargs="+", default=None, help="BLOCK (elements per load)")
    p.add_argument("--warps", type=int, nargs="+", default=None)
    args = p.parse_args(argv)
    device, shape, dtype = kernel_bench_device(args.device, args.shape)  # before triton's import
    from rollout.kernels import finite

    gpu = device.type == "cuda"
    tensors = model_tensors(shape, device, dtype)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    flat = torch.randn(nbytes // 2, device=device, dtype=dtype)
    copy_dst = torch.empty_like(flat)
    t_copy = _ms(lambda: copy_dst.copy_(flat), device)
    t_amax = _ms(lambda: flat.abs().amax() if not gpu else flat.amax(), device)
    del copy_dst
    gb = nbytes / 1e9
    print(f"{shape}: {len(tensors)} tensors, {gb:.2f} GB {str(dtype).removeprefix('torch.')}")
    print(f"copy (read + write): {t_copy:.2f} ms = {2e3 * gb / t_copy:.0f} GB/s; flat amax (read): {t_amax:.2f} ms "
          f"= {1e3 * gb / t_amax:.0f} GB/s")
    default = (finite.CHUNK, finite.BLOCK, finite.NUM_WARPS)
    chunks = [1 << c for c in (args.chunks or ([18, 19, 20, 21] if gpu else [12]))]
    blocks = args.blocks or ([2048, 4096, 8192] if gpu else [1024])
    warps = args.warps or ([4, 8, 16] if gpu else [4])
    print(f"{'CHUNK':>9}{'BLOCK':>7}{'warps':>6}{'ms':>8}{'GB/s':>7}{'of copy':>9}")
    rows = []
    try:
        for chunk, block, nw in itertools.product(chunks, blocks, warps):
            if block > chunk:
                continue
            finite.CHUNK, finite.BLOCK, finite.NUM_WARPS = chunk, block, nw
            assert not bool(finite.non_finite_flags(tensors).any())  # compiles this variant, checks it
            ms = _ms(lambda: finite.non_finite_flags(tensors), device)
            rows.append((ms, chunk, block, nw))
            mark = " (default)" if (chunk, block, nw) == default else ""
            print(f"{chunk:>9}{block:>7}{nw:>6}{ms:>8.2f}{1e3 * gb / ms:>7.0f}{100 * (gb / ms) / (2 * gb / t_copy):>8.0f}%{mark}",
                  flush=True)
    finally:
        finite.CHUNK, finite.BLOCK, finite.NUM_WARPS = default
    best = min(rows)
    print(f"best: CHUNK={best[1]} BLOCK={best[2]} warps={best[3]}: {best[0]:.2f} ms")


if __name__ == "__main__":
    main()
