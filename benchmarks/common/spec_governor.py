"""benchmarks.spec --gpu-governor: is speculation with its governor ever slower than plain decoding?

One engine (a benchmark shape, random weights, greedy, ignore_eos) at each batch size:
- plain: no drafter, overlap scheduling on (what "off" means);
- poor: drafts that are always wrong (random tokens, full length every step), governor on;
  "now" overlaps the steps the governor keeps plain and probes in blocks (on CUDA), ending a
  clearly losing probe early; "before" is the governor of the morning of 2026-12-02: every
  step without overlap, probes in alternation, each probe to its end;
- good: the suffix drafter with a warm history of the same greedy rollout (every draft
  right), governor on ("now");
- sparse: right drafts at 2 positions in 8 and nothing to draft at the rest, governor off,
  with the steps that have nothing to draft overlapped ("now", speculative/speculator.py) and
  not ("before": `Speculator.draftless_overlap = False`).

The random weights are rewritten into a successor model first (`successor_model`): every
layer's o_proj and down_proj are zero, so the residual stream is the token's embedding, and
the lm_head maps it to a fixed random successor with a wide margin. Each step still reads
every weight and attends over the whole context (the cost is the 8B model's), but greedy
decoding is a fixed walk that no kernel's rounding changes. (With plain random weights the
logits are nearly flat, so an earlier rollout stops predicting the next one as soon as a
verify step's kernels round differently from a decode step's, and "good" drafts were not.)

ms per emitted token-step (the timed generate's wall time over the decode steps plain decoding
would take), so rows compare directly.
"""

from __future__ import annotations

import random
import time

import torch

from rollout.kernels.options import KernelOptions
from benchmarks.common.spec import speculator, use_speculation
from rollout.core.hooks import NO_SPECULATION
from rollout.request import Req
from speculative.base import Drafter
from speculative.governor import SpeedGovernor
from speculative.speculator import Speculator


class WrongDrafter(Drafter):
    """Random tokens, k of them every step: nothing is accepted."""

    def __init__(self, vocab: int, k: int) -> None:
        super().__init__(k, 1 << 30)
        self.rng, self.vocab = random.Random(0), vocab

    def propose(self, req: Req, k: int) -> list[int]:
        return [self.rng.randrange(self.vocab) for _ in range(k)]

    def observe_step(self, req: Req, drafted: int, accepted: int) -> None:
        pass  # stay at full length: the worst case the governor must catch


@torch.no_grad()
def successor_model(engine, seed: int = 0) -> torch.Tensor:
    """Rewrite the engine's weights in place (its CUDA graphs keep their addresses) so greedy
    decoding follows a random permutation: token t -> perm[t], whatever kernels run. Returns
    perm (on the CPU)."""
    model = engine.runner.model
    for layer in model.layers:
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
    model.norm.weight.fill_(1.0)
    if model.lm_head is None:
        raise ValueError("successor_model needs an untied lm_head (llama8b has one)")
    emb = model.embed_tokens.weight
    perm = torch.randperm(emb.shape[0], generator=torch.Generator().manual_seed(seed))
    # lm_head row perm[t] = e_t: logits[perm[t]] = |e_t|^2 / rms against random dot products elsewhere
    rows = torch.empty_like(emb)
    rows[perm.to(emb.device)] = emb
    model.lm_head.weight.copy_(rows)
    return perm


class SparseRightDrafter(Drafter):
    """Right drafts (the successor walk) of k tokens at one position in `every`, none at the
    others: most steps have nothing to draft, as half of a second GRPO epoch's batch-1 steps
    had (BENCHMARKS.md). It knows a token ahead whether it will draft (`may_draft_next`), as
    the n-gram and suffix drafters do."""

    def __init__(self, perm: torch.Tensor, k: int, every: int) -> None:
        super().__init__(k, 1 << 30)
        self.perm, self.every = perm.tolist(), every

    def propose(self, req: Req, k: int) -> list[int]:
        if req.known_len % self.every >= 2:
            return []
        out, t = [], req.all_ids[-1]
        for _ in range(k):
            t = self.perm[t]
            out.append(t)
        return out

    def may_draft_next(self, req: Req) -> bool:
        return (req.known_len + 1) % self.every < 2

    def observe_step(self, req: Req, drafted: int, accepted: int) -> None:
        pass  # full length every time


