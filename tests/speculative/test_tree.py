"""Draft trees (speculative/tree.py): the budget and depth hold, nodes come in topological
order, the chain's draft is a root path of every tree of its depth (so a tree never accepts
less), and `follow` picks the path that tree verification accepts."""

from __future__ import annotations

import random

from speculative.choice import DraftSpec, walk
from speculative.index import ContinuationIndex
from speculative.tree import DraftTree, build, split_ahead


def _index(seed: int, sequences: int = 12, length: int = 40, vocab: int = 6) -> tuple[ContinuationIndex, list[int]]:
    """Random walks over a small vocabulary: their continuations branch often."""
    rng = random.Random(seed)
    index = ContinuationIndex(8)
    for _ in range(sequences):
        seq = [rng.randrange(vocab) for _ in range(length)]
        index.add(seq, 0, len(seq))
    return index, [rng.randrange(vocab) for _ in range(6)]


def _root_paths(tree: DraftTree) -> set[tuple[int, ...]]:
    paths: list[tuple[int, ...]] = []
    for token, parent in zip(tree.tokens, tree.parents):
        paths.append((paths[parent] if parent >= 0 else ()) + (token,))
    return set(paths)


def test_budget_depth_and_topological_order():
    for seed in range(20):
        index, context = _index(seed)
        spec = DraftSpec(seed, 100, coupled=seed % 2 == 0)
        for depth, nodes in ((1, 4), (3, 5), (4, 16), (8, 32)):
            tree = build(index, context, depth, nodes, 2, spec)
            assert 0 < len(tree) <= nodes
            assert all(p < i for i, p in enumerate(tree.parents)), "a parent comes before its children"
            assert max(tree.depth(i) for i in range(len(tree))) <= depth
            siblings = [(p, t) for p, t in zip(tree.parents, tree.tokens)]
            assert len(set(siblings)) == len(siblings), "no token twice under one parent"


def test_the_chain_is_a_root_path_of_the_tree():
    for seed in range(20):
        index, context = _index(seed)
        spec = DraftSpec(seed, 7, coupled=True)
        for depth, nodes in ((4, 4), (4, 9), (8, 16)):
            drafts = walk(index, context, depth, 2, spec)
            tree = build(index, context, depth, nodes, 2, spec)
            assert tuple(drafts) in _root_paths(tree)


def test_follow_is_the_longest_matching_root_path():
    tree = DraftTree(tokens=[3, 7, 4, 8, 5, 9, 11], parents=[-1, 0, 0, 1, 2, 3, 3])
    assert tree.follow([3, 7, 8, 11, 0]) == [3, 7, 8, 11]
    assert tree.follow([3, 4, 5, 6]) == [3, 4, 5]
    assert tree.follow([3, 7, 9]) == [3, 7]
    assert tree.follow([9, 3]) == []
    assert tree.follow([]) == []
    assert tree.follow_nodes([3, 7, 8, 11, 0]) == [0, 1, 3, 6]  # off the leading chain (0, 1, 2): KV moves
    assert tree.follow_nodes([3, 4, 5, 6]) == [0, 2, 4]
    for seed in range(10):  # against every root path of a real tree
        index, context = _index(seed)
        tree = build(index, context, 5, 12, 2, DraftSpec(seed, 0, coupled=True))
        paths = _root_paths(tree)
        rng = random.Random(seed)
        for _ in range(50):
            future = [rng.randrange(6) for _ in range(6)]
            got = tree.follow(future)
            best = max((len(p) for p in paths if tuple(future[: len(p)]) == p), default=0)
            assert len(got) == best and tuple(got) in paths | {()}


def test_no_match_no_tree():
    index = ContinuationIndex(8)
    index.add([1, 2, 3], 0, 3)
    assert len(build(index, [5, 6], 4, 8, 2, DraftSpec(0, 0, coupled=True))) == 0


def test_ahead_trees_hold_each_candidates_tree_merged():
    """A tree drafted ahead of a token in flight, once its candidates are dropped, holds as a
    root path every path of the tree that would have been drafted after each candidate it
    kept whole (the merge loses none), within the budget and depth; no two siblings share a
    token; a node's chance sums its copies'."""
    for seed in range(20):
        index, context = _index(seed)
        spec = DraftSpec(seed, 100, coupled=seed % 2 == 0)
        for depth, nodes in ((2, 6), (4, 16), (8, 32)):
            full = build(index, context[:-1], depth, nodes, 2, spec, ahead=True)
            tree = split_ahead(full)
            assert 0 < len(tree) <= nodes
            assert sum(p >= 0 for p in full.parents) <= nodes, "candidates are free, the nodes below them are not"
            assert all(p < i for i, p in enumerate(tree.parents))
            assert max(tree.depth(i) for i in range(len(tree))) <= depth
            siblings = list(zip(tree.parents, tree.tokens))
            assert len(siblings) == len(set(siblings)), "a merged tree has no duplicate siblings"
            merged = _root_paths(tree)
            kept = _root_paths(full)
            assert {p[1:] for p in kept if len(p) > 1} == merged
            assert abs(sum(tree.probs) - sum(q for q, p in zip(full.probs, full.parents) if p >= 0)) < 1e-9
            # the candidates' race: the first is the in-flight token's coupled (or latest) draw
            assert all(0 < q <= 1 for q in full.probs)


def test_ahead_tree_first_level_is_what_followed_the_last_token():
    """Candidates for the token in flight come from a 1-token match (min_n 1), the levels below
    from the usual min_n: a context whose last two tokens were never seen still gets one."""
    index = ContinuationIndex(8)
    index.add([7, 1, 2, 3, 1, 4, 5], 0, 7)
    spec = DraftSpec(0, 50, coupled=False)
    assert not len(build(index, [9, 9, 1], 3, 8, 2, spec))  # (9, 1) never seen: no chain tree
    tree = build(index, [9, 9, 1], 3, 8, 2, spec, ahead=True)
    assert sorted(tree.tokens[i] for i, p in enumerate(tree.parents) if p < 0) == [2, 4]
    assert _root_paths(split_ahead(tree)) == {(3,), (3, 1), (3, 1, 4), (5,)}
