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
        path: list[int] = []
        at = -1
        for token in future:
            nxt = next((i for i in range(len(self.tokens)) if self.parents[i] == at and self.tokens[i] == token), None)
            if nxt is None:
                break
            path.append(token)
            at = nxt
        return path


def _ranked(levels, key: int | None) -> list[tuple[int, float]]:
    """The children to consider after a context: (token, score factor), the coupled (or
    latest) choice first with factor 1 (the chain is grown before any branch)."""
    q = blended(levels)
    first = latest(levels) if key is None else race(q, key)
    rest = sorted((x for x in q if x != first), key=q.__getitem__, reverse=True)
    return [(first, 1.0)] + [(x, q[x]) for x in rest]


def build(index: ContinuationIndex, context: Sequence[int], max_depth: int, max_nodes: int, min_n: int,
          spec: DraftSpec) -> DraftTree:
    """A draft tree of at most `max_nodes` nodes and depth `max_depth` after `context`."""
    tree = DraftTree()
    base = list(context[len(context) - index.max_n :])
    paths: list[list[int]] = []  # each node's tokens from the root (its context's tail)
    heap: list[tuple[float, int, int, int, int]] = []  # (-score, tie, parent, token, depth)
    tie = 0

    def expand(parent: int, score: float, path: list[int]) -> None:
        nonlocal tie
        depth = len(path)
        if depth >= max_depth:
            return
        levels = index.matches((base + path)[-index.max_n :], min_n)
        if not levels:
            return
        key = position_key(spec.seed, spec.position + depth) if spec.coupled else None
        for token, p in _ranked(levels, key):
            heapq.heappush(heap, (-score * p, tie, parent, token, depth + 1))
            tie += 1

    expand(-1, 1.0, [])
    while heap and len(tree) < max_nodes:
        neg, _, parent, token, _depth = heapq.heappop(heap)
        path = (paths[parent] if parent >= 0 else []) + [token]
        tree.tokens.append(token)
        tree.parents.append(parent)
        paths.append(path)
        expand(len(tree) - 1, -neg, path)
    return tree

