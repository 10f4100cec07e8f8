"""Speculative decoding benchmark helpers (benchmarks/spec.py): the H200 projection from
the measured verify-step costs, and the drafter's host cost on a synthetic GRPO batch.

The projection is arithmetic on a table, not a measurement: at a mean accepted length a per
verify step, a step emits 1 + min(a, k) tokens per request and costs the verify step of k
drafts; the speedup is the best k's tokens per ms over plain decoding's (overlap on), as in
BENCHMARKS.md ("Speedup over plain decoding ... from the first call's table"). It leaves out
the drafter's host time, which runs in series with the device while speculating (overlap is
off): `host_cost` measures it.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from rollout.core.hooks import NO_SPECULATION, Speculation
from rollout.request import Req, SamplingParams
from speculative.base import Drafter
from speculative.governor import SpeedGovernor
from speculative.noise import position_key, race_noise
from speculative.speculator import Speculator


def use_speculation(engine, speculation: Speculation) -> Speculation:
    """Put a speculation hook into the engine (its loop, scheduler and facade), as the
    benchmarks do to compare drafters, and plain decoding (NO_SPECULATION), on one engine;
    returns the hook it replaced."""
    old = engine.loop.speculation
    engine.speculation = engine.loop.speculation = engine.scheduler.speculation = speculation
    return old


def speculator(engine, drafter: Drafter, governor: SpeedGovernor | None = None, tree_nodes: int = 0) -> Speculator:
    """A Speculator around `drafter` on the engine's KV and counters: `governor` (None:
    drafting every step), trees of `tree_nodes` nodes where the engine's attention takes them."""
    spec = Speculator(drafter, engine.kv, engine.counters)
    spec.governor, spec.tree_nodes, spec.tree_rows = governor, tree_nodes, engine.runner.tree_rows_max
    return spec


@contextmanager
def plain_decoding(engine) -> Iterator[None]:
    """A speculative engine's steps without drafts, and without overlap (as its loop runs
    with no drafter: EngineConfig.overlap), for the plain decoding a run compares with."""
    loop = engine.loop
    old, overlap = use_speculation(engine, NO_SPECULATION), loop.overlap
    loop.overlap = engine.config.overlap
    try:
        yield
    finally:
        use_speculation(engine, old)
        loop.overlap = overlap


# H200, Llama-3.1-8B shape, bf16, ms per step (BENCHMARKS.md, "the verify step's host time",
# 2026-12-02): batch -> (decode with overlap on, verify k = 1..K as decode rows
# in a CUDA graph). Batch 1's verify rows now attend with the Triton decode kernel, which needs
# no host plan (rollout.attention.SMALL_DECODE_ROWS): 5.23-5.62 ms against 6.45-6.98 the same
# morning. Batch 64's 64 x (1 + k) rows are past that range (FlashInfer, as before). Batch 64
# stops at k = 4, the widest its graphs were captured for (the engine captures requests x
# (1 + num_speculative_tokens), and the call's engine had k = 4).
H200_STEP_MS: dict[int, tuple[float, tuple[float, ...]]] = {
    1: (4.34, (5.23, 5.38, 5.30, 5.44, 5.42, 5.45, 5.45, 5.62)),
    64: (8.60, (13.00, 16.06, 17.53, 19.47)),
}


# the same call's plain decode with overlap off (what a step without drafts costs while
# speculating: overlap is off then)
H200_DECODE_NO_OVERLAP_MS: dict[int, float] = {1: 4.73, 64: 10.62}


def batch1_trace_speedup(verifies: list[int], plain_steps: int, decode_steps: int, overlapped: int = 0,
                         waited: int = 0) -> float:
    """H200 batch-1 decode speedup from a step trace: `verifies` holds the number of drafts
    each verify step checked, `plain_steps` the steps that drafted nothing, `overlapped` of
    those the ones that ran overlapped (speculative/speculator.py; the rest without overlap) and
    `waited` of those the ones the next step waited for (a drain before drafting, or the
    sample's end): they cost a step without overlap too. `decode_steps` is the steps plain
    decoding (overlap on) takes for the same tokens. At batch 1 every step is one request's,
    so this is the table's cost of each step as it ran."""
    decode, verify = H200_STEP_MS[1]
    slow = plain_steps - overlapped + min(waited, overlapped)
    cost = (sum(verify[min(k, len(verify)) - 1] for k in verifies) + slow * H200_DECODE_NO_OVERLAP_MS[1]
            + (plain_steps - slow) * decode)
    return decode_steps * decode / cost if cost else 1.0


