"""Speculator: speculative decoding as the step loop's speculation hook (rollout/core/hooks.py).

Each step it decides whether to draft (the governor: drafting only while it beats plain
decoding, governor.py), picks the requests that draft and how far (each request's own length,
adapted by its drafter; trees where the step's rows fit what the attention takes as slot
lists), asks the drafter, and tells the loop whether the step overlaps: a drafting step
waits for the tokens in flight (its drafts continue them) unless no request could draft
whatever they are, and one that found nothing to draft overlaps as a plain step does. It
gives the scheduler its verify budget rule, cuts draft trees to chains beside prefill work,
and lays out verify steps (verify.py: acceptance, KV rollback, tree compaction).

Knows drafters, the governor, requests' draft fields and the KV manager; does not know the
device (a draft model's forward stays behind its drafter).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from rollout.batch import ScheduledBatch
from rollout.cache.manager import KVManager
from rollout.core.hooks import PLAIN_ROWS, Speculation, StepRows
from rollout.metrics import Counters
from rollout.request import Req, RolloutOutput
from speculative.base import Drafter
from speculative.governor import SpeedGovernor
from speculative.verify import VerifyRows

LOOK_REQUESTS = 4  # running requests a plain hold's look for drafts asks about (governor.py)


class Speculator(Speculation):
    def __init__(self, drafter: Drafter, kv: KVManager | None = None, counters: Counters | None = None) -> None:
        self.drafter = drafter
        self.kv = kv  # None: no engine (the drafting policy alone, as the unit tests drive it)
        self.counters = counters if counters is not None else Counters()
        self.governor: SpeedGovernor | None = SpeedGovernor()  # None: always draft
        # draft trees (tree.py) of at most this many nodes where the drafter grows them (0:
        # chains), in steps whose rows fit `tree_rows()`: the rows the engine's attention takes
        # as per-row KV slot lists (ModelRunner.tree_rows_max)
        self.tree_nodes = 0
        self.tree_rows: Callable[[], int] = lambda: 0
        # A drafting step that finds nothing to draft overlaps as a plain step does (and the
        # next one waits for its token only where a draft may follow it). False runs such steps
        # without overlap: what benchmarks and tests compare it with.
        self.draftless_overlap = True
        self._look_at = 0  # where the next look for drafts starts among the running requests
        # this step, for the counters and the governor: it overlapped with nothing to draft;
        # it had no prefill work; the share of its requests that had drafts; when it started
        self._draftless = False
        self._decode_only = False
        self._share = 0.0
        self._start, self._generated = 0.0, 0

    @property
    def drafting(self) -> bool:
        """Whether the next step drafts (the governor's mode; always without a governor)."""
        return self.governor is None or self.governor.drafting

    # ---- the step loop's hook -----------------------------------------------------------
    def drain_for_drafts(self, running: list[Req], overlap: bool,
                         drain: Callable[[], list[RolloutOutput]]) -> Sequence[RolloutOutput]:
        if not self.drafting:
            return ()  # a plain step: it overlaps the one in flight
        if overlap and self.draftless_overlap and self.nothing_to_draft(running):
            return ()  # no draft can follow whatever is in flight: the step overlaps it
        start, before = time.perf_counter(), self.counters.generated_tokens
        drained = drain()
        if self.governor is not None:  # that wait is plain decoding's
            self.governor.observe_drain(time.perf_counter() - start, self.counters.generated_tokens - before)
        self.counters.spec_drains += 1
        return drained

    def propose(self, running: list[Req], overlap: bool) -> bool:
        self._start, self._generated = time.perf_counter(), self.counters.generated_tokens
        drafting = self.drafting
        self.propose_all(running)  # a request with a token in flight gets none
        if not drafting:
            self._draftless = False
            return overlap
        _trim_drafts_to_grammar(running)
        # Nothing to draft: the step overlaps as a plain one does (the next step's drafts, if
        # any, first read its tokens back). It pays where the next step cannot draft either
        # (nothing_to_draft), as measured in BENCHMARKS.md (speculative decoding).
        self._draftless = overlap and self.draftless_overlap and not any(r.draft_tokens for r in running)
        return self._draftless

    def scheduled(self, batch: ScheduledBatch) -> None:
        reqs, lens, num_decode = batch.reqs, batch.extend_lens, batch.num_decode
        # prefill work: a chunk, or a prompt's last token (a "decode" that samples its first)
        if any(not reqs[i].draft_tokens for i in range(num_decode, len(reqs))) or any(
                not (reqs[i].output_ids or reqs[i].num_inflight) for i in range(num_decode)):
            self.trees_to_chains(batch)
        # for the governor: a step without prefill work, and the share of its requests with drafts
        self._decode_only = all(n == 1 + len(r.draft_tokens) and r.output_ids for r, n in zip(reqs, lens))
        self._share = sum(1 for r in reqs if r.draft_tokens) / len(reqs) if self._decode_only else 0.0
        self.counters.spec_overlapped_steps += self._draftless and self._decode_only

    def rows(self, reqs: list[Req]) -> StepRows:
        if not any(r.draft_tokens for r in reqs):
            return PLAIN_ROWS
        return VerifyRows(self, [list(r.draft_tokens) for r in reqs], [r.draft_parents for r in reqs])

    def finished(self, req: Req) -> None:
        self.drafter.observe_finished(req)

    def end_step(self) -> None:
        if self.governor is not None:  # this step's tokens read back, or (overlapped) the previous step's
            self.governor.observe(time.perf_counter() - self._start, self.counters.generated_tokens - self._generated,
                                  self._decode_only, self._share > 0, self._share)

    def verify_tokens(self, req: Req, need: int, budget: int) -> int:
        """A verify runs the last token and all k drafts, whole or not at all."""
        k = len(req.draft_tokens)
        assert self.kv is not None, "the scheduler's speculation has the engine's KV manager"
        if need != 1 or 1 + k > budget or not self.kv.extend(req, req.num_computed_tokens + 1 + k):
            req.clear_drafts()  # short of budget or memory: a plain decode this step
            return need
        return 1 + k

    def trees_to_chains(self, batch: ScheduledBatch) -> None:
        """A step with prefill work may run in the extend layout, where each request attends
        causally over its positions: a draft tree's nodes would see their siblings there. Its
        trees keep their leading chain (a tree drafter grows its chain first) and give back
        the other nodes' KV."""
        assert self.kv is not None
        for i in range(batch.num_decode, len(batch.reqs)):
            req = batch.reqs[i]
            if req.draft_parents is None:
                continue
            chain = next((j for j, p in enumerate(req.draft_parents) if p != j - 1), len(req.draft_parents))
            req.draft_tokens = req.draft_tokens[:chain]
            req.draft_parents = None
            self.kv.truncate(req, req.num_computed_tokens + 1 + chain)
            batch.extend_lens[i] = 1 + chain

    # ---- the drafting policy ------------------------------------------------------------
    def propose_all(self, running: list[Req]) -> None:
        """Set `draft_tokens` on every running request that is decoding this step."""
        for req in running:
            req.clear_drafts()
        if self.governor is not None and not self.governor.drafting:
            if self.governor.check_due():
                self.governor.looked(*self.look(running), len(running))
            return  # plain decoding is faster right now (governor.py)
        drafter = self.drafter
        drafter.begin_step(running)
        wanted: list[tuple[Req, int]] = []
        for req in running:
            if not req.output_ids:
                continue  # prefilling
            if req.spec_pause > 0:  # counts down in every drafting step, its token in flight or not
                req.spec_pause -= 1
                continue
            if req.num_inflight or req.num_computed_tokens != req.seq_len - 1:
                continue  # its last token is not known on the host (in flight, or re-prefilling)
            if req.spec_k < 0:
                req.spec_k = drafter.max_tokens
            # accepting every draft and the token after them must fit the request's limits
            k = min(req.spec_k, req.params.max_new_tokens - len(req.output_ids) - 1,
                    drafter.context_len - req.known_len - 1)
            if k > 0:
                wanted.append((req, k))
        # trees where the step's rows stay within what the attention takes as slot lists: every
        # running request a row, the drafting ones `tree_nodes` more
        if self.tree_nodes and wanted and len(running) + len(wanted) * self.tree_nodes <= self.tree_rows():
            for req, k in wanted:
                if req.grammar is not None:  # a grammar trims chains only (_trim_drafts_to_grammar)
                    req.draft_tokens = drafter.propose(req, k)[:k]
                    continue
                nodes = min(self.tree_nodes, drafter.context_len - req.known_len - 1)
                tokens, parents = drafter.propose_tree(req, k, nodes)
                req.draft_tokens = tokens
                req.draft_parents = None if parents == list(range(-1, len(parents) - 1)) else parents
            return
        for (req, k), drafts in zip(wanted, drafter.propose_batch(wanted)):
            req.draft_tokens = drafts[:k]

    def nothing_to_draft(self, running: list[Req]) -> bool:
        """Can no decoding request get a draft this step, whatever its token still in flight
        is? Then the step need not wait for that token: it overlaps, losing no draft. Stops at
        the first request that may draft."""
        return not any(self.drafter.may_draft_next(r) for r in running
                       if (r.output_ids or r.num_inflight) and r.spec_pause <= 0)  # (its first token may be in flight)

    def look(self, running: list[Req]) -> tuple[int, int]:
        """(how many would get a draft, how many were asked) of the next LOOK_REQUESTS running
        requests in turn, on the tokens the host knows: a plain hold's look (governor.py). A
        drafter whose proposals cost device work looks at none (it is not asked between steps)."""
        if not self.drafter.looks:
            return 0, 0
        decoding = [r for r in running if r.output_ids and r.spec_pause <= 0]
        n = min(LOOK_REQUESTS, len(decoding))
        found = sum(bool(self.drafter.propose(decoding[(self._look_at + i) % len(decoding)], 1)) for i in range(n))
        self._look_at += n
        return found, n

    # ---- the engine's -------------------------------------------------------------------
    def policy_changed(self, lora_name: str | None = None) -> None:
        """The governor measures afresh, then the drafter's own hook."""
        if self.governor is not None:
            self.governor.restart()
        if lora_name is None:
            self.drafter.on_weight_update()
        else:
            self.drafter.on_adapter_update(lora_name)

    def release(self) -> None:
        self.drafter.release()


def _trim_drafts_to_grammar(running: list[Req]) -> None:
    """Cut each constrained request's drafts to what its grammar allows: a refused draft
    could never be accepted (the token drawn there is masked to the grammar), so verifying
    it would only waste the position."""
    for req in running:
        if req.grammar is not None and req.draft_tokens:
            req.draft_tokens = req.draft_tokens[: req.grammar.legal_prefix(req.draft_tokens)]
