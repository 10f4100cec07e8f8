"""Colocated data-parallel rollout under torchrun: one Engine per rank, prompts split
across ranks, results gathered on rank 0 in the original order (prompt-major, then sample).

    torchrun --nproc-per-node N scripts/launch_dp_rollout.py --model DIR \\
        [--device cpu|cuda] [--backend gloo|nccl] [--prompts FILE | --num-prompts 64 --prompt-len 128] \\
        [--samples 1] [--temperature 0] [--max-new-tokens 128] [--seed 0] [--split strided|contiguous] \\
        [--warmup] [--output results.json]

With --device cuda each rank runs on cuda:LOCAL_RANK. --tp T: each engine is a TP group of T
consecutive ranks (DP x TP: --nproc-per-node = engines x T; the prompts split over engines). Throughput scaling 1 -> N GPUs: run
the same workload with --nproc-per-node 1 and N (e.g. --model llama8b for random weights
shaped like Llama-3.1-8B, --ignore-eos, --warmup) and compare the "aggregate tok/s" lines.

Same results as one engine: every random draw is seeded per request (SamplingParams.seed,
sample index), so a prompt's samples do not depend on which rank runs it or what else is
batched there. With --seed -1 (engine-drawn seeds) that no longer holds.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

from rollout import SamplingParams
from rollout.distributed.dp_rollout import DPRollout, run_dp_rollout
from rollout.distributed.group import DistContext, init_distributed, shutdown
from rollout.distributed.launch_args import (add_common_args, build_engine, finite_float, int_at_least, maybe_die,
                                             resolve_backend)
from rollout.distributed.phases import phase
from rollout.distributed.prompts import load_prompts
from rollout.wire import output_to_json


def make_params(args: argparse.Namespace, num_prompts: int) -> list[SamplingParams]:
    seed = None if args.seed < 0 else args.seed
    base = dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, max_new_tokens=args.max_new_tokens,
                n=args.samples, ignore_eos=args.ignore_eos, logprobs_mode=args.logprobs_mode)
    if args.seed_per_prompt and seed is not None:
        return [SamplingParams(**base, seed=seed + i) for i in range(num_prompts)]
    return [SamplingParams(**base, seed=seed)] * num_prompts


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    parser.add_argument("--prompts", default=None, help="JSON list (or JSONL) of token-id lists or strings")
    parser.add_argument("--num-prompts", type=int_at_least(1), default=64)
    parser.add_argument("--prompt-len", type=int_at_least(1), default=128)
    parser.add_argument("--samples", type=int_at_least(1), default=1, help="samples per prompt (n); not --n: torchrun would take that as its own abbreviation")
    parser.add_argument("--temperature", type=finite_float(0.0), default=0.0)
    parser.add_argument("--top-p", type=finite_float(0.0, 1.0, above=True), default=1.0)
    parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument("--max-new-tokens", type=int_at_least(1), default=128)
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--logprobs-mode", choices=("processed", "raw"), default="processed")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (per request); -1: engine-drawn")
    parser.add_argument("--seed-per-prompt", action="store_true", help="prompt i gets seed + i (else all share --seed)")
    parser.add_argument("--split", choices=("strided", "contiguous"), default="strided")
    parser.add_argument("--tp", type=int_at_least(1), default=1, help="tensor-parallel ranks per engine (divides the world)")
    parser.add_argument("--warmup", action="store_true", help="one short untimed rollout first (compiles kernels / graphs)")
    parser.add_argument("--repeats", type=int_at_least(1), default=1, help="timed rollouts; the summary reports each")
    parser.add_argument("--output", default=None, help="rank 0 writes outputs and summary here (JSON)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    ctx = init_distributed(resolve_backend(args), args.device, args.timeout_s, lambda r: f"rollout rank {r}")
    with phase(ctx, "build engine"):
        engine = build_engine(args, ctx.device, tensor_parallel_size=args.tp)
        prompts = load_prompts(args.prompts, vocab_size=engine.model_config.vocab_size, num_prompts=args.num_prompts,
                               prompt_len=args.prompt_len, seed=args.seed, tokenizer=engine.tokenizer)
        params = make_params(args, len(prompts))
    if args.warmup:
        warm = [p[:16] for p in prompts[: 2 * ctx.world_size // args.tp]]
        run_dp_rollout(engine, warm, SamplingParams(max_new_tokens=8, temperature=0), ctx, label="warmup")
        engine.flush_cache()  # the timed run must not start with the warm-up's prefixes cached
    maybe_die(ctx, args, step=1)
    runs = []
    for i in range(args.repeats):
        if i:
            engine.flush_cache()
        runs.append(run_dp_rollout(engine, prompts, params, ctx, split=args.split, label=f"rollout {i + 1}"))
    if ctx.rank == 0:
        report(args, ctx, runs)  # type: ignore[arg-type]
    shutdown(ctx)


def report(args: argparse.Namespace, ctx: DistContext, runs: list[DPRollout]) -> None:
    summaries = []
    for i, run in enumerate(runs):
        summary = {
            "world_size": ctx.world_size, "tensor_parallel_size": args.tp, "backend": ctx.backend, "device": args.device, "model": args.model,
            "prompts": len({o.prompt_index for o in run.outputs}), "samples": len(run.outputs), "tokens": run.tokens,
            "wall_s": run.wall_seconds, "aggregate_tok_s": run.tokens / run.wall_seconds,
            "rank_seconds": run.rank_seconds, "rank_tokens": run.rank_tokens, "rank_prompts": run.rank_prompts,
            "per_rank_tok_s": [t / s if s else 0.0 for t, s in zip(run.rank_tokens, run.rank_seconds)],
        }
        summaries.append(summary)
        slowest = max(run.rank_seconds)
        print(f"[dp rollout {i + 1}/{len(runs)}] {ctx.world_size} ranks, TP {args.tp} ({ctx.backend}, {args.device}): "
              f"{summary['samples']} samples, {run.tokens} tokens in {run.wall_seconds:.2f} s -> "
              f"aggregate {summary['aggregate_tok_s']:.1f} tok/s; per engine "
              f"{[round(x, 1) for x in summary['per_rank_tok_s']]} tok/s, slowest engine {slowest:.2f} s", flush=True)
    if args.output:
        doc = {"summary": summaries[-1], "runs": summaries, "outputs": [output_to_json(o) for o in runs[-1].outputs]}
        Path(args.output).write_text(json.dumps(doc))


if __name__ == "__main__":
    main()
