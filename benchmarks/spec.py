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
length: a projection, not a measurement (benchmarks/common/spec.py).
iii (--grpo-epochs, on its own): GRPO epochs over one dataset with training between them, each
step's rollout plain and speculative (benchmarks/common/spec_grpo.py), and a batch-1 step trace.
GPU (--gpu): verify-step cost against a decode step on the Llama-3.1-8B shape (random bf16
weights) at batch 1/16/64 for k = 1..4 drafts, and the speedup that gives at an accepted
length measured on the CPU rows.

    python -m benchmarks.spec [--new 64] [--skip-governor] [--repeats 2]
    python -m benchmarks.spec --host-only
    python -m benchmarks.spec --grpo-epochs [--dataset-size 64 --epochs 2 --k 8 --batch1-k 4 8]
    python -m benchmarks.spec --gpu [--batches 1 64 --max-k 8 --no-eager --no-draft-model]
    python -m benchmarks.spec --gpu --batches 1 --profile-verify 4 [--profile-host 30]
        (where a verify step's time goes against a decode step: benchmarks/common/spec_profile.py)
    python -m benchmarks.spec --gpu-governor [--batches 1 64 --new-gpu 129]
        (poor and good drafts under the governor against plain: benchmarks/common/spec_governor.py)
--small-decode-rows R (any engine it builds) sets KernelOptions.small_decode_rows: decode graphs
of at most R rows attend with the Triton kernel.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rollout.kernels.options import KernelOptions


def kernel_options(args: argparse.Namespace) -> KernelOptions:
    """The KernelOptions of every engine a run builds (--small-decode-rows)."""
    return KernelOptions(small_decode_rows=args.small_decode_rows)


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


def _speculator(engine, variant: Variant):
    from benchmarks.common.spec import WindowedGovernor, speculator
    from speculative import make_drafter
    from speculative.governor import SpeedGovernor

    if variant.speculative is None:
        return None
    drafter = make_drafter(dataclasses.replace(engine.config, speculative=variant.speculative), engine.context_len)
    drafter.coupled = variant.coupled
    paired = lambda: SpeedGovernor(blocks=engine.config.overlap_plain)  # noqa: E731 (as make_speculator builds it)
    governor = {"paired": paired, "windowed": WindowedGovernor, "off": lambda: None}[variant.governor]()
    return speculator(engine, drafter, governor)


def _use(engine, spec) -> None:
    """The variant's speculator in the engine (None: plain decoding, as the speculative engine
    runs it without drafts: overlap as EngineConfig.overlap says)."""
    from benchmarks.common.spec import use_speculation
    from rollout.core.hooks import NO_SPECULATION

    use_speculation(engine, NO_SPECULATION if spec is None else spec)
    engine.loop.overlap = engine.config.overlap if spec is None else engine.config.overlap_plain


def _measure(engine, workload: str, variant: Variant, prompts, params, warm) -> Row:
    """One timed generate with the variant's drafter, after the same cache state and warm-up
    (or first epoch, which fills the suffix drafter's history) for every variant."""
    _use(engine, _speculator(engine, variant))
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
    from benchmarks.common.spec import projected_speedup

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
          "BENCHMARKS' verify-step costs, not a measurement (benchmarks/common/spec.py)")
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
    from benchmarks.common.spec import Sample, draft_coverage
    from rollout.request import derive_seed

    _use(engine, None)
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
    """The drafters' host work per step at batch 64 (8 prompts x 8 samples, --host-history
    earlier responses each, 16 by default; no model): it runs in series with the device
    while speculating."""
    from benchmarks.common.spec import host_cost
    from speculative.ngram import NgramDrafter
    from speculative.suffix import SuffixDrafter

    print(f"\ndrafter host cost per step, batch 64 = 8 prompts x 8 samples, {args.host_history} earlier responses "
          "per prompt (prompts 200 tokens, responses 256, samples half way; a synthetic policy, temperature 1)")
    print(f"{'drafter':<16} | {'ms/step':>7} | {'drafted/step':>12} | {'acc/verify':>10}")
    for label, make in (("ngram point", lambda: NgramDrafter(4, 1 << 20, coupled=False)),
                        ("ngram coupled", lambda: NgramDrafter(4, 1 << 20)),
                        ("suffix point", lambda: SuffixDrafter(4, 1 << 20, 4_000_000, coupled=False)),
                        ("suffix coupled", lambda: SuffixDrafter(4, 1 << 20, 4_000_000))):
        cost = host_cost(make, history=args.host_history, steps=args.host_steps)
        print(f"{label:<16} | {cost.ms_per_step:>7.2f} | {cost.drafted_per_step:>12.1f} | {cost.accepted_per_verify:>10.2f}")


