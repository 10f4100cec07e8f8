"""NgramDrafter (prompt lookup): the longest n-gram that ends the request's tokens and
occurred earlier in them proposes what followed it there. Strong on repetitive text (code,
structured answers, quoting the prompt); free of any model."""

from __future__ import annotations

import weakref

from rollout.request import Req
from speculative.base import Drafter
from speculative.index import NgramIndex

MAX_N, MIN_N = 4, 2


class NgramDrafter(Drafter):
    def __init__(self, max_tokens: int, context_len: int, max_n: int = MAX_N, min_n: int = MIN_N) -> None:
        super().__init__(max_tokens, context_len)
        self.max_n, self.min_n = max_n, min_n
        # one index per live request, dropped with the request (no bookkeeping on abort)
        self._indices: weakref.WeakKeyDictionary[Req, NgramIndex] = weakref.WeakKeyDictionary()

    def index_of(self, req: Req) -> NgramIndex:
        index = self._indices.get(req)
        if index is None:
            index = self._indices[req] = NgramIndex(self.max_n)
        index.sync(req.prompt_ids, req.output_ids)
        return index

    def propose(self, req: Req, k: int) -> list[int]:
        index = self.index_of(req)
        tokens = index.tokens
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            draft = index.continuation(tuple(tokens[-n:]), k, own=True)
            if draft:
                return draft
        return []
