"""SuffixDrafter: drafts from the request itself, its running siblings (the other samples of
its prompt this step) and earlier rollouts of the same prompt. In RL the same prompts are
sampled n times per step and again epoch after epoch, so those rollouts are strong drafts
(SuffixDecoding, SPEC-RL).

Every candidate sequence (prompt + response) carries an NgramIndex; a draft comes from the
longest suffix of the request (up to MAX_MATCH tokens) found in any candidate, with what
followed it there. (A suffix tree would match suffixes of any length; past ~8 tokens the
match length adds little, and hashed n-grams keep each step's host work at a few dict
look-ups per candidate.)

History is keyed by (prompt tokens, radix namespace: adapter and version), so an adapter's
rollouts draft only for that adapter; it is bounded by `history_tokens` (least recently used
prompts dropped first) and kept or dropped on a weight update (`keep_on_update`).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable

from rollout.request import Req
from speculative.index import NgramIndex
from speculative.ngram import NgramDrafter

MAX_MATCH = 8
MIN_MATCH = 2
HISTORY_PER_PROMPT = 16  # earlier responses kept per prompt (the newest)


def prompt_key(req: Req) -> Hashable:
    key = req.cache_key
    if hasattr(key, "version"):  # an adapter: its rollouts draft across its versions too
        key = (key.namespace, key.lora_name)
    return (key, tuple(req.prompt_ids))


class History:
    """Finished rollouts per prompt, as indexed token sequences, capped in tokens (LRU)."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.num_tokens = 0
        self._by_prompt: OrderedDict[Hashable, deque[NgramIndex]] = OrderedDict()

    def add(self, key: Hashable, tokens: list[int]) -> None:
        if self.max_tokens <= 0 or len(tokens) > self.max_tokens:
            return
        index = NgramIndex(MAX_MATCH)
        index.sync(tokens)
        entries = self._by_prompt.setdefault(key, deque())
        self._by_prompt.move_to_end(key)
        entries.append(index)
        self.num_tokens += len(tokens)
        if len(entries) > HISTORY_PER_PROMPT:
            self.num_tokens -= len(entries.popleft().tokens)
        while self.num_tokens > self.max_tokens and self._by_prompt:
            _, dropped = self._by_prompt.popitem(last=False)
            self.num_tokens -= sum(len(i.tokens) for i in dropped)

    def get(self, key: Hashable) -> list[NgramIndex]:
        entries = self._by_prompt.get(key)
        if entries is None:
            return []
        self._by_prompt.move_to_end(key)
        return list(entries)

    def clear(self) -> None:
        self._by_prompt.clear()
        self.num_tokens = 0


class SuffixDrafter(NgramDrafter):
    def __init__(self, max_tokens: int, context_len: int, history_tokens: int, keep_on_update: bool = True) -> None:
        super().__init__(max_tokens, context_len, max_n=MAX_MATCH, min_n=MIN_MATCH)
        self.history = History(history_tokens)
        self.keep_on_update = keep_on_update
        self._siblings: dict[Hashable, list[Req]] = {}

    def begin_step(self, running: list[Req]) -> None:
        siblings: dict[Hashable, list[Req]] = {}
        for req in running:
            if req.output_ids:
                siblings.setdefault(prompt_key(req), []).append(req)
        self._siblings = siblings

    def propose(self, req: Req, k: int) -> list[int]:
        own = self.index_of(req)
        key = prompt_key(req)
        candidates = [own] + [self.index_of(r) for r in self._siblings.get(key, ()) if r is not req]
        candidates += self.history.get(key)
        tokens = own.tokens
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            suffix = tuple(tokens[-n:])
            best: list[int] = []
            for index in candidates:  # the longest continuation among equally long matches
                draft = index.continuation(suffix, k, own=index is own)
                if len(draft) > len(best):
                    best = draft
            if best:
                return best
        return []

    def observe_finished(self, req: Req) -> None:
        self.history.add(prompt_key(req), req.all_ids)

    def on_weight_update(self) -> None:
        if not self.keep_on_update:
            self.history.clear()
