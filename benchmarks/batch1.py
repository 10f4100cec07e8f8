"""Batch-1 decode, variant against variant in one process: wall per step, the device's
span per step (CUDA events) and the host phases, with the engine of benchmarks.rollout (b).

A variant is attention:matmul:pdl[:kv[:silu[:rope]]], e.g. `auto:skinny:pdl` (the default engine), or
`flashinfer:cublas:nopdl` (the engine before issue #16's batch-1 work): the attention
backend, the one-row matmul (the skinny kernel or cuBLAS, KernelOptions.skinny_matmul),
programmatic dependent launch on or off (KernelOptions.pdl) or `pdl-mm` (for the norms,
SiLU-mul and the GEMV only: not the rotary and the attention kernels, pdl_rotary_attention),
and where the new K/V are stored: `rotary` (default: in the rotary's launch) or `store` (a
launch of its own, rotary_kv_store), and SiLU-mul as the gate_up GEMV's epilogue: `silu`
(default) or `nosilu` (its own kernel, silu_epilogue), and the rotary with the K/V store as
the qkv GEMV's epilogue: `rope` (default) or `norope` (the rotary's own launch,
rope_epilogue); `variant_options` makes the engine's KernelOptions of one.
`auto:skinny:pdl-mm:store:nosilu:norope` is the engine of BENCHMARKS.md's "Batch 1, H200, 2026-12-01
(issue #16 (b)): a one-row GEMV, PDL, ...", `auto:skinny:pdl:rotary:silu:norope` the one of its next
section ("... the K/V store inside the rotary, ..."). Each variant is its own engine, built after the
previous one is gone; repeat one to see the drift of a call.

    python -m benchmarks.batch1 [--variants auto:skinny:pdl auto:skinny:pdl-mm:store auto:skinny:pdl]
    python -m benchmarks.batch1 --device cpu --shape tiny --steps 8   # smoke run (no device span)
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Sequence

import torch

from rollout.kernels.options import KernelOptions


def variant_options(variant: str) -> tuple[str, KernelOptions]:
    """(the attention backend, the engine's KernelOptions) of a variant (the module docstring)."""
    fields = variant.split(":")
    attention, matmul, launch, kv, silu, rope = (fields + ["rotary", "silu", "rope"][max(len(fields) - 3, 0):])[:6]
    if matmul not in ("skinny", "cublas") or launch not in ("pdl", "nopdl", "pdl-mm") or kv not in ("rotary", "store") \
            or silu not in ("silu", "nosilu") or rope not in ("rope", "norope"):
        raise SystemExit(f"variant {variant!r}: expected "
                         "attention:skinny|cublas:pdl|nopdl|pdl-mm[:rotary|store[:silu|nosilu[:rope|norope]]]")
    return attention, KernelOptions(skinny_matmul=matmul == "skinny", pdl=launch != "nopdl",
                                    pdl_rotary_attention=launch != "pdl-mm", rotary_kv_store=kv == "rotary",
                                    silu_epilogue=silu == "silu", rope_epilogue=rope == "rope")


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama8b")
    p.add_argument("--variants", nargs="+",
                   default=["auto:skinny:pdl", "auto:skinny:pdl:rotary:silu:norope",
                            "auto:skinny:pdl-mm:store:nosilu:norope"])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--device", default="cuda")
    args = p.parse_args(argv)

    from rollout import Engine, EngineConfig, SamplingParams
    from benchmarks.common.steady import PhaseTimer, run_to_decode
    from rollout.model.shapes import SHAPES, write_shape_dir

    cuda = args.device.startswith("cuda")
    model_dir = write_shape_dir(args.shape, prefix=f"batch1-{args.shape}-")
    vocab = SHAPES[args.shape]["vocab_size"]
    rows = []
    for variant in args.variants:
        attention, options = variant_options(variant)
        engine = Engine(EngineConfig(model=model_dir, dtype="bfloat16" if cuda else "float32", device=args.device,
                                     load_format="dummy", page_size=16, gpu_memory_fraction=0.6, attention=attention,
                                     max_running_requests=512, max_prefill_tokens=8192,
                                     max_total_tokens=None if cuda else 4096, kernel_options=options))
        g = torch.Generator().manual_seed(0)
        greedy = SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True)
        engine.generate(input_ids=torch.randint(100, vocab - 100, (1, args.input_len), generator=g).tolist(),
                        sampling_params=greedy)  # warm-up outside the timing
        engine.add_request(torch.randint(100, vocab - 100, (args.input_len,), generator=g).tolist(),
                           SamplingParams(temperature=0, max_new_tokens=args.steps + 64, ignore_eos=True))
        run_to_decode(engine, warm_steps=10)
        timer = PhaseTimer()
        for obj, name in ((engine.scheduler, "schedule"), (engine.runner, "prepare"), (engine.runner, "forward"),
                          (engine.loop, "read_back")):
            timer.add(obj, name)
        events = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if cuda else []
        if cuda:
            torch.cuda.synchronize()
            events[0].record()
        walls = []
        for _ in range(args.steps):
            start = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - start)
        if cuda:
            events[1].record()
            torch.cuda.synchronize()
        timer.restore()
        span = events[0].elapsed_time(events[1]) / args.steps if cuda else float("nan")
        phases = {k: 1e3 * sum(v) / len(v) for k, v in timer.samples.items() if v}
        median = 1e3 * sorted(walls)[len(walls) // 2]
        rows.append((f"{variant} [{engine.runner.backend.name}]", median, span, phases))
        print(f"{rows[-1][0]}: median step {median:.3f} ms, device span {span:.3f} ms", flush=True)
        while engine.has_unfinished():
            engine.step()
        del engine
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    name = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"\n{args.shape}, batch 1, prompt {args.input_len}, {args.steps} decode steps, {name}")
    keys = ["schedule", "prepare", "forward", "read_back"]
    print(f"{'variant [backend]':<48} | {'step ms':>7} | {'tok/s':>6} | {'device ms':>9} | " + " | ".join(f"{k:>9}" for k in keys))
    for label, median, span, phases in rows:
        print(f"{label:<48} | {median:>7.3f} | {1e3 / median:>6.0f} | {span:>9.3f} | "
              + " | ".join(f"{phases.get(k, 0.0):>9.3f}" for k in keys))


if __name__ == "__main__":
    main()
