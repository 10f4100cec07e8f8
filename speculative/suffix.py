"""SuffixDrafter: drafts from the request itself, its running siblings (the other samples of
its prompt) and earlier rollouts of the same prompt. In RL the same prompts are sampled n
times per step and again epoch after epoch, so those rollouts are strong drafts
(SuffixDecoding, SPEC-RL); at a temperature they are draws from (nearly) the policy itself,
so their continuation counts are an estimate of the distribution the target samples from,
which the coupled choice turns into acceptance (choice.py).

All of a prompt's candidate sequences share one ContinuationIndex (groups.py), so a draft
token costs one dict look-up per match length (MIN_MATCH..MAX_MATCH) whatever the number
of siblings and earlier rollouts. (A suffix tree would match suffixes of any length; past
~8 tokens the match length adds little.)

Where the prompt's own samples have never continued the context, the drafter falls back on
the other prompts' earlier rollouts (`cross_prompt`; groups.py `History.shared`), as
SuffixDecoding's global tree does: phrasing a policy repeats across prompts (" equals ",
", which is") drafts there: on the second-epoch GRPO trace it drafts in most of the batch-1
steps that had no draft (BENCHMARKS.md, speculative decoding, "2026-12-07: drafting from other
prompts' rollouts where a prompt's own never continued"). The fallback's trees are kept
to SHARED_TREE_NODES: its matches are weaker, and each node is a verify row.
"""

from __future__ import annotations

from rollout.request import Req
from speculative.base import Drafter
from speculative.choice import walk
from speculative.groups import History, PromptGroup
from speculative.ngram import draft_spec, last_tokens
from speculative.tree import build

MAX_MATCH = 8
MIN_MATCH = 2
SHARED_TREE_NODES = 8


class SuffixDrafter(Drafter):
    def __init__(self, max_tokens: int, context_len: int, history_tokens: int, keep_on_update: bool = True,
                 coupled: bool = True, cross_prompt: bool = True) -> None:
        super().__init__(max_tokens, context_len)
        self.history = History(history_tokens, MAX_MATCH, cross_prompt)
        self.keep_on_update = keep_on_update
        self.coupled = coupled  # False: point-mass drafts (the latest continuation), as before coupling
        self._live: dict[Req, PromptGroup] = {}  # running requests with output -> their prompt's group

    def begin_step(self, running: list[Req]) -> None:
        """Every running sample's new tokens into its group before anyone drafts: a request
        drafts from its siblings as they stand now."""
        alive = set(running)
        for req in [r for r in self._live if r not in alive]:  # aborted or retracted (it may come back)
            group = self._live.pop(req)
            if not group.evicted:  # (an evicted group's counts went with it)
                self.history.leave(group, req)
        for req in running:
            if req.output_ids:
                self._group_of(req).sync(req)

    def _group_of(self, req: Req) -> PromptGroup:
        group = self._live.get(req)
        if group is None or group.evicted:  # new, or its group's history was dropped
            group = self._live[req] = self.history.group(req)
        else:
            self.history.touch(group)
        return group

    def propose(self, req: Req, k: int) -> list[int]:
        group = self._group_of(req)
        group.sync(req)
        context, spec = last_tokens(req, MAX_MATCH), draft_spec(req, self.coupled)
        draft = walk(group.index, context, k, MIN_MATCH, spec)
        if not draft and group.shared is not None:
            draft = walk(group.shared, context, k, MIN_MATCH, spec)
        return draft

    def propose_tree(self, req: Req, depth: int, nodes: int) -> tuple[list[int], list[int]]:
        group = self._group_of(req)
        group.sync(req)
        context, spec = last_tokens(req, MAX_MATCH), draft_spec(req, self.coupled)
        tree = build(group.index, context, depth, nodes, MIN_MATCH, spec)
        if not len(tree) and group.shared is not None:
            tree = build(group.shared, context, depth, min(nodes, SHARED_TREE_NODES), MIN_MATCH, spec)
        return tree.tokens, tree.parents

    def may_draft_next(self, req: Req) -> bool:
        group = self._group_of(req)
        group.sync(req)
        tail = last_tokens(req, MIN_MATCH - 1)
        return group.index.may_match_after(tail, MIN_MATCH) or (
            group.shared is not None and group.shared.may_match_after(tail, MIN_MATCH))

    def tracked_requests(self) -> int:
        """Requests whose tokens are counted as running samples (0 once nothing runs: a
        finished, aborted or retracted request leaves no counts behind)."""
        return len(self._live) + self.history.num_members

    def observe_finished(self, req: Req) -> None:
        group = self._live.pop(req, None)
        if group is None or group.evicted:  # never ran with output (one token), or its group was dropped
            group = self.history.group(req)
        self.history.finish(group, req)

    def on_weight_update(self) -> None:
        if not self.keep_on_update:
            self.history.clear()

    def on_adapter_update(self, lora_name: str) -> None:
        if not self.keep_on_update:
            self.history.clear(lora_name)