# H200, batch-1 verify steps of draft trees (`benchmarks.spec --gpu --batches 1 4 --max-k 8 --tree-nodes 8
# 16 24 32 47`, 2026-12-06; BENCHMARKS.md "draft trees"): rows -> ms. The same call's
# chain of 8 drafts took 5.53 ms and its decode 4.36 / 5.08 ms (overlap on / off).
H200_TREE_MS: dict[int, float] = {9: 5.63, 17: 6.03, 25: 6.06, 33: 6.49, 48: 6.52}


def _rows_ms(rows: int, table: dict[int, float]) -> float:
    """`table` (rows -> ms) at `rows`: linear between its measured widths, NaN past the widest."""
    widths = sorted(table)
    if rows > widths[-1]:
        return float("nan")
    hi = next(w for w in widths if w >= rows)
    lo = max(w for w in widths if w <= rows)
    t = 0.0 if hi == lo else (rows - lo) / (hi - lo)
    return (1 - t) * table[lo] + t * table[hi]


def verify_ms(rows: int) -> float:
    """A batch-1 verify step of `rows` rows (1 + drafts, or 1 + tree nodes): the chain table
    up to its widest, then the tree table (linear between its measured widths); NaN past the
    widest measured (48 rows: also the most a tree step may have with FlashInfer's graphs)."""
    verify = H200_STEP_MS[1][1]
    if rows - 1 <= len(verify):
        return verify[rows - 2]
    return _rows_ms(rows, H200_TREE_MS)


# The same call's batch-1 steps as one table, rows -> ms with overlap off (1 row: plain decode;
# 2 / 5 / 9: chains of 1 / 4 / 8 drafts, 9 the mean of the chain's and the 8-node tree's; then
# the trees), and plain decode with overlap on: the host gap a step launched ahead of the read
# back saves is the difference, 0.72 ms.
H200_2026_12_06_ROWS_MS: dict[int, float] = {1: 5.08, 2: 5.51, 5: 5.85, 9: 5.58, 17: 6.03, 25: 6.06, 33: 6.49,
                                             48: 6.52}
H200_2026_12_06_DECODE_MS = 4.36
# H100 80GB HBM3, 2026-12-06 (`benchmarks.spec --gpu --batches 1 --max-k 8 --no-eager --no-draft-model
# --tree-nodes 16 32 47`, BENCHMARKS.md): chains of 1..8 drafts, then trees
H100_2026_12_06_ROWS_MS: dict[int, float] = {1: 6.04, 2: 6.66, 3: 6.78, 4: 6.72, 5: 6.90, 6: 6.90, 7: 6.91, 8: 6.90,
                                             9: 7.01, 17: 7.43, 33: 7.91, 48: 7.95}
H100_2026_12_06_DECODE_MS = 5.81
# A verify whose accepted path left its tree's leading chain moves that path's KV into
# position order (speculative/verify.py `_compact_path`): one launch for every layer (rollout/kernels/
# kv_copy.py), 0.13 ms host and device for 1-15 moved tokens on an H100 (`python -m
# benchmarks.kernels.kv_copy`, 2026-12-07, BENCHMARKS.md; the torch form it replaced: 2.3 ms).
KV_MOVE_MS = 0.13


def ahead_trace_speedup(steps, tokens: int, table: dict[int, float] = H200_2026_12_06_ROWS_MS,
                        decode_ms: float = H200_2026_12_06_DECODE_MS, move_ms: float = 0.0) -> float:
    """Batch-1 decode speedup from a replayed trace (spec_tree.batch1_ahead_trace): each
    (rows, accepted, waited[, moved]) step at the table's cost for its rows (overlap off: the
    step waited for a read back), less the host gap (the table's 1 row against `decode_ms`,
    plain decoding with overlap on) where it was launched before the step it follows was
    read, plus `move_ms` for a verify whose accepted path left the tree's leading chain (the
    KV move after it, which the table's fixed trees never make); against plain decoding for
    the same tokens. The H200's table of 2026-12-06 by default."""
    gap = table[1] - decode_ms
    cost = sum(_rows_ms(rows, table) - (0.0 if waited else gap) + (move_ms if rest and rest[0] else 0.0)
               for rows, _, waited, *rest in steps)
    return tokens * decode_ms / cost if cost else 1.0


def tree_trace_speedup(steps: list[tuple[int, int]] | tuple, plain_steps: int, decode_steps: int,
                       overlap_plain: bool) -> float:
    """H200 batch-1 decode speedup from a tree trace (spec_tree.py): each (nodes, accepted)
    step a verify of 1 + nodes rows, each step without a tree a decode step with overlap on
    or off; against plain decoding (overlap on) for the same tokens."""
    decode = H200_STEP_MS[1][0]
    plain = decode if overlap_plain else H200_DECODE_NO_OVERLAP_MS[1]
    cost = sum(verify_ms(1 + n) for n, _ in steps) + plain_steps * plain
    return decode_steps * decode / cost if cost else 1.0


