"""benchmarks.spec's workload iii (benchmarks/spec.py --grpo-epochs): GRPO epochs over one
dataset with the policy trained between them, every step's rollout run plain and with the
suffix drafter (the same tokens: verification is exact), and a batch-1 step trace whose
drafts the H200 verify-cost table turns into a decode speedup (benchmarks/common/spec.py)."""

from __future__ import annotations

import copy
import dataclasses
import time
from dataclasses import dataclass

import torch


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
    from rollout.kernels.options import KernelOptions
    from benchmarks.common.spec import batch1_trace_speedup, plain_decoding, projected_speedup, tree_trace_speedup
    from benchmarks.common.spec_tree import ahead_summary, batch1_ahead_trace, batch1_tree_trace, plain_futures
    from benchmarks.common.spec_tree import summary as tree_summary
    from rollout.model.fetch import fetch_default_model
    from rollout.rl import ArithmeticTask, Epochs, GRPOConfig, GRPOTrainer, load_policy
    from rollout.rl.grpo import sample_seed

    path = str(fetch_default_model())
    engine = Engine(EngineConfig(model=path, speculative="suffix", page_size=16, seed=0,
                                 num_speculative_tokens=args.k, speculative_governor=args.governor == "on",
                                 speculative_cross_prompt=args.cross_prompt == "on",
                                 kernel_options=KernelOptions(small_decode_rows=args.small_decode_rows)))
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
    tree_traces = []
    ahead_traces = []
    for step in range(args.epochs * steps_per_epoch):
        if step % steps_per_epoch == 0 and 0 < step // steps_per_epoch <= args.batch1_epochs:
            for k in args.batch1_k or [args.k]:
                for adapt in (True, False) if args.batch1_fixed else (True,):
                    traces.append(_batch1_trace(engine, generate, task, step, step // steps_per_epoch + 1, args.new,
                                                args.batch1_samples, k, adapt))
                    print(f"  chain trace k <= {k}, adapt {adapt}: {len(traces[-1].verifies)} verifies, "
                          f"{traces[-1].accepted} accepted, {traces[-1].plain_steps} steps without drafts", flush=True)
                for nodes in args.batch1_tree or []:
                    for fallback in sorted({0, args.batch1_tree_fallback}) if nodes else (0,):
                        tree_traces.append(batch1_tree_trace(engine, generate, task, step, step // steps_per_epoch + 1,
                                                             args.new, args.batch1_samples, k, nodes, fallback))
                        print("  " + tree_summary(tree_traces[-1]), flush=True)
                if args.batch1_ahead:
                    futures = [f for at in range(step, step + args.batch1_steps)  # (all from this epoch's first policy)
                               for f in plain_futures(engine, generate, task, at, args.new, args.batch1_samples)]
                    for nodes in args.batch1_ahead:
                        for mode in ["drain"] + [f"{m}:{e}" for e in args.batch1_ahead_least
                                                 for m in ("ahead", "ahead-drain")]:
                            ahead_traces.append(batch1_ahead_trace(engine.speculation.drafter, futures, k, nodes, mode))
                            print("  " + ahead_summary(ahead_traces[-1]), flush=True)
        problems = task.problems(step, config.prompts_per_step)
        prompts = [task.prompt_ids(p, engine.tokenizer) for p in problems]
        params = [SamplingParams(temperature=1.0, max_new_tokens=args.new, n=8, seed=sample_seed(0, step, i))
                  for i in range(len(prompts))]
        with plain_decoding(engine):  # no drafts, the history untouched
            engine.flush_cache()
            start = time.perf_counter()
            plain = generate(input_ids=prompts, sampling_params=params)
            plain_s = time.perf_counter() - start
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
          f"(lr {args.lr}) and a sync after every step; suffix drafter, k <= {args.k}, governor {args.governor}, history "
          f"kept across updates, other prompts' rollouts drafting {args.cross_prompt}")
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
    for t in traces:
        a = t.accepted / max(len(t.verifies), 1)
        held = "" if t.adapt else " (draft lengths held at k)"
        print(f"\nbatch 1 at the start of epoch {t.epoch}, k <= {t.k}{held}: {t.samples} samples alone, {t.tokens} tokens after the first, "
              f"{len(t.verifies)} verify steps ({a:.2f} accepted each, drafts {sum(t.verifies)}, accepted {t.accepted}) "
              f"+ {t.plain_steps} steps without drafts = {len(t.verifies) + t.plain_steps} steps against {t.tokens}: "
              f"{t.tokens / max(len(t.verifies) + t.plain_steps, 1):.2f} tokens a step; H200 batch-1 decode speedup from "
              f"the step trace: {batch1_trace_speedup(list(t.verifies), t.plain_steps, t.tokens):.2f}x without "
              f"overlap in them; {t.overlapped} of them overlapped, {t.drains} drains: "
              f"{batch1_trace_speedup(list(t.verifies), t.plain_steps, t.tokens, t.overlapped, t.drains + t.samples):.2f}x")
    for t in tree_traces:
        print(f"\n{tree_summary(t)}; H200 batch-1 decode speedup (steps without a tree overlapped / not): "
              f"{tree_trace_speedup(t.steps, t.plain_steps, t.tokens, True):.2f}x / "
              f"{tree_trace_speedup(t.steps, t.plain_steps, t.tokens, False):.2f}x")
    for t in ahead_traces:
        print(f"\n{ahead_summary(t)}")
    if args.batch1_save and ahead_traces:  # to re-cost on another machine's step table (spec.ahead_trace_speedup)
        import json

        with open(args.batch1_save, "w") as f:
            json.dump([dataclasses.asdict(t) for t in ahead_traces], f)
        print(f"ahead traces written to {args.batch1_save}")
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
    k: int
    samples: int
    tokens: int  # emitted after each sample's first (prefill) token
    verifies: tuple[int, ...]  # drafts checked by each verify step
    accepted: int
    plain_steps: int  # steps that drafted nothing
    adapt: bool  # draft lengths adapted to acceptance (the drafter's policy), else held at k
    overlapped: int = 0  # ... of those, steps that ran overlapped (overlap forced on, as on CUDA)
    drains: int = 0  # steps that waited for an overlapped step before drafting


