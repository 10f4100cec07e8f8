"""Client overhead benchmark (issue #13): the same prompts through in-process
`Engine.generate` and through `RolloutClient.generate` against an engine process on the
same device with the same engine config, at batch 1 and batch 256 (configurable).

Reports per batch size the median wall time of one generate call (every request of a
call returns with it, so this is each request's latency), output tokens/s, and the
client's overhead over in-process, in % and in ms per request. Goal (H200, Llama-3.1-8B
shape, bf16): <= 5% at batch 1.

Random ("dummy") weights from the shape's config.json, seeded, so both engines hold the
same weights and should emit the same tokens (reported). The two run one after the other
(the engine process first, then in-process), each with --mem-fraction of the free memory
for its KV cache. Each timed call uses fresh prompts (the same sets on both sides), so the
prefix cache never serves a repeat.

    python -m benchmarks.client [--shape llama8b] [--batches 1 256] [--input-len 128] [--output-len 256]
    python -m benchmarks.client --shape tiny --device cpu --batches 1 8 --output-len 8   # smoke run
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rollout.model.shapes import SHAPES, write_shape_dir


@dataclass
class Timing:
    seconds: list[float]  # wall time of each timed call
    tokens: list[list[list[int]]]  # per call, per request: the generated token ids

    @property
    def median_s(self) -> float:
        return statistics.median(self.seconds)


def prompt_sets(vocab: int, batch: int, input_len: int, count: int, seed: int) -> list[list[list[int]]]:
    """`count` sets of `batch` random prompts, the same for a given seed."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(100, vocab - 100, (batch, input_len), generator=g).tolist() for _ in range(count)]


def time_calls(generate, sets: list[list[list[int]]], params) -> Timing:
    seconds, tokens = [], []
    for prompts in sets:
        start = time.perf_counter()
        outs = generate(input_ids=prompts, sampling_params=params)
        seconds.append(time.perf_counter() - start)
        tokens.append([o.token_ids for o in outs])
    return Timing(seconds, tokens)


def run_all(generate, args, vocab: int, params) -> dict[int, Timing]:
    """Warm up (one call per batch size, prompts of their own), then the timed calls."""
    for batch in args.batches:
        generate(input_ids=prompt_sets(vocab, batch, args.input_len, 1, seed=10_000 + batch)[0], sampling_params=params)
    return {batch: time_calls(generate, prompt_sets(vocab, batch, args.input_len, args.repeats, seed=batch), params)
            for batch in args.batches}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama8b", choices=sorted(SHAPES))
    parser.add_argument("--device", default="cuda", help="cpu only for a smoke run with --shape tiny")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 256])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per batch size (the median is reported)")
    parser.add_argument("--mem-fraction", type=float, default=0.6, help="of free GPU memory for the KV pool")
    args = parser.parse_args(argv)

    from rollout import Engine, EngineConfig, SamplingParams
    from rollout.server import RolloutClient

    device = torch.device(args.device)
    cfg = SHAPES[args.shape]
    model_dir = write_shape_dir(args.shape, prefix=f"bench-client-{args.shape}-")
    options = dict(dtype="bfloat16" if device.type == "cuda" else "float32", device=args.device, load_format="dummy",
                   page_size=16, gpu_memory_fraction=args.mem_fraction, max_running_requests=max(args.batches),
                   max_total_tokens=None if device.type == "cuda" else 65536)
    params = SamplingParams(temperature=0, max_new_tokens=args.output_len, ignore_eos=True)

    start = time.perf_counter()
    with RolloutClient.launch(model_dir, server_args=["--log-level", "WARNING"], **options) as client:
        print(f"engine process up in {time.perf_counter() - start:.1f} s on {client.info.model.device}, "
              f"KV capacity {client.stats().kv_capacity_tokens} tokens", flush=True)
        served = run_all(client.generate, args, cfg["vocab_size"], params)
    engine = Engine(EngineConfig(model=model_dir, **options))
    print(f"in-process engine: KV capacity {engine.kv.capacity} tokens", flush=True)
    local = run_all(engine.generate, args, cfg["vocab_size"], params)
    del engine
    gc.collect()

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"\n{args.shape}, {options['dtype']}, {name}: generate(), input {args.input_len} / output {args.output_len} "
          f"tokens, greedy, median of {args.repeats} calls")
    print(f"{'batch':>5} | {'in-process s':>12} | {'client s':>9} | {'in-process tok/s':>16} | {'client tok/s':>12} | "
          f"{'overhead':>8} | {'ms/request':>10} | same tokens")
    for batch in args.batches:
        mine, theirs = local[batch], served[batch]
        tokens = batch * args.output_len
        extra = theirs.median_s - mine.median_s
        print(f"{batch:>5} | {mine.median_s:>12.4f} | {theirs.median_s:>9.4f} | {tokens / mine.median_s:>16.0f} | "
              f"{tokens / theirs.median_s:>12.0f} | {extra / mine.median_s:>+8.1%} | {1e3 * extra / batch:>+10.3f} | "
              f"{'yes' if mine.tokens == theirs.tokens else 'NO'}")


if __name__ == "__main__":
    main()
