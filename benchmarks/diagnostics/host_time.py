"""Where the host's time goes in steady decode, and what makes it wait for the device.

For each (batch, attention, overlap) spec: fills the engine to steady decode (random
weights of a benchmark shape), then
  1. runs steps under `torch.cuda.set_sync_debug_mode("warn")` and prints every call site
     that synchronized the host with the device (the step should have one: the read-back);
  2. times host phases without any added sync (schedule, prepare, forward launch, sample
     launch, read-back wait, read-back work) and the device time per step (CUDA events);
  3. prints a cProfile of the steps, top functions by own time.

    python -m benchmarks.diagnostics.host_time --specs 1:flashinfer:on 256:flashinfer:on:16 [--shape llama8b]
    (spec: batch:attention:overlap[:torch threads])
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path

import torch

from benchmarks.common.steady import PhaseTimer, run_to_decode


def fill(engine, batch: int, input_len: int, vocab: int, steps: int) -> None:
    from rollout import SamplingParams

    prompts = torch.randint(100, vocab - 100, (batch, input_len)).tolist()
    params = SamplingParams(temperature=0, max_new_tokens=steps, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params)
    run_to_decode(engine, warm_steps=5)


def sync_sites(engine, steps: int) -> Counter:
    sites: Counter = Counter()

    def show(message, category, filename, lineno, file=None, line=None):
        stack = [f for f in traceback.extract_stack()[:-1] if "/rollout/" in f.filename or "flashinfer" in f.filename]
        where = " <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in reversed(stack[-4:]))
        sites[f"{str(message)[:60]} @ {where}"] += 1

    old = warnings.showwarning
    warnings.showwarning = show
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                engine.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = old
    return sites


def host_phases(engine, steps: int) -> dict[str, float]:
    timer = PhaseTimer()
    timer.add(engine.scheduler, "schedule")
    timer.add(engine.runner, "prepare")
    timer.add(engine.runner, "forward", "forward (launch)")
    timer.add(engine.loop, "read_back", "read back (wait + work)")
    start_ev, end_ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start_ev.record()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall = time.perf_counter() - t0
    end_ev.record()
    torch.cuda.synchronize()
    timer.restore()
    phases = timer.seconds
    out = {k: 1e3 * v / steps for k, v in phases.items()}
    out["launch rest (sample, pack, D2H)"] = 1e3 * wall / steps - sum(out.values())
    out["= wall per step"] = 1e3 * wall / steps
    out["device span per step (events)"] = start_ev.elapsed_time(end_ev) / steps
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama8b")
    parser.add_argument("--specs", nargs="+", default=["1:flashinfer:on", "256:flashinfer:on"])
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--top", type=int, default=22)
    parser.add_argument("--cublas", action="store_true",
                        help="cuBLAS for every matmul: the skinny kernel off (KernelOptions.skinny_matmul = False)")
    args = parser.parse_args()

    from rollout import Engine, EngineConfig
    from rollout.kernels.options import KernelOptions
    from rollout.model.shapes import SHAPES, write_shape_dir

    model_dir = write_shape_dir(args.shape, prefix=f"diag-{args.shape}-")
    vocab = SHAPES[args.shape]["vocab_size"]
    for spec in args.specs:
        batch, attention, overlap, *threads = spec.split(":")  # optional 4th field: torch threads
        batch = int(batch)
        engine = Engine(EngineConfig(model=model_dir, dtype="bfloat16", device="cuda", load_format="dummy", page_size=16,
                                     max_running_requests=max(batch, 1), gpu_memory_fraction=0.5, attention=attention,
                                     cuda_graph_max_bs=max(batch, 1), overlap_schedule=overlap == "on",
                                     num_threads=int(threads[0]) if threads else None,
                                     kernel_options=KernelOptions(skinny_matmul=not args.cublas)))
        fill(engine, batch, args.input_len, vocab, steps=10 * args.steps)
        print(f"\n=== batch {batch}, attention {engine.runner.backend.name}, overlap {overlap}, "
              f"torch threads {torch.get_num_threads()} ===", flush=True)
        sites = sync_sites(engine, 5)
        print("host<-device syncs in 5 steps:" + ("" if sites else " none"))
        for site, n in sites.most_common(12):
            print(f"  {n:3d}x {site}")
        for k, v in host_phases(engine, args.steps).items():
            print(f"  {k:<34} {v:7.2f} ms")
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
        prof.disable()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(args.top)
        lines = [ln for ln in s.getvalue().splitlines() if ln.strip()]
        print("\n".join(ln[:150] for ln in lines[3 : 6 + args.top]))
        del engine
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
