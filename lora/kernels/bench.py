"""Micro-benchmark of the SGMV kernels on a GPU (bf16), for choosing tilings.

    python -m lora.kernels.bench [--hidden 4096 --inter 14336 --q 4096 --kv 1024 --rank 16
                                  --slots 8 --layers 32 --split-k N]

Times are GPU time inside CUDA graphs (``triton.testing.do_bench_cudagraph``), as the
engine's decode graphs run them; host launch cost is not in them. Every timed call walks
``--layers`` copies of the weights, as a forward pass does, so adapters come from HBM
rather than from an L2 that one layer's few MB would fit in; figures are per layer.

Table 1, per projection (qkv: 3 slices, o / down: 1, gate_up: 2) and batch shape (decode:
one token per request, slots drawn uniformly from the adapters in use; prefill: long
requests): shrink and expand time, their effective bandwidth (bytes each must move / time,
in GB/s and as a share of the H200's ~4.8 TB/s), the tiling chosen, and the same products
as plain torch.mm for ONE adapter over the whole batch (a floor: no segments, no split).

Table 2, the per-token LoRA cost of an 8B decode step: shrink + expand of all 4
projections x ``--layers`` layers in one graph, against the base decode step it rides on.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import numpy as np
import torch

PEAK_GBPS = 4800.0  # H200 HBM3e
# Base decode step of Llama-3-8B on an H200 without LoRA (ms): the budget the LoRA ops eat into.
BASE_STEP_MS = {1: 4.8, 256: 13.0}


def _time_us(fn: Callable[[], object], num_layers: int) -> float:
    """GPU time of one layer's call, in us: fn walks all layers once."""
    from triton.testing import do_bench_cudagraph

    return float(do_bench_cudagraph(fn, rep=50)) * 1e3 / num_layers


class Projection:
    """One LoRA projection's weights for every layer and the batch's activations."""

    def __init__(self, name: str, hidden: int, widths: tuple[int, ...], args: argparse.Namespace) -> None:
        self.name, self.hidden, self.widths = name, hidden, widths
        self.num_slices, self.n_out, self.rank = len(widths), sum(widths), args.rank
        self.offsets = tuple(int(v) for v in np.cumsum((0,) + widths))
        kw = dict(device="cuda", dtype=torch.bfloat16)
        rows = self.num_slices * args.rank
        self.a = [torch.randn(args.slots, rows, hidden, **kw) / hidden**0.5 for _ in range(args.layers)]
        self.b = [torch.randn(args.slots, self.n_out, args.rank, **kw) / args.rank**0.5 for _ in range(args.layers)]
        self.slot_ranks = torch.full((args.slots,), args.rank, dtype=torch.int32, device="cuda")

    def shrink(self, layer: int, x: torch.Tensor, seg: tuple[torch.Tensor, ...]) -> torch.Tensor:
        from lora import ops

        return ops.sgmv_shrink(x, self.a[layer], *seg, self.slot_ranks, num_slices=self.num_slices,
                               max_rank=self.rank)

    def expand(self, layer: int, h: torch.Tensor, out: torch.Tensor, seg: tuple[torch.Tensor, ...]) -> None:
        from lora import ops

        ops.sgmv_expand(h, self.b[layer], out, *seg, self.slot_ranks, slice_offsets=self.offsets, max_rank=self.rank)


def _segments(lens: list[int], num_adapters: int, seed: int) -> tuple[tuple[torch.Tensor, ...], int]:
    """Device (row_ids, seg_indptr, seg_slots) of requests on slots drawn from the first
    ``num_adapters``, and how many distinct slots that drew."""
    from lora.segments import plan_segments

    slots = np.random.default_rng(seed).integers(0, num_adapters, len(lens))
    plan = plan_segments(slots, lens)
    seg = tuple(torch.from_numpy(a).cuda() for a in (plan.row_ids, plan.seg_indptr, plan.seg_slots))
    return seg, plan.num_segments


def _tiling(proj: Projection, num_rows: int, num_segments: int) -> str:
    from lora.kernels import sgmv, tiling

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    s = tiling.shrink_tiling(num_rows, num_segments, proj.hidden, proj.num_slices, proj.rank, 2, num_sms=sms,
                             split_k=sgmv._FORCE_SPLIT_K)
    e = tiling.expand_tiling(num_rows, num_segments, proj.widths, proj.rank, s.split_k, num_sms=sms)
    return f"s{s.block_m}x{s.block_n}x{s.block_k}/{s.split_k} e{e.block_m}x{e.block_n}"


