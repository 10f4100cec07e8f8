"""Speculative decoding benchmark (issue #12): accepted length and speedup of each drafter
against plain decoding, in one run.

CPU (default), the real SmolLM2-135M-Instruct, fp32, one engine whose drafter each variant
swaps in (the same cache state before every timed run):
  i   repetitive prompts (lists and patterns to continue), batch 1 and batch 8, greedy
  ii  a second GRPO epoch: the arithmetic prompts of scripts/grpo.py x n = 8 at temperature
      1, the suffix drafter's history warm from the first epoch (the ngram drafter has none);
      point-mass drafts (before) and coupled drafts (the sampler's noise) side by side
then the governor (off / windowed, as before / paired probes) on i batch 1 and ii, and the
drafters' host cost per step at batch 64 (`--host-only`: that alone, no model). Each row
also shows the H200 speedup the verify-step costs in BENCHMARKS.md project at its accepted
length: a projection, not a measurement (rollout/bench/spec.py).
GPU (--gpu): verify-step cost against a decode step on the Llama-3.1-8B shape (random bf16
weights) at batch 1/16/64 for k = 1..4 drafts, and the speedup that gives at an accepted
length measured on the CPU rows.

    python -m scripts.bench_spec [--new 64] [--skip-governor] [--repeats 2]
    python -m scripts.bench_spec --host-only
    python -m scripts.bench_spec --gpu
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Variant:
    label: str
    speculative: str | None  # None: plain decoding
    coupled: bool = True  # False: point-mass drafts (the latest continuation), as before coupling
    governor: str = "paired"  # "paired" (the engine's), "windowed" (the one before it), "off"


@dataclass(frozen=True)
class Row:
    workload: str
    variant: Variant
    seconds: float
    tokens: int
    verify_steps: int
    accepted: int
    drafted: int

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds

    @property
    def accepted_per_verify(self) -> float:
        return self.accepted / self.verify_steps if self.verify_steps else 0.0

    @property
    def accepted_per_step(self) -> float:
        """Per request-step, verifying or not (each emits 1 + its accepted drafts)."""
        return self.accepted / max(self.tokens - self.accepted, 1)


def _drafter(engine, variant: Variant):
    from rollout.bench.spec import WindowedGovernor
    from speculative import make_drafter
    from speculative.governor import SpeedGovernor

    if variant.speculative is None:
        return None
    drafter = make_drafter(dataclasses.replace(engine.config, speculative=variant.speculative), engine.context_len)
    drafter.coupled = variant.coupled
    drafter.governor = {"paired": SpeedGovernor, "windowed": WindowedGovernor, "off": lambda: None}[variant.governor]()
    return drafter


def _measure(engine, workload: str, variant: Variant, prompts, params, warm) -> Row:
    """One timed generate with the variant's drafter, after the same cache state and warm-up
    (or first epoch, which fills the suffix drafter's history) for every variant."""
    engine.drafter = engine.loop.drafter = _drafter(engine, variant)
    engine.flush_cache()
    for w in warm:
        engine.generate(input_ids=w[0], sampling_params=w[1])
    c0 = dataclasses.replace(engine.counters)
    start = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    seconds = time.perf_counter() - start
    c = engine.counters
    return Row(workload, variant, seconds, sum(len(o.token_ids) for o in outs), c.verify_steps - c0.verify_steps,
               c.accepted_tokens - c0.accepted_tokens, c.drafted_tokens - c0.drafted_tokens)


def _print_rows(rows: list[Row]) -> None:
    from rollout.bench.spec import projected_speedup

    print(f"{'workload':<31} | {'drafter':<30} | {'tok/s':>6} | {'speedup':>7} | {'acc/verify':>10} | "
          f"{'accept':>6} | {'acc/step':>8} | {'H200 b1 / b64 (a/verify)':>24} | {'(a/step)':>12}")
    base: dict[str, float] = {}
    for row in rows:
        if row.variant.speculative is None:
            base[row.workload] = row.rate
        a, s = row.accepted_per_verify, row.accepted_per_step
        spec = row.variant.speculative is not None
        proj = f"{projected_speedup(a, 1):.2f}x / {projected_speedup(a, 64):.2f}x" if spec else "-"
        proj_step = f"{projected_speedup(s, 1):.2f}x / {projected_speedup(s, 64):.2f}x" if spec else "-"
        rate = f"{row.accepted / row.drafted:.0%}" if row.drafted else "-"
        print(f"{row.workload:<31} | {row.variant.label:<30} | {row.rate:>6.1f} | {row.rate / base[row.workload]:>6.2f}x | "
              f"{(f'{a:.2f}' if spec else '-'):>10} | {rate:>6} | {(f'{s:.2f}' if spec else '-'):>8} | {proj:>24} | "
              f"{proj_step:>12}")


def cpu(args) -> None:
    from rollout import Engine, EngineConfig, SamplingParams
    from rollout.model.fetch import fetch_default_model
    from rollout.rl.tasks import ArithmeticTask

    path = str(fetch_default_model())
    # one engine; each variant swaps its drafter in (same weights, same cache state per run)
    engine = Engine(EngineConfig(model=path, speculative="suffix", page_size=16))
    tok = engine.tokenizer

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
    greedy = SamplingParams(temperature=0, max_new_tokens=args.new, ignore_eos=True)
    warm_greedy = [(repetitive[:1], SamplingParams(temperature=0, max_new_tokens=4))]
    epoch = [SamplingParams(temperature=1.0, max_new_tokens=args.new, n=8, seed=s) for s in (0, 1)]
    workloads = {  # name -> (prompts, params, warm-up runs)
        "i: repetitive, batch 1": (repetitive[:1], greedy, warm_greedy),
        "i: repetitive, batch 8": (repetitive, greedy, warm_greedy),
        "ii: GRPO epoch 2, 8 x n=8, T=1": (grpo, epoch[1], [(grpo, epoch[0])]),  # epoch 1 fills the history
    }
    none = Variant("none", None)
    # Drafting every step (governor off), so acceptance is the drafts' own, not the
    # governor's timing-dependent choices; greedy requests draft the latest continuation
    # either way, so one variant per drafter there.
    greedy_variants = [none, Variant("ngram", "ngram", governor="off"), Variant("suffix", "suffix", governor="off")]
    sampled_variants = [none, Variant("ngram point (before)", "ngram", coupled=False, governor="off"),
                        Variant("ngram coupled", "ngram", governor="off"),
                        Variant("suffix point (before)", "suffix", coupled=False, governor="off"),
                        Variant("suffix coupled", "suffix", governor="off")]
    rows = []
    for name, (prompts, params, warm) in workloads.items():
        variants = sampled_variants if params.temperature > 0 else greedy_variants
        rows += _best_of(engine, name, variants, prompts, params, warm, args.repeats)
    print(f"\nSmolLM2-135M-Instruct, fp32, CPU ({torch.get_num_threads()} threads), up to {args.new} new tokens, "
          f"best of {args.repeats}, drafting every step (governor off); the H200 columns are a projection from "
          "BENCHMARKS' verify-step costs, not a measurement (rollout/bench/spec.py)")
    _print_rows(rows)

    if not args.skip_governor:  # the governor on the good case and the poor one: off / before / now
        grows = []
        for name in ("i: repetitive, batch 1", "ii: GRPO epoch 2, 8 x n=8, T=1"):
            prompts, params, warm = workloads[name]
            variants = [none] + [Variant(f"{d}, governor {g}", d, governor=g) for d in ("ngram", "suffix")
                                 for g in ("off", "windowed", "paired")]
            grows += _best_of(engine, name, variants, prompts, params, warm, args.repeats)
        print(f"\ngovernor: off (always draft), windowed (16-step windows, before), paired (probes, now); coupled "
              f"drafts; best of {args.repeats}")
        _print_rows(grows)
    coverage(engine, grpo, epoch)
    host(args)


def coverage(engine, prompts, epochs) -> None:
    """Where epoch 2's acceptance goes: one draft at every position from the true context."""
    from rollout.bench.spec import Sample, draft_coverage
    from rollout.request import derive_seed

    engine.drafter = engine.loop.drafter = None
    engine.flush_cache()
    first, second = ([Sample(o.prompt_ids, o.token_ids, derive_seed(p.seed, o.sample_index))
                      for o in engine.generate(input_ids=prompts, sampling_params=p)] for p in epochs)
    c = draft_coverage(first, second, epochs[1].temperature)

    def share(n: int) -> str:
        return f"{n / c.positions:.1%}"

    print(f"\nii, one suffix draft at each of epoch 2's {c.positions} positions after the first, from the true "
          f"context (siblings in lockstep): a suffix of >= 2 tokens matched at {share(c.matched)}, the token drawn "
          f"was among the counted continuations at {share(c.in_support)}; the coupled draft was the draw at "
          f"{share(c.coupled)}, the point-mass draft at {share(c.point)}")


def _best_of(engine, name: str, variants: list[Variant], prompts, params, warm, repeats: int) -> list[Row]:
    """Each variant `repeats` times, interleaved (load from other jobs hits them alike); the
    fastest run of each is kept (a shared machine only ever slows a run down)."""
    runs: dict[Variant, list[Row]] = {v: [] for v in variants}
    for _ in range(repeats):
        for variant in variants:
            runs[variant].append(_measure(engine, name, variant, prompts, params, warm))
            print(f"  {name} / {variant.label}: {runs[variant][-1].rate:.1f} tok/s", flush=True)
    return [max(r, key=lambda row: row.rate) for r in runs.values()]


def host(args) -> None:
    """The drafters' host work per step at batch 64 (8 prompts x 8 samples, 16 earlier
    responses each, no model): it runs in series with the device while speculating."""
    from rollout.bench.spec import host_cost
    from speculative.ngram import NgramDrafter
    from speculative.suffix import SuffixDrafter

    print("\ndrafter host cost per step, batch 64 = 8 prompts x 8 samples, 16 earlier responses per prompt "
          "(prompts 200 tokens, responses 256, samples half way; a synthetic policy, temperature 1)")
    print(f"{'drafter':<16} | {'ms/step':>7} | {'drafted/step':>12} | {'acc/verify':>10}")
    for label, make in (("ngram point", lambda: NgramDrafter(4, 1 << 20, coupled=False)),
                        ("ngram coupled", lambda: NgramDrafter(4, 1 << 20)),
                        ("suffix point", lambda: SuffixDrafter(4, 1 << 20, 4_000_000, coupled=False)),
                        ("suffix coupled", lambda: SuffixDrafter(4, 1 << 20, 4_000_000))):
        cost = host_cost(make, steps=args.host_steps)
        print(f"{label:<16} | {cost.ms_per_step:>7.2f} | {cost.drafted_per_step:>12.1f} | {cost.accepted_per_verify:>10.2f}")


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
    ks = range(1, args.max_k + 1)
    print(f"{'batch':>5} | {'decode on/off':>13} | " + " | ".join(f"verify k={k:<7}" for k in ks))
    table: dict[int, list[float]] = {}
    for batch in batches:
        times, eager = [], []
        engine.drafter = engine.loop.drafter = None
        engine.loop.overlap = True
        overlap = step_ms(engine, prompts[batch])
        engine.loop.overlap = False
        for k in range(0, args.max_k + 1):
            engine.drafter = engine.loop.drafter = FixedDrafter(max(k, 1), 10_000) if k else None
            engine.drafter and setattr(engine.drafter, "governor", None)
            engine.runner.verify_rows_max = None
            times.append(step_ms(engine, prompts[batch]))
            if k:
                engine.runner.verify_rows_max = 0
                eager.append(step_ms(engine, prompts[batch]) if args.eager else float("nan"))
        table[batch] = [overlap, *times[1:]]  # speedups are against plain decoding as it runs: overlap on
        print(f"{batch:>5} | {overlap:>6.2f}/{times[0]:<6.2f} | "
              + " | ".join(f"{t:>6.2f}/{e:<6.2f}" for t, e in zip(times[1:], eager)))
    print("\nspeedup over plain decoding (overlap on) at a mean accepted length a per verify, best k:")
    print(f"{'batch':>5} | " + " | ".join(f"a={a:<4}" for a in args.accepted))
    for batch, times in table.items():
        cells = []
        for a in args.accepted:
            best = max((1 + min(a, k)) * times[0] / times[k] for k in ks)
            cells.append(f"{best:>5.2f}x")
        print(f"{batch:>5} | " + " | ".join(cells))
    del engine
    torch.cuda.empty_cache()
    if not args.draft_model:
        return

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


@dataclass
class EpochRow:
    epoch: int
    reward: float  # the spec rollout's mean reward (the trainer's step)
    length: float  # mean response tokens
    plain_s: float
    spec_s: float
    tokens: int
    same_tokens: bool  # the spec rollout's tokens equal the plain one's (same seeds: they must)
    verifies: int
    accepted: int
    drafted: int


def grpo_epochs(args) -> None:
    """iii: GRPO as it runs: a dataset of --dataset-size arithmetic prompts walked epoch after
    epoch (8 prompts x n = 8 per step, temperature 1), the policy trained after every step
    and synced into the engine, the suffix drafter's history kept across the updates. Each
    step's rollout runs twice with the trainer's seeds, from a flushed prefix cache: plain
    decoding, then speculation (drafts from earlier epochs and the running siblings), which
    the trainer then trains on. Seeded verification emits the same tokens as plain decoding,
    so the two runs produce the same tokens and only their time differs. --governor off (the
    default) drafts every step, so the acceptance is the drafts' own and projects to the
    H200; on this CPU, compute-bound at 64 rows, the engine's governor (--governor on) would
    mostly turn drafting off, and its acceptance would say little about a GPU."""
    from rollout import Engine, EngineConfig, SamplingParams
    from rollout.bench.spec import projected_speedup
    from rollout.model.fetch import fetch_default_model
    from rollout.rl import ArithmeticTask, Epochs, GRPOConfig, GRPOTrainer, load_policy
    from rollout.rl.grpo import sample_seed

    path = str(fetch_default_model())
    engine = Engine(EngineConfig(model=path, speculative="suffix", page_size=16, seed=0,
                                 speculative_governor=args.governor == "on"))
    task = Epochs(ArithmeticTask(seed=0, system_prompt="Answer briefly."), args.dataset_size)
    config = GRPOConfig(prompts_per_step=8, samples_per_prompt=8, max_new_tokens=args.new, temperature=1.0,
                        lr=args.lr, seed=0, samples_every=0)
    trainer = GRPOTrainer(engine, load_policy(path), task, config)
    steps_per_epoch = -(-args.dataset_size // config.prompts_per_step)
    generate = engine.generate
    spec_outputs: list = []

    def keep_outputs(*a, **kw):  # the trainer's rollout: kept to compare with the plain one
        spec_outputs[:] = generate(*a, **kw)
        return spec_outputs

    engine.generate = keep_outputs
    rows = []
    traces = []
    for step in range(args.epochs * steps_per_epoch):
        if step % steps_per_epoch == 0 and step and len(traces) < args.batch1_epochs:
            traces.append(_batch1_trace(engine, generate, task, step, step // steps_per_epoch + 1, args.new,
                                         args.batch1_samples))
        problems = task.problems(step, config.prompts_per_step)
        prompts = [task.prompt_ids(p, engine.tokenizer) for p in problems]
        params = [SamplingParams(temperature=1.0, max_new_tokens=args.new, n=8, seed=sample_seed(0, step, i))
                  for i in range(len(prompts))]
        drafter = engine.drafter
        engine.drafter = engine.loop.drafter = None  # plain decoding: no drafts, the history untouched
        engine.flush_cache()
        start = time.perf_counter()
        plain = generate(input_ids=prompts, sampling_params=params)
        plain_s = time.perf_counter() - start
        engine.drafter = engine.loop.drafter = drafter
        engine.flush_cache()
        c0 = dataclasses.replace(engine.counters)
        record = trainer.step(step)
        c = engine.counters
        same = sorted((o.prompt_index, o.sample_index, o.token_ids) for o in plain) == \
            sorted((o.prompt_index, o.sample_index, o.token_ids) for o in spec_outputs)
        rows.append(EpochRow(step // steps_per_epoch + 1, record["critic/rewards/mean"], record["response_length/mean"],
                             plain_s, record["timing_s/gen"], record["rollout/tokens"], same,
                             c.verify_steps - c0.verify_steps, c.accepted_tokens - c0.accepted_tokens,
                             c.drafted_tokens - c0.drafted_tokens))
        r = rows[-1]
        print(f"  step {step + 1} (epoch {r.epoch}): reward {r.reward:.3f}, {r.length:.1f} tokens, plain {r.plain_s:.2f} s, "
              f"spec {r.spec_s:.2f} s, accepted {r.accepted}/{r.drafted} in {r.verifies} verifies, same tokens {r.same_tokens}",
              flush=True)
    print(f"\niii: GRPO epochs on SmolLM2-135M-Instruct, fp32, CPU ({torch.get_num_threads()} threads): a dataset of "
          f"{args.dataset_size} arithmetic prompts, 8 x n=8 per step, T=1, up to {args.new} new tokens, full fine-tuning "
          f"(lr {args.lr}) and a sync after every step; suffix drafter, governor {args.governor}, history kept across "
          "updates")
    print(f"{'step':>4} | {'epoch':>5} | {'reward':>6} | {'len':>5} | {'plain tok/s':>11} | {'spec tok/s':>10} | "
          f"{'speedup':>7} | {'same':>4} | {'acc/verify':>10} | {'accept':>6} | {'acc/step':>8} | "
          f"{'H200 b1 / b64 (a/verify)':>24} | {'(a/step)':>12}")
    for i, r in enumerate(rows):
        a = r.accepted / r.verifies if r.verifies else 0.0
        s = r.accepted / max(r.tokens - r.accepted, 1)
        rate = f"{r.accepted / r.drafted:.0%}" if r.drafted else "-"
        print(f"{i + 1:>4} | {r.epoch:>5} | {r.reward:>6.3f} | {r.length:>5.1f} | {r.tokens / r.plain_s:>11.1f} | "
              f"{r.tokens / r.spec_s:>10.1f} | {r.plain_s / r.spec_s:>6.2f}x | {'yes' if r.same_tokens else 'NO':>4} | "
              f"{a:>10.2f} | {rate:>6} | {s:>8.2f} | "
              f"{projected_speedup(a, 1):>10.2f}x / {projected_speedup(a, 64):.2f}x | "
              f"{projected_speedup(s, 1):.2f}x / {projected_speedup(s, 64):.2f}x")
    from rollout.bench.spec import batch1_trace_speedup

    for t in traces:
        a = t.accepted / max(len(t.verifies), 1)
        print(f"\nbatch 1 at the start of epoch {t.epoch}: {t.samples} samples alone, {t.tokens} tokens after the first, "
              f"{len(t.verifies)} verify steps ({a:.2f} accepted each, drafts {sum(t.verifies)}, accepted {t.accepted}) "
              f"+ {t.plain_steps} steps without drafts = {len(t.verifies) + t.plain_steps} steps against {t.tokens}: "
              f"{t.tokens / max(len(t.verifies) + t.plain_steps, 1):.2f} tokens a step; H200 batch-1 decode speedup from "
              f"the step trace: {batch1_trace_speedup(list(t.verifies), t.plain_steps, t.tokens):.2f}x")
    print("\nper epoch (its steps summed):")
    for epoch in sorted({r.epoch for r in rows}):
        mine = [r for r in rows if r.epoch == epoch]
        tokens, accepted, verifies = (sum(getattr(r, f) for r in mine) for f in ("tokens", "accepted", "verifies"))
        drafted = sum(r.drafted for r in mine)
        plain_s, spec_s = sum(r.plain_s for r in mine), sum(r.spec_s for r in mine)
        a, s = accepted / max(verifies, 1), accepted / max(tokens - accepted, 1)
        print(f"  epoch {epoch}: reward {sum(r.reward for r in mine) / len(mine):.3f}, "
              f"{tokens / (64 * len(mine)):.1f} tokens a sample, CPU speedup {plain_s / spec_s:.2f}x, "
              f"accepted {accepted}/{drafted} ({accepted / max(drafted, 1):.0%}) in {verifies} verifies: "
              f"{a:.2f} per verify, {s:.2f} per request-step; H200 projection b1 / b64: "
              f"{projected_speedup(a, 1):.2f}x / {projected_speedup(a, 64):.2f}x (a/verify), "
              f"{projected_speedup(s, 1):.2f}x / {projected_speedup(s, 64):.2f}x (a/step); "
              f"same tokens as plain: {all(r.same_tokens for r in mine)}")


@dataclass(frozen=True)
class Batch1Trace:
    epoch: int
    samples: int
    tokens: int  # emitted after each sample's first (prefill) token
    verifies: tuple[int, ...]  # drafts checked by each verify step
    accepted: int
    plain_steps: int  # steps that drafted nothing


def _batch1_trace(engine, generate, task, step: int, epoch: int, new: int, samples: int) -> Batch1Trace:
    """Batch 1 at the start of an epoch: the step's first samples, each alone (no running
    siblings), drafting from a copy of the history (earlier epochs only; the real one is left
    as it was). Each engine step is then one request's, and its drafts say what it cost."""
    import copy

    from rollout import SamplingParams
    from rollout.rl.grpo import sample_seed

    drafter = engine.drafter
    engine.drafter = engine.loop.drafter = trial = copy.deepcopy(drafter)
    verifies: list[int] = []
    inner = trial.observe_step

    def record(req, drafted, accepted):
        verifies.append(drafted)
        inner(req, drafted, accepted)

    trial.observe_step = record
    tokens = accepted = 0
    problems = task.problems(step, 8)
    for i in range(samples):
        prompt = task.prompt_ids(problems[i % len(problems)], engine.tokenizer)
        c0 = engine.counters.accepted_tokens
        engine.flush_cache()
        (out,) = generate(input_ids=[prompt], sampling_params=SamplingParams(
            temperature=1.0, max_new_tokens=new, seed=sample_seed(1, step, i)))
        tokens += len(out.token_ids) - 1
        accepted += engine.counters.accepted_tokens - c0
    engine.drafter = engine.loop.drafter = drafter
    plain = tokens - accepted - len(verifies)  # each verify emits its accepted drafts + 1
    return Batch1Trace(epoch, samples, tokens, tuple(verifies), accepted, plain)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2, help="CPU: timed runs per variant (the fastest is kept)")
    parser.add_argument("--skip-governor", action="store_true", help="CPU: leave out the governor comparison")
    parser.add_argument("--host-only", action="store_true", help="only the drafters' host cost (no model)")
    parser.add_argument("--host-steps", type=int, default=64)
    parser.add_argument("--grpo-epochs", action="store_true",
                        help="iii only: GRPO epochs over one dataset with training between them, plain vs speculative")
    parser.add_argument("--epochs", type=int, default=6, help="--grpo-epochs: epochs to run")
    parser.add_argument("--dataset-size", type=int, default=8, help="--grpo-epochs: prompts in the dataset")
    parser.add_argument("--lr", type=float, default=1e-5, help="--grpo-epochs: the trainer's learning rate")
    parser.add_argument("--batch1-samples", type=int, default=32,
                        help="--grpo-epochs: samples run alone at the start of each later epoch (the batch-1 trace)")
    parser.add_argument("--batch1-epochs", type=int, default=1, help="--grpo-epochs: epochs (from the second) traced")
    parser.add_argument("--governor", choices=("off", "on"), default="off",
                        help="--grpo-epochs: off drafts every step (the drafts' own acceptance)")
    parser.add_argument("--gpu", action="store_true")
    parser.add_argument("--shape", default="llama8b")
    parser.add_argument("--device", default="cuda", help="--gpu: the device (cpu: a smoke run of the GPU table)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--new-gpu", type=int, default=33, help="--gpu: tokens per timed request")
    parser.add_argument("--draft-shape", default="draft06b")
    parser.add_argument("--max-k", type=int, default=4, help="--gpu: verify k = 1..this many drafts")
    parser.add_argument("--no-eager", dest="eager", action="store_false", help="--gpu: leave out the extend-layout column")
    parser.add_argument("--no-draft-model", dest="draft_model", action="store_false",
                        help="--gpu: leave out the 0.6B draft model's table")
    parser.add_argument("--profile-draft", action="store_true", help="--gpu: cProfile a draft-model run at the first batch")
    parser.add_argument("--accepted", type=float, nargs="+", default=[0.5, 1.0, 2.0, 3.0],
                        help="mean accepted lengths to turn GPU step costs into speedups (measure them on CPU)")
    args = parser.parse_args()
    if args.host_only:
        host(args)
    elif args.grpo_epochs:
        grpo_epochs(args)
    else:
        gpu(args) if args.gpu else cpu(args)


if __name__ == "__main__":
    main()
