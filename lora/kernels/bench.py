"""Micro-benchmark of the SGMV kernels on a GPU (bf16), for choosing block sizes.

    python -m lora.kernels.bench [--hidden 4096 --inter 14336 --q 4096 --kv 1024 --rank 16 --slots 8]

Per projection (qkv: 3 slices, gate_up: 2, down: 1) and batch shape (decode: one token per
segment, slots drawn at random; prefill: a few long segments), prints the median time of
shrink and expand, the same products as plain torch.mm for ONE adapter over the whole
batch (a floor: no segment handling), and each kernel's effective bandwidth (the bytes it
must move / time; these ops are memory-bound, H200 peak ~4.8 TB/s).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch


def _time_us(fn: Callable[[], object]) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=100)) * 1e3  # ms -> us


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--inter", type=int, default=14336)
    p.add_argument("--q", type=int, default=4096, help="q width of the fused qkv projection")
    p.add_argument("--kv", type=int, default=1024, help="k and v widths")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--slots", type=int, default=8)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA")
    from lora import ops

    dev, bf16, rank = "cuda", torch.bfloat16, args.rank
    projections = {"qkv": (args.hidden, (args.q, args.kv, args.kv)), "gate_up": (args.hidden, (args.inter,) * 2),
                   "down": (args.inter, (args.hidden,))}
    batches = {f"decode {b}": [1] * b for b in (1, 16, 64, 256)}
    batches |= {"prefill 1x512": [512], "prefill 4x1024": [1024] * 4}
    g = torch.Generator().manual_seed(0)
    print(f"{'proj':<9}{'batch':<16}{'shrink us':>10}{'GB/s':>7}{'expand us':>10}{'GB/s':>7}{'1-adapter mm us':>16}")
    for proj, (k, widths) in projections.items():
        n_out, num_slices = sum(widths), len(widths)
        offsets = tuple(sum(widths[:j]) for j in range(num_slices + 1))
        lora_a = torch.randn(args.slots, num_slices * rank, k, device=dev, dtype=bf16) / k**0.5
        lora_b = torch.randn(args.slots, n_out, rank, device=dev, dtype=bf16) / rank**0.5
        slot_ranks = torch.full((args.slots,), rank, dtype=torch.int32, device=dev)
        for name, seg_lens in batches.items():
            t = sum(seg_lens)
            slots = torch.randint(0, args.slots, (len(seg_lens),), generator=g, dtype=torch.int32)
            used = len(set(slots.tolist()))
            indptr = torch.tensor([0] + seg_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(dev)
            slots = slots.to(dev)
            x = torch.randn(t, k, device=dev, dtype=bf16)
            out = torch.randn(t, n_out, device=dev, dtype=bf16)
            kw = dict(max_rank=rank, max_seg_len=max(seg_lens))
            h = ops.sgmv_shrink(x, lora_a, indptr, slots, slot_ranks, num_slices=num_slices, **kw)
            t_shrink = _time_us(lambda: ops.sgmv_shrink(x, lora_a, indptr, slots, slot_ranks,
                                                         num_slices=num_slices, **kw))
            t_expand = _time_us(lambda: ops.sgmv_expand(h, lora_b, out, indptr, slots, slot_ranks,
                                                         slice_offsets=offsets, **kw))
            a0, b0 = lora_a[0], lora_b[0]  # [num_slices * rank, K], [N_out, rank]
            t_mm = _time_us(lambda: torch.mm(torch.mm(x, a0.T)[:, :rank], b0.T))
            # bytes: bf16 inputs each read once (weights once per adapter in use), outputs written
            shrink_bytes = 2 * (t * k + used * num_slices * rank * k + t * num_slices * rank)
            expand_bytes = 2 * (t * num_slices * rank + used * n_out * rank + 2 * t * n_out)
            print(f"{proj:<9}{name:<16}{t_shrink:>10.1f}{shrink_bytes / t_shrink / 1e3:>7.0f}"
                  f"{t_expand:>10.1f}{expand_bytes / t_expand / 1e3:>7.0f}{t_mm:>16.1f}")


if __name__ == "__main__":
    main()
