"""What the suffix drafter knows per prompt: one ContinuationIndex over the prompt, the
responses of its running samples (the request itself and its siblings) and its earlier
finished responses, so a draft reads the counts of every candidate sequence with one look-up
per match length, and the history that bounds them.

A group is keyed by (prompt tokens, radix namespace: adapter, not its version), so an
adapter's rollouts draft only for that adapter. The history is bounded in tokens (least
recently used prompts lose theirs first) and per prompt (the newest HISTORY_PER_PROMPT
responses); running members are not counted against it (the running batch bounds them).
Whatever leaves (an evicted response, an aborted or retracted member) leaves the counts.

The finished responses of every prompt under one namespace are also counted in one shared
index (`History.shared`): what other prompts' rollouts said after the same few tokens, which
the suffix drafter falls back on where the prompt's own samples have never continued its
context (SuffixDecoding's global tree). It holds no prompts and no running members, and a
response leaves it with its group, so it is bounded by the same history bound (its entries
about double the index memory the bound stands for).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable
from dataclasses import dataclass

from rollout.request import Req
from speculative.index import ContinuationIndex

HISTORY_PER_PROMPT = 16  # earlier responses kept per prompt (the newest)


def prompt_key(req: Req) -> Hashable:
    key = req.cache_key
    if hasattr(key, "version"):  # an adapter: its rollouts draft across its versions too
        key = AdapterGroup(key.namespace, key.lora_name)
    return (key, tuple(req.prompt_ids))


@dataclass(frozen=True)
class AdapterGroup:
    """The namespace part of an adapter's prompt keys (its version left out)."""

    namespace: str | None
    lora_name: str


class PromptGroup:
    __slots__ = ("key", "prompt", "index", "members", "responses", "evicted", "shared")

    def __init__(self, key: Hashable, prompt: list[int], max_n: int, shared: ContinuationIndex | None = None) -> None:
        self.key = key
        self.shared = shared  # the namespace's cross-prompt index its finished responses join
        self.prompt = list(prompt)
        self.index = ContinuationIndex(max_n)
        self.index.add(self.prompt, 0, len(self.prompt))
        self.members: dict[Req, int] = {}  # running request -> its output tokens counted
        self.responses: deque[list[int]] = deque()  # finished responses counted, oldest first
        self.evicted = False  # dropped from the history: members move to a fresh group

    @property
    def history_tokens(self) -> int:
        return len(self.prompt) + sum(len(r) for r in self.responses) if self.responses else 0

    def sync(self, req: Req) -> None:
        """Count the member's output tokens not counted yet."""
        out, done = req.output_ids, self.members.get(req, 0)
        if done < len(out):
            self._count(out, done, len(out), add=True)
            self.members[req] = len(out)

    def leave(self, req: Req) -> None:
        """A member stops running without finishing (aborted, retracted): its counts go."""
        done = self.members.pop(req, 0)
        if done:
            self._count(req.output_ids, 0, done, add=False)

    def finish(self, req: Req, keep: bool) -> int:
        """A member finished: its response stays counted as history (keep) or leaves.
        Returns the history tokens added."""
        self.sync(req)
        done = self.members.pop(req, 0)
        if not keep:
            self._count(req.output_ids, 0, done, add=False)
            return 0
        self.responses.append(list(req.output_ids[:done]))
        self._count_shared(self.responses[-1], add=True)
        added = len(self.prompt) * (len(self.responses) == 1) + done
        if len(self.responses) > HISTORY_PER_PROMPT:
            added -= self.drop_oldest()
        return added

    def drop_oldest(self) -> int:
        """Forget the oldest response; returns the history tokens freed."""
        response = self.responses.popleft()
        self._count(response, 0, len(response), add=False)
        self._count_shared(response, add=False)
        return len(response) + len(self.prompt) * (not self.responses)

    def leave_shared(self) -> None:
        """The group is evicted: its responses leave the shared index (its own goes with it)."""
        for response in self.responses:
            self._count_shared(response, add=False)

    def _count_shared(self, response: list[int], add: bool) -> None:
        """A finished response into or out of the shared index, after the prompt's last max_n
        tokens: a chat template's tail is the same for every prompt, so a response's first
        tokens draft across prompts too. (The prompt's own tokens are not counted there.)"""
        if self.shared is not None:
            head = self.prompt[max(len(self.prompt) - self.shared.max_n, 0) :]
            (self.shared.add if add else self.shared.remove)(head + response, len(head), len(head) + len(response))

    def _count(self, response: list[int], start: int, end: int, add: bool) -> None:
        """Response tokens [start, end) into or out of the index, with the max_n tokens
        before them (the heads of their n-grams; the prompt's tail for the first ones)."""
        max_n = self.index.max_n
        lo = max(start - max_n, 0)
        head = self.prompt[max(len(self.prompt) - max_n, 0) :] if lo == 0 else []
        window = head + response[lo:end]
        (self.index.add if add else self.index.remove)(window, len(head) + start - lo, len(window))


