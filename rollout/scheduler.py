"""Scheduler: waiting and running queues -> one ScheduledBatch per step.

There is no prefill phase and no decode phase: each request has num_computed_tokens, and
a step computes the next tokens of each chosen request (1 for a decode, a chunk for a
prefill; a prefix-cache hit just starts the counter higher). Running requests go first
(oldest first); waiting requests are admitted while the step's prefill token budget and
KV memory last. When KV runs out for a running request, the newest running requests are
retracted to the front of `waiting` (their computed KV left in the prefix cache) and
resume later: nothing is dropped or truncated. SamplingParams.priority orders both: higher
priorities run and are admitted first, and the lowest are retracted first.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from itertools import count
from typing import Protocol

from rollout.batch import ScheduledBatch
from rollout.cache.manager import KVManager
from rollout.config import EngineConfig
from rollout.core.hooks import NO_SPECULATION, Speculation
from rollout.request import Req

_LPM_MAX_WAITING = 128  # above this, sorting by prefix match costs more than it saves


class AdapterResidency(Protocol):
    """What the scheduler asks of the adapter manager (lora/manager.py LoraManager): a request
    that runs under an adapter holds that adapter's device slot while it runs."""

    def can_acquire(self, name: str) -> bool:
        """Could a request under adapter `name` get its slot now?"""
        ...

    def acquire(self, req: Req) -> None: ...

    def release(self, req: Req) -> None: ...


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVManager, lora: AdapterResidency | None = None,
                 speculation: Speculation = NO_SPECULATION) -> None:
        self.config = config
        self.kv = kv
        # a request with drafts asks it how many of them run this step (Speculation.verify_tokens)
        self.speculation = speculation
        # Running requests' adapters always sit in device slots, so a step never mixes more
        # adapters than there are slots: a request whose adapter finds no slot waits.
        self.lora = lora
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []  # admission order, oldest first
        # waiting requests whose grammar failed to compile: the step loop finishes them
        self.grammar_failed: list[Req] = []
        self._arrival = count()
        # queued requests with a deadline / a non-zero priority: when both are 0 (the common
        # case) a step pays nothing for either feature
        self.num_deadlines = 0
        self.num_prioritized = 0
        # no queued request expires before this (it may be stale-early after a removal: the
        # step loop's scan then sets it again), so a step reads the clock and nothing more
        self.next_deadline = math.inf

    # ---- queue management ---------------------------------------------------------------
    def add(self, req: Req) -> None:
        params = req.params
        if params.deadline_s is not None:
            req.deadline = time.monotonic() + params.deadline_s
            self.num_deadlines += 1
            self.next_deadline = min(self.next_deadline, req.deadline)
        if params.priority:
            self.num_prioritized += 1
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def find(self, rid: str) -> Req | None:
        for req in self.running:
            if req.rid == rid:
                return req
        for req in self.waiting:
            if req.rid == rid:
                return req
        return None

    def remove(self, req: Req) -> None:
        """Take a request out of either queue and give back its KV (finish or abort)."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._release(req)
        self.num_deadlines -= req.deadline is not None
        self.num_prioritized -= bool(req.params.priority)
        for follower in req.followers:  # a leader that leaves before forking frees its followers
            follower.leader = None
        req.followers = []

    def start_running(self, req: Req) -> None:
        """A waiting request whose KV was set up outside admission (a fork)."""
        self.waiting.remove(req)
        req.arrival = next(self._arrival)
        self.running.append(req)
        if self.lora is not None and req.lora_name is not None:
            self.lora.acquire(req)  # its leader's adapter: resident and in use, so never short

    def _release(self, req: Req, *, cache: bool = True) -> None:
        self.kv.release(req, cache=cache)
        if self.lora is not None:
            self.lora.release(req)

    def retract(self, req: Req, *, keep_kv: bool = True) -> None:
        self.running.remove(req)
        req.clear_drafts()  # proposed for a step it no longer runs in
        self._release(req, cache=keep_kv)
        self.waiting.appendleft(req)

    def retract_all(self, which: Callable[[Req], bool] | None = None, *, keep_kv: bool = True) -> list[Req]:
        """Retract every running request (or those `which` selects), newest first.
        keep_kv=False drops their KV instead of caching it: for a weight update, an adapter
        update or sleep, which drop that KV right after (inserting it into the tree only to
        flush it was half the work: 32 requests, retract + flush 3.38 -> 1.72 ms on CPU)."""
        victims = [r for r in reversed(self.running) if which is None or which(r)]
        for req in victims:
            self.retract(req, keep_kv=keep_kv)
        return victims

    # ---- one step ---------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch | None:
        budget = self.config.max_prefill_tokens
        decodes: list[tuple[Req, int]] = []
        extends: list[tuple[Req, int]] = []
        retracted: list[Req] = []
        gone: set[int] = set()  # ids of requests retracted earlier in this loop (O(1) test)
        for req in self._by_priority(self.running):
            if gone and id(req) in gone:
                continue
            seq_len = req.seq_len
            if req.num_inflight and seq_len - len(req.prompt_ids) >= req.params.max_new_tokens:
                continue  # its last token is already in flight: nothing more to compute
            need = seq_len - req.num_computed_tokens
            if req.draft_tokens:  # a verify: its last token and its drafts, or a plain decode
                need = self.speculation.verify_tokens(req, need, budget)
            n = 1 if need == 1 else min(need, budget)
            if n <= 0:
                continue  # a chunked prefill waits for budget; it keeps its KV
            while not self.kv.extend(req, req.num_computed_tokens + n):
                victim = self._victim()  # the newest of the lowest priority: not yet in the batch
                self.retract(victim)
                retracted.append(victim)
                gone.add(id(victim))
                if victim is req:
                    break
            if gone and id(req) in gone:
                continue
            if need > 1:
                budget -= n
            # a decode is one token that completes the request's known tokens; a 1-token
            # prefill chunk is an extend (it samples nothing)
            (decodes if n == need == 1 else extends).append((req, n))
        if not retracted and self.waiting:
            # Don't admit in a step that had to retract: memory is already short.
            budget = self._admit(budget, decodes, extends)
        if not decodes and not extends:
            return None
        chosen = decodes + extends
        return ScheduledBatch(
            reqs=[r for r, _ in chosen],
            extend_lens=[n for _, n in chosen],
            num_decode=len(decodes),
            retracted=retracted,
        )

    def _admit(self, budget: int, decodes: list[tuple[Req, int]], extends: list[tuple[Req, int]]) -> int:
        # Leave room for every running request's next token, so admission does not force
        # a retraction on the very next step.
        reserve = sum(self.kv.pages_to_extend(r, r.seq_len + 1) for r in self.running)
        for req in self._ordered_waiting():
            if budget <= 0 or len(self.running) >= self.config.max_running_requests:
                break
            if req.leader is not None or req.num_inflight:
                continue  # waits for its leader's prompt (then forks it) / for its last token
            if req.grammar is not None and not req.grammar.ready():
                continue  # its grammar is compiling (off this thread): the others go on
            if req.grammar is not None and req.grammar.error() is not None:
                if req not in self.grammar_failed:
                    self.grammar_failed.append(req)
                continue
            lora = self.lora if req.lora_name is not None else None
            if lora is not None and not lora.can_acquire(req.lora_name):  # type: ignore[arg-type]
                continue  # every slot serves a running adapter: this one waits, others may go
            n = self.kv.admit(req, budget, reserve)
            if n is None:
                break
            if lora is not None:
                lora.acquire(req)
            self.waiting.remove(req)
            req.arrival = next(self._arrival)
            self.running.append(req)
            if n == 1 and req.num_computed_tokens + 1 == req.seq_len:
                decodes.append((req, n))
            else:
                extends.append((req, n))
                budget -= n
        return budget

    def _ordered_waiting(self) -> list[Req]:
        reqs = list(self.waiting)
        if self.config.schedule_policy == "lpm" and self.kv.tree is not None and len(reqs) <= _LPM_MAX_WAITING:
            reqs.sort(key=self.kv.prefix_len, reverse=True)  # stable: FCFS among equals
        if self.num_prioritized:
            reqs.sort(key=lambda r: -r.params.priority)  # stable: the order above within a priority
        return reqs

    def _by_priority(self, reqs) -> list[Req]:
        """Highest priority first, the order given within one (stable). No sort when no queued
        request has a priority: the common case costs a counter test."""
        if not self.num_prioritized:
            return list(reqs)
        return sorted(reqs, key=lambda r: -r.params.priority)

    def _victim(self) -> Req:
        """The request a step short of KV retracts. schedule() walks the running requests by
        priority, in arrival order within one, so this one is the last it would reach."""
        if not self.num_prioritized:
            return self.running[-1]
        return min(self.running, key=lambda r: (r.params.priority, -r.arrival))
