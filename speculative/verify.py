"""A verify step's rows (the step loop's StepRows, rollout/core/hooks.py): each request's
last known token, then its drafts (a chain in order; a tree's nodes parents first), one
sampling row each. Row 0 draws after the last known token, a draft's row after that draft,
each with the noise of its own position (a tree node's position is its depth), so what a
request emits is exactly what plain decoding would have drawn: the drafts the draws follow,
then the first draw no draft matches.

After the read back the step's KV is rolled back to what was emitted: the last token's and
the accepted drafts' K/V stay (a tree's accepted path first moved into position order), the
rest is never cached or reused, and whole pages past it go back to the allocator.

Knows the draft fields of requests, the KV manager and the counters; the tokens themselves
go through the loop (TokenSink.emit), which checks stops and grammars.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from rollout.core.hooks import Launched, StepRows, TokenSink
from rollout.request import Req, RolloutOutput, tree_depths

if TYPE_CHECKING:
    from rollout.cache.manager import KVManager
    from rollout.metrics import Counters
    from speculative.base import Drafter


class Verifier(Protocol):
    """What a verify step's read back updates (speculator.py's Speculator, which lays the step
    out): the KV it rolls back, the counters, and the drafter that hears how far it got."""

    kv: KVManager | None
    counters: Counters
    drafter: Drafter


class VerifyRows(StepRows):
    def __init__(self, speculator: Verifier, drafts: list[list[int]], trees: list[list[int] | None]) -> None:
        self.speculator = speculator
        self.chains = drafts  # each request's drafts (none: a plain row), in row order
        self.trees = trees  # each request's draft parents (None: a chain)

    def sampling(self, reqs: list[Req]) -> tuple[list[Req], list[int] | None]:
        rows = [r for r, d in zip(reqs, self.chains) for _ in range(1 + len(d))]
        offsets = [j for d, tree in zip(self.chains, self.trees)
                   for j in [0, *(range(1, 1 + len(d)) if tree is None else tree_depths(tree))]]
        return rows, offsets

    def drafts(self, reqs: list[Req]) -> list[list[int]]:
        return self.chains

    def read_back(self, launched: Launched, rows: list[list[float]], sink: TokenSink) -> list[RolloutOutput]:
        finished = []
        top_k, version, constrained = launched.top_k, launched.version, launched.constrained
        at = 0  # the first row of the next request
        for req, drafts, tree in zip(launched.reqs, self.chains, self.trees):
            mine, at = rows[at : at + 1 + len(drafts)], at + 1 + len(drafts)
            req.num_inflight -= 1
            req.clear_drafts()
            if req.finished:
                continue  # finished or aborted while this token was in flight: dropped
            # The run follows the drafts the draws equal: a chain's next, or the matching child.
            path: list[int] = []  # the accepted drafts' indices
            node = -1
            while True:
                row = mine[node + 1]
                done = sink.emit(req, row, top_k, version, constrained)
                node = _next_draft(drafts, tree, node, int(row[0])) if drafts and not done else None
                if node is None:
                    break  # finished, or no draft is the token drawn: the run ends
                path.append(node)
            if drafts:
                if tree is not None:
                    self._compact_path(req, len(drafts), path)
                self._settle(req, len(drafts), 1 + len(path), max(tree_depths(tree)) if tree else len(drafts))
            if req.finished:
                finished.append(sink.finish(req, version))
        return finished

    def _compact_path(self, req: Req, num_drafts: int, path: list[int]) -> None:
        """A tree's accepted drafts into position order: draft i's K/V was stored at the slot
        of position start + 1 + i (runner._prepare_rows), and the j-th accepted one belongs
        at start + 1 + j. A parent precedes its children, so path[j] >= j: move j reads slot
        path[j] >= j, past every slot the moves before it wrote (copy_slots' contract)."""
        moves = [(i, j) for j, i in enumerate(path) if i != j]
        if not moves:
            return
        kv = self.speculator.kv
        assert kv is not None
        start = req.num_computed_tokens - 1 - num_drafts  # the step computed start .. start + num_drafts
        row = kv.table[req.req_pool_idx]
        kv.pool.copy_slots(row[[start + 1 + i for i, _ in moves]], row[[start + 1 + j for _, j in moves]])

    def _settle(self, req: Req, num_drafts: int, emitted: int, depth: int) -> None:
        """KV rollback: the step computed the last token and every draft; only the KV of the
        last token and of the accepted drafts is kept. `depth`: the drafts' depth (a tree's
        deepest level; a chain's length), what the draft length policy compares with."""
        spec = self.speculator
        assert spec.kv is not None
        req.num_computed_tokens -= num_drafts + 1 - emitted
        spec.kv.truncate(req, req.num_computed_tokens)
        spec.counters.drafted_tokens += num_drafts
        spec.counters.accepted_tokens += emitted - 1
        spec.counters.verify_steps += 1
        spec.drafter.observe_step(req, depth, emitted - 1)


def _next_draft(drafts: list[int], parents: list[int] | None, node: int, token: int) -> int | None:
    """The draft after `node` (-1: the last known token) that is `token`, if any."""
    if parents is None:  # a chain: the next draft
        nxt = node + 1
        return nxt if nxt < len(drafts) and drafts[nxt] == token else None
    return next((i for i in range(node + 1, len(drafts)) if parents[i] == node and drafts[i] == token), None)