def per_projection(projections: list[Projection], args: argparse.Namespace) -> None:
    shapes = [(f"decode {b} x{a}", [1] * b, a) for b in (1, 16, 64, 256) for a in (1, args.slots) if a <= b]
    shapes += [("prefill 512 x1", [512], 1), ("prefill 4x1024 x1", [1024] * 4, 1)]
    shapes += [(f"prefill 4x1024 x{min(4, args.slots)}", [1024] * 4, min(4, args.slots))] if args.slots > 1 else []
    layers = range(args.layers)
    print(f"{'proj':<8}{'batch':<19}{'shrink us':>10}{'GB/s':>7}{'%':>4}{'expand us':>10}{'GB/s':>7}{'%':>4}"
          f"{'mm shrink':>10}{'mm expand':>10}  tiling")
    for proj in projections:
        for name, lens, num_adapters in shapes:
            rows = sum(lens)
            seg, used = _segments(lens, num_adapters, seed=rows + num_adapters)
            x = torch.randn(rows, proj.hidden, device="cuda", dtype=torch.bfloat16)
            out = torch.randn(rows, proj.n_out, device="cuda", dtype=torch.bfloat16)
            h = proj.shrink(0, x, seg)
            t_shrink = _time_us(lambda: [proj.shrink(layer, x, seg) for layer in layers], args.layers)
            t_expand = _time_us(lambda: [proj.expand(layer, h, out, seg) for layer in layers], args.layers)
            h16 = torch.randn(rows, proj.rank, device="cuda", dtype=torch.bfloat16)
            t_mm_shrink = _time_us(lambda: [torch.mm(x, proj.a[layer][0].T) for layer in layers], args.layers)
            t_mm_expand = _time_us(lambda: [out.addmm_(h16, proj.b[layer][0].T) for layer in layers], args.layers)
            cols = proj.num_slices * proj.rank
            # bytes each must move: inputs read once (weights once per adapter in use), outputs written
            shrink_bytes = 2 * rows * proj.hidden + 2 * used * cols * proj.hidden + 4 * h.numel()
            expand_bytes = 4 * h.numel() + 2 * used * proj.n_out * proj.rank + 2 * 2 * rows * proj.n_out
            gbps_s, gbps_e = shrink_bytes / t_shrink / 1e3, expand_bytes / t_expand / 1e3
            print(f"{proj.name:<8}{name:<19}{t_shrink:>10.1f}{gbps_s:>7.0f}{100 * gbps_s / PEAK_GBPS:>4.0f}"
                  f"{t_expand:>10.1f}{gbps_e:>7.0f}{100 * gbps_e / PEAK_GBPS:>4.0f}"
                  f"{t_mm_shrink:>10.1f}{t_mm_expand:>10.1f}  {_tiling(proj, rows, used)}")


def decode_step(projections: list[Projection], args: argparse.Namespace) -> None:
    print(f"\nLoRA ops of one decode step: 4 projections x {args.layers} layers in one graph")
    print(f"{'batch':<8}{'adapters':>9}{'LoRA ms':>9}{'base step ms':>14}{'overhead':>10}")
    for batch in (1, 16, 64, 256):
        for num_adapters in sorted({1, min(args.slots, batch)}):
            seg, _ = _segments([1] * batch, num_adapters, seed=batch + num_adapters)
            xs = [torch.randn(batch, p.hidden, device="cuda", dtype=torch.bfloat16) for p in projections]
            outs = [torch.randn(batch, p.n_out, device="cuda", dtype=torch.bfloat16) for p in projections]

            def step() -> None:
                for layer in range(args.layers):
                    for proj, x, out in zip(projections, xs, outs):
                        proj.expand(layer, proj.shrink(layer, x, seg), out, seg)

            total_ms = _time_us(step, 1) / 1e3
            base = BASE_STEP_MS.get(batch)
            overhead = f"{100 * total_ms / base:>9.0f}%" if base else f"{'':>10}"
            print(f"{batch:<8}{num_adapters:>9}{total_ms:>9.2f}{base or '':>14}{overhead}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--inter", type=int, default=14336)
    p.add_argument("--q", type=int, default=4096, help="q width of the fused qkv projection")
    p.add_argument("--kv", type=int, default=1024, help="k and v widths")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--slots", type=int, default=8, help="adapters resident (and the most used at once)")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--split-k", type=int, default=None, help="force shrink's split-K (a sweep; default: from shapes)")
    p.add_argument("--only", choices=("ops", "step"), default=None, help="run one of the two tables")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA")
    from lora.kernels import sgmv

    sgmv._FORCE_SPLIT_K = args.split_k
    torch.manual_seed(0)
    projections = [Projection("qkv", args.hidden, (args.q, args.kv, args.kv), args),
                   Projection("o", args.q, (args.hidden,), args),
                   Projection("gate_up", args.hidden, (args.inter, args.inter), args),
                   Projection("down", args.inter, (args.hidden,), args)]
    with torch.inference_mode():
        if args.only != "step":
            per_projection(projections, args)
        if args.only != "ops":
            decode_step(projections, args)


if __name__ == "__main__":
    main()
