"""Radix cache unit tests: match/insert/split, locks, LRU eviction, page alignment,
namespaces, flush. The property test against a naive model is in test_radix_model.py."""

from __future__ import annotations

import pytest
import torch

from rollout.cache.kv_pool import PageAllocator
from rollout.cache.radix import RadixCache


from _radix_helpers import Recorder, check_structure, t  # noqa: E402


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
        slots = alloc.slots_for_positions(0, len(seq))
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
