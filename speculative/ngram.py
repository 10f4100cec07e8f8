"""NgramDrafter (prompt lookup): the request's own tokens, indexed by n-gram, propose what
followed the longest n-gram that ends them. Strong on repetitive text (code, structured
answers, quoting the prompt); free of any model.

Sampled requests draft with the sampler's own noise over what followed (choice.py); greedy
ones, and every request with `coupled=False`, follow the latest continuation.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

from rollout.request import Req
from speculative.base import Drafter
from speculative.choice import DraftSpec, walk
from speculative.index import ContinuationIndex
from speculative.tree import build

MAX_N, MIN_N = 4, 2


@dataclass
class OwnIndex:
    index: ContinuationIndex
    indexed: int = 0  # tokens of the request counted so far


def last_tokens(req: Req, n: int) -> list[int]:
    """The request's last n tokens, without concatenating its whole sequence."""
    out = req.output_ids
    if len(out) >= n:
        return out[len(out) - n :]
    prompt = req.prompt_ids
    return prompt[max(len(prompt) - (n - len(out)), 0) :] + out


def draft_spec(req: Req, coupled: bool) -> DraftSpec:
    """A request's drafts start at its next position (the sampler draws it with that
    position's noise); greedy requests have no noise to couple to."""
    return DraftSpec(req.seed, req.known_len, coupled and req.params.temperature > 0)


class NgramDrafter(Drafter):
    def __init__(self, max_tokens: int, context_len: int, max_n: int = MAX_N, min_n: int = MIN_N,
                 coupled: bool = True) -> None:
        super().__init__(max_tokens, context_len)
        self.max_n, self.min_n = max_n, min_n
        self.coupled = coupled  # False: point-mass drafts (the latest continuation), as before coupling
        # one index per live request, dropped with the request (no bookkeeping on abort)
        self._own: weakref.WeakKeyDictionary[Req, OwnIndex] = weakref.WeakKeyDictionary()

    def index_of(self, req: Req) -> ContinuationIndex:
        own = self._own.get(req)
        if own is None:
            own = self._own[req] = OwnIndex(ContinuationIndex(self.max_n))
        new = req.known_len - own.indexed
        if new > 0:  # the new tokens, after the max_n before them (their n-grams' heads)
            window = last_tokens(req, new + self.max_n)
            own.index.add(window, len(window) - new, len(window))
            own.indexed += new
        return own.index

    def propose(self, req: Req, k: int) -> list[int]:
        return walk(self.index_of(req), last_tokens(req, self.max_n), k, self.min_n, draft_spec(req, self.coupled))

    def propose_tree(self, req: Req, depth: int, nodes: int) -> tuple[list[int], list[int]]:
        tree = build(self.index_of(req), last_tokens(req, self.max_n), depth, nodes, self.min_n,
                     draft_spec(req, self.coupled))
        return tree.tokens, tree.parents

    def may_draft_next(self, req: Req) -> bool:
        return self.index_of(req).may_match_after(last_tokens(req, self.min_n - 1), self.min_n)
