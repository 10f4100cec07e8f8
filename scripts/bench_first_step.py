"""Where bench_rollout (b)'s time goes beyond its decode steps: every step of a batch-1 run
timed (the first one is the prompt's prefill), then the first step alone, its host phases and
device span, and one profile of it by host time.

    python -m scripts.bench_first_step [--shape llama8b] [--input-len 128] [--new 256]
    python -m scripts.bench_first_step --device cpu --shape tiny --new 8   # smoke run
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama8b")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--new", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cuda")
    p.add_argument("--cprofile", type=int, default=0, help="also the first step under cProfile: its top N Python functions")
    args = p.parse_args()

    from rollout import Engine, EngineConfig, SamplingParams
    from rollout.bench.steady import PhaseTimer
    from rollout.model.shapes import SHAPES, write_shape_dir

    cuda = args.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    model_dir = write_shape_dir(args.shape, prefix=f"first-{args.shape}-")
    vocab = SHAPES[args.shape]["vocab_size"]
    engine = Engine(EngineConfig(model=model_dir, dtype="bfloat16" if cuda else "float32", device=args.device,
                                 load_format="dummy", page_size=16, gpu_memory_fraction=0.6, max_running_requests=512,
                                 max_prefill_tokens=8192, max_total_tokens=None if cuda else 4096))
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0, max_new_tokens=args.new, ignore_eos=True)

    def prompt() -> list[int]:
        return torch.randint(100, vocab - 100, (args.input_len,), generator=g).tolist()

    engine.generate(input_ids=[prompt()], sampling_params=params)  # warm-up outside the timing
    for rep in range(args.repeats):  # bench_rollout (b), every step timed
        engine.flush_cache()
        sync()
        start = time.perf_counter()
        engine.add_request(prompt(), params)
        steps = []
        while engine.has_unfinished():
            t = time.perf_counter()
            engine.step()
            steps.append(1e3 * (time.perf_counter() - t))
        sync()
        total = time.perf_counter() - start
        median = sorted(steps)[len(steps) // 2]
        print(f"run {rep}: {1e3 * total:.1f} ms ({args.new / total:.0f} tok/s), {len(steps)} steps: first "
              f"{' '.join(f'{m:.2f}' for m in steps[:4])} ms, median {median:.3f} ms, beyond n x median "
              f"{sum(steps) - len(steps) * median:.1f} ms", flush=True)
    for rep in range(args.repeats + 1):  # the first step alone; the last one profiled
        engine.flush_cache()
        sync()
        timer = PhaseTimer()
        for obj, name in ((engine.scheduler, "schedule"), (engine.runner, "prepare"), (engine.runner, "forward"),
                          (engine.loop, "read_back")):
            timer.add(obj, name)
        engine.add_request(prompt(), params)
        profiled = rep == args.repeats
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]
                                      + ([torch.profiler.ProfilerActivity.CUDA] if cuda else []))
        if profiled:
            prof.__enter__()
        events = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if cuda else []
        if cuda:
            events[0].record()
        t = time.perf_counter()
        engine.step()
        host = 1e3 * (time.perf_counter() - t)
        if cuda:
            events[1].record()
        sync()
        if profiled:
            prof.__exit__(None, None, None)
        timer.restore()
        span = events[0].elapsed_time(events[1]) if cuda else float("nan")
        phases = " ".join(f"{k} {1e3 * sum(v):.2f}" for k, v in timer.samples.items() if v)
        print(f"first step{' (profiled)' if profiled else ''}: host {host:.2f} ms, device span {span:.2f} ms; {phases}",
              flush=True)
        while engine.has_unfinished():
            engine.step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=50))
    if args.cprofile:  # the host's Python: which of our functions (and torch's, Triton's) the step's time is in
        import cProfile
        import pstats

        for _ in range(2):
            engine.flush_cache()
            sync()
            engine.add_request(prompt(), params)
            with cProfile.Profile() as cprof:
                engine.step()
                sync()
            while engine.has_unfinished():
                engine.step()
        stats = pstats.Stats(cprof)
        stats.sort_stats("tottime").print_stats(args.cprofile)
        stats.sort_stats("cumulative").print_stats(args.cprofile)


if __name__ == "__main__":
    main()
