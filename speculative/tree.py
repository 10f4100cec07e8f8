"""Draft trees: several continuations of a request in one verify step.

A chain draft (choice.walk) follows one continuation; where a prompt's earlier rollouts
branch (GRPO samples each prompt n times at temperature 1), the chain picks one branch and a
wrong pick ends the run. A tree keeps the other likely branches too: the target scores every
node in one step (each node attends to the request's context and its own ancestors), and
the sampler's draw at each depth picks at most one child, so the accepted run is the
longest root path that the target's draws follow. Verification stays exact: with the
sampler's seeded noise the target's draw at a position is a function of the path before it,
as in a chain.

`build` grows a tree best first within a node budget. The chain's draft comes first (each
coupled choice keeps its parent's score), so a tree accepts at least what the chain of its
depth would; then the other continuations, each scored by its parent's score times its
share of the blended continuation estimate q (choice.py).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

from speculative.choice import DraftSpec, blended, latest, race
from speculative.index import ContinuationIndex
from speculative.noise import position_key


@dataclass
class DraftTree:
    """Nodes in topological order (a parent before its children): token and parent index
    (-1: a child of the request's last token)."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    # each node's estimated chance that the target draws its path: the product of the
    # blended continuation estimates q along it (empty where not built by `build`)
    probs: list[float] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.tokens)

    def depth(self, node: int) -> int:
        d = 0
        while node >= 0:
            node, d = self.parents[node], d + 1
        return d

    def follow(self, future: Sequence[int]) -> list[int]:
        """The longest root path whose tokens are `future`'s first ones (what verification
        accepts when the target draws `future`)."""
        return [self.tokens[i] for i in self.follow_nodes(future)]

    def follow_nodes(self, future: Sequence[int]) -> list[int]:
        """That path's node indices. Where the j-th is not j the path left the leading chain,
        and the engine moves its KV into position order (speculative/verify.py `_compact_path`)."""
        path: list[int] = []
        at = -1
        for token in future:
            nxt = next((i for i in range(len(self.tokens)) if self.parents[i] == at and self.tokens[i] == token), None)
            if nxt is None:
                break
            path.append(nxt)
            at = nxt
        return path


def _ranked(levels, key: int | None) -> list[tuple[int, float, float]]:
    """The children to consider after a context: (token, score factor, chance), the coupled
    (or latest) choice first with factor 1 (the chain is grown before any branch). The
    chance is q less an escape for continuations never seen: n / (n + 1) of it, n the
    longest match's count (one sighting is not certainty)."""
    q = blended(levels)
    first = latest(levels) if key is None else race(q, key)
    rest = sorted((x for x in q if x != first), key=q.__getitem__, reverse=True)
    seen = sum(levels[0].values())
    sure = seen / (seen + 1)
    return [(first, 1.0, q[first] * sure)] + [(x, q[x], q[x] * sure) for x in rest]


def build(index: ContinuationIndex, context: Sequence[int], max_depth: int, max_nodes: int, min_n: int,
          spec: DraftSpec, ahead: bool = False) -> DraftTree:
    """A draft tree of at most `max_nodes` nodes and depth `max_depth` after `context`.

    `ahead`: the context's next token is still in flight (sampled on the device, not yet
    read). The tree then has one level more: its first level holds candidates for that
    token (whatever followed the context's last token, min_n 1), which cost nothing (the
    device feeds the token: `split_ahead` drops them) and do not count against
    `max_nodes`; `spec.position` is the in-flight token's."""
    tree = DraftTree()
    base = list(context[len(context) - index.max_n :])
    paths: list[list[int]] = []  # each node's tokens from the root (its context's tail)
    heap: list[tuple[float, int, int, int, int, float]] = []  # (-score, tie, parent, token, depth, prob)
    tie = 0

    free = 1 if ahead else 0  # levels of candidates for the token in flight, not rows
    rows = 0  # nodes past the free level

    def expand(parent: int, score: float, path: list[int], prob: float) -> None:
        nonlocal tie
        depth = len(path)
        if depth >= max_depth + free:
            return
        levels = index.matches((base + path)[-index.max_n :], 1 if depth < free else min_n)
        if not levels:
            return
        key = position_key(spec.seed, spec.position + depth) if spec.coupled else None
        for token, p, q in _ranked(levels, key):
            heapq.heappush(heap, (-score * p, tie, parent, token, depth + 1, prob * q))
            tie += 1

    expand(-1, 1.0, [], 1.0)
    while heap and rows < max_nodes:
        neg, _, parent, token, depth, prob = heapq.heappop(heap)
        if token < 0:  # a node's children, wanted now: look them up
            expand(parent, -neg, paths[parent], prob)
            continue
        path = (paths[parent] if parent >= 0 else []) + [token]
        tree.tokens.append(token)
        tree.parents.append(parent)
        tree.probs.append(prob)
        paths.append(path)
        rows += depth > free
        # Its children are looked up only when they could be next: none scores above the node
        # (the first child's factor is 1), so an entry at its score stands for them until
        # then. The nodes taken last never pay for a look-up (the drafting is host time a
        # verify step waits for).
        heapq.heappush(heap, (neg, tie, len(tree) - 1, -1, depth, prob))
        tie += 1
    return tree


def split_ahead(tree: DraftTree) -> DraftTree:
    """The draft tree a verify launched ahead of the token in flight would run: the subtrees
    under the candidates for that token, merged as a trie (the first level goes). The device
    would feed the token itself, so every row computes a continuation of the token actually
    drawn, whichever candidate its subtree assumed: a path whose tokens the draws follow is
    exact under any of them, and the same path under two candidates is one path. A merged
    node's chance is the sum of its copies' (each already weighted by its candidate's).

    Measured, not built into the engine: on the second-epoch GRPO trace such verifies gain
    nothing over waiting for the token (benchmarks/common/spec_tree.py batch1_ahead_trace;
    BENCHMARKS.md, speculative decoding, "2026-12-06: the batch-1 trace step by step; trees
    drafted ahead of the token in flight, measured and not built")."""
    out = DraftTree()
    index: dict[int, int] = {}  # node of `tree` -> node of the merge
    child: dict[tuple[int, int], int] = {}  # (parent in the merge, token) -> node of the merge
    for i, (token, parent) in enumerate(zip(tree.tokens, tree.parents)):
        if parent < 0:
            continue  # a candidate for the token in flight
        at = -1 if tree.parents[parent] < 0 else index[parent]
        j = child.get((at, token))
        if j is None:
            j = child[(at, token)] = len(out)
            out.tokens.append(token)
            out.parents.append(at)
            out.probs.append(0.0)
        out.probs[j] += tree.probs[i]
        index[i] = j
    return out
