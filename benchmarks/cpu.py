"""CPU benchmark: the engine against transformers `generate`, side by side in one run.

SmolLM2-135M-Instruct, float32, input 128 / output 64 tokens (EOS ignored), greedy, at
batch 16 and 64; and a GRPO-shaped row (8 prompts x n=8 samples, temperature 1), where
transformers uses num_return_sequences and the engine prefills each prompt once. Prints output tokens/s for both and the ratio (ratios, not absolute
times, are what is comparable on a noisy shared machine).

    python -m benchmarks.cpu [--batches 16 64] [--threads 2]
"""

from __future__ import annotations

import argparse
import platform
import time

import torch


def bench_hf(model, prompts: torch.Tensor, new_tokens: int, n: int = 1) -> float:
    # n > 1: sampling with num_return_sequences, as an RL loop using HF would do it
    sampling = dict(do_sample=True, num_return_sequences=n, top_k=0) if n > 1 else dict(do_sample=False)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens,
            min_new_tokens=new_tokens, pad_token_id=0, **sampling,
        )
    elapsed = time.perf_counter() - start
    assert out.shape == (prompts.shape[0] * n, prompts.shape[1] + new_tokens)
    return out.shape[0] * new_tokens / elapsed


def bench_engine(engine, prompts: torch.Tensor, new_tokens: int, n: int = 1) -> float:
    from rollout import SamplingParams

    if n > 1:
        params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, n=n, seed=0, ignore_eos=True)
    else:
        params = SamplingParams(temperature=0, max_new_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = engine.generate(input_ids=prompts.tolist(), sampling_params=params)
    elapsed = time.perf_counter() - start
    assert all(len(o.token_ids) == new_tokens for o in outs)
    return len(outs) * new_tokens / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--grpo", type=int, nargs=2, default=[8, 8], metavar=("PROMPTS", "N"),
                        help="also a GRPO-shaped row: PROMPTS prompts x N samples (0 0 to skip)")
    parser.add_argument("--deterministic", action="store_true", help="also EngineConfig(deterministic=True), same prompts")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    from rollout import Engine, EngineConfig
    from rollout.model.fetch import fetch_default_model

    path = str(fetch_default_model())
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engines = {"engine": Engine(EngineConfig(model=path, dtype="float32", device="cpu",
                                             max_running_requests=max(args.batches)))}
    if args.deterministic:
        engines["deterministic"] = Engine(EngineConfig(model=path, dtype="float32", device="cpu", deterministic=True,
                                                       max_running_requests=max(args.batches)))
    g = torch.Generator().manual_seed(0)
    # warm-up: first calls pay one-off allocation costs
    warm = torch.randint(100, 40000, (2, 16), generator=g)
    bench_hf(hf, warm, 4)
    for engine in engines.values():
        bench_engine(engine, warm, 4)

    rows = []
    runs = [(f"{b}", b, 1) for b in args.batches]
    if args.grpo[0] and args.grpo[1]:
        runs.append((f"{args.grpo[0]}x n={args.grpo[1]}", args.grpo[0], args.grpo[1]))
    for label, batch, n in runs:
        prompts = torch.randint(100, 40000, (batch, args.input_len), generator=g)
        hf_tps = bench_hf(hf, prompts, args.output_len, n)
        tps = []
        for engine in engines.values():
            engine.flush_cache()
            tps.append(bench_engine(engine, prompts, args.output_len, n))
        rows.append((label, hf_tps, tps))
        print(f"batch {label}: transformers {hf_tps:.1f} tok/s, "
              + ", ".join(f"{name} {t:.1f} tok/s" for name, t in zip(engines, tps)), flush=True)

    print(f"\nSmolLM2-135M fp32, in {args.input_len} / out {args.output_len}, {args.threads} threads, "
          f"{platform.processor() or platform.machine()}, torch {torch.__version__}")
    det = " | deterministic tok/s | vs engine" if args.deterministic else ""
    print(f"{'batch':>10} | {'transformers tok/s':>18} | {'engine tok/s':>12} | {'ratio':>6}{det}")
    for label, hf_tps, tps in rows:
        line = f"{label:>10} | {hf_tps:>18.1f} | {tps[0]:>12.1f} | {tps[0] / hf_tps:>5.2f}x"
        if args.deterministic:
            line += f" | {tps[1]:>19.1f} | {tps[1] / tps[0] - 1:>+8.0%}"
        print(line)


if __name__ == "__main__":
    main()