def gpu(args) -> None:
    from rollout import Engine, EngineConfig, SamplingParams
    from benchmarks.common.spec import speculator
    from rollout.model.shapes import SHAPES, write_shape_dir
    from speculative.base import Drafter
    from speculative.speculator import Speculator

    class FixedDrafter(Drafter):  # k tokens every step (their values do not change the cost)
        def propose(self, req, k):
            return [1] * k

        def observe_step(self, req, drafted, accepted):
            pass

    def fixed(k: int) -> Speculator:  # k drafts every step, no governor to turn them off
        return speculator(engine, FixedDrafter(k, 10_000))

    class FixedTree(FixedDrafter):  # a tree of `tree_nodes` nodes every step: a chain of k, then children along it
        def propose_tree(self, req, depth, nodes):
            chain = min(depth, nodes)
            return [1] * nodes, [i - 1 if i < chain else (i - chain) % chain - 1 for i in range(nodes)]

    def tree(k: int, nodes: int) -> Speculator:
        return speculator(engine, FixedTree(k, 10_000), tree_nodes=nodes)

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
                  load_format="dummy", page_size=16, max_running_requests=64, speculative_governor=False,
                  shared_prefix_attention=args.shared_prefix, kernel_options=kernel_options(args))
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
        _use(engine, None)
        engine.loop.overlap = True
        overlap = step_ms(engine, prompts[batch])
        for k in range(0, args.max_k + 1):
            _use(engine, fixed(k) if k else None)
            engine.loop.overlap = engine.config.overlap_plain if k else False
            engine.runner.verify_rows_max = None
            times.append(step_ms(engine, prompts[batch]))
            if k:
                engine.runner.verify_rows_max = 0
                eager.append(step_ms(engine, prompts[batch]) if args.eager else float("nan"))
        table[batch] = [overlap, *times[1:]]  # speedups are against plain decoding as it runs: overlap on
        print(f"{batch:>5} | {overlap:>6.2f}/{times[0]:<6.2f} | "
              + " | ".join(f"{t:>6.2f}/{e:<6.2f}" for t, e in zip(times[1:], eager)))
    if args.tree_nodes:  # verify steps of draft trees (depth <= max_k), against the chains above
        print(f"\ndraft trees, depth <= {args.max_k}: ms per verify step (nodes: ms)")
        engine.runner.verify_rows_max = None  # (the extend-layout column above left it at 0)
        for batch in batches:
            cells = []
            for nodes in args.tree_nodes:
                _use(engine, spec := tree(args.max_k, nodes))
                rows = batch * (1 + nodes)
                ms = step_ms(engine, prompts[batch]) if batch + batch * nodes <= spec.tree_rows() else float("nan")
                cells.append(f"{nodes}: {ms:.2f} ({rows} rows)")
            print(f"{batch:>5} | " + " | ".join(cells))
        _use(engine, None)
    print("\nspeedup over plain decoding (overlap on) at a mean accepted length a per verify, best k:")
    print(f"{'batch':>5} | " + " | ".join(f"a={a:<4}" for a in args.accepted))
    for batch, times in table.items():
        cells = []
        for a in args.accepted:
            best = max((1 + min(a, k)) * times[0] / times[k] for k in ks)
            cells.append(f"{best:>5.2f}x")
        print(f"{batch:>5} | " + " | ".join(cells))
    if args.profile_verify:
        from benchmarks.common.spec_profile import run as profile_verify

        profile_verify(engine, prompts[batches[0]], fixed, args.profile_verify, host_top=args.profile_host,
                       make_tree=tree, tree_nodes=tuple(args.tree_nodes or ()))
    del engine
    torch.cuda.empty_cache()
    if not args.draft_model:
        return

    # a draft model of 0.6B shape (Llama-3 vocabulary) against the target: its cost per step
    draft_path = write_shape_dir(args.draft_shape)
    engine = Engine(EngineConfig(model=path, speculative="draft", draft_model=draft_path, gpu_memory_fraction=0.5,
                                 num_speculative_tokens=4, **common))
    spec = engine.speculation
    spec.drafter.observe_step = lambda req, drafted, accepted: None  # keep k = 4 (random drafts are rejected)
    propose_s = [0.0]
    inner = spec.propose_all

    def timed_propose(running):
        sync()
        t0 = time.perf_counter()
        inner(running)
        sync()
        propose_s[0] += time.perf_counter() - t0

    spec.propose_all = timed_propose
    print(f"\ndraft model {args.draft_shape} ({common['dtype']}, decode graphs on CUDA) -> {args.shape}, k = 4: ms per step")
    print(f"{'batch':>5} | {'draft + verify':>14} | {'verify alone':>12} | {'drafting':>8} | {'forwards/step':>13} | "
          f"{'graph replays':>13}")
    graphs = engine.draft.graphs
    for batch in batches:
        f0, s0 = spec.drafter.forwards, engine.counters.steps
        r0 = graphs.num_replays if graphs is not None else 0
        propose_s[0] = 0.0
        total = step_ms(engine, prompts[batch])
        steps = max(engine.counters.steps - s0, 1)
        forwards = (spec.drafter.forwards - f0) / steps
        replays = ((graphs.num_replays if graphs is not None else 0) - r0) / steps
        print(f"{batch:>5} | {total:>14.2f} | {table[batch][4]:>12.2f} | {1e3 * propose_s[0] / steps:>8.2f} | "
              f"{forwards:>13.1f} | {replays:>13.1f}")
    if args.profile_draft:  # where a batch-1 drafting step's host time goes
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.runcall(step_ms, engine, prompts[batches[0]])
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2, help="CPU: timed runs per variant (the fastest is kept)")
    parser.add_argument("--skip-governor", action="store_true", help="CPU: leave out the governor comparison")
    parser.add_argument("--host-only", action="store_true", help="only the drafters' host cost (no model)")
    parser.add_argument("--host-steps", type=int, default=64)
    parser.add_argument("--host-history", type=int, default=16,
                        help="earlier responses per prompt in the host-cost batch (fewer: a quicker smoke run)")
    parser.add_argument("--grpo-epochs", action="store_true",
                        help="iii only: GRPO epochs over one dataset with training between them, plain vs speculative")
    parser.add_argument("--epochs", type=int, default=6, help="--grpo-epochs: epochs to run")
    parser.add_argument("--dataset-size", type=int, default=8, help="--grpo-epochs: prompts in the dataset")
    parser.add_argument("--lr", type=float, default=1e-5, help="--grpo-epochs: the trainer's learning rate")
    parser.add_argument("--batch1-samples", type=int, default=32,
                        help="--grpo-epochs: samples run alone at the start of each later epoch (the batch-1 trace)")
    parser.add_argument("--batch1-steps", type=int, default=1,
                        help="--batch1-ahead: the replayed samples are --batch1-samples of each of this many steps' "
                             "prompts (8 a step), from the epoch's first step on, all sampled before it trains")
    parser.add_argument("--batch1-epochs", type=int, default=1, help="--grpo-epochs: epochs (from the second) traced")
    parser.add_argument("--batch1-k", type=int, nargs="*", help="--grpo-epochs: the trace's draft limits (default: --k)")
    parser.add_argument("--batch1-tree", type=int, nargs="*", metavar="N",
                        help="--grpo-epochs: also trace draft trees of at most N nodes (0: chains) at each --batch1-k "
                             "depth, their path chosen as tree verification would (benchmarks/common/spec_tree.py)")
    parser.add_argument("--batch1-ahead", type=int, nargs="*", metavar="N",
                        help="--grpo-epochs: replay the batch-1 samples step by step with trees of at most N nodes: "
                             "each step that may draft waits for the token in flight (the engine), or drafts a tree "
                             "ahead of it (benchmarks/common/spec_tree.py batch1_ahead_trace)")
    parser.add_argument("--batch1-ahead-least", type=float, nargs="*", default=[0.0], metavar="E",
                        help="--batch1-ahead: draft ahead only where the tree expects at least E accepted drafts")
    parser.add_argument("--batch1-save", default=None, metavar="PATH",
                        help="--batch1-ahead: write the replayed steps (rows, accepted, waited) as JSON")
    parser.add_argument("--batch1-tree-fallback", type=int, default=0, metavar="N",
                        help="--batch1-tree: also trace trees grown from matches of N tokens where none of 2 is found")
    parser.add_argument("--batch1-fixed", action="store_true",
                        help="--grpo-epochs: also trace the chains with draft lengths held at k (no adaptation)")
    parser.add_argument("--k", type=int, default=4, help="--grpo-epochs: num_speculative_tokens")
    parser.add_argument("--cross-prompt", choices=("on", "off"), default="on",
                        help="--grpo-epochs: the suffix drafter's fallback on other prompts' rollouts")
    parser.add_argument("--governor", choices=("off", "on"), default="off",
                        help="--grpo-epochs: off drafts every step (the drafts' own acceptance)")
    parser.add_argument("--gpu-governor", action="store_true",
                        help="plain decoding against speculation with its governor, poor and good drafts (GPU shape)")
    parser.add_argument("--gpu", action="store_true")
    parser.add_argument("--shape", default="llama8b")
    parser.add_argument("--device", default="cuda", help="--gpu: the device (cpu: a smoke run of the GPU table)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--new-gpu", type=int, default=33, help="--gpu: tokens per timed request")
    parser.add_argument("--draft-shape", default="draft06b")
    parser.add_argument("--max-k", type=int, default=4, help="--gpu: verify k = 1..this many drafts")
    parser.add_argument("--tree-nodes", type=int, nargs="*", metavar="N",
                        help="--gpu: also time verify steps of draft trees of N nodes (depth <= --max-k)")
    parser.add_argument("--no-eager", dest="eager", action="store_false", help="--gpu: leave out the extend-layout column")
    parser.add_argument("--no-draft-model", dest="draft_model", action="store_false",
                        help="--gpu: leave out the 0.6B draft model's table")
    parser.add_argument("--profile-verify", type=int, default=0, metavar="K",
                        help="--gpu: profile decode and verify k = K steps at the first batch, and trees of each "
                             "--tree-nodes N at depth <= K (benchmarks/common/spec_profile.py)")
    parser.add_argument("--profile-host", type=int, default=0, metavar="N",
                        help="--profile-verify: also the N Python functions of most own time (cProfile)")
    parser.add_argument("--small-decode-rows", type=int, default=None, metavar="R",
                        help="GPU: decode graphs of at most R rows attend with the Triton kernel "
                             "(KernelOptions.small_decode_rows; default: as the engine has it)")
    parser.add_argument("--no-shared-prefix", dest="shared_prefix", action="store_false",
                        help="--gpu: EngineConfig(shared_prefix_attention=False): a verify's rows each read the "
                             "request's context (as before H100, 2026-12-07)")
    parser.add_argument("--profile-draft", action="store_true", help="--gpu: cProfile a draft-model run at the first batch")
    parser.add_argument("--accepted", type=float, nargs="+", default=[0.5, 1.0, 2.0, 3.0],
                        help="mean accepted lengths to turn GPU step costs into speedups (measure them on CPU)")
    args = parser.parse_args(argv)
    if args.host_only:
        host(args)
    elif args.gpu_governor:
        from benchmarks.common.spec_governor import run

        run(args)
    elif args.grpo_epochs:
        from benchmarks.common.spec_grpo import grpo_epochs

        grpo_epochs(args)
    else:
        gpu(args) if args.gpu else cpu(args)


if __name__ == "__main__":
    main()
