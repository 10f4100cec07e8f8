"""Tensor parallelism on GPUs (issue #15): TP=T against TP=1 on the same shape, one process
(TPEngine spawns the other ranks), random weights made on the GPUs.

    python -m benchmarks.tp --model llama8b --tp 2 --device cuda --dtype bfloat16 [--output tp.json]

Rows, for TP=1 (cuda:0) and TP=T (cuda:0..T-1), after one short warm-up rollout:
  batch 1    1 prompt, input 128, output 256 (ignore EOS): latency-bound decode
  (a)        256 prompts, input 512, output 256 (ignore EOS): benchmarks.rollout's workload (a)
  sync       update_weights(full=True) of every HF-named full tensor, from a trainer copy
             (transformers' model) on cuda:0 in this process: TP=T fans them out over the
             TP group and each rank keeps its shard; median of --sync-repeats
`--model tiny --device cpu --dtype float32` is a smoke run (gloo, CPU).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import torch

from rollout import Engine, EngineConfig, SamplingParams
from rollout.distributed.launch_args import DTYPES, resolve_model
from rollout.distributed.tp_engine import TPEngine
from rollout.hf_trainer import load_trainer_model
from rollout.model.config import ModelConfig
from weightsync.trainer import iter_hf_weights

WORKLOADS = {"batch 1": (1, 128, 256), "(a)": (256, 512, 256)}  # prompts, input, output


def _sync(device: str) -> None:
    if device != "cpu":
        for i in range(torch.cuda.device_count()):
            torch.cuda.synchronize(i)


def run(engine, vocab: int, args: argparse.Namespace, trainer) -> dict:
    g = torch.Generator().manual_seed(0)
    engine.generate(input_ids=torch.randint(100, vocab - 100, (4, 32), generator=g).tolist(),
                    sampling_params=SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True))  # warm-up
    out = {}
    for name, (count, input_len, output_len) in WORKLOADS.items():
        prompts = torch.randint(100, vocab - 100, (count, input_len), generator=g).tolist()
        params = SamplingParams(temperature=1.0, max_new_tokens=output_len, ignore_eos=True, seed=1)
        engine.call("flush_cache") if isinstance(engine, TPEngine) else engine.flush_cache()
        _sync(args.device)
        start = time.perf_counter()
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        _sync(args.device)
        seconds = time.perf_counter() - start
        out[name] = sum(len(o.token_ids) for o in outs) / seconds
        print(f"  {name}: {out[name]:.1f} tok/s ({seconds:.2f} s)", flush=True)
    times = []
    for _ in range(args.sync_repeats + 1):  # the first is a warm-up (allocations)
        _sync(args.device)
        start = time.perf_counter()
        engine.update_weights(iter_hf_weights(trainer), full=True)
        _sync(args.device)
        times.append(time.perf_counter() - start)
    out["sync_ms"] = statistics.median(times[1:]) * 1e3
    print(f"  sync: {out['sync_ms']:.1f} ms (all: {[round(t * 1e3, 1) for t in times]})", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama8b", help="a checkpoint dir or a built-in shape (random weights)")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=tuple(DTYPES))
    parser.add_argument("--mem-fraction", type=float, default=0.6, help="of free GPU memory for each rank's KV pool")
    parser.add_argument("--sync-repeats", type=int, default=3)
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    if args.device == "cpu":  # smoke run: small workloads
        WORKLOADS.update({"batch 1": (1, 16, 16), "(a)": (8, 32, 16)})
    model_dir, load_format = resolve_model(args.model, "dummy")
    vocab = ModelConfig.from_dir(model_dir).vocab_size
    first = "cpu" if args.device == "cpu" else "cuda:0"
    # the trainer's copy first, so the engines' KV pools size themselves around it
    trainer = load_trainer_model(model_dir, load_format, DTYPES[args.dtype], torch.device(first))
    nbytes = sum(t.numel() * t.element_size() for _, t in iter_hf_weights(trainer))
    results = {}
    for tp in (1, args.tp):
        config = EngineConfig(model=model_dir, dtype=args.dtype, device=first, load_format=load_format, page_size=16,
                              gpu_memory_fraction=args.mem_fraction, tensor_parallel_size=tp, load_tokenizer=False)
        print(f"TP={tp}:", flush=True)
        engine = Engine(config) if tp == 1 else TPEngine(config)
        results[f"tp{tp}"] = run(engine, vocab, args, trainer)
        if tp > 1:
            engine.close()
        del engine
        gc.collect()  # the engine's reference cycles hold its GPU memory until collected
        if args.device != "cpu":
            torch.cuda.empty_cache()
    one, many = results["tp1"], results[f"tp{args.tp}"]
    print(f"\n{args.model} {args.dtype}, {nbytes / 1e9:.2f} GB of weights: TP={args.tp} vs TP=1")
    for name in WORKLOADS:
        print(f"  {name:<8} {one[name]:>9.1f} -> {many[name]:>9.1f} tok/s  ({many[name] / one[name]:.2f}x)")
    print(f"  sync     {one['sync_ms']:>9.1f} -> {many['sync_ms']:>9.1f} ms     "
          f"({nbytes / one['sync_ms'] / 1e6:.0f} -> {nbytes / many['sync_ms'] / 1e6:.0f} GB/s)")
    if args.output:
        Path(args.output).write_text(json.dumps({"model": args.model, "dtype": args.dtype, "tp": args.tp,
                                                 "weight_bytes": nbytes, "results": results}, indent=1))


if __name__ == "__main__":
    main()