class History:
    """The prompt groups, least recently used first, and the history's token bound."""

    def __init__(self, max_tokens: int, max_n: int, cross_prompt: bool = True) -> None:
        self.max_tokens = max_tokens
        self.max_n = max_n
        self.num_tokens = 0
        self._groups: OrderedDict[Hashable, PromptGroup] = OrderedDict()
        # namespace -> the finished responses of all its prompts (None: no cross-prompt drafts)
        self._shared: dict[Hashable, ContinuationIndex] | None = {} if cross_prompt else None

    def __len__(self) -> int:
        return len(self._groups)

    @property
    def num_members(self) -> int:
        return sum(len(g.members) for g in self._groups.values())

    def group(self, req: Req) -> PromptGroup:
        """The group of the request's prompt (made on first use), now the most recent."""
        key = prompt_key(req)
        group = self._groups.get(key)
        if group is None:
            shared = None if self._shared is None else self._shared.setdefault(key[0], ContinuationIndex(self.max_n))
            group = self._groups[key] = PromptGroup(key, req.prompt_ids, self.max_n, shared)
        else:
            self._groups.move_to_end(key)
        return group

    def touch(self, group: PromptGroup) -> None:
        self._groups.move_to_end(group.key)

    def finish(self, group: PromptGroup, req: Req) -> None:
        """A member finished: its response becomes history (if it fits the bound)."""
        self.num_tokens += group.finish(req, keep=0 < req.known_len <= self.max_tokens)
        self._bound(spare=group)
        self.release_if_empty(group)

    def leave(self, group: PromptGroup, req: Req) -> None:
        """A member stopped running without finishing (aborted, retracted)."""
        group.leave(req)
        self.release_if_empty(group)

    def release_if_empty(self, group: PromptGroup) -> None:
        """A group with no running member and no history holds nothing worth its index."""
        if not group.members and not group.responses and not group.evicted:
            group.evicted = True
            del self._groups[group.key]

    def shared(self, req: Req) -> ContinuationIndex | None:
        """The cross-prompt index of the request's namespace (None: none, or not kept)."""
        return None if self._shared is None else self._shared.get(prompt_key(req)[0])

    def responses(self, req: Req) -> list[list[int]]:
        group = self._groups.get(prompt_key(req))
        return list(group.responses) if group is not None else []

    def clear(self, lora_name: str | None = None) -> None:
        """Forget finished responses: every prompt's, or (lora_name) those made under that
        adapter only. Running members re-count into fresh groups."""
        def cleared(namespace: Hashable) -> bool:
            return lora_name is None or isinstance(namespace, AdapterGroup) and namespace.lora_name == lora_name

        for key, group in list(self._groups.items()):
            if cleared(key[0]):
                self._evict(group)
        if self._shared is not None:  # every group that counted into these was evicted just now
            for namespace in [n for n in self._shared if cleared(n)]:
                del self._shared[namespace]

    def _bound(self, spare: PromptGroup) -> None:
        """Drop least recently used prompts' histories until the bound holds (the prompt
        just finished into goes last: its newest responses are the likeliest to draft)."""
        if self.num_tokens <= self.max_tokens:
            return
        for key in list(self._groups):
            if self.num_tokens <= self.max_tokens:
                break
            group = self._groups[key]
            if group is spare:
                continue
            self._evict(group)
        while self.num_tokens > self.max_tokens and spare.responses:
            self.num_tokens -= spare.drop_oldest()

    def _evict(self, group: PromptGroup) -> None:
        self.num_tokens -= group.history_tokens
        group.leave_shared()
        group.evicted = True
        del self._groups[group.key]