def _table_speedup(accepted: float, batch: int) -> float:
    decode, verify = H200_STEP_MS[batch]
    return max((1 + min(accepted, k)) * decode / ms for k, ms in enumerate(verify, start=1))


def projected_speedup(accepted: float, batch: int) -> float:
    """H200 speedup over plain decoding projected from the verify-cost table at a mean
    accepted length per verify step; batches between the table's rows interpolate in
    log2(batch). A projection: it assumes the CPU's acceptance carries over to the 8B model."""
    rows = sorted(H200_STEP_MS)
    if batch <= rows[0] or batch >= rows[-1]:
        return _table_speedup(accepted, min(max(batch, rows[0]), rows[-1]))
    hi = next(b for b in rows if b >= batch)
    lo = max(b for b in rows if b <= batch)
    if hi == lo:
        return _table_speedup(accepted, lo)
    t = (math.log2(batch) - math.log2(lo)) / (math.log2(hi) - math.log2(lo))
    return (1 - t) * _table_speedup(accepted, lo) + t * _table_speedup(accepted, hi)


@dataclass(frozen=True)
class HostCost:
    ms_per_step: float  # propose_all (sync of the new tokens + every request's drafts)
    drafted_per_step: float
    accepted_per_verify: float


class _Chain:
    """A sparse random Markov chain standing in for the policy: each token has four likely
    successors, so samples share n-grams and branch as model samples do. It draws as the
    engine's sampler does (the exponential race with the request's seeded noise), so
    coupled drafts meet the noise they were chosen for."""

    WEIGHTS = (0.55, 0.25, 0.12, 0.08)

    def __init__(self, vocab: int, seed: int) -> None:
        self.vocab, self.seed = vocab, seed
        self._next: dict[int, list[int]] = {}
        self._log_w = [math.log(w) for w in self.WEIGHTS]

    def draw(self, token: int, seed: int, position: int) -> int:
        succ = self._next.get(token)
        if succ is None:
            succ = self._next[token] = random.Random(self.seed * 1_000_003 + token).sample(range(self.vocab), 4)
        key = position_key(seed, position)
        return max(zip(succ, self._log_w), key=lambda s: s[1] + race_noise(key, s[0]))[0]

    def extend(self, req: Req, length: int) -> list[int]:
        """`length` tokens drawn after the request's sequence, at its next positions."""
        out, token, at = [], (req.output_ids or req.prompt_ids)[-1], req.known_len
        for j in range(length):
            token = self.draw(token, req.seed, at + j)
            out.append(token)
        return out


