"""Radix tree over token ids: which token prefixes already have KV, and in which slots.

Each namespace (the adapter id; None for the base model) has its own root, so KV made
under one adapter is never served to another. With page_size > 1 every key and every
split is page-aligned, so a node's slots are always whole pages. A node locked by a
running request (lock_ref > 0, propagated up to the root) is never evicted; unlocked
leaves are evicted least-recently-used first.

The tree knows slots and tokens; it does not know requests or devices. Freed slots go
back through `free_slots` (the page allocator's).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Hashable

import torch


class TreeNode:
    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access", "namespace")

    def __init__(self, key: list[int], value: torch.Tensor, parent: TreeNode | None, namespace: Hashable) -> None:
        self.children: dict[tuple[int, ...], TreeNode] = {}
        self.parent = parent
        self.key = key  # tokens on the edge into this node
        self.value = value  # [len(key)] int64 slots
        self.lock_ref = 0
        self.last_access = 0
        self.namespace = namespace

    @property
    def is_root(self) -> bool:
        return self.parent is None

    def __lt__(self, other: TreeNode) -> bool:
        return self.last_access < other.last_access


class RadixCache:
    def __init__(self, page_size: int, free_slots: Callable[[torch.Tensor], None]) -> None:
        self.page_size = page_size
        self._free_slots = free_slots
        self._clock = itertools.count(1)
        self.roots: dict[Hashable, TreeNode] = {}
        self.evictable_size = 0  # tokens in unlocked nodes
        self.protected_size = 0  # tokens in locked nodes

    # ---- keys -------------------------------------------------------------------------
    def _child_key(self, key: list[int]) -> tuple[int, ...]:
        return tuple(key[: self.page_size])

    def _match_len(self, a: list[int], b: list[int]) -> int:
        """Length of the common prefix of a and b, rounded down to whole pages."""
        n = min(len(a), len(b))
        i = 0
        while i < n and a[i] == b[i]:
            i += 1
        return i - i % self.page_size

    def _root(self, namespace: Hashable) -> TreeNode:
        root = self.roots.get(namespace)
        if root is None:
            root = TreeNode([], torch.empty(0, dtype=torch.int64), None, namespace)
            root.lock_ref = 1  # the root is never evicted
            self.roots[namespace] = root
        return root

    def aligned(self, n: int) -> int:
        return n - n % self.page_size

    # ---- lookups ----------------------------------------------------------------------
    def match_prefix(self, tokens: list[int], namespace: Hashable = None) -> tuple[torch.Tensor, TreeNode]:
        """Longest cached page-aligned prefix of `tokens`: (its slots, the deepest node).
        Splits a node when the match ends inside it, so the returned node covers exactly
        the matched prefix and can be locked."""
        node = self._root(namespace)
        key = tokens[: self.aligned(len(tokens))]
        parts: list[torch.Tensor] = []
        now = next(self._clock)
        node.last_access = now
        while key:
            child = node.children.get(self._child_key(key))
            if child is None:
                break
            child.last_access = now
            n = self._match_len(child.key, key)
            if n == 0:
                break
            if n < len(child.key):
                child = self._split(child, n)
            parts.append(child.value)
            node = child
            key = key[n:]
        value = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)
        return value, node

    def insert(self, tokens: list[int], slots: torch.Tensor, namespace: Hashable = None) -> int:
        """Insert a page-aligned run. Returns how many leading tokens were already in the
        tree: the caller owns (and must free) its own slots for those."""
        if len(tokens) != slots.numel() or len(tokens) % self.page_size:
            raise ValueError(f"insert: {len(tokens)} tokens, {slots.numel()} slots, page {self.page_size}")
        node = self._root(namespace)
        key, value = tokens, slots
        now = next(self._clock)
        node.last_access = now
        present = 0
        while key:
            child = node.children.get(self._child_key(key))
            if child is None:
                break
            child.last_access = now
            n = self._match_len(child.key, key)
            if n < len(child.key):
                child = self._split(child, n)
            present += n
            key, value = key[n:], value[n:]
            node = child
        if key:
            leaf = TreeNode(list(key), value.clone(), node, namespace)
            leaf.last_access = now
            node.children[self._child_key(key)] = leaf
            self.evictable_size += len(key)
        return present

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut `child`'s edge after n tokens; returns the new upper node."""
        upper = TreeNode(child.key[:n], child.value[:n].clone(), child.parent, child.namespace)
        upper.lock_ref = child.lock_ref
        upper.last_access = child.last_access
        assert child.parent is not None
        child.parent.children[self._child_key(child.key)] = upper
        child.key = child.key[n:]
        child.value = child.value[n:].clone()
        child.parent = upper
        upper.children[self._child_key(child.key)] = child
        return upper

    # ---- locking ----------------------------------------------------------------------
    def inc_lock(self, node: TreeNode) -> None:
        while not node.is_root:
            if node.lock_ref == 0:
                self.evictable_size -= len(node.key)
                self.protected_size += len(node.key)
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]

    def dec_lock(self, node: TreeNode) -> None:
        while not node.is_root:
            if node.lock_ref <= 0:
                raise RuntimeError("radix: unlock of an unlocked node")
            if node.lock_ref == 1:
                self.evictable_size += len(node.key)
                self.protected_size -= len(node.key)
            node.lock_ref -= 1
            node = node.parent  # type: ignore[assignment]

    # ---- eviction ---------------------------------------------------------------------
    def _leaves(self) -> list[TreeNode]:
        out, stack = [], list(self.roots.values())
        while stack:
            node = stack.pop()
            if not node.children and not node.is_root:
                out.append(node)
            stack.extend(node.children.values())
        return out

    def evict(self, num_tokens: int) -> int:
        """Free at least num_tokens tokens of unlocked leaves (LRU first), if there are
        that many. Returns how many were freed."""
        heap = [leaf for leaf in self._leaves() if leaf.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            leaf = heapq.heappop(heap)
            self._free_slots(leaf.value)
            freed += len(leaf.key)
            self.evictable_size -= len(leaf.key)
            parent = leaf.parent
            assert parent is not None
            del parent.children[self._child_key(leaf.key)]
            if not parent.children and not parent.is_root and parent.lock_ref == 0:
                heapq.heappush(heap, parent)
        return freed

    def drop_namespaces(self, which: Callable[[Hashable], bool]) -> int:
        """Drop every cached prefix of the namespaces `which` selects (an adapter updated or
        unloaded: its KV is stale), leaving the others. Returns how many tokens were freed.
        No request may hold a lock in them (the engine retracts or waits for those first)."""
        freed = 0
        for namespace in [ns for ns in self.roots if which(ns)]:
            stack = list(self.roots[namespace].children.values())
            nodes = []
            while stack:
                node = stack.pop()
                if node.lock_ref:
                    raise RuntimeError(f"radix: namespace {namespace!r} still has KV locked by a running request")
                nodes.append(node)
                stack.extend(node.children.values())
            for node in nodes:
                self._free_slots(node.value)
                self.evictable_size -= len(node.key)
                freed += len(node.key)
            del self.roots[namespace]
        return freed

    def flush(self) -> None:
        """Drop every cached prefix (after a weight update the KV is stale)."""
        if self.protected_size:
            raise RuntimeError(f"radix flush with {self.protected_size} tokens still locked by running requests")
        self.evict(self.evictable_size)
        self.roots.clear()

    @property
    def total_size(self) -> int:
        return self.evictable_size + self.protected_size
