"""Speculative decoding benchmark (issue #12): accepted length and speedup of each drafter
against plain decoding, in one run.

CPU (default), the real SmolLM2-135M-Instruct, fp32:
  i   repetitive prompts (lists and patterns to continue), batch 1 and batch 8, greedy
  ii  a second GRPO epoch: the arithmetic prompts of scripts/grpo.py x n = 8 at temperature
      1, the suffix drafter's history warm from the first epoch (the ngram drafter has none)
GPU (--gpu): verify-step cost against a decode step on the Llama-3.1-8B shape (random bf16
weights) at batch 1/16/64 for k = 1..4 drafts, and the speedup that gives at an accepted
length measured on the CPU rows.

    python -m scripts.bench_spec [--new 64]
    python -m scripts.bench_spec --gpu
"""

from __future__ import annotations

import argparse
import time

import torch


def _run(engine, prompts, params) -> tuple[float, int, list]:
    start = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    return time.perf_counter() - start, sum(len(o.token_ids) for o in outs), outs


def cpu(args) -> None:
    from rollout import Engine, EngineConfig, SamplingParams
    from rollout.model.fetch import fetch_default_model
    from rollout.rl.tasks import ArithmeticTask

    path = str(fetch_default_model())
    engines = {name: Engine(EngineConfig(model=path, speculative=name, page_size=16)) for name in (None, "ngram", "suffix")}
    tok = engines[None].tokenizer

    def chat(text: str) -> list[int]:
        return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                  tokenize=False))

    repetitive = [chat(t) for t in (
        "Write the numbers from 1 to 40 separated by commas.",
        "Repeat this line five times: the quick brown fox jumps over the lazy dog.",
        "Write a Python function that returns the list [0, 1, 2, 3, 4, 5, 6, 7, 8, 9] squared, element by element.",
        "List the days of the week, then list them again in the same order.",
        "Count down from 30 to 1, one number per line.",
        "Write the alphabet in capital letters, separated by spaces, twice.",
        "Write 'hello world' ten times, one per line.",
        "Spell the word 'banana' letter by letter, three times.",
    )]
    task = ArithmeticTask(seed=0)
    grpo = [task.prompt_ids(problem, tok) for problem in task.problems(0, 8)]
    rows = []
    greedy = SamplingParams(temperature=0, max_new_tokens=args.new, ignore_eos=True)
    for label, prompts in (("i: repetitive, batch 1", repetitive[:1]), ("i: repetitive, batch 8", repetitive)):
        for name, engine in engines.items():
            engine.generate(input_ids=prompts[:1], sampling_params=SamplingParams(temperature=0, max_new_tokens=4))
            c0 = dict(vars(engine.counters))
            secs, toks, outs = _run(engine, prompts, greedy)
            rows.append((label, name, secs, toks, engine.counters, c0))
    grpo_params = SamplingParams(temperature=1.0, max_new_tokens=args.new, n=8, seed=0)
    for name, engine in engines.items():
        _run(engine, grpo, grpo_params)  # epoch 1: the suffix drafter's history fills
        c0 = dict(vars(engine.counters))
        secs, toks, _ = _run(engine, grpo, SamplingParams(temperature=1.0, max_new_tokens=args.new, n=8, seed=1))
        rows.append(("ii: GRPO epoch 2, 8 x n=8, T=1", name, secs, toks, engine.counters, c0))

    print(f"\nSmolLM2-135M-Instruct, fp32, CPU ({torch.get_num_threads()} threads), up to {args.new} new tokens")
    print(f"{'workload':<32} | {'drafter':<7} | {'tok/s':>7} | {'speedup':>7} | {'accepted/verify':>15} | {'accept rate':>11}")
    base: dict[str, float] = {}
    for label, name, secs, toks, c, c0 in rows:
        rate = toks / secs
        if name is None:
            base[label] = rate
        verifies = c.verify_steps - c0["verify_steps"]
        accepted = c.accepted_tokens - c0["accepted_tokens"]
        drafted = c.drafted_tokens - c0["drafted_tokens"]
        print(f"{label:<32} | {str(name):<7} | {rate:>7.1f} | {rate / base[label]:>6.2f}x | "
              f"{(accepted / verifies if verifies else 0):>15.2f} | {(accepted / drafted if drafted else 0):>10.0%}")


def gpu(args) -> None:
    from rollout import Engine, EngineConfig, SamplingParams
    from rollout.model.shapes import SHAPES, write_shape_dir
    from speculative.base import Drafter

    class FixedDrafter(Drafter):  # k tokens every step (their values do not change the cost)
        def propose(self, req, k):
            return [1] * k

        def observe_step(self, req, drafted, accepted):
            pass

    cfg = SHAPES[args.shape]
    path = write_shape_dir(args.shape)
    engine = Engine(EngineConfig(model=path, dtype="bfloat16", device="cuda", load_format="dummy", page_size=16,
                                 speculative="ngram", gpu_memory_fraction=0.6))
    g = torch.Generator().manual_seed(0)
    print(f"\n{args.shape}, bf16, {torch.cuda.get_device_name()}: ms per step, context ~512")
    print(f"{'batch':>5} | {'decode':>7} | " + " | ".join(f"verify k={k}" for k in range(1, 5)))
    for batch in (1, 16, 64):
        prompts = torch.randint(100, cfg["vocab_size"] - 100, (batch, 512), generator=g).tolist()
        times = []
        for k in range(0, 5):
            engine.drafter = engine.loop.drafter = FixedDrafter(max(k, 1), 10_000) if k else None
            engine.generate(input_ids=prompts, sampling_params=SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True))
            torch.cuda.synchronize()
            start, steps0 = time.perf_counter(), engine.counters.steps
            engine.generate(input_ids=prompts, sampling_params=SamplingParams(temperature=0, max_new_tokens=33, ignore_eos=True))
            torch.cuda.synchronize()
            steps = engine.counters.steps - steps0 - 1  # the prefill step
            times.append(1e3 * (time.perf_counter() - start) / max(steps, 1))
        print(f"{batch:>5} | {times[0]:>7.2f} | " + " | ".join(f"{t:>10.2f}" for t in times[1:]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--gpu", action="store_true")
    parser.add_argument("--shape", default="llama8b")
    args = parser.parse_args()
    gpu(args) if args.gpu else cpu(args)


if __name__ == "__main__":
    main()