def host_cost(drafter_factory, prompts: int = 8, siblings: int = 8, history: int = 16, prompt_len: int = 200,
              response_len: int = 256, steps: int = 64, seed: int = 0) -> HostCost:
    """Time a drafter's per-step host work at batch prompts x siblings (64 by default), each
    prompt with `history` finished responses, the running samples half way through theirs,
    at temperature 1, drafting and verifying against the chain. What is timed is only
    `propose_all` (indexing the step's new tokens, then every request's drafts)."""
    rng = random.Random(seed)
    chain = _Chain(512, seed)
    drafter = drafter_factory()
    spec = Speculator(drafter)  # the engine's per-step proposals around the drafter
    spec.governor = None
    running: list[Req] = []
    for p in range(prompts):
        prompt = [rng.randrange(49_152) for _ in range(prompt_len)]
        for h in range(history):
            done = Req(rid=f"h{p}.{h}", prompt_ids=prompt, params=SamplingParams(), seed=rng.getrandbits(63))
            done.output_ids = chain.extend(done, response_len)
            drafter.observe_finished(done)
        for s in range(siblings):
            req = Req(rid=f"r{p}.{s}", prompt_ids=prompt, params=SamplingParams(max_new_tokens=10 * response_len),
                      seed=rng.getrandbits(63))
            req.output_ids = chain.extend(req, response_len // 2)
            req.num_computed_tokens = req.seq_len - 1
            running.append(req)
    spec.propose_all(running)  # first sight of the running samples: indexed once, not timed
    for req in running:
        req.draft_tokens = []
    seconds = 0.0
    drafted = accepted = verifies = 0
    for _ in range(steps):
        start = time.perf_counter()
        spec.propose_all(running)
        seconds += time.perf_counter() - start
        for req in running:
            drafts, req.draft_tokens = req.draft_tokens, []
            emitted: list[int] = []
            for d in [*drafts, None]:  # the target's draws: accepted while they equal the drafts
                token = chain.draw(emitted[-1] if emitted else req.output_ids[-1], req.seed, req.known_len + len(emitted))
                emitted.append(token)
                if token != d:
                    break
            if drafts:
                drafted += len(drafts)
                accepted += len(emitted) - 1
                verifies += 1
                drafter.observe_step(req, len(drafts), len(emitted) - 1)
            req.output_ids.extend(emitted)
            req.num_computed_tokens = req.seq_len - 1
    return HostCost(1e3 * seconds / steps, drafted / steps, accepted / max(verifies, 1))


class WindowedGovernor:
    """The governor before paired probes (kept here only to measure against): windows of 16
    steps, drafting then plain decoding, every step counted (prefill ones too); drafting off
    for a doubling number of windows while the last plain window was faster."""

    def __init__(self, window: int = 16) -> None:
        self.window, self.drafting = window, True
        self._steps, self._seconds, self._tokens = 0, 0.0, 0
        self.rate = {True: 0.0, False: 0.0}
        self._off_windows, self._off_length, self._wins = 0, 1, 0

    def observe(self, seconds: float, tokens: int, decode_only: bool = True, verified: bool | None = None,
                share: float | None = None) -> None:
        self._steps, self._seconds, self._tokens = self._steps + 1, self._seconds + seconds, self._tokens + tokens
        if self._steps < self.window:
            return
        rate = self._tokens / self._seconds if self._seconds > 0 else 0.0
        self.rate[self.drafting] = rate
        self._steps, self._seconds, self._tokens = 0, 0.0, 0
        if self.drafting:
            if not self.rate[False]:
                self.drafting, self._off_windows = False, 1
            elif rate < self.rate[False]:
                self.drafting, self._off_windows = False, self._off_length
                self._off_length = min(2 * self._off_length, 32)
            else:
                self._wins += 1
                if self._wins >= 8:
                    self._wins, self.drafting, self._off_windows = 0, False, 1
        else:
            self._off_windows -= 1
            if self._off_windows <= 0:
                self.drafting = True
                if self.rate[True] >= rate:
                    self._off_length = 1

    def observe_drain(self, seconds: float, tokens: int) -> None:
        """(It never had overlapped plain steps: the read-back lands in the drafting window.)"""

    def restart(self) -> None:
        """(It never restarted on a weight update.)"""

    def check_due(self) -> bool:
        """(It never looked for drafts while off.)"""
        return False


@dataclass(frozen=True)
class Sample:
    prompt_ids: list[int]
    token_ids: list[int]
    seed: int  # the sample's own seed (derive_seed of the request's seed and sample index)


@dataclass(frozen=True)
class Coverage:
    """One draft at every position of a second epoch, from the true context: where
    acceptance is lost before any choice is made (no timing, no draft lengths)."""

    positions: int  # response positions after the first (which the prompt's step samples)
    matched: int  # the context's last >= 2 tokens occur in the prompt's sequences
    in_support: int  # ... and the token drawn there is among the counted continuations
    coupled: int  # the coupled draft is the token drawn
    point: int  # the point-mass draft (the latest continuation) is the token drawn


def draft_coverage(first: list[Sample], second: list[Sample], temperature: float) -> Coverage:
    """The suffix drafter with `first` as history and the samples of `second` running in
    lockstep (position t of every sample drafted from tokens[:t], siblings up to t too;
    those shorter than t finished into the history): what one draft would hit."""
    from speculative.choice import blended
    from speculative.ngram import last_tokens
    from speculative.suffix import MAX_MATCH, MIN_MATCH, SuffixDrafter

    drafter = SuffixDrafter(1, 1 << 30, 1 << 40)
    params = SamplingParams(temperature=temperature)
    for s in first:
        done = Req(rid="h", prompt_ids=s.prompt_ids, params=params, seed=s.seed)
        done.output_ids = list(s.token_ids)
        drafter.observe_finished(done)
    live = [(Req(rid=f"r{i}", prompt_ids=s.prompt_ids, params=params, seed=s.seed), s) for i, s in enumerate(second)]
    positions = matched = in_support = coupled = point = 0
    for t in range(1, max(len(s.token_ids) for s in second)):
        for req, s in live:
            req.output_ids = list(s.token_ids[:t])
            if len(s.token_ids) == t:
                drafter.observe_finished(req)
        live = [(req, s) for req, s in live if len(s.token_ids) > t]
        drafter.begin_step([req for req, _ in live])
        for req, s in live:
            drawn = s.token_ids[t]
            positions += 1
            levels = drafter.history.group(req).index.matches(last_tokens(req, MAX_MATCH), MIN_MATCH)
            if not levels:
                continue
            matched += 1
            in_support += drawn in blended(levels)
            for flag in (True, False):
                drafter.coupled = flag
                hit = drafter.propose(req, 1) == [drawn]
                coupled, point = (coupled + hit, point) if flag else (coupled, point + hit)
    return Coverage(positions, matched, in_support, coupled, point)
