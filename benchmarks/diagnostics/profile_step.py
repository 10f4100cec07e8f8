"""Where a decode step's time goes, on the GPU: host phases and the top kernels.

Fills the engine to a steady decode state (random bf16 weights of a benchmark shape), then
times N steps split into host phases (schedule, prepare, forward, sample + bookkeeping) and
profiles them with torch.profiler, printing the kernels by total device time. Meant as the
first command of a GPU run chasing the roofline gap in BENCHMARKS.md.

    python -m benchmarks.diagnostics.profile_step [--shape llama8b] [--batch 256] [--input-len 512] [--steps 20]
    python -m benchmarks.diagnostics.profile_step --prefill --batch 16 --input-len 1024   # the prefill steps instead
    python -m benchmarks.diagnostics.profile_step --batch 512 --n 8 --input-len 1024 --temperature 1   # GRPO's shape

--prefill profiles the steps that prefill the batch (chunks of max_prefill_tokens, eager),
after one warm-up batch of the same shape, and prints their kernels the same way.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

import torch


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama8b")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--no-graph", action="store_true", help="profile eager decode instead of CUDA graphs")
    parser.add_argument("--attention", default="auto")
    parser.add_argument("--trace", default=None, help="also write the profiled steps as a chrome trace (JSON) here")
    parser.add_argument("--overlap", action="store_true", help="overlap scheduling on (phases are then not split)")
    parser.add_argument("--device", default="cuda", help="cpu only for a smoke run with --shape tiny")
    parser.add_argument("--deterministic", action="store_true", help="EngineConfig(deterministic=True)")
    parser.add_argument("--prefill", action="store_true", help="profile the batch's prefill steps, not decode")
    parser.add_argument("--max-prefill-tokens", type=int, default=8192)
    parser.add_argument("--cublas", action="store_true",
                        help="cuBLAS for every matmul: the skinny kernel off (KernelOptions.skinny_matmul = False)")
    parser.add_argument("--lora", type=int, default=0,
                        help="N > 0: N random rank-16 adapters on all seven modules, the requests spread over them")
    parser.add_argument("--apart", action="store_true",
                        help="with --lora at batch 1: the adapter's kernels apart from the GEMV, not its expand in "
                             "the GEMV's epilogue (KernelOptions.lora_one_row_epilogue = False)")
    parser.add_argument("--n", type=int, default=1,
                        help="samples per prompt (batch / n prompts, forked after their prefill: GRPO's shape, "
                             "rows sharing a prompt's KV)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy; GRPO samples at 1")
    parser.add_argument("--no-share", action="store_true", help="EngineConfig(shared_prefix_attention=False)")
    parser.add_argument("--max-running", type=int, default=None,
                        help="EngineConfig.max_running_requests and cuda_graph_max_bs (default: the batch): the "
                             "benchmarks' engines use 512, which captures graphs up to 512 rows")
    args = parser.parse_args(argv)

    from rollout import Engine, EngineConfig, SamplingParams
    from rollout.kernels.options import KernelOptions
    from rollout.model.shapes import SHAPES, write_shape_dir
    from benchmarks.common.steady import PhaseTimer, run_to_decode

    model_dir = write_shape_dir(args.shape, prefix=f"profile-{args.shape}-")
    cuda = args.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    engine = Engine(EngineConfig(model=model_dir, dtype="bfloat16" if cuda else "float32", device=args.device, load_format="dummy",
                                 page_size=16, max_running_requests=args.max_running or max(args.batch, 1),
                                 gpu_memory_fraction=0.6, cuda_graph=not args.no_graph,
                                 cuda_graph_max_bs=args.max_running or max(args.batch, 1),
                                 attention=args.attention, overlap_schedule=args.overlap,
                                 deterministic=args.deterministic, max_prefill_tokens=args.max_prefill_tokens,
                                 shared_prefix_attention=not args.no_share,
                                 enable_lora=args.lora > 0, max_loras_per_batch=max(args.lora, 1), max_lora_rank=16,
                                 kernel_options=KernelOptions(skinny_matmul=not args.cublas,
                                                              lora_one_row_epilogue=not args.apart)))
    vocab = SHAPES[args.shape]["vocab_size"]
    names = load_adapters(engine, SHAPES[args.shape], args.lora)
    if args.prefill:
        return profile_prefill(engine, args, vocab, sync, names)
    if args.n < 1 or args.batch % args.n:
        parser.error(f"--n {args.n} must divide --batch {args.batch}")
    prompts = torch.randint(100, vocab - 100, (args.batch // args.n, args.input_len)).tolist()
    params = SamplingParams(temperature=args.temperature, max_new_tokens=args.steps * 3 + 8, ignore_eos=True,
                            n=args.n, seed=0)
    for i, p in enumerate(prompts):
        engine.add_request(p, params, lora_name=names[i % len(names)] if names else None)
    run_to_decode(engine, warm_steps=3)  # prefill until every request decodes, then warm the decode path

    timer = PhaseTimer()
    if not args.overlap:  # a sync after forward would defeat overlap: time whole steps only then
        timer.add(engine.scheduler, "schedule")
        timer.add(engine.runner, "prepare")
        timer.add(engine.runner, "forward", after=sync)
    sync()
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    total = time.perf_counter() - start
    timer.restore()
    phases = dict(timer.seconds)
    if phases:
        phases["sample+bookkeeping"] = total - sum(phases.values())
    print(f"\n{args.shape} {engine.config.dtype}, batch {args.batch}, context ~{args.input_len}, graphs {engine.runner.graphs is not None}, "
          f"attention {engine.runner.backend.name}, overlap {args.overlap}, deterministic {args.deterministic}, "
          f"n {args.n}, temperature {args.temperature}, "
          f"LoRA adapters {args.lora} ({sum(r.lora_name is not None for r in engine.scheduler.running)} of "
          f"{len(engine.scheduler.running)} running requests under one): "
          f"{1e3 * total / args.steps:.2f} ms per decode step")
    for name, secs in phases.items():
        print(f"  {name:<20} {1e3 * secs / args.steps:8.2f} ms")
    if (graphs := engine.runner.graphs) is not None:
        print(f"  graph replays {graphs.num_replays}, with shared-prefix attention {graphs.num_shared_replays}")

    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(args.steps):
            engine.step()
        sync()
    if args.trace:
        prof.export_chrome_trace(args.trace)
    print(prof.key_averages().table(sort_by="cuda_time_total" if cuda else "cpu_time_total", row_limit=args.top))


def load_adapters(engine, cfg: dict, count: int) -> list[str]:
    """`count` random rank-16 adapters on all seven modules, loaded."""
    from benchmarks.common.adapters import load_random_adapters

    return load_random_adapters(engine, cfg, count) if count > 0 else []


def profile_prefill(engine, args, vocab: int, sync, names: list[str]) -> None:
    """Time and profile the steps that prefill `batch` prompts (one new token each), spread
    over the adapters `names` (none: the base model)."""
    from rollout import SamplingParams

    params = SamplingParams(temperature=0, max_new_tokens=1, ignore_eos=True)

    def prefill_all() -> int:
        engine.flush_cache()  # no prefix hits: every prompt token is computed
        for i, p in enumerate(torch.randint(100, vocab - 100, (args.batch, args.input_len)).tolist()):
            engine.add_request(p, params, lora_name=names[i % len(names)] if names else None)
        steps = 0
        while engine.has_unfinished():
            engine.step()
            steps += 1
        sync()
        return steps

    prefill_all()  # warm-up: kernel builds and autotuning outside the timing
    start = time.perf_counter()
    steps = prefill_all()
    total = time.perf_counter() - start
    tokens = args.batch * args.input_len
    print(f"\n{args.shape} {engine.config.dtype}, prefill of {args.batch} x {args.input_len} tokens in {steps} steps "
          f"(chunks of {args.max_prefill_tokens}), attention {engine.runner.backend.name}, deterministic "
          f"{args.deterministic}: {1e3 * total:.1f} ms, {tokens / total:.0f} tok/s")
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if args.device.startswith("cuda") else [])
    with torch.profiler.profile(activities=activities) as prof:
        prefill_all()
    print(prof.key_averages().table(sort_by="cuda_time_total" if args.device.startswith("cuda") else "cpu_time_total",
                                    row_limit=args.top))


if __name__ == "__main__":
    main()