def _batch1_trace(engine, generate, task, step: int, epoch: int, new: int, samples: int, k: int,
                  adapt: bool = True) -> Batch1Trace:
    """Batch 1 at the start of an epoch: the step's first samples, each alone (no running
    siblings), drafting from a copy of the history (earlier epochs only; the real one is left
    as it was). Each engine step is then one request's, and its drafts say what it cost.
    adapt=False holds every request's draft length at k (no shrinking, no pause after
    rejections)."""
    from rollout import SamplingParams
    from rollout.rl.grpo import sample_seed

    from benchmarks.common.spec import speculator, use_speculation

    spec = engine.speculation
    trial = copy.deepcopy(spec.drafter)
    trial.max_tokens = k  # at most the engine's k (its graphs hold requests x (1 + k) rows)
    verifies: list[int] = []
    inner = trial.observe_step

    def record(req, drafted, accepted):
        verifies.append(drafted)
        if adapt:
            inner(req, drafted, accepted)

    trial.observe_step = record
    old = use_speculation(engine, speculator(engine, trial, copy.deepcopy(spec.governor), spec.tree_nodes))
    overlap_plain, engine.loop.overlap = engine.loop.overlap, True  # plain steps overlap, as CUDA runs them
    counted = dataclasses.replace(engine.counters)
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
    use_speculation(engine, old)
    engine.loop.overlap = overlap_plain
    c = engine.counters
    plain = tokens - accepted - len(verifies)  # each verify emits its accepted drafts + 1
    return Batch1Trace(epoch, k, samples, tokens, tuple(verifies), accepted, plain, adapt,
                       c.spec_overlapped_steps - counted.spec_overlapped_steps, c.spec_drains - counted.spec_drains)
