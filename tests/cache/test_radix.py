"""RadixCache: unit tests, and a rule-based property test against a naive model.

The model is a dict (namespace, page-aligned token-prefix tuple) -> slots of that prefix's
last page. A prefix is in the tree iff its tuple is a key; the tree's eviction is observed
through a recording `free_slots` callback, and exactly those slots are removed from the model.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from rollout.cache.kv_pool import PageAllocator
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


def test_empty_match() -> None:
    cache = RadixCache(1, Recorder())
    slots, node = cache.match_prefix([1, 2, 3])
    assert slots.numel() == 0 and slots.dtype == torch.int64 and node.is_root
    assert cache.total_size == 0


def test_insert_match_and_split() -> None:
    rec = Recorder()
    cache = RadixCache(1, rec)
    assert cache.insert([1, 2, 3, 4], t([10, 11, 12, 13])) == 0
    assert cache.evictable_size == 4
    slots, node = cache.match_prefix([1, 2, 3, 4, 5])
    assert slots.tolist() == [10, 11, 12, 13] and node.key == [1, 2, 3, 4]
    # a match ending mid-edge splits the node: the returned node covers exactly the prefix
    slots, node = cache.match_prefix([1, 2, 9])
    assert slots.tolist() == [10, 11]
    assert node.key == [1, 2] and len(node.children) == 1
    (lower,) = node.children.values()
    assert lower.key == [3, 4] and lower.value.tolist() == [12, 13] and lower.parent is node
    # inserting a diverging sequence reuses the shared prefix and reports it
    assert cache.insert([1, 2, 7, 8, 9], t([20, 21, 22, 23, 24])) == 2
    assert cache.evictable_size == 7
    assert cache.match_prefix([1, 2, 7, 8, 9])[0].tolist() == [10, 11, 22, 23, 24]
    assert cache.match_prefix([1, 2, 3, 4])[0].tolist() == [10, 11, 12, 13]
    # inserting something fully present adds nothing
    assert cache.insert([1, 2, 3], t([30, 31, 32])) == 3
    assert cache.evictable_size == 7
    # a split during insert (diverging inside an edge)
    assert cache.insert([1, 2, 3, 5], t([40, 41, 42, 43])) == 3
    assert cache.match_prefix([1, 2, 3, 5])[0].tolist() == [10, 11, 12, 43]
    assert cache.match_prefix([1, 2, 3, 4])[0].tolist() == [10, 11, 12, 13]
    check_structure(cache)
    assert rec.runs == []


def test_insert_rejects_bad_lengths() -> None:
    cache = RadixCache(4, Recorder())
    with pytest.raises(ValueError):
        cache.insert([1, 2, 3, 4], t([1, 2, 3]))
    with pytest.raises(ValueError):
        cache.insert([1, 2, 3], t([1, 2, 3]))  # not page-aligned


@pytest.mark.parametrize("ps", [4, 16])
def test_page_aligned_matching(ps: int) -> None:
    rec = Recorder()
    cache = RadixCache(ps, rec)
    a = list(range(100, 100 + 3 * ps))
    a_slots = list(range(ps, 4 * ps))
    cache.insert(a, t(a_slots))
    # a query shorter than a page matches nothing
    assert cache.match_prefix(a[: ps - 1])[0].numel() == 0
    # a query is rounded down to whole pages
    for n in range(len(a) + 3):
        q = a[:n] + [7] * max(0, n - len(a))
        assert cache.match_prefix(q)[0].tolist() == a_slots[: (min(n, len(a)) // ps) * ps]
    # divergence inside the second page: only the first page matches, and the split is at a page boundary
    b = a[: ps + 1] + [0] * (2 * ps - 1)
    slots, node = cache.match_prefix(b)
    assert slots.tolist() == a_slots[:ps] and len(node.key) == ps
    # inserting b shares only the first page (the tree never splits inside a page)
    b_slots = list(range(10 * ps, 13 * ps))
    assert cache.insert(b, t(b_slots)) == ps
    assert cache.match_prefix(b)[0].tolist() == a_slots[:ps] + b_slots[ps:]
    assert cache.match_prefix(a)[0].tolist() == a_slots
    check_structure(cache)
    # divergence inside the first page: two siblings keyed by their first page
    c = a[: ps - 1] + [1] + a[ps:]
    assert cache.insert(c, t(list(range(20 * ps, 23 * ps)))) == 0
    assert len(cache.roots[None].children) == 2
    check_structure(cache)
    # every node holds whole pages; evicting frees page-aligned runs
    cache.evict(cache.evictable_size)
    assert cache.total_size == 0
    for run in rec.runs:
        assert len(run) % ps == 0 and run[0] % ps == 0


def test_lock_prevents_eviction() -> None:
    rec = Recorder()
    cache = RadixCache(1, rec)
    cache.insert([1, 2, 3], t([1, 2, 3]))
    cache.insert([4, 5], t([4, 5]))
    _, node = cache.match_prefix([1, 2])  # splits [1,2,3] -> [1,2] / [3]
    cache.inc_lock(node)
    assert cache.protected_size == 2 and cache.evictable_size == 3
    check_structure(cache)
    freed = cache.evict(100)
    assert freed == 3 and sorted(rec.freed) == [3, 4, 5]
    assert cache.match_prefix([1, 2, 3])[0].tolist() == [1, 2]
    assert cache.evictable_size == 0 and cache.protected_size == 2
    cache.inc_lock(node)  # locked twice
    cache.dec_lock(node)
    assert cache.evict(100) == 0
    cache.dec_lock(node)
    assert cache.evictable_size == 2 and cache.protected_size == 0
    with pytest.raises(RuntimeError):
        cache.dec_lock(node)
    assert cache.evict(1) == 2
    assert sorted(rec.freed) == [1, 2, 3, 4, 5]
    check_structure(cache)


def test_lock_survives_split_below_and_above() -> None:
    cache = RadixCache(1, Recorder())
    cache.insert([1, 2, 3, 4], t([1, 2, 3, 4]))
    _, node = cache.match_prefix([1, 2, 3, 4])
    cache.inc_lock(node)
    cache.match_prefix([1, 2])  # split above the locked node: the upper half is locked too
    check_structure(cache)
    assert cache.protected_size == 4
    cache.insert([1, 2, 9], t([7, 8, 9]))
    assert cache.evict(10) == 1
    assert cache.match_prefix([1, 2, 3, 4])[0].tolist() == [1, 2, 3, 4]
    cache.dec_lock(node)
    check_structure(cache)
    assert cache.protected_size == 0 and cache.evictable_size == 4


def test_lru_eviction_order() -> None:
    rec = Recorder()
    cache = RadixCache(1, rec)
    cache.insert([1, 1], t([11, 12]))
    cache.insert([2, 2], t([21, 22]))
    cache.insert([3, 3], t([31, 32]))
    cache.match_prefix([1, 1])  # touch the oldest: now [2,2] is least recently used
    assert cache.evict(1) == 2 and rec.runs == [[21, 22]]
    cache.insert([3, 3, 4], t([31, 32, 34]))  # touches [3,3]
    # [1,1] is now the oldest leaf
    assert cache.evict(2) == 2 and rec.runs[-1] == [11, 12]
    # leaves go before their parent; a parent becomes evictable once its children are gone
    assert cache.evict(2) == 3
    assert rec.runs[-2:] == [[34], [31, 32]]
    assert cache.total_size == 0 and cache.roots[None].children == {}


def test_lru_eviction_order_among_siblings() -> None:
    rec = Recorder()
    cache = RadixCache(4, rec)
    base = [0, 0, 0, 0]
    for i in range(1, 5):
        cache.insert(base + [i] * 4, t(list(range(4 * 10 * i, 4 * 10 * i + 8))))
    for i in (3, 1, 4, 2):  # access order
        cache.match_prefix(base + [i] * 4)
    cache.evict(4 * 4)  # all four leaves, oldest first; the shared parent is not needed
    assert [run[-1] // 40 for run in rec.runs] == [3, 1, 4, 2]
    assert cache.total_size == 4


def test_evict_more_than_available_and_partial() -> None:
    rec = Recorder()
    cache = RadixCache(1, rec)
    cache.insert([1, 2, 3, 4, 5], t([1, 2, 3, 4, 5]))
    cache.insert([9], t([9]))
    assert cache.evict(0) == 0 and rec.runs == []
    # evicting 1 token frees a whole leaf (the LRU one)
    assert cache.evict(1) == 5
    assert cache.evict(100) == 1
    assert cache.evict(100) == 0
    assert sorted(rec.freed) == [1, 2, 3, 4, 5, 9]


def test_namespaces_never_share_nodes() -> None:
    rec = Recorder()
    cache = RadixCache(4, rec)
    toks = list(range(8))
    cache.insert(toks, t(list(range(4, 12))), namespace=None)
    assert cache.match_prefix(toks, "lora-a")[0].numel() == 0
    assert cache.insert(toks, t(list(range(16, 24))), namespace="lora-a") == 0  # nothing shared
    assert cache.insert(toks[:4] + [9, 9, 9, 9], t(list(range(24, 32))), namespace="lora-b") == 0
    assert cache.match_prefix(toks)[0].tolist() == list(range(4, 12))
    assert cache.match_prefix(toks, "lora-a")[0].tolist() == list(range(16, 24))
    assert cache.match_prefix(toks, "lora-b")[0].tolist() == list(range(24, 28))
    nodes: dict[object, set[int]] = {}
    for ns, root in cache.roots.items():
        stack, ids = [root], set()
        while stack:
            n = stack.pop()
            assert n.namespace == ns
            ids.add(id(n))
            stack.extend(n.children.values())
        nodes[ns] = ids
    assert set(nodes) == {None, "lora-a", "lora-b"}
    assert not (nodes[None] & nodes["lora-a"]) and not (nodes[None] & nodes["lora-b"])
    assert not (nodes["lora-a"] & nodes["lora-b"])
    # locking in one namespace protects nothing in another
    _, node = cache.match_prefix(toks, "lora-a")
    cache.inc_lock(node)
    cache.evict(100)
    assert sorted(rec.freed) == list(range(4, 12)) + list(range(24, 32))
    assert cache.match_prefix(toks, "lora-a")[0].tolist() == list(range(16, 24))
    cache.dec_lock(node)
    check_structure(cache)


def test_flush() -> None:
    ps = 4
    alloc = PageAllocator(16, ps)
    rec = Recorder()

    def free(slots: torch.Tensor) -> None:
        rec(slots)
        alloc.free_slots(slots)

    cache = RadixCache(ps, free)
    inserted = []
    for seq in ([1] * 8, [1] * 4 + [2] * 8, [3] * 4):
        slots = alloc.slots_for_positions(None, 0, len(seq))
        present = cache.insert(seq, slots, namespace=seq[-1] % 2)
        alloc.free_slots(slots[:present])
        inserted += slots[present:].tolist()
    _, node = cache.match_prefix([1] * 8, namespace=1)
    cache.inc_lock(node)
    with pytest.raises(RuntimeError):
        cache.flush()
    assert cache.total_size == len(inserted) and rec.runs == []  # refused: nothing freed
    cache.dec_lock(node)
    cache.flush()
    assert sorted(rec.freed) == sorted(inserted)
    assert cache.total_size == 0 and cache.roots == {}
    assert alloc.num_free_pages == alloc.num_pages - 1
    assert cache.match_prefix([1] * 8, namespace=1)[0].numel() == 0
    cache.flush()  # flushing an empty tree is fine


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
        slots = self.alloc.slots_for_positions(None, 0, len(tokens))
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
