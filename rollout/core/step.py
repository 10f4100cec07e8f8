"""The step loop: schedule -> forward -> sample (results left on the device) -> read back
(append tokens, finish requests), with overlap scheduling: step t+1 is launched before step
t's tokens are read back, so host work hides behind device work. A step with constrained
rows (structured output) reads step t back between its forward and its sampling: their
masks need the token in flight.

`forward`, `sample` and `read_back` are public so that benchmarks and diagnostics can time
them (scripts/bench_host.py, diag_host.py) without reaching into private methods.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rollout.cache.manager import KVManager
from rollout.core.outputs import Outputs
from rollout.metrics import Counters
from rollout.model.runner import ModelRunner
from rollout.request import Req, RolloutOutput, tree_depths
from rollout.sampling import SamplingBatch, sample
from rollout.scheduler import ScheduledBatch, Scheduler
from rollout.structured.bitmask import TokenMask

if TYPE_CHECKING:
    from rollout.structured.service import StructuredOutput
    from speculative.base import Drafter

log = logging.getLogger("rollout")


@dataclass
class Forwarded:
    """A step whose logits are on the device and not yet sampled: with overlap scheduling and
    constrained rows, the previous step is read back in between (the masks need its tokens)."""

    logits: torch.Tensor  # [rows, vocab] float32: one row per position drawn
    reqs: list[Req]  # the requests that sample, in row order
    drafts: list[list[int]]  # the drafts each request verifies (its rows are 1 + len(drafts))
    pool_rows: list[int]  # each request's row in the request table (taken before a read back frees it)
    version: int
    trees: list[list[int] | None]  # each request's draft parents (None: a chain)

    @property
    def constrained(self) -> bool:
        return any(r.grammar is not None for r in self.reqs)


@dataclass
class Launched:
    """A step whose sampled tokens are still on the device (or just copied back)."""

    reqs: list[Req]
    packed: torch.Tensor | None  # [rows, 3 + 4k] float64: token, raw lp, processed lp, top-k
    # speculation: the drafts each request verified this step (its rows are 1 + len(drafts))
    drafts: list[list[int]]
    event: torch.cuda.Event | None  # set when the copy to pinned host memory is done
    top_k: int
    version: int  # weight version that produced these tokens
    trees: list[list[int] | None]  # draft parents of each request's drafts (None: a chain)


class StepLoop:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner, kv: KVManager, outputs: Outputs,
                 counters: Counters, vocab_size: int, overlap: bool, drafter: Drafter | None = None,
                 structured: StructuredOutput | None = None, overlap_plain: bool = False) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.kv = kv
        self.outputs = outputs
        self.counters = counters
        self.vocab_size = vocab_size
        self.overlap = overlap
        self.drafter = drafter  # speculative decoding (then overlap is off: drafts need the last tokens)
        # ... except in steps the governor keeps plain: those overlap as without speculation
        self.overlap_plain = overlap_plain
        # ... and drafting steps with nothing to draft (benchmarks set False for the "before")
        self.overlap_draftless = True
        self._overlapped = overlap  # whether the step being run overlaps
        self.inflight: Launched | None = None  # overlap scheduling: the step not yet read back
        self.structured = structured  # grammar masks for constrained requests

    def step(self, version: int) -> list[RolloutOutput]:
        """One scheduler -> model -> sampler step; returns the requests that finished (with
        overlap scheduling, those of the previous step)."""
        finished = self._finish_failed_grammars(version)
        self._overlapped = self.overlap
        draftless_overlap = self.overlap_plain and self.overlap_draftless
        if self.drafter is not None:
            if not self.drafter.drafting:
                self._overlapped = self.overlap_plain
            elif self.inflight is not None and not (draftless_overlap and
                                                    self.drafter.nothing_to_draft(self.scheduler.running)):
                # drafts continue the tokens in flight: read them back first
                drained, before = time.perf_counter(), self.counters.generated_tokens
                finished.extend(self.drain())
                self.drafter.observe_drain(time.perf_counter() - drained, self.counters.generated_tokens - before)
                self.counters.spec_drains += 1
        start, generated = time.perf_counter(), self.counters.generated_tokens
        draftless = False  # a drafting step with nothing to draft, overlapped
        if self.drafter is not None:
            self.drafter.propose_all(self.scheduler.running)  # a request with a token in flight gets none
            _trim_drafts_to_grammar(self.scheduler.running)
            if draftless_overlap and not self._overlapped and not any(r.draft_tokens for r in self.scheduler.running):
                # Nothing to draft: the step overlaps as a plain one does (the next step's
                # drafts, if any, first read its tokens back). It pays where the next step
                # cannot draft either (nothing_to_draft): on the H200 a batch-1 step costs
                # 4.34 ms overlapped against 4.73 (BENCHMARKS.md, speculative decoding, session 13).
                self._overlapped = draftless = True
        batch = self.scheduler.schedule()
        decode_only = verified = False  # for the governor: a step without prefill work, and one verifying drafts
        share = 0.0  # ... and the share of its requests that had drafts
        if self.drafter is not None and batch is not None:
            decode_only = batch.decode_only()
            share = sum(1 for r in batch.reqs if r.draft_tokens) / len(batch.reqs) if decode_only else 0.0
            verified = share > 0
            self.counters.spec_overlapped_steps += draftless and decode_only
        forwarded = self.forward(batch, version) if batch is not None else None
        if self._overlapped:
            previous, self.inflight = self.inflight, None
            if previous is not None and forwarded is not None and forwarded.constrained:
                # A constrained row's mask needs the token still in flight: read it back now,
                # while the forward just launched keeps the device busy; sampling follows.
                finished.extend(self.read_back(previous))
                previous = None
            self.inflight = self.sample(forwarded) if forwarded is not None else None
            if previous is not None:
                finished.extend(self.read_back(previous))
        elif forwarded is not None:
            finished.extend(self.read_back(self.sample(forwarded)))
        if batch is not None:
            self.counters.steps += 1
            if self.drafter is not None:  # this step's tokens read back, or (overlapped) the previous step's
                self.drafter.observe_speed(time.perf_counter() - start, self.counters.generated_tokens - generated,
                                           decode_only, verified, share)
        elif self.scheduler.waiting:
            self._wait_for_grammars()
        return finished

    def drain(self) -> list[RolloutOutput]:
        """Read back the step in flight (before anything that must see every token)."""
        if self.inflight is None:
            return []
        launched, self.inflight = self.inflight, None
        return self.read_back(launched)

    def forward(self, batch: ScheduledBatch, version: int) -> Forwarded:
        """Run the model on one batch: its logits stay on the device, not yet sampled."""
        self.counters.retractions += len(batch.retracted)
        for req in batch.reqs:
            self._note_admission(req)
        fb = self.runner.prepare(batch)
        logits = self.runner.forward(fb)
        samplers = batch.samplers()
        for req, n in zip(batch.reqs, batch.extend_lens):
            req.num_computed_tokens += n
            self.counters.computed_tokens += n
        rows, samplers = self._fork_followers(samplers)
        if len(rows) != logits.shape[0]:
            logits = logits[torch.tensor(rows, device=logits.device)]
        return Forwarded(logits, samplers, [list(r.draft_tokens) for r in samplers],
                         [r.req_pool_idx for r in samplers], version, [r.draft_parents for r in samplers])

    def sample(self, forwarded: Forwarded) -> Launched:
        """Sample a forwarded batch (under its grammars' masks); results stay on the device."""
        logits, samplers, drafts, version = forwarded.logits, forwarded.reqs, forwarded.drafts, forwarded.version
        if not samplers:
            return Launched([], None, [], None, 0, version, [])
        # one sampling row per position drawn: a request verifying k drafts draws k + 1 tokens,
        # each with the noise of its own position, so what it emits is exactly what plain
        # decoding would have drawn there (drafts are proposals, accepted where they agree)
        # (a tree node's position is its depth below the request's last token)
        row_reqs = [r for r, d in zip(samplers, drafts) for _ in range(1 + len(d))]
        offsets = None
        if len(row_reqs) > len(samplers):
            offsets = [j for d, tree in zip(drafts, forwarded.trees)
                       for j in [0, *(range(1, 1 + len(d)) if tree is None else tree_depths(tree))]]
        mask = self._token_mask(forwarded, logits.device) if forwarded.constrained else None
        res = sample(logits, SamplingBatch.from_reqs(row_reqs, self.vocab_size, logits.device, offsets), mask)
        if self._overlapped:  # only then does a step read tokens it has not seen
            self.runner.record_tokens(forwarded.pool_rows, res.token_ids)
        for req in samplers:
            req.num_inflight += 1
        # Everything the host needs, packed into one float64 tensor (token ids < 2**53 are
        # exact) for one transfer: the step's one host sync happens when it is read back.
        columns = [res.token_ids, res.raw_logprobs, res.processed_logprobs]
        k = 0
        if res.top_raw is not None:
            k = res.top_raw[0].shape[1]
            columns += [*res.top_raw, *res.top_processed]  # type: ignore[misc]
        packed = torch.cat([c.double().reshape(len(row_reqs), -1) for c in columns], dim=1)
        event = None
        if packed.is_cuda:
            host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            host.copy_(packed, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            packed = host
        return Launched(samplers, packed, drafts, event, k, version, forwarded.trees)

    def _token_mask(self, forwarded: Forwarded, device: torch.device) -> TokenMask | None:
        """The grammar mask of this step's constrained rows (their matchers have seen every
        token emitted so far: with overlap, the previous step was read back first)."""
        rows, at = [], 0
        for req, drafts in zip(forwarded.reqs, forwarded.drafts):
            if req.grammar is not None and not req.finished:
                rows.append((at, req.grammar, drafts))
            at += 1 + len(drafts)
        assert self.structured is not None, "constrained requests come through the engine's intake"
        return self.structured.masks.build(rows, at, device)

    def _finish_failed_grammars(self, version: int) -> list[RolloutOutput]:
        """Waiting requests whose grammar failed to compile end as aborted (the error is
        logged); rare: intake already refused what xgrammar cannot parse."""
        failed, self.scheduler.grammar_failed = self.scheduler.grammar_failed, []
        outputs = []
        for req in failed:
            if req.finished:
                continue
            log.warning("request %s: %s", req.rid, req.grammar.error())  # type: ignore[union-attr]
            outputs.append(self.abort(req, version))
        return outputs

    def abort(self, req: Req, version: int) -> RolloutOutput:
        """End a request now (the caller's abort, a grammar that failed to compile): its
        output holds what it had, marked aborted."""
        req.finish_reason = "abort"
        self.scheduler.remove(req)
        self.counters.aborted_requests += 1
        return self.outputs.make(req, version)

    def _wait_for_grammars(self) -> None:
        """Nothing ran and requests wait: if it is for their grammars, sleep until one is
        compiled (at most 50 ms) instead of spinning against the compiling threads."""
        pending = [r.grammar.compiled for r in self.scheduler.waiting if r.grammar is not None and not r.grammar.ready()]
        if pending:
            wait(pending, timeout=0.05, return_when=FIRST_COMPLETED)

    def read_back(self, launched: Launched) -> list[RolloutOutput]:
        """Append a launched step's tokens (waiting for them if need be) and finish requests."""
        if launched.event is not None:
            launched.event.synchronize()
        if not launched.reqs:
            return []
        packed = launched.packed.tolist()  # type: ignore[union-attr]
        k = launched.top_k
        finished = []
        at = 0  # the first row of the next request
        for req, drafts, tree in zip(launched.reqs, launched.drafts, launched.trees):
            rows, at = packed[at : at + 1 + len(drafts)], at + 1 + len(drafts)
            req.num_inflight -= 1
            req.clear_drafts()
            if req.finished:
                continue  # finished or aborted while this token was in flight: dropped
            # row 0 draws after the last known token; a draft's row draws after that draft. The
            # run follows the drafts the draws equal: a chain's next, or the matching child
            path: list[int] = []  # the accepted drafts' indices
            node = -1
            while True:
                row = rows[node + 1]
                token = int(row[0])
                req.append_token(token, *self._logprobs(req, row, k), launched.version)
                self.counters.generated_tokens += 1
                done = self.outputs.check_finish(req, token)
                if req.grammar is not None and req.grammar.accept(token):
                    req.finish_reason, done = "stop", True  # the grammar is complete (its stop token accepted)
                node = _next_draft(drafts, tree, node, token) if drafts and not done else None
                if node is None:
                    break  # finished, or no draft is the token drawn: the run ends
                path.append(node)
            if drafts:
                if tree is not None:
                    self._compact_path(req, len(drafts), path)
                self._settle_drafts(req, len(drafts), 1 + len(path), max(tree_depths(tree)) if tree else len(drafts))
            if req.finished:
                self.scheduler.remove(req)
                self.counters.finished_requests += 1
                if self.drafter is not None:
                    self.drafter.observe_finished(req)
                finished.append(self.outputs.make(req, launched.version))
        return finished

    @staticmethod
    def _logprobs(req: Req, row: list[float], k: int) -> tuple[float, list[tuple[int, float]] | None]:
        mode = req.params.logprobs_mode
        lp = row[1] if mode == "raw" else row[2]
        top = None
        if req.params.top_logprobs:
            # per row: raw values, raw ids, processed values, processed ids (k each)
            base = 3 if mode == "raw" else 3 + 2 * k
            vals, ids = row[base : base + k], row[base + k : base + 2 * k]
            top = [(int(t), v) for t, v in zip(ids, vals)][: req.params.top_logprobs]
        return lp, top

    def _compact_path(self, req: Req, num_drafts: int, path: list[int]) -> None:
        """A tree's accepted drafts into position order: draft i's K/V was stored at the slot
        of position start + 1 + i (runner._prepare_rows), and the j-th accepted one belongs
        at start + 1 + j. A parent precedes its children, so path[j] >= j: move j reads slot
        path[j] >= j, past every slot the moves before it wrote (copy_slots' contract)."""
        moves = [(i, j) for j, i in enumerate(path) if i != j]
        if not moves:
            return
        start = req.num_computed_tokens - 1 - num_drafts  # the step computed start .. start + num_drafts
        row = self.kv.table[req.req_pool_idx]
        self.kv.pool.copy_slots(row[[start + 1 + i for i, _ in moves]], row[[start + 1 + j for _, j in moves]])

    def _settle_drafts(self, req: Req, num_drafts: int, emitted: int, depth: int | None = None) -> None:
        """KV rollback: the step computed the last token and every draft; only the KV of the
        last token and of the accepted drafts is kept (the rest is never cached or reused),
        and whole pages past it go back to the allocator. `depth`: the drafts' depth (a tree's
        deepest level; a chain's length), what the draft length policy compares with."""
        rejected = num_drafts + 1 - emitted
        req.num_computed_tokens -= rejected
        self.kv.truncate(req, req.num_computed_tokens)
        self.counters.drafted_tokens += num_drafts
        self.counters.accepted_tokens += emitted - 1
        self.counters.verify_steps += 1
        if self.drafter is not None:
            self.drafter.observe_step(req, num_drafts if depth is None else depth, emitted - 1)

    def _note_admission(self, req: Req) -> None:
        """A request's first admission (by the scheduler or a fork): how much of its prompt
        came from the cache is fixed now, and its prompt counts once in the counters."""
        if req.num_cached_tokens is None:
            req.num_cached_tokens = req.num_computed_tokens
            self.counters.prompt_tokens += len(req.prompt_ids)
            self.counters.cached_prompt_tokens += req.num_cached_tokens

    def _fork_followers(self, samplers: list[Req]) -> tuple[list[int], list[Req]]:
        """Leaders that just finished their prompt hand it (KV and last logits) to their
        waiting followers, which then sample their first token in this same step. Returns
        the logits row of each sampling row (a request verifying k drafts has k + 1)."""
        starts, at = [], 0
        for req in samplers:
            starts.append(at)
            at += 1 + len(req.draft_tokens)
        rows = list(range(at))
        out = list(samplers)
        for i, leader in enumerate(samplers):
            if not leader.followers or leader.output_ids:
                continue
            self.kv.share_prompt(leader)
            for follower in leader.followers:
                follower.leader = None
                if follower.finished or follower not in self.scheduler.waiting:
                    continue
                if self.kv.fork(leader, follower):
                    self.scheduler.start_running(follower)
                    self._note_admission(follower)
                    rows.append(starts[i])  # a leader finishing its prompt has no drafts: one row
                    out.append(follower)
            leader.followers = []
        return rows, out


def _next_draft(drafts: list[int], parents: list[int] | None, node: int, token: int) -> int | None:
    """The draft after `node` (-1: the last known token) that is `token`, if any."""
    if parents is None:  # a chain: the next draft
        nxt = node + 1
        return nxt if nxt < len(drafts) and drafts[nxt] == token else None
    return next((i for i in range(node + 1, len(drafts)) if parents[i] == node and drafts[i] == token), None)


def _trim_drafts_to_grammar(running: list[Req]) -> None:
    """Cut each constrained request's drafts to what its grammar allows: a refused draft
    could never be accepted (the token drawn there is masked to the grammar), so verifying
    it would only waste the position."""
    for req in running:
        if req.grammar is not None and req.draft_tokens:
            req.draft_tokens = req.draft_tokens[: req.grammar.legal_prefix(req.draft_tokens)]
