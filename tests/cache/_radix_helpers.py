"""Shared by the radix tests: a recording free_slots callback and structural checks."""

from __future__ import annotations

import torch

from rollout.cache.radix import RadixCache, TreeNode


class Recorder:
    """free_slots callback: records every freed run (in call order)."""

    def __init__(self) -> None:
        self.runs: list[list[int]] = []

    def __call__(self, slots: torch.Tensor) -> None:
        self.runs.append(slots.tolist())

    @property
    def freed(self) -> list[int]:
        return [s for run in self.runs for s in run]


def t(xs: list[int]) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64)


def walk(cache: RadixCache) -> list[TreeNode]:
    out, stack = [], [c for r in cache.roots.values() for c in r.children.values()]
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(node.children.values())
    return out


def check_structure(cache: RadixCache) -> None:
    """Structural invariants of the tree itself."""
    ps = cache.page_size
    evictable = protected = 0
    for ns, root in cache.roots.items():
        assert root.parent is None and root.namespace == ns and root.key == []
        stack = [root]
        while stack:
            node = stack.pop()
            child_lock_sum = 0
            for k, child in node.children.items():
                assert child.parent is node
                assert child.namespace == ns
                assert k == tuple(child.key[:ps])
                assert len(child.key) > 0 and len(child.key) % ps == 0
                assert child.value.numel() == len(child.key)
                assert child.lock_ref >= 0
                child_lock_sum += child.lock_ref
                if child.lock_ref:
                    protected += len(child.key)
                else:
                    evictable += len(child.key)
                stack.append(child)
            if not node.is_root:
                # locks propagate to the root: a node is locked at least as often as its children
                assert node.lock_ref >= child_lock_sum
    assert cache.evictable_size == evictable
    assert cache.protected_size == protected
    assert cache.total_size == evictable + protected


# ---- unit tests -------------------------------------------------------------------------------
