"""Where benchmarks.rollout (b)'s time goes beyond its decode steps: every step of a batch-1 run
timed (the first one is the prompt's prefill), for each prompt length and prefill layout
(`--prefill-rows on`: the prompt's tokens as decode rows replaying a decode graph, the
engine's default within its budget, rollout/model/runner.py; `off`: the eager extend
layout), a table of them; then the first step alone, its host phases and device span, and
one profile of it by host time (first length and layout given).

    python -m benchmarks.first_step [--shape llama8b] [--input-len 128 256 512] [--prefill-rows on off]
    python -m benchmarks.first_step --device cpu --shape tiny --new 8   # smoke run
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

import torch


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama8b")
    p.add_argument("--input-len", type=int, nargs="+", default=[128])
    p.add_argument("--prefill-rows", nargs="+", default=["on"], choices=["on", "off"],
                   help="the prefill as decode rows (a graph replay; on: the engine's default) or eager")
    p.add_argument("--rows-budget", type=int, default=None,
                   help="with --prefill-rows on: ModelRunner.extend_rows_kv (default: the engine's, EXTEND_ROWS_KV); "
                        "a larger one times longer prompts as rows (the budget's crossover)")
    p.add_argument("--new", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cuda")
    p.add_argument("--cprofile", type=int, default=0, help="also the first step under cProfile: its top N Python functions")
    args = p.parse_args(argv)

    from rollout import Engine, EngineConfig, SamplingParams
    from benchmarks.common.steady import PhaseTimer
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

    def prompt(length: int) -> list[int]:
        return torch.randint(100, vocab - 100, (length,), generator=g).tolist()

    def rows(mode: str) -> None:  # as the engine decides (its budget), or never
        engine.runner.extend_rows_kv = args.rows_budget if mode == "on" else 0

    engine.generate(input_ids=[prompt(n) for n in args.input_len], sampling_params=params)  # warm-up, untimed
    table = []
    for length in args.input_len:
        for mode in args.prefill_rows:
            rows(mode)
            firsts, totals = [], []
            for rep in range(args.repeats):  # benchmarks.rollout (b), every step timed
                engine.flush_cache()
                sync()
                start = time.perf_counter()
                engine.add_request(prompt(length), params)
                steps = []
                while engine.has_unfinished():
                    t = time.perf_counter()
                    engine.step()
                    steps.append(1e3 * (time.perf_counter() - t))
                sync()
                total = time.perf_counter() - start
                median = sorted(steps)[len(steps) // 2]
                firsts.append(steps[0])
                totals.append(total)
                print(f"in {length}, prefill rows {mode}, run {rep}: {1e3 * total:.1f} ms ({args.new / total:.0f} tok/s), "
                      f"{len(steps)} steps: first {' '.join(f'{m:.2f}' for m in steps[:4])} ms, median {median:.3f} ms, "
                      f"beyond n x median {sum(steps) - len(steps) * median:.1f} ms", flush=True)
            table.append((length, mode, sorted(firsts)[len(firsts) // 2], sorted(totals)[len(totals) // 2]))
    print(f"\n{args.shape}, {args.device}, {args.new} new tokens, median of {args.repeats} runs")
    print(f"{'input':>6} | {'prefill rows':>12} | {'first step ms':>13} | {'run ms':>8} | {'tok/s':>6}")
    for length, mode, first, total in table:
        print(f"{length:>6} | {mode:>12} | {first:>13.2f} | {1e3 * total:>8.1f} | {args.new / total:>6.1f}")
    rows(args.prefill_rows[0])
    for rep in range(args.repeats + 1):  # the first step alone; the last one profiled
        engine.flush_cache()
        sync()
        timer = PhaseTimer()
        for obj, name in ((engine.scheduler, "schedule"), (engine.runner, "prepare"), (engine.runner, "forward"),
                          (engine.loop, "read_back")):
            timer.add(obj, name)
        engine.add_request(prompt(args.input_len[0]), params)
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
            engine.add_request(prompt(args.input_len[0]), params)
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
