"""benchmarks.spec --grpo-epochs --batch1-tree N..: what draft trees (speculative/tree.py) would
accept on the batch-1 trace, before any engine verifies a tree.

The samples run as the chain trace's do (spec_grpo._batch1_trace: each alone at the start of
an epoch, drafting from a copy of the history), each first without drafts (its tokens: with
the seeded sampler a verify accepts exactly what plain decoding draws) and then with a
drafter that grows a tree of at most N nodes from the suffix drafter's index, as a tree
drafter would, and hands the engine the tree's path that those tokens follow. The engine
verifies that path, so the request advances exactly as a tree verify would advance it; the
trace records each step's tree size and accepted length, and a tree that nothing in it
matched counts as a verify step accepting 0 (the engine ran it as a plain step).

The trees never see the future: only the choice of path does, and that choice is what tree
verification itself makes. A projection of acceptance, not a measurement of a tree engine.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass


@dataclass(frozen=True)
class TreeTrace:
    epoch: int
    depth: int
    nodes: int  # the budget (0: the chain draft through the same path choice)
    samples: int
    tokens: int  # emitted after each sample's first (prefill) token
    steps: tuple[tuple[int, int], ...]  # (tree nodes, accepted) of each step that had a tree
    plain_steps: int  # steps without a tree
    fallback: int = 0  # matches this short grew the tree where none of MIN_MATCH was found (0: none)
    fallback_steps: tuple[tuple[int, int], ...] = ()  # (nodes, accepted) of the trees from such matches

    @property
    def accepted(self) -> int:
        return sum(a for _, a in self.steps)


def batch1_tree_trace(engine, generate, task, step: int, epoch: int, new: int, samples: int, depth: int,
                      nodes: int, fallback: int = 0) -> TreeTrace:
    from rollout import SamplingParams
    from benchmarks.common.spec import plain_decoding, speculator, use_speculation
    from rollout.rl.grpo import sample_seed
    from speculative.ngram import draft_spec, last_tokens
    from speculative.suffix import MAX_MATCH
    from speculative.tree import DraftTree, build

    spec = engine.speculation
    trial = copy.deepcopy(spec.drafter)
    trial.max_tokens = depth
    future: list[int] = []  # this sample's tokens (its plain run)
    steps: list[tuple[int, int]] = []
    sizes: dict = {}  # request -> the size of the tree its path came from, until the engine verifies it
    short: set = set()  # requests whose pending tree came from the fallback's short matches
    fallback_steps: list[tuple[int, int]] = []

    own_propose, own_tree = trial.propose, trial.propose_tree  # (propose is replaced below)

    def propose(req, k):
        # the drafter's own trees (and chains), so the trace measures what the engine would verify
        if nodes:
            tree = DraftTree(*own_tree(req, k, nodes))
        else:
            drafts = own_propose(req, k)
            tree = DraftTree(drafts, list(range(-1, len(drafts) - 1)))
        from_short = False
        if not len(tree) and fallback and nodes:
            group = trial._group_of(req)
            spec = draft_spec(req, trial.coupled)
            tree, from_short = build(group.index, last_tokens(req, MAX_MATCH), k, nodes, fallback, spec), True
        if not len(tree):
            return []
        done = len(req.output_ids)
        assert req.output_ids == future[:done], "the speculative run left plain decoding's tokens"
        path = tree.follow(future[done:])
        if path:
            sizes[req] = len(tree)
            if from_short:
                short.add(req)
        else:  # a tree verify accepting nothing: the engine runs it as a plain step
            steps.append((len(tree), 0))
            if from_short:
                fallback_steps.append((len(tree), 0))
        return path

    inner = trial.observe_step

    def observe(req, drafted, accepted):
        # what the engine accepted of the path: all of it, except a path running through the
        # sample's last token (that one is emitted as the end, not counted as accepted)
        steps.append((sizes.pop(req), accepted))
        if req in short:
            short.discard(req)
            fallback_steps.append((steps[-1][0], accepted))
        inner(req, drafted, accepted)

    trial.propose = propose
    trial.observe_step = observe
    trial_spec = speculator(engine, trial, copy.deepcopy(spec.governor), spec.tree_nodes)
    overlap_plain, engine.loop.overlap = engine.loop.overlap, True  # plain steps overlap, as CUDA runs them
    tokens = 0
    problems = task.problems(step, 8)
    for i in range(samples):
        prompt = task.prompt_ids(problems[i % len(problems)], engine.tokenizer)
        params = SamplingParams(temperature=1.0, max_new_tokens=new, seed=sample_seed(1, step, i))
        with plain_decoding(engine):
            engine.flush_cache()
            (plain,) = generate(input_ids=[prompt], sampling_params=params)
        future[:] = plain.token_ids
        old = use_speculation(engine, trial_spec)
        engine.flush_cache()
        (out,) = generate(input_ids=[prompt], sampling_params=params)
        use_speculation(engine, old)
        assert out.token_ids == plain.token_ids, "verification must emit plain decoding's tokens"
        tokens += len(out.token_ids) - 1
    engine.loop.overlap = overlap_plain
    emitted = sum(a + 1 for _, a in steps)
    return TreeTrace(epoch, depth, nodes, samples, tokens, tuple(steps), tokens - emitted, fallback,
                     tuple(fallback_steps))


def summary(t: TreeTrace) -> str:
    verifies = len(t.steps)
    sizes = [n for n, _ in t.steps]
    shape = f"trees of <= {t.nodes} nodes" if t.nodes else "chains"
    if t.fallback:
        shape += (f" (matches of {t.fallback} where none longer: {len(t.fallback_steps)} trees, "
                  f"{sum(a for _, a in t.fallback_steps)} accepted)")
    return (f"batch 1 at the start of epoch {t.epoch}, {shape}, depth <= {t.depth}: "
            f"{t.samples} samples, {t.tokens} tokens after the first, {verifies} tree steps "
            f"({t.accepted / max(verifies, 1):.2f} accepted each, {sum(sizes) / max(verifies, 1):.1f} nodes each) "
            f"+ {t.plain_steps} steps without a tree = {verifies + t.plain_steps} steps: "
            f"{t.tokens / max(verifies + t.plain_steps, 1):.2f} tokens a step; accepted by tree size "
            f"{_by_size(t)}")


def _by_size(t: TreeTrace) -> str:
    buckets: dict[int, list[int]] = {}
    for n, a in t.steps:
        buckets.setdefault(n, []).append(a)
    return ", ".join(f"{n}: {len(v)} x {sum(v) / len(v):.2f}" for n, v in sorted(buckets.items()))



@dataclass(frozen=True)
class AheadTrace:
    """A batch-1 trace replayed step by step on the host, for the cost of each step as the
    engine would launch it: `steps` holds (rows, accepted, waited, moved) per step, rows 1 for
    a step without drafts, `waited` whether the host read the device's last token before
    launching it (the device idles while the host drafts and launches: no overlap), `moved`
    the accepted drafts off the tree's leading chain, whose KV the engine moves into position
    order after the step (speculative/verify.py `_compact_path`)."""

    # "drain": a step that may draft waits for the token in flight; "ahead:E": it drafts ahead
    # of it where the ahead tree expects at least E accepted drafts, else runs plain;
    # "ahead-drain:E": else waits as "drain" does
    mode: str
    depth: int
    nodes: int
    samples: int
    tokens: int
    steps: tuple[tuple[int, int, bool, int], ...]
    draft_ms: float  # host ms per drafting call (propose_tree / propose_tree_ahead), this CPU


def plain_futures(engine, generate, task, step: int, new: int, samples: int) -> list[tuple[list[int], object, list[int]]]:
    """(prompt, params, plain decoding's tokens) of each batch-1 sample at `step`, as the
    traces above run them."""
    from rollout import SamplingParams
    from benchmarks.common.spec import plain_decoding
    from rollout.rl.grpo import sample_seed

    problems = task.problems(step, 8)
    out = []
    with plain_decoding(engine):
        for i in range(samples):
            prompt = task.prompt_ids(problems[i % len(problems)], engine.tokenizer)
            params = SamplingParams(temperature=1.0, max_new_tokens=new, seed=sample_seed(1, step, i))
            engine.flush_cache()
            (plain,) = generate(input_ids=[prompt], sampling_params=params)
            out.append((prompt, params, list(plain.token_ids)))
    return out


def batch1_ahead_trace(drafter, futures, depth: int, nodes: int, mode: str) -> AheadTrace:
    """Replay each sample's plain tokens through the drafter's trees (a copy of it: its
    history grows by these samples as the engine's would), step by step as the engine
    schedules them at batch 1 with overlap: a step without drafts is launched before its
    token is read; then the next step either waits for that token and drafts with it
    ("drain", as the engine does) or drafts a tree ahead of it, each subtree
    under one candidate value, and verifies the subtree the device drew ("ahead"). A verify
    step's tokens are read before the next step is drafted (its accepted run decides it)."""
    import time

    from rollout.request import Req, derive_seed
    from speculative.ngram import draft_spec, last_tokens
    from speculative.suffix import MAX_MATCH, MIN_MATCH
    from speculative.tree import DraftTree, build, split_ahead

    trial = copy.deepcopy(drafter)
    kind, _, at_least = mode.partition(":")
    least = float(at_least or 0)
    steps: list[tuple[int, int, bool, int]] = []
    tokens = 0
    seconds, calls = 0.0, 0
    for i, (prompt, params, future) in enumerate(futures):
        req = Req(rid=f"ahead{i}", prompt_ids=prompt, params=params, seed=derive_seed(params.seed, 0))
        n = len(future)
        tokens += n - 1
        pos, known = 1, 0  # future[:pos] emitted; the host has read future[:known]
        while pos < n:
            waited = known == pos
            k = min(depth, params.max_new_tokens - pos - 1)
            req.output_ids = future[:known]
            tree = DraftTree()
            if not waited and k > 0 and kind != "drain":
                start = time.perf_counter()
                group = trial._group_of(req)  # (the suffix drafter's index, as its own trees read it)
                group.sync(req)
                ahead = split_ahead(build(group.index, last_tokens(req, MAX_MATCH), k, nodes, MIN_MATCH,
                                          draft_spec(req, trial.coupled), ahead=True))
                seconds, calls = seconds + time.perf_counter() - start, calls + 1
                if len(ahead) and sum(ahead.probs) >= least:
                    tree = ahead
            if not waited and not len(tree) and kind != "ahead" and trial.may_draft_next(req):
                known = pos  # the step waits for the token in flight, then drafts with it
                continue
            if waited and k > 0:
                start = time.perf_counter()
                tree = DraftTree(*trial.propose_tree(req, k, nodes))
                seconds, calls = seconds + time.perf_counter() - start, calls + 1
            rows = 1 + len(tree)
            path = tree.follow_nodes(future[pos:])
            emitted = min(len(path) + 1, n - pos)
            steps.append((rows, emitted - 1, waited, sum(node != j for j, node in enumerate(path[: emitted - 1]))))
            pos += emitted
            # a verify is read before the next step drafts; a plain step's token is in flight
            # while the next one launches (the host has read the one before it)
            known = pos if len(tree) else pos - 1
        req.output_ids = list(future)
        trial.observe_finished(req)
    return AheadTrace(mode, depth, nodes, len(futures), tokens, tuple(steps), 1e3 * seconds / max(calls, 1))


def ahead_summary(t: AheadTrace) -> str:
    from benchmarks.common.spec import (H100_2026_12_06_DECODE_MS, H100_2026_12_06_ROWS_MS, H200_2026_12_06_DECODE_MS,
                                        KV_MOVE_MS, ahead_trace_speedup)

    verifies = [(r, a) for r, a, *_ in t.steps if r > 1]
    plain = len(t.steps) - len(verifies)
    waited = sum(w for _, _, w, *_ in t.steps)
    moving = sum(1 for *_, moved in t.steps if moved)
    return (f"batch 1, {t.mode}, trees of <= {t.nodes} nodes, depth <= {t.depth}: {t.samples} samples, {t.tokens} "
            f"tokens after the first, {len(t.steps)} steps: {len(verifies)} verifies "
            f"({sum(a for _, a in verifies) / max(len(verifies), 1):.2f} accepted each, "
            f"{sum(r - 1 for r, _ in verifies) / max(len(verifies), 1):.1f} nodes each), {plain} without drafts, "
            f"{waited} waited for the token in flight, {moving} verifies moved KV; drafting {t.draft_ms:.3f} ms a call (this CPU); "
            f"batch-1 decode speedup on the H200's step costs (2026-12-06) "
            f"{ahead_trace_speedup(t.steps, t.tokens):.2f}x, "
            f"the H100's (2026-12-06) "
            f"{ahead_trace_speedup(t.steps, t.tokens, H100_2026_12_06_ROWS_MS, H100_2026_12_06_DECODE_MS):.2f}x; "
            f"H200 with {KV_MOVE_MS} ms a KV move and the drafting time on every waited step "
            f"{_charged(t, H200_2026_12_06_DECODE_MS, KV_MOVE_MS):.2f}x")


def _charged(t: AheadTrace, decode_ms: float, move_ms: float) -> float:
    """The H200 projection with each KV move and, on every step that waited for a read back,
    this CPU's drafting time per call added (host time the device then waits for)."""
    from benchmarks.common.spec import ahead_trace_speedup

    waited = sum(w for _, _, w, *_ in t.steps)
    cost = t.tokens * decode_ms / ahead_trace_speedup(t.steps, t.tokens, move_ms=move_ms)
    return t.tokens * decode_ms / (cost + waited * t.draft_ms)
