"""Where a whole batch-256 run's decode time goes: step time by window of the run, and the
GPU's time per step in profiled windows, by kernel kind.

`profile_step` looks at steady steps right after the prefill (short contexts); this runs
workload (a) of benchmarks.rollout end to end (256 prompts x 512 random tokens, 256 new tokens,
random bf16 weights of the Llama-3.1-8B shape) and profiles 6-step windows early, in the
middle and late in the decode, when every request's KV is longer. It answers: is a decode
step bound by the host (GPU idle between kernels) or by the GPU (busy ~ wall), and which
kernels grow with the context.

    python -m benchmarks.diagnostics.profile_run [--shape llama8b] [--batch 256] [--input-len 512] [--output-len 256]
                                  [--windows 60 150 240] [--device cuda] [--first-steps 20]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence

import torch

KINDS = (  # (kind, substrings of kernel names), first match wins
    ("gemm", ("gemm", "cutlass", "nvjet", "matmul")),
    ("attention", ("flashinfer", "prefill", "decode", "attn", "attention", "sdpa", "fmha")),  # sdpa: cuDNN's (the peer)
    ("copy", ("memcpy", "memset")),
)


def kind_of(name: str) -> str:
    lowered = name.lower()
    return next((kind for kind, keys in KINDS if any(k in lowered for k in keys)), "other")


def busy_time(spans: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) spans (kernels of several streams may overlap)."""
    total, current_start, current_end = 0.0, None, None
    for start, end in sorted(spans):
        if current_end is None or start > current_end:
            if current_end is not None:
                total += current_end - current_start
            current_start, current_end = start, end
        else:
            current_end = max(current_end, end)
    if current_end is not None:
        total += current_end - current_start
    return total


def summarize(prof, steps: int, wall_ms: float, top: int) -> str:
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    spans = [(e.time_range.start, e.time_range.end) for e in events]
    by_kind: dict[str, float] = {}
    by_name: dict[str, float] = {}
    for e in events:
        duration = e.time_range.end - e.time_range.start
        by_kind[kind_of(e.name)] = by_kind.get(kind_of(e.name), 0.0) + duration
        by_name[e.name[:70]] = by_name.get(e.name[:70], 0.0) + duration
    per_step = 1e3 * steps  # us totals -> ms per step
    lines = [f"wall {wall_ms / steps:.2f} ms/step (profiled), GPU busy {busy_time(spans) / per_step:.2f} ms/step: "
             + ", ".join(f"{kind} {us / per_step:.2f}" for kind, us in sorted(by_kind.items()))]
    lines += [f"    {us / per_step:7.3f} ms  {name}" for name, us in sorted(by_name.items(), key=lambda x: -x[1])[:top]]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama8b")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--windows", type=int, nargs="*", default=[60, 150, 240], help="first step of each profiled window")
    parser.add_argument("--window-steps", type=int, default=6)
    parser.add_argument("--top", type=int, default=6)
    parser.add_argument("--first-steps", type=int, default=0,
                        help="also print the wall time of each of the run's first N steps (the prefill chunks and "
                             "the switch to decode; with --windows 0 ... their kernels too)")
    parser.add_argument("--device", default="cuda", help="cpu only for a smoke run with --shape tiny (no GPU profile)")
    args = parser.parse_args(argv)

    from rollout import Engine, EngineConfig, SamplingParams
    from rollout.model.shapes import SHAPES, write_shape_dir

    cuda = args.device.startswith("cuda")
    engine = Engine(EngineConfig(model=write_shape_dir(args.shape, prefix=f"run-{args.shape}-"),
                                 dtype="bfloat16" if cuda else "float32", device=args.device, load_format="dummy",
                                 page_size=16, gpu_memory_fraction=0.6, max_running_requests=args.batch,
                                 cuda_graph_max_bs=args.batch))
    vocab = SHAPES[args.shape]["vocab_size"]
    prompts = torch.randint(100, vocab - 100, (args.batch, args.input_len)).tolist()
    for p in prompts[: max(1, args.batch // 4)]:  # warm-up: graphs, allocator, kernels
        engine.add_request(p, SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    for p in prompts:
        engine.add_request(p, SamplingParams(temperature=0, max_new_tokens=args.output_len, ignore_eos=True))
    graphs = engine.runner.graphs
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    steps: list[tuple[int, float, bool]] = []  # (index, wall ms, replayed a decode graph)
    profiled: set[int] = set()  # steps timed under the profiler: left out of the medians
    windows = set(args.windows) if cuda else set()
    index, prof, window_start, window_t0 = 0, None, 0, 0.0
    while engine.has_unfinished():
        if index in windows:
            sync()
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
            prof.__enter__()
            window_start, window_t0 = index, time.perf_counter()
        replays = graphs.num_replays if graphs is not None else 0
        t = time.perf_counter()
        engine.step()
        steps.append((index, 1e3 * (time.perf_counter() - t), graphs is not None and graphs.num_replays > replays))
        if prof is not None:
            profiled.add(index)
        index += 1
        if prof is not None and index == window_start + args.window_steps:
            sync()
            wall = 1e3 * (time.perf_counter() - window_t0)
            prof.__exit__(None, None, None)
            print(f"steps {window_start}-{index - 1}: " + summarize(prof, args.window_steps, wall, args.top), flush=True)
            prof = None
    decode = [(i, ms) for i, ms, graphed in steps if graphed and i not in profiled]
    decode = decode or [(i, ms) for i, ms, _ in steps if i not in profiled]  # no graphs (CPU)
    print(f"\n{args.shape}, batch {args.batch}, in {args.input_len} / out {args.output_len}: {len(steps)} steps, "
          f"median decode step {statistics.median(ms for _, ms in decode):.2f} ms (unprofiled steps)")
    if args.first_steps:
        print(f"first {args.first_steps} steps, wall ms (* profiled): " + ", ".join(
            f"{i}: {ms:.1f}{'*' if i in profiled else ''}{' graph' if graphed else ''}"
            for i, ms, graphed in steps[: args.first_steps]))
    for start in range(0, index, 32):
        window = [ms for i, ms in decode if start <= i < start + 32]
        if window:
            print(f"  steps {start:4d}-{start + 31:4d}: median {statistics.median(window):6.2f} ms (n={len(window)})")


if __name__ == "__main__":
    main()
