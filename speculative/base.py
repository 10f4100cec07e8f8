"""The drafter interface: what a drafter is.

A drafter proposes tokens that may follow a request (a chain, or a tree where it grows them)
and learns from what happens to them. It sees CPU state only (token ids of requests); a
draft model's device work stays behind its own runner. Which requests draft in a step, how
far, and whether a step drafts at all is the Speculator's business (speculator.py), as is
verifying the drafts (verify.py).

Draft length adapts per request (`observe_step`): it grows by one after a fully accepted run
and halves after a fully rejected one; a request whose drafts keep failing stops drafting for
a while, then tries again. So speculation costs a request little when its continuation cannot
be guessed (a verify step reads the weights once, as a decode does; its extra work is the
rejected positions).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from rollout.request import Req

PAUSE_STEPS = 16  # steps a request waits before drafting again after its length fell to 0


class Drafter(ABC):
    # Proposals cost host work only, so a plain hold may ask for some between steps to see
    # whether drafts appeared (Speculator.look); a draft model's would be a forward.
    looks = True

    def __init__(self, max_tokens: int, context_len: int) -> None:
        self.max_tokens = max_tokens  # the longest draft (the engine's num_speculative_tokens)
        self.context_len = context_len

    def begin_step(self, running: list[Req]) -> None:
        """Before the step's proposals (a drafter that looks across requests indexes them here)."""

    @abstractmethod
    def propose(self, req: Req, k: int) -> list[int]:
        """Up to k tokens that may follow `req.all_ids` (empty: no guess)."""

    def propose_batch(self, wanted: list[tuple[Req, int]]) -> list[list[int]]:
        """Drafts for every (request, k) of this step; a drafter that runs a model batches
        them here, the others answer one request at a time."""
        return [self.propose(req, k) for req, k in wanted]

    def propose_tree(self, req: Req, depth: int, nodes: int) -> tuple[list[int], list[int]]:
        """A draft tree of at most `nodes` nodes and `depth` levels: (tokens, parents), parents
        first (-1: a child of the last known token). A drafter without trees drafts a chain."""
        tokens = self.propose(req, min(depth, nodes))
        return tokens, list(range(-1, len(tokens) - 1))

    def may_draft_next(self, req: Req) -> bool:
        """Could `req` get a draft after one more token, whichever it is? True when the
        drafter cannot tell (then a step always waits for the token in flight)."""
        return True

    def observe_step(self, req: Req, drafted: int, accepted: int) -> None:
        """A verification of `req`: `accepted` of its `drafted` drafts (a tree: of its depth)."""
        if accepted == drafted:
            req.spec_k = min(self.max_tokens, req.spec_k + 1)
        elif accepted == 0:
            req.spec_k //= 2
            if req.spec_k == 0:
                req.spec_k, req.spec_pause = 1, PAUSE_STEPS

    def observe_finished(self, req: Req) -> None:
        """A request finished (its tokens may draft for later requests)."""

    def on_weight_update(self) -> None:
        """The policy changed (drafters holding history decide whether to keep it)."""

    def on_adapter_update(self, lora_name: str) -> None:
        """The policy under one adapter changed (a draft model drafts without adapters: it is
        not made stale by one)."""

    def release(self) -> None:
        """Drop every device resource tied to requests (the engine goes to sleep)."""
