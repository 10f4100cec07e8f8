"""A drafter for tests of draft trees: it knows plain decoding's outputs and hides them
behind decoy branches (tests/speculative/test_engine_tree.py, test_verify_rows.py)."""

from __future__ import annotations

from collections.abc import Callable

from rollout.request import Req
from speculative.base import Drafter


class OracleTree(Drafter):
    """Trees holding a decoy branch first, then every plain-decoding continuation of the
    request's prompt that agrees with its tokens so far (as a trie), within the budget."""

    def __init__(self, plain: dict[tuple[int, ...], list[list[int]]], vocab: int, k: int, nodes: int) -> None:
        super().__init__(k, 10_000)
        self.plain, self.vocab = plain, vocab
        self.nodes = nodes
        self.trees = 0  # trees proposed

    def propose(self, req: Req, k: int) -> list[int]:
        return []

    def propose_tree(self, req: Req, depth: int, nodes: int) -> tuple[list[int], list[int]]:
        done = req.output_ids
        futures = [out[len(done) :] for out in self.plain[tuple(req.prompt_ids)] if out[: len(done)] == done]
        futures = [f[:depth] for f in futures if f]
        if not futures:
            return [], []
        self.trees += 1
        tokens: list[int] = []
        parents: list[int] = []
        firsts = {f[0] for f in futures}
        decoy = next(t for t in range(self.vocab) if t not in firsts)
        for j in range(min(2, depth)):  # a wrong branch at the root, two deep
            tokens.append((decoy + j) % self.vocab)
            parents.append(j - 1)
        children: dict[tuple[int, int], int] = {}
        for future in futures:
            at = -1
            for token in future:
                if (at, token) not in children:
                    if len(tokens) >= nodes:
                        break
                    if at >= 0:  # a wrong sibling before the right child: the path's indices jump
                        tokens.append(decoy)
                        parents.append(at)
                    if len(tokens) >= nodes:
                        break
                    children[(at, token)] = len(tokens)
                    tokens.append(token)
                    parents.append(at)
                at = children[(at, token)]
        return tokens, parents

    def observe_step(self, req: Req, drafted: int, accepted: int) -> None:
        pass  # keep the trees at full depth


def plug(engine, oracle: OracleTree, tree_rows: Callable[[], int] = lambda: 1 << 30) -> None:
    """Make `oracle` the engine's drafter: trees of its node budget every step (no governor),
    in steps whose rows fit `tree_rows` (default: any)."""
    spec = engine.speculation
    spec.drafter, spec.governor, spec.tree_nodes, spec.tree_rows = oracle, None, oracle.nodes, tree_rows
