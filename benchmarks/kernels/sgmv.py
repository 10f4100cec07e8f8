"""Micro-benchmark of the multi-LoRA ops on a GPU (bf16), for choosing tilings and launch modes.

    python -m benchmarks.kernels.sgmv [--shape llama8b --rank 16 --slots 8 --split-k N --expand-block-n N
                                  --only ops|step --batches 1 256]
    python -m benchmarks.kernels.sgmv --device cpu     # a smoke run of every table (tiny shape, interpreter)

Times are GPU time inside CUDA graphs (``triton.testing.do_bench_cudagraph``), as the
engine's decode graphs run them; host launch cost is not in them. Every timed call walks all
layers' weights, as a forward pass does, so adapters come from HBM rather than from an L2
that one layer's few MB would fit in.

Table 1 (``ops``), per projection (qkv: 3 slices, o / down: 1, gate_up: 2) and batch shape
(decode: one token per request, slots drawn uniformly from the adapters in use; prefill:
long requests): shrink and expand time per layer, their effective bandwidth (bytes each must
move / time, GB/s and share of the H200's ~4.8 TB/s), the tiling chosen, and the same
products as plain torch.mm for ONE adapter over the whole batch (a floor: no segments).

Table 2 (``step``), what the adapters add to a decode step: the model's four projections x
all layers in one graph -- the base GEMMs (real weights shapes, cuBLAS) through the engine's
own `Linear` + `LoraHook` + `LoraPool` -- without LoRA, and with it in three launch modes:
  in order   shrink, GEMM, expand on one stream, plain launches (the engine before #10's
             second pass: 2 LoRA launches per projection on the critical path)
  side       the shrink on a side stream beside the GEMM (graph branches), expand after it
  side+pdl   and expand launched early with programmatic dependent launch (the default
             past LoraPool.defer_max_rows)
  deferred   shrink and expand both on the side stream into an fp32 delta the consumer adds
             (`Linear.forward_deferred`; the consumer's extra read is not in this table)
The "added" columns are (step with LoRA - step without) in ms and against the real decode
step (BASE_STEP_MS, measured end to end: attention, norms and sampling included).
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np
import torch

from rollout.kernels.options import KernelOptions

PEAK_GBPS = 4800.0  # H200 HBM3e
# Base decode step of Llama-3-8B on an H200 without LoRA (ms): the budget the LoRA ops eat into.
BASE_STEP_MS = {1: 4.8, 256: 13.0}
MODES = ("in order", "side", "side+pdl", "deferred")


class Timer:
    """GPU time of fn in a CUDA graph (ms); on CPU (the smoke run) wall time of one call."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def ms(self, fn: Callable[[], object]) -> float:
        if self.device.type == "cuda":
            from triton.testing import do_bench_cudagraph

            return float(do_bench_cudagraph(fn, rep=50))
        start = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - start)


