"""Radix cache: a hypothesis rule-based state machine against a naive model of the tree
(page sizes 1 and 4, one or two namespaces)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from rollout.cache.kv_pool import PageAllocator
from rollout.cache.radix import RadixCache, TreeNode


from _radix_helpers import check_structure, walk  # noqa: E402


# ---- rule-based property test against a naive model --------------------------------------------

NAMESPACES = [None, "adapter"]
# Pages for page_size 4, chosen to collide: P0/P1 share 3 tokens, P0/P2 share none.
PAGES4 = [[0, 0, 0, 0], [0, 0, 0, 1], [1, 0, 0, 0]]


class RadixModelMachine(RuleBasedStateMachine):
    """Model: (namespace, page-aligned prefix tuple) -> slots of that prefix's last page.
    A prefix is cached iff its key is present; for page_size 1 a page is one token."""

    @initialize(page_size=st.sampled_from([1, 4]), num_ns=st.sampled_from([1, 2]))
    def setup(self, page_size: int, num_ns: int) -> None:
        self.ps = page_size
        self.namespaces = NAMESPACES[:num_ns]
        self.alloc = PageAllocator(4096, page_size)
        self.model: dict[tuple, tuple[int, ...]] = {}
        self.slot_key: dict[int, tuple] = {}  # slot -> its model key
        # Slots the tree owns now. The allocator reuses freed pages, so a slot can be stored,
        # freed and stored again: "freed at most once" is per ownership.
        self.owned: set[int] = set()
        self.num_stored = 0  # slots the tree ever took ownership of
        self.num_freed = 0  # slots the tree ever freed
        self.locks: list[tuple[TreeNode, object, tuple[int, ...]]] = []
        self.cache = RadixCache(page_size, self._on_free)
        self.last_evict_runs: list[list[int]] = []
        self.seqs: list[list[int]] = []  # inserted page data, reused so that prefixes run deep

    def _on_free(self, slots: torch.Tensor) -> None:
        run = slots.tolist()
        self.last_evict_runs.append(run)
        for s in run:
            assert s in self.owned, f"tree freed slot {s} it does not own (never stored, or freed twice)"
            self.owned.remove(s)
            self.num_freed += 1
        self.alloc.free_slots(slots)  # the real allocator also catches double frees

    # -- helpers --
    def _data(self, known: bool, pick: int, cut: int, data: list[int]) -> list[int]:
        """Random pages, optionally after a prefix of an earlier insert (deep shared paths:
        splits above locked nodes, long matches)."""
        if known and self.seqs:
            return self.seqs[pick % len(self.seqs)][:cut] + data
        return data

    def _tokens(self, data: list[int], extra: list[int]) -> list[int]:
        if self.ps == 1:
            return list(data) + list(extra)
        return [tok for p in data for tok in PAGES4[p]] + list(extra)

    def _key(self, ns: object, tokens: list[int], n: int) -> tuple:
        return (ns, tuple(tokens[:n]))

    def _model_prefix_len(self, ns: object, tokens: list[int]) -> int:
        """Longest page-aligned prefix of tokens the model says is cached."""
        n = 0
        while n + self.ps <= len(tokens) and self._key(ns, tokens, n + self.ps) in self.model:
            n += self.ps
        return n

    def _model_slots(self, ns: object, tokens: list[int], n: int) -> list[int]:
        return [s for j in range(self.ps, n + 1, self.ps) for s in self.model[self._key(ns, tokens, j)]]

    def _locked_keys(self) -> set[tuple]:
        """Every cached prefix on the path to a locked node (locks propagate to the root)."""
        return {(ns, prefix[:j]) for _, ns, prefix in self.locks for j in range(self.ps, len(prefix) + 1, self.ps)}

    def _model_tokens(self) -> int:
        return len(self.model) * self.ps

    # -- rules --
    @rule(
        ns_i=st.integers(0, 1),
        known=st.booleans(),
        pick=st.integers(0, 100),
        cut=st.integers(0, 8),
        data=st.lists(st.integers(0, 2), max_size=6),
    )
    def insert(self, ns_i: int, known: bool, pick: int, cut: int, data: list[int]) -> None:
        ns = self.namespaces[ns_i % len(self.namespaces)]
        data = self._data(known, pick, cut, data)
        self.seqs.append(data)
        tokens = self._tokens(data, [])
        slots = self.alloc.slots_for_positions(0, len(tokens))
        expect_present = self._model_prefix_len(ns, tokens)
        present = self.cache.insert(tokens, slots, ns)
        assert present == expect_present
        # the caller frees its own copies of the already-present part (as KVManager does)
        self.alloc.free_slots(slots[:present])
        for j in range(present + self.ps, len(tokens) + 1, self.ps):
            key = self._key(ns, tokens, j)
            assert key not in self.model
            page = tuple(slots[j - self.ps : j].tolist())
            self.model[key] = page
            for s in page:
                assert s not in self.owned
                self.owned.add(s)
                self.slot_key[s] = key
                self.num_stored += 1

    @rule(
        ns_i=st.integers(0, 1),
        known=st.booleans(),
        pick=st.integers(0, 100),
        cut=st.integers(0, 9),
        data=st.lists(st.integers(0, 2), max_size=4),
        extra=st.lists(st.integers(0, 1), max_size=3),
        lock=st.booleans(),
    )
    def match(
        self, ns_i: int, known: bool, pick: int, cut: int, data: list[int], extra: list[int], lock: bool
    ) -> None:
        ns = self.namespaces[ns_i % len(self.namespaces)]
        tokens = self._tokens(self._data(known, pick, cut, data), extra)
        slots, node = self.cache.match_prefix(tokens, ns)
        n = self._model_prefix_len(ns, tokens)
        assert slots.numel() == n
        assert slots.tolist() == self._model_slots(ns, tokens, n)
        # the returned node covers exactly the matched prefix
        depth, cur, path = 0, node, []
        while not cur.is_root:
            depth += len(cur.key)
            path = cur.key + path
            cur = cur.parent
        assert depth == n and path == tokens[:n] and cur is self.cache.roots[ns]
        if lock:
            self.cache.inc_lock(node)
            self.locks.append((node, ns, tuple(tokens[:n])))

    @precondition(lambda self: bool(self.locks))
    @rule(i=st.integers(0, 100))
    def unlock(self, i: int) -> None:
        node, _, _ = self.locks.pop(i % len(self.locks))
        self.cache.dec_lock(node)

    @rule(k=st.integers(0, 30))
    def evict(self, k: int) -> None:
        locked = self._locked_keys()
        evictable_before = self.cache.evictable_size
        total_before = self._model_tokens()
        self.last_evict_runs = []
        freed = self.cache.evict(k)
        runs = self.last_evict_runs
        assert freed == sum(len(r) for r in runs)
        if evictable_before >= k:
            assert freed >= k
            if runs:  # it stops as soon as it has enough
                assert freed - len(runs[-1]) < k
        else:
            assert freed == evictable_before  # everything unlocked goes
        self._remove_from_model([s for r in runs for s in r], locked)
        assert self._model_tokens() == total_before - freed
        # the model stays prefix-closed: only whole leaves were removed
        for ns, prefix in self.model:
            assert len(prefix) == self.ps or (ns, prefix[: -self.ps]) in self.model

    def _remove_from_model(self, freed: list[int], locked: set[tuple]) -> None:
        freed_set = set(freed)
        for s in freed:
            key = self.slot_key.pop(s, None)
            if key is None:  # already removed with another slot of its page
                continue
            assert key not in locked, "evicted a locked prefix"
            page = self.model.pop(key)
            assert set(page) <= freed_set, "a page was freed only in part"
            for other in page:
                self.slot_key.pop(other, None)

    @rule()
    def flush(self) -> None:
        self.last_evict_runs = []
        if any(prefix for _, _, prefix in self.locks):  # a lock on the root (empty match) holds nothing
            total = self.cache.total_size
            with pytest.raises(RuntimeError):
                self.cache.flush()
            assert self.cache.total_size == total and not self.last_evict_runs
            return
        self.cache.flush()
        freed = [s for r in self.last_evict_runs for s in r]
        assert sorted(freed) == sorted(s for page in self.model.values() for s in page)
        self._remove_from_model(freed, set())
        assert not self.model and self.cache.roots == {}
        self.locks.clear()  # root locks only; those roots are gone

    # -- invariants --
    @invariant()
    def sizes_match_model(self) -> None:
        if not hasattr(self, "cache"):
            return
        assert self.cache.evictable_size + self.cache.protected_size == self._model_tokens()
        assert self.cache.protected_size == len(self._locked_keys()) * self.ps
        check_structure(self.cache)

    @invariant()
    def slots_accounted_for(self) -> None:
        if not hasattr(self, "cache"):
            return
        in_tree = [s for page in self.model.values() for s in page]
        assert len(set(in_tree)) == len(in_tree)  # no slot serves two prefixes
        assert set(in_tree) == self.owned
        assert self.num_stored == self.num_freed + len(in_tree)
        tree_slots = [s for node in walk(self.cache) for s in node.value.tolist()]
        assert sorted(tree_slots) == sorted(in_tree)
        # pages: held by the tree or free in the allocator, nothing leaked
        held = {s // self.ps for s in in_tree}
        assert len(held) * self.ps == len(in_tree)
        assert len(held) + self.alloc.num_free_pages == self.alloc.num_pages - 1

    def teardown(self) -> None:
        if not hasattr(self, "cache"):
            return
        while self.locks:
            self.cache.dec_lock(self.locks.pop()[0])
        self.cache.flush()
        assert not self.owned and self.num_freed == self.num_stored
        assert self.alloc.num_free_pages == self.alloc.num_pages - 1


RadixModelMachine.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestRadixModel = RadixModelMachine.TestCase
