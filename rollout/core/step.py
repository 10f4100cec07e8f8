"""The step loop: schedule -> forward -> sample (results left on the device) -> read back
(append tokens, finish requests). Two paths, side by side: the plain one reads a step back
before the next, the overlapped one launches step t+1 before reading step t back, so host
work hides behind device work. A step with constrained rows (structured output) reads step t
back between its forward and its sampling: their masks need the token in flight.

Speculative decoding and structured output come in through hooks (hooks.py), whose null
implementations stand in when they are off: the speculation hook drafts before the
schedule, says whether the step overlaps and lays out a verify step's rows; the grammar hook
masks constrained rows.

`forward`, `sample` and `read_back` are public so that benchmarks and diagnostics can time
them (benchmarks/host.py, benchmarks/diagnostics/host_time.py) without reaching into private methods.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import torch

from rollout.batch import ScheduledBatch
from rollout.cache.manager import KVManager
from rollout.core.hooks import NO_GRAMMAR, NO_SPECULATION, Grammar, Launched, Speculation, StepRows
from rollout.core.outputs import Outputs
from rollout.metrics import Counters
from rollout.model.runner import ModelRunner
from rollout.request import Req, RolloutOutput
from rollout.sampling import SamplingBatch, sample
from rollout.scheduler import Scheduler

log = logging.getLogger("rollout")


@dataclass
class Forwarded:
    """A step whose logits are on the device and not yet sampled: with overlap scheduling and
    constrained rows, the previous step is read back in between (the masks need its tokens)."""

    logits: torch.Tensor  # [rows, vocab] float32: one row per position drawn
    reqs: list[Req]  # the requests that sample, in row order
    rows: StepRows  # how the rows map to the requests (a verify step: 1 + drafts each)
    version: int
    constrained: bool  # does a request sample under a grammar


class StepLoop:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner, kv: KVManager, outputs: Outputs,
                 counters: Counters, vocab_size: int, overlap: bool, speculation: Speculation = NO_SPECULATION,
                 grammar: Grammar = NO_GRAMMAR) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.kv = kv
        self.outputs = outputs
        self.counters = counters
        self.vocab_size = vocab_size
        self.overlap = overlap  # whether plain steps overlap (a verify step never does)
        self.speculation = speculation
        self.grammar = grammar
        self.inflight: Launched | None = None  # overlap scheduling: the step not yet read back

    def step(self, version: int) -> list[RolloutOutput]:
        """One scheduler -> model -> sampler step; returns the requests that finished (with
        overlap scheduling, those of the previous step)."""
        finished = self._finish_failed_grammars(version)
        if self.scheduler.num_deadlines and time.monotonic() >= self.scheduler.next_deadline:
            finished.extend(self._finish_expired(version))
        running = self.scheduler.running
        if self.inflight is not None:  # drafts continue the tokens in flight: the hook reads them first
            finished.extend(self.speculation.drain_for_drafts(running, self.overlap, self.drain))
        overlap = self.speculation.propose(running, self.overlap)
        batch = self.scheduler.schedule()
        if batch is None:
            if overlap:
                finished.extend(self.drain())
            if self.scheduler.waiting:
                self.grammar.wait_for_compiles(self.scheduler.waiting)
            return finished
        self.speculation.scheduled(batch)
        finished.extend(self._overlapped(batch, version) if overlap else self._plain(batch, version))
        self.counters.steps += 1
        self.speculation.end_step()
        return finished

    def _plain(self, batch: ScheduledBatch, version: int) -> list[RolloutOutput]:
        """Launch the step and read its tokens back: the host waits for the device."""
        return self.read_back(self.sample(self.forward(batch, version)))

    def _overlapped(self, batch: ScheduledBatch, version: int) -> list[RolloutOutput]:
        """Launch the step, then read back the one in flight while the device works; this
        step's tokens stay in flight (on the device, fed to the next step from there)."""
        forwarded = self.forward(batch, version)
        pool_rows = [r.req_pool_idx for r in forwarded.reqs]  # taken before a read back frees them
        finished: list[RolloutOutput] = []
        previous, self.inflight = self.inflight, None
        if previous is not None and forwarded.constrained:
            # A constrained row's mask needs the token still in flight: read it back now,
            # while the forward just launched keeps the device busy; sampling follows.
            finished, previous = self.read_back(previous), None
        self.inflight = self.sample(forwarded, pool_rows)
        if previous is not None:
            finished = self.read_back(previous)
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
        if rows is not None:
            logits = logits[torch.tensor(rows, device=logits.device)]
        return Forwarded(logits, samplers, self.speculation.rows(samplers), version,
                         self.grammar.constrained(samplers))

    def sample(self, forwarded: Forwarded, record_rows: list[int] | None = None) -> Launched:
        """Sample a forwarded batch (under its grammars' masks); results stay on the device.
        `record_rows` (overlap): each request's row in the request table, where its token is
        kept on the device for the next step to feed."""
        logits, samplers, layout, version = forwarded.logits, forwarded.reqs, forwarded.rows, forwarded.version
        if not samplers:
            return Launched([], None, None, 0, version, layout, False)
        # One sampling row per position drawn, each with the noise of its own position: a
        # request verifying k drafts draws k + 1 tokens, exactly what plain decoding would
        # have drawn there (drafts are proposals, accepted where they agree).
        row_reqs, offsets = layout.sampling(samplers)
        mask = self.grammar.mask(samplers, layout.drafts(samplers), logits.device) if forwarded.constrained else None
        res = sample(logits, SamplingBatch.from_reqs(row_reqs, self.vocab_size, logits.device, offsets), mask)
        if record_rows:  # only an overlapped step's tokens are read by a step before the host sees them
            self.runner.record_tokens(record_rows, res.token_ids)
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
        return Launched(samplers, packed, event, k, version, layout, forwarded.constrained)

    def read_back(self, launched: Launched) -> list[RolloutOutput]:
        """Append a launched step's tokens (waiting for them if need be) and finish requests."""
        if launched.event is not None:
            launched.event.synchronize()
        if not launched.reqs:
            return []
        return launched.rows.read_back(launched, launched.packed.tolist(), self)  # type: ignore[union-attr]

    def emit(self, req: Req, row: list[float], top_k: int, version: int, constrained: bool) -> bool:
        """Append a sampled row's token (and its log-probs) to `req`; True when that ends it
        (a stop, its length, or its grammar complete)."""
        token = int(row[0])
        req.append_token(token, *_logprobs(req, row, top_k), version)
        self.counters.generated_tokens += 1
        done = self.outputs.check_finish(req, token)
        if constrained and self.grammar.accept(req, token):
            req.finish_reason, done = "stop", True  # the grammar is complete (its stop token accepted)
        return done

    def finish(self, req: Req, version: int) -> RolloutOutput:
        """A request that just finished leaves the queues (its KV to the tree or the pool)."""
        self.scheduler.remove(req)
        self.counters.finished_requests += 1
        self.speculation.finished(req)
        return self.outputs.make(req, version)

    def abort(self, req: Req, version: int) -> RolloutOutput:
        """End a request now (the caller's abort, a grammar that failed to compile): its
        output holds what it had, marked aborted."""
        req.finish_reason = "abort"
        self.scheduler.remove(req)
        self.counters.aborted_requests += 1
        return self.outputs.make(req, version)

    def _finish_expired(self, version: int) -> list[RolloutOutput]:
        """Requests past their deadline end now ("deadline") with what they have. The step in
        flight is read back first, so its tokens count and none is left on the device for a
        request that is gone (rare: once a request)."""
        now = time.monotonic()
        sched = self.scheduler
        timed = [r for r in (*sched.running, *sched.waiting) if r.deadline is not None]
        expired = [r for r in timed if r.deadline <= now]
        sched.next_deadline = min((r.deadline for r in timed if r.deadline > now), default=math.inf)
        if not expired:
            return []  # the next deadline belonged to a request that has finished since
        outputs = self.drain()
        for req in expired:
            if req.finished:
                continue  # it finished in the step just read back
            req.finish_reason = "deadline"
            sched.remove(req)
            self.counters.deadline_requests += 1
            outputs.append(self.outputs.make(req, version))
        return outputs

    def _finish_failed_grammars(self, version: int) -> list[RolloutOutput]:
        """Waiting requests whose grammar failed to compile end as aborted (the error is
        logged); rare: intake already refused what xgrammar cannot parse."""
        if not self.scheduler.grammar_failed:
            return []
        failed, self.scheduler.grammar_failed = self.scheduler.grammar_failed, []
        outputs = []
        for req in failed:
            if req.finished:
                continue
            log.warning("request %s: %s", req.rid, req.grammar.error())  # type: ignore[union-attr]
            outputs.append(self.abort(req, version))
        return outputs

    def _note_admission(self, req: Req) -> None:
        """A request's first admission (by the scheduler or a fork): how much of its prompt
        came from the cache is fixed now, and its prompt counts once in the counters."""
        if req.num_cached_tokens is None:
            req.num_cached_tokens = req.num_computed_tokens
            self.counters.prompt_tokens += len(req.prompt_ids)
            self.counters.cached_prompt_tokens += req.num_cached_tokens

    def _fork_followers(self, samplers: list[Req]) -> tuple[list[int] | None, list[Req]]:
        """Leaders that just finished their prompt hand it (KV and last logits) to their
        waiting followers, which then sample their first token in this same step. Returns
        the logits row of each sampling row once a follower joined (None: the logits' own
        rows, a request verifying k drafts has k + 1), and the requests that sample."""
        rows: list[int] | None = None
        starts: list[int] = []
        out = samplers
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
                    if rows is None:  # the first fork of the step (rare): every row so far, then the forks'
                        starts = _first_rows(samplers)
                        rows, out = list(range(starts[-1])), list(samplers)
                    rows.append(starts[i])  # a leader finishing its prompt has no drafts: one row
                    out.append(follower)
            leader.followers = []
        return rows, out


def _first_rows(samplers: list[Req]) -> list[int]:
    """Each request's first logits row (a request verifying k drafts has k + 1), then the
    number of rows."""
    starts, at = [], 0
    for req in samplers:
        starts.append(at)
        at += 1 + len(req.draft_tokens)
    starts.append(at)
    return starts


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