class Projection:
    """One LoRA projection's weights for every layer and the batch's activations."""

    def __init__(self, name: str, hidden: int, widths: tuple[int, ...], args: argparse.Namespace,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.name, self.hidden, self.widths = name, hidden, widths
        self.options: KernelOptions = args.options  # the kernels (forced split-K / column block)
        self.num_slices, self.n_out, self.rank = len(widths), sum(widths), args.rank
        self.offsets = tuple(int(v) for v in np.cumsum((0,) + widths))
        kw = dict(device=device, dtype=dtype)
        rows = self.num_slices * args.rank
        self.a = [torch.randn(args.slots, rows, hidden, **kw) / hidden**0.5 for _ in range(args.layers)]
        self.b = [torch.randn(args.slots, self.n_out, args.rank, **kw) / args.rank**0.5 for _ in range(args.layers)]
        self.slot_ranks = torch.full((args.slots,), args.rank, dtype=torch.int32, device=device)

    def shrink(self, layer: int, x: torch.Tensor, seg: tuple[torch.Tensor, ...]) -> torch.Tensor:
        from lora import ops

        return ops.sgmv_shrink(x, self.a[layer], *seg, self.slot_ranks, num_slices=self.num_slices,
                               max_rank=self.rank, options=self.options)

    def expand(self, layer: int, h: torch.Tensor, out: torch.Tensor, seg: tuple[torch.Tensor, ...]) -> None:
        from lora import ops

        ops.sgmv_expand(h, self.b[layer], out, *seg, self.slot_ranks, slice_offsets=self.offsets, max_rank=self.rank,
                        options=self.options)


def _plan(lens: list[int], num_adapters: int, seed: int, device: torch.device, num_segments: int | None = None):
    """(SegmentPlan, device (row_ids, seg_indptr, seg_slots)) of requests on slots drawn from
    the first ``num_adapters``."""
    from rollout.model.lora_segments import plan_segments

    slots = np.random.default_rng(seed).integers(0, num_adapters, len(lens))
    plan = plan_segments(slots, lens, num_segments=num_segments)
    seg = tuple(torch.from_numpy(a).to(device) for a in (plan.row_ids, plan.seg_indptr, plan.seg_slots))
    return plan, seg


def _tiling(proj: Projection, num_rows: int, num_segments: int, device: torch.device) -> str:
    from lora.kernels import sgmv, tiling

    sms = sgmv._num_sms(device)
    s = tiling.shrink_tiling(num_rows, num_segments, proj.hidden, proj.num_slices, proj.rank, 2, num_sms=sms,
                             split_k=proj.options.lora_split_k)
    e = tiling.expand_tiling(num_rows, num_segments, proj.widths, proj.rank, s.split_k, num_sms=sms,
                             block_n=proj.options.lora_expand_block_n)
    return f"s{s.block_m}x{s.block_n}x{s.block_k}/{s.split_k} e{e.block_m}x{e.block_n}"


def per_projection(projections: list[Projection], args: argparse.Namespace, timer: Timer, device: torch.device,
                   dtype: torch.dtype) -> None:
    shapes = [(f"decode {b} x{a}", [1] * b, a) for b in args.batches for a in (1, args.slots) if a <= b]
    long = 1024 if device.type == "cuda" else 8
    shapes += [(f"prefill {long // 2} x1", [long // 2], 1), (f"prefill 4x{long} x1", [long] * 4, 1)]
    shapes += [(f"prefill 4x{long} x{min(4, args.slots)}", [long] * 4, min(4, args.slots))] if args.slots > 1 else []
    layers = range(args.layers)
    print(f"{'proj':<8}{'batch':<19}{'shrink us':>10}{'GB/s':>7}{'%':>4}{'expand us':>10}{'GB/s':>7}{'%':>4}"
          f"{'mm shrink':>10}{'mm expand':>10}  tiling", flush=True)
    per_layer = 1e3 / args.layers
    for proj in projections:
        for name, lens, num_adapters in shapes:
            rows = sum(lens)
            plan, seg = _plan(lens, num_adapters, rows + num_adapters, device)
            x = torch.randn(rows, proj.hidden, device=device, dtype=dtype)
            out = torch.randn(rows, proj.n_out, device=device, dtype=dtype)
            h = proj.shrink(0, x, seg)
            t_shrink = timer.ms(lambda: [proj.shrink(layer, x, seg) for layer in layers]) * per_layer
            t_expand = timer.ms(lambda: [proj.expand(layer, h, out, seg) for layer in layers]) * per_layer
            h16 = torch.randn(rows, proj.rank, device=device, dtype=dtype)
            t_mm_shrink = timer.ms(lambda: [torch.mm(x, proj.a[layer][0].T) for layer in layers]) * per_layer
            t_mm_expand = timer.ms(lambda: [out.addmm_(h16, proj.b[layer][0].T) for layer in layers]) * per_layer
            cols, used = proj.num_slices * proj.rank, plan.num_segments
            # bytes each must move: inputs read once (weights once per adapter in use), outputs written
            shrink_bytes = 2 * rows * proj.hidden + 2 * used * cols * proj.hidden + 4 * h.numel()
            expand_bytes = 4 * h.numel() + 2 * used * proj.n_out * proj.rank + 2 * 2 * rows * proj.n_out
            gbps_s, gbps_e = shrink_bytes / t_shrink / 1e3, expand_bytes / t_expand / 1e3
            print(f"{proj.name:<8}{name:<19}{t_shrink:>10.1f}{gbps_s:>7.0f}{100 * gbps_s / PEAK_GBPS:>4.0f}"
                  f"{t_expand:>10.1f}{gbps_e:>7.0f}{100 * gbps_e / PEAK_GBPS:>4.0f}"
                  f"{t_mm_shrink:>10.1f}{t_mm_expand:>10.1f}  {_tiling(proj, rows, used, device)}", flush=True)


def decode_step(args: argparse.Namespace, timer: Timer, device: torch.device, dtype: torch.dtype) -> None:
    """Table 2: base GEMMs + LoRA through the engine's Linear / LoraHook / LoraPool."""
    from lora.kernels import sgmv
    from lora.pool import LoraPool
    from rollout.model.config import ModelConfig
    from rollout.batch import LoraInputs
    from rollout.model.llama import Linear
    from rollout.model.shapes import SHAPES

    cfg = ModelConfig.from_dict(dict(SHAPES[args.shape], num_hidden_layers=args.layers))
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    adapters = LoraPool(cfg, args.slots, args.rank, targets, dtype, device)  # the adapters every mode runs
    for t in (*adapters.a_stack.values(), *adapters.b_stack.values()):
        t.normal_(0, 0.01)
    adapters.slot_ranks.fill_(args.rank)

    def pool_for(mode: str, batch: int) -> LoraPool:
        """The adapters in a pool built with the mode's options, each projection's hook on it."""
        pool = LoraPool(cfg, args.slots, args.rank, targets, dtype, device, options=replace(
            args.options, lora_pdl=mode in ("side+pdl", "deferred"),
            lora_concurrent_max_rows=batch,  # each mode as named, whatever the engine's policy
            lora_defer_max_rows=batch if mode == "deferred" else 0))
        for name in adapters.a_stack:
            pool.a_stack[name].copy_(adapters.a_stack[name])
            pool.b_stack[name].copy_(adapters.b_stack[name])
        pool.slot_ranks.copy_(adapters.slot_ranks)
        for i, (linear, _) in enumerate(linears):
            linear.lora = pool.hook(i // len(sizes), names[i % len(sizes)])
        return pool

    sizes = {"qkv_proj": (cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size), "o_proj": (cfg.q_size, cfg.hidden_size),
             "gate_up_proj": (cfg.hidden_size, 2 * cfg.intermediate_size),
             "down_proj": (cfg.intermediate_size, cfg.hidden_size)}
    linears, names = [], list(sizes)
    for layer in range(cfg.num_layers):
        for name, (fan_in, fan_out) in sizes.items():
            linear = Linear(fan_in, fan_out, bias=False)
            linear.weight.data = torch.randn(fan_out, fan_in, device=device, dtype=dtype) / fan_in**0.5
            linear.lora = adapters.hook(layer, name)
            linears.append((linear, fan_in))

    print(f"\nDecode step: {len(sizes)} projections x {cfg.num_layers} layers of {args.shape} in one graph "
          f"(base GEMMs + LoRA rank {args.rank}); ms, and added ms / % of the real decode step")
    print(f"{'batch':<7}{'adapters':>9}{'base ms':>9}" + "".join(f"{m + ' ms':>14}" for m in MODES)
          + "".join(f"{'added ' + m:>17}" for m in MODES), flush=True)
    for batch in args.batches:
        for num_adapters in sorted({1, min(args.slots, batch)}):
            plan, seg = _plan([1] * batch, num_adapters, batch + num_adapters, device, num_segments=args.slots)
            inputs = LoraInputs(*seg, plan.num_lora_rows)
            xs = {fan_in: torch.randn(batch, fan_in, device=device, dtype=dtype) for fan_in in {f for _, f in linears}}

            def step() -> None:
                for linear, fan_in in linears:
                    linear(xs[fan_in])

            def step_deferred() -> None:
                for linear, fan_in in linears:
                    linear.forward_deferred(xs[fan_in])

            times = {}
            with torch.inference_mode():
                pool = pool_for("in order", batch)
                pool.plan(None, active=False)
                times["base"] = timer.ms(step)
                for mode in MODES:
                    pool = pool_for(mode, batch)
                    pool.plan(inputs, active=True, concurrent=mode != "in order")
                    times[mode] = timer.ms(step_deferred if mode == "deferred" else step)
                    del pool
            real = BASE_STEP_MS.get(batch)
            added = "".join(f"{times[m] - times['base']:>9.2f}" + (f"{100 * (times[m] - times['base']) / real:>7.1f}%"
                                                                    if real else f"{'':>8}") for m in MODES)
            print(f"{batch:<7}{num_adapters:>9}{times['base']:>9.2f}" + "".join(f"{times[m]:>14.2f}" for m in MODES)
                  + added, flush=True)
    print(f"PDL available here: {sgmv.pdl_enabled(device)}")


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default=None, help="model shape (rollout.model.shapes; default llama8b, cpu: tiny)")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--slots", type=int, default=None, help="adapters resident (and the most used at once)")
    p.add_argument("--layers", type=int, default=None, help="layers walked per timed call (default: the shape's)")
    p.add_argument("--split-k", type=int, default=None, help="force shrink's split-K (a sweep; default: from shapes)")
    p.add_argument("--expand-block-n", type=int, default=None, help="force expand's column block (16..256, a sweep)")
    p.add_argument("--only", choices=("ops", "step"), default=None, help="run one of the two tables")
    p.add_argument("--batches", type=int, nargs="+", default=None, help="decode batch sizes (default 1 16 64 256)")
    p.add_argument("--device", default="cuda", help="cpu: a smoke run of every table (Triton interpreter)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("needs CUDA (or --device cpu for a smoke run)")
    if device.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton
    # on CPU the kernels, not the torch reference, under the interpreter
    args.options = KernelOptions(lora_triton=True if device.type == "cpu" else KernelOptions().lora_triton,
                                 lora_split_k=args.split_k, lora_expand_block_n=args.expand_block_n)
    from rollout.model.shapes import SHAPES

    args.shape = args.shape or ("llama8b" if device.type == "cuda" else "tiny")
    cfg = SHAPES[args.shape]
    args.layers = args.layers or cfg["num_hidden_layers"]
    args.slots = args.slots or (8 if device.type == "cuda" else 2)
    args.batches = args.batches or ([1, 16, 64, 256] if device.type == "cuda" else [1, 4])
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16  # the interpreter has no bf16 dot
    torch.manual_seed(0)
    timer = Timer(device)
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    with torch.inference_mode():
        if args.only != "step":
            projections = [Projection("qkv", h, (q, kv, kv), args, device, dtype),
                           Projection("o", q, (h,), args, device, dtype),
                           Projection("gate_up", h, (i, i), args, device, dtype),
                           Projection("down", i, (h,), args, device, dtype)]
            per_projection(projections, args, timer, device, dtype)
            del projections
    if args.only != "ops":
        decode_step(args, timer, device, dtype)


if __name__ == "__main__":
    main()