def run(args) -> None:
    from rollout import Engine, EngineConfig, SamplingParams
    from rollout.model.shapes import SHAPES, write_shape_dir
    from speculative.suffix import SuffixDrafter

    cuda = args.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    path = write_shape_dir(args.shape)
    vocab = SHAPES[args.shape]["vocab_size"]
    engine = Engine(EngineConfig(model=path, dtype="bfloat16" if cuda else "float32", device=args.device,
                                 load_format="dummy", page_size=16, max_running_requests=max(args.batches),
                                 speculative="suffix", gpu_memory_fraction=0.5,
                                 kernel_options=KernelOptions(small_decode_rows=args.small_decode_rows)))
    perm = successor_model(engine)
    loop = engine.loop
    overlap_plain = loop.overlap  # plain steps overlap (CUDA)
    g = torch.Generator().manual_seed(0)
    new = args.new_gpu
    params = SamplingParams(temperature=0, max_new_tokens=new, ignore_eos=True)

    def timed(prompts, spec: Speculator | None, overlap_plain_now: bool = overlap_plain, warm=True) -> float:
        use_speculation(engine, NO_SPECULATION if spec is None else spec)
        loop.overlap = overlap_plain if spec is None else overlap_plain_now
        if warm:  # kernels and graphs of these shapes, outside the timing
            engine.generate(input_ids=prompts, sampling_params=SamplingParams(temperature=0, max_new_tokens=4,
                                                                             ignore_eos=True))
        sync()
        c = engine.counters
        before = (c.steps, c.verify_steps, c.drafted_tokens, c.accepted_tokens)
        start = time.perf_counter()
        engine.generate(input_ids=prompts, sampling_params=params)
        sync()
        steps, verifies, drafted, accepted = (after - b for after, b in zip(
            (c.steps, c.verify_steps, c.drafted_tokens, c.accepted_tokens), before))
        last[:] = [steps, verifies / len(prompts), drafted, accepted]
        return 1e3 * (time.perf_counter() - start) / (new - 1)

    last = [0, 0.0, 0, 0]  # the last timed run's steps, verify steps per request, drafted, accepted tokens

    def governed(drafter: Drafter, blocks: bool, early_stop: bool = True) -> Speculator:
        return speculator(engine, drafter, SpeedGovernor(blocks=blocks, early_stop=early_stop))

    print(f"\n{args.shape}, {'bf16' if cuda else 'fp32'}, {args.device}: ms per token-step, greedy, {new} new tokens, "
          f"prompts of {args.context} random tokens, k = {engine.config.num_speculative_tokens}")
    print(f"{'batch':>5} | {'plain':>6} | {'poor, now':>9} | {'poor, before':>12} | {'good, now':>9} | "
          f"{'poor now / plain':>16} | {'good speedup':>12} | good: steps, verifies/request, accepted/drafted")
    sparse: dict[int, tuple[float, list]] = {}
    overlapped_before = [engine.counters.spec_overlapped_steps]
    for batch in args.batches:
        prompts = torch.randint(100, vocab - 100, (batch, args.context), generator=g).tolist()
        plain = timed(prompts, None)
        poor_now = timed(prompts, governed(WrongDrafter(vocab, engine.config.num_speculative_tokens), overlap_plain))
        poor_before = timed(prompts, governed(WrongDrafter(vocab, engine.config.num_speculative_tokens), False, False),
                            False)
        suffix = SuffixDrafter(engine.config.num_speculative_tokens, engine.context_len, 1 << 30)
        # fills the history with this very rollout (and leaves the prompts cached, as the warm-up
        # before every other timing does: the timed runs compare decode steps, not prefills)
        good = governed(suffix, overlap_plain)
        timed(prompts, good, warm=False)
        good_now = timed(prompts, good, warm=False)
        print(f"{batch:>5} | {plain:>6.2f} | {poor_now:>9.2f} | {poor_before:>12.2f} | {good_now:>9.2f} | "
              f"{poor_now / plain:>15.2f}x | {plain / good_now:>11.2f}x | {last[0]}, {last[1]:.1f}, "
              f"{last[3]}/{last[2]}", flush=True)
        sparse[batch] = plain, []
        for on in (True, False):  # a drafting step with nothing to draft overlaps (now) or not (before)
            # always drafting (no governor): the rows compare the steps' mechanics
            spec = speculator(engine, SparseRightDrafter(perm, engine.config.num_speculative_tokens, 8))
            spec.draftless_overlap = on
            ms = timed(prompts, spec)
            sparse[batch][1].append((ms, last[0], engine.counters.spec_overlapped_steps - overlapped_before[0]))
            overlapped_before[0] = engine.counters.spec_overlapped_steps
    print("\nsparse right drafts (k tokens at 2 positions in 8, governor off), ms per token-step: steps with "
          "nothing to draft overlapped (now) / not (before)")
    print(f"{'batch':>5} | {'plain':>6} | {'now':>6} | {'before':>6} | {'now speedup':>11} | {'before':>6} | steps now / before")
    for batch, (plain, ((now, s_now, _), (before, s_before, _))) in sparse.items():
        print(f"{batch:>5} | {plain:>6.2f} | {now:>6.2f} | {before:>6.2f} | {plain / now:>10.2f}x | "
              f"{plain / before:>5.2f}x | {s_now} / {s_before}", flush=True)
