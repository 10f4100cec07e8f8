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

    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)

    def step_ms(engine, prompts, new: int = args.new_gpu) -> float:
        params = SamplingParams(temperature=0, max_new_tokens=new, ignore_eos=True)
        engine.generate(input_ids=prompts, sampling_params=SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True))
        sync()
        start, steps0 = time.perf_counter(), engine.counters.steps
        engine.generate(input_ids=prompts, sampling_params=params)
        sync()
        return 1e3 * (time.perf_counter() - start) / max(engine.counters.steps - steps0 - 1, 1)  # less the prefill

    cfg = SHAPES[args.shape]
    path = write_shape_dir(args.shape)
    common = dict(dtype="bfloat16" if args.device.startswith("cuda") else "float32", device=args.device,
                  load_format="dummy", page_size=16, max_running_requests=64, speculative_governor=False)
    engine = Engine(EngineConfig(model=path, speculative="ngram", gpu_memory_fraction=0.5, **common))
    g = torch.Generator().manual_seed(0)
    batches = tuple(args.batches)
    prompts = {b: torch.randint(100, cfg["vocab_size"] - 100, (b, args.context), generator=g).tolist() for b in batches}
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    print(f"\n{args.shape}, {common['dtype']}, {name}: ms per step, context ~{args.context}; decode with overlap "
          "scheduling on/off (speculation turns it off); verify k: decode rows (a CUDA graph) / the extend layout")
    print(f"{'batch':>5} | {'decode on/off':>13} | " + " | ".join(f"verify k={k:<7}" for k in range(1, 5)))
    table: dict[int, list[float]] = {}
    for batch in batches:
        times, eager = [], []
        engine.drafter = engine.loop.drafter = None
        engine.loop.overlap = True
        overlap = step_ms(engine, prompts[batch])
        engine.loop.overlap = False
        for k in range(0, 5):
            engine.drafter = engine.loop.drafter = FixedDrafter(max(k, 1), 10_000) if k else None
            engine.drafter and setattr(engine.drafter, "governor", None)
            engine.runner.verify_rows_max = None
            times.append(step_ms(engine, prompts[batch]))
            if k:
                engine.runner.verify_rows_max = 0
                eager.append(step_ms(engine, prompts[batch]))
        table[batch] = [overlap, *times[1:]]  # speedups are against plain decoding as it runs: overlap on
        print(f"{batch:>5} | {overlap:>6.2f}/{times[0]:<6.2f} | "
              + " | ".join(f"{t:>6.2f}/{e:<6.2f}" for t, e in zip(times[1:], eager)))
    print("\nspeedup over plain decoding (overlap on) at a mean accepted length a per verify, best k:")
    print(f"{'batch':>5} | " + " | ".join(f"a={a:<4}" for a in args.accepted))
    for batch, times in table.items():
        cells = []
        for a in args.accepted:
            best = max((1 + min(a, k)) * times[0] / times[k] for k in range(1, 5))
            cells.append(f"{best:>5.2f}x")
        print(f"{batch:>5} | " + " | ".join(cells))
    del engine
    torch.cuda.empty_cache()

    # a draft model of 0.6B shape (Llama-3 vocabulary) against the target: its cost per step
    draft_path = write_shape_dir(args.draft_shape)
    engine = Engine(EngineConfig(model=path, speculative="draft", draft_model=draft_path, gpu_memory_fraction=0.5,
                                 num_speculative_tokens=4, **common))
    engine.drafter.observe_step = lambda req, drafted, accepted: None  # keep k = 4 (random drafts are rejected)
    propose_s = [0.0]
    inner = engine.drafter.propose_all

    def timed_propose(running):
        sync()
        t0 = time.perf_counter()
        inner(running)
        sync()
        propose_s[0] += time.perf_counter() - t0

    engine.drafter.propose_all = timed_propose
    print(f"\ndraft model {args.draft_shape} ({common['dtype']}, decode graphs on CUDA) -> {args.shape}, k = 4: ms per step")
    print(f"{'batch':>5} | {'draft + verify':>14} | {'verify alone':>12} | {'drafting':>8} | {'forwards/step':>13} | "
          f"{'graph replays':>13}")
    graphs = engine.draft.graphs
    for batch in batches:
        f0, s0 = engine.drafter.forwards, engine.counters.steps
        r0 = graphs.num_replays if graphs is not None else 0
        propose_s[0] = 0.0
        total = step_ms(engine, prompts[batch])
        steps = max(engine.counters.steps - s0, 1)
        forwards = (engine.drafter.forwards - f0) / steps
        replays = ((graphs.num_replays if graphs is not None else 0) - r0) / steps
        print(f"{batch:>5} | {total:>14.2f} | {table[batch][4]:>12.2f} | {1e3 * propose_s[0] / steps:>8.2f} | "
              f"{forwards:>13.1f} | {replays:>13.1f}")
    if args.profile_draft:  # where a batch-1 drafting step's host time goes
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.runcall(step_ms, engine, prompts[batches[0]])
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--gpu", action="store_true")
    parser.add_argument("--shape", default="llama8b")
    parser.add_argument("--device", default="cuda", help="--gpu: the device (cpu: a smoke run of the GPU table)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--new-gpu", type=int, default=33, help="--gpu: tokens per timed request")
    parser.add_argument("--draft-shape", default="draft06b")
    parser.add_argument("--profile-draft", action="store_true", help="--gpu: cProfile a draft-model run at the first batch")
    parser.add_argument("--accepted", type=float, nargs="+", default=[0.5, 1.0, 2.0, 3.0],
                        help="mean accepted lengths to turn GPU step costs into speedups (measure them on CPU)")
    args = parser.parse_args()
    gpu(args) if args.gpu else cpu(args)


if __name__ == "__main__":
    main()
