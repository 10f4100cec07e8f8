"""The drafter interface, and the per-request draft length policy every drafter shares.

A drafter sees CPU state only (token ids of requests); it never touches the device. The
engine asks it for drafts before each step (`propose_all`), tells it how each verification
went (`observe_step`) and when a request finishes (`observe_finished`, for history).

Draft length adapts per request: it grows by one after a fully accepted run and halves
after a fully rejected one; a request whose drafts keep failing stops drafting for a while,
then tries again. So speculation costs a request little when its continuation cannot be
guessed (a verify step reads the weights once, as a decode does; its extra work is the
rejected positions).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

from rollout.request import Req
from speculative.governor import SpeedGovernor

PAUSE_STEPS = 16  # steps a request waits before drafting again after its length fell to 0
LOOK_REQUESTS = 4  # running requests a plain hold's look for drafts asks about (governor.py)


class Drafter(ABC):
    def __init__(self, max_tokens: int, context_len: int) -> None:
        self.max_tokens = max_tokens
        self.context_len = context_len
        self.governor: SpeedGovernor | None = SpeedGovernor()  # None: always draft
        # draft trees (speculative/tree.py) of at most this many nodes where the drafter grows
        # them (0: chains), in steps whose verify rows fit `tree_rows()`: the rows the engine's
        # attention can take as per-row KV slot lists (ModelRunner.tree_rows_max)
        self.tree_nodes = 0
        self.tree_rows: Callable[[], int] = lambda: 0
        self._look_at = 0  # where the next look for drafts starts among the running requests

    @property
    def drafting(self) -> bool:
        """Whether the next step drafts (the governor's mode; always without a governor)."""
        return self.governor is None or self.governor.drafting

    def observe_drain(self, seconds: float, tokens: int) -> None:
        """A drafting step first read back an overlapped plain step: plain decoding's time."""
        if self.governor is not None:
            self.governor.observe_drain(seconds, tokens)

    def propose_all(self, running: list[Req]) -> None:
        """Set `draft_tokens` on every running request that is decoding this step."""
        for req in running:
            req.clear_drafts()
        if self.governor is not None and not self.governor.drafting:
            if self.governor.check_due():
                self.governor.looked(*self.look(running), len(running))
            return  # plain decoding is faster right now (governor.py)
        self.begin_step(running)
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
                req.spec_k = self.max_tokens
            # accepting every draft and the token after them must fit the request's limits
            k = min(req.spec_k, req.params.max_new_tokens - len(req.output_ids) - 1,
                    self.context_len - req.known_len - 1)
            if k > 0:
                wanted.append((req, k))
        # trees where the step's rows stay within what the attention takes as slot lists: every
        # running request a row, the drafting ones `tree_nodes` more
        if self.tree_nodes and wanted and len(running) + len(wanted) * self.tree_nodes <= self.tree_rows():
            for req, k in wanted:
                if req.grammar is not None:  # a grammar trims chains only (step.py)
                    req.draft_tokens = self.propose(req, k)[:k]
                    continue
                nodes = min(self.tree_nodes, self.context_len - req.known_len - 1)
                tokens, parents = self.propose_tree(req, k, nodes)
                req.draft_tokens = tokens
                req.draft_parents = None if parents == list(range(-1, len(parents) - 1)) else parents
            return
        for (req, k), drafts in zip(wanted, self.propose_batch(wanted)):
            req.draft_tokens = drafts[:k]

    def nothing_to_draft(self, running: list[Req]) -> bool:
        """Can no decoding request get a draft this step, whatever its token still in flight
        is? Then the step need not wait for that token (rollout/core/step.py): it overlaps,
        losing no draft. Stops at the first request that may draft."""
        return not any(self.may_draft_next(r) for r in running
                       if (r.output_ids or r.num_inflight) and r.spec_pause <= 0)  # (its first token may be in flight)

    def may_draft_next(self, req: Req) -> bool:
        """Could `req` get a draft after one more token, whichever it is? True when the
        drafter cannot tell (then a step always waits for the token in flight)."""
        return True

    def look(self, running: list[Req]) -> tuple[int, int]:
        """(how many would get a draft, how many were asked) of the next LOOK_REQUESTS running
        requests in turn, on the tokens the host knows: a plain hold's look (governor.py). A
        drafter whose proposals cost device work looks at none (it is not asked between steps)."""
        decoding = [r for r in running if r.output_ids and r.spec_pause <= 0]
        n = min(LOOK_REQUESTS, len(decoding))
        found = sum(bool(self.propose(decoding[(self._look_at + i) % len(decoding)], 1)) for i in range(n))
        self._look_at += n
        return found, n

    def begin_step(self, running: list[Req]) -> None:
        """Before the step's proposals (a drafter that looks across requests indexes them here)."""

    def propose_batch(self, wanted: list[tuple[Req, int]]) -> list[list[int]]:
        """Drafts for every (request, k) of this step; a drafter that runs a model batches
        them here, the others answer one request at a time."""
        return [self.propose(req, k) for req, k in wanted]

    @abstractmethod
    def propose(self, req: Req, k: int) -> list[int]:
        """Up to k tokens that may follow `req.all_ids` (empty: no guess)."""

    def propose_tree(self, req: Req, depth: int, nodes: int) -> tuple[list[int], list[int]]:
        """A draft tree of at most `nodes` nodes and `depth` levels: (tokens, parents), parents
        first (-1: a child of the last known token). A drafter without trees drafts a chain."""
        tokens = self.propose(req, min(depth, nodes))
        return tokens, list(range(-1, len(tokens) - 1))

    def observe_speed(self, seconds: float, tokens: int, decode_only: bool = True, verified: bool | None = None,
                      share: float | None = None) -> None:
        """One engine step's wall time and emitted tokens, whether it had no prefill work,
        whether it verified drafts and the share of its requests that had them (for the governor)."""
        if self.governor is not None:
            self.governor.observe(seconds, tokens, decode_only, verified, share)

    def observe_step(self, req: Req, drafted: int, accepted: int) -> None:
        if accepted == drafted:
            req.spec_k = min(self.max_tokens, req.spec_k + 1)
        elif accepted == 0:
            req.spec_k //= 2
            if req.spec_k == 0:
                req.spec_k, req.spec_pause = 1, PAUSE_STEPS

    def observe_finished(self, req: Req) -> None:
        """A request finished (its tokens may draft for later requests)."""

    def policy_changed(self, lora_name: str | None = None) -> None:
        """The target's weights changed, or (lora_name) one adapter's: what the engine calls.
        The governor measures afresh, then the drafter's own hook."""
        if self.governor is not None:
            self.governor.restart()
        if lora_name is None:
            self.on_weight_update()
        else:
            self.on_adapter_update(lora_name)

    def on_weight_update(self) -> None:
        """The policy changed (drafters holding history decide whether to keep it)."""

    def on_adapter_update(self, lora_name: str) -> None:
        """The policy under one adapter changed (a draft model drafts without adapters: it is
        not made stale by one)."""

    def release(self) -> None:
        """Drop every device resource tied to requests (the engine goes to sleep)."""
