"""PageAllocator / KVPool / ReqSlotTable: page bookkeeping and slot layout."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import grow_slots

from rollout.cache.kv_pool import KVPool, OutOfSlots, PageAllocator, ReqSlotTable

PAGE_SIZES = [1, 16]


def _all_free(alloc: PageAllocator) -> bool:
    return alloc.num_free_pages == alloc.num_pages - 1 and sorted(alloc._free) == list(range(1, alloc.num_pages))


# ---- PageAllocator: alloc / free ----------------------------------------------------------


def test_too_small_pool_rejected() -> None:
    with pytest.raises(ValueError):
        PageAllocator(1, 16)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_alloc_free_round_trip(page_size: int) -> None:
    alloc = PageAllocator(9, page_size)
    assert alloc.num_free_pages == 8
    assert alloc.capacity_slots == 8 * page_size
    assert alloc.num_free_slots == 8 * page_size
    a = alloc.alloc_pages(3)
    b = alloc.alloc_pages(5)
    assert len(set(a) | set(b)) == 8
    assert 0 not in a + b
    assert alloc.num_free_pages == 0 and alloc.num_free_slots == 0
    with pytest.raises(OutOfSlots):
        alloc.alloc_pages(1)
    alloc.free_pages(a)
    assert alloc.num_free_pages == 3
    # freed pages come back
    assert sorted(alloc.alloc_pages(3)) == sorted(a)
    alloc.free_pages(a)
    alloc.free_pages(b)
    assert _all_free(alloc)
    alloc.free_pages([])  # no-op


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_low_pages_first(page_size: int) -> None:
    alloc = PageAllocator(6, page_size)
    assert alloc.alloc_pages(3) == [1, 2, 3]


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_page_zero_never_handed_out(page_size: int) -> None:
    alloc = PageAllocator(5, page_size)
    for _ in range(3):  # drain and refill: page 0 never appears
        pages = alloc.alloc_pages(alloc.num_free_pages)
        assert sorted(pages) == [1, 2, 3, 4]
        alloc.free_pages(pages)
    slots = alloc.slots_for_positions(0, 4 * page_size)
    assert int(slots.min()) >= page_size  # no slot of page 0
    with pytest.raises(OutOfSlots):
        alloc.slots_for_positions(0, 1)
    with pytest.raises(RuntimeError):
        alloc.free_pages([0])  # page 0 is not the allocator's to take back


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_double_free_caught(page_size: int) -> None:
    alloc = PageAllocator(6, page_size)
    pages = alloc.alloc_pages(3)
    alloc.free_pages(pages[:1])
    with pytest.raises(RuntimeError):
        alloc.free_pages(pages[:1])  # freed twice
    with pytest.raises(RuntimeError):
        alloc.free_pages([pages[1], pages[1]])  # twice in one call
    with pytest.raises(RuntimeError):
        alloc.free_pages([5])  # never allocated
    # failed frees change nothing
    assert alloc.num_free_pages == 3
    alloc.free_pages(pages[1:])
    assert _all_free(alloc)
    # the same via free_slots
    slots = alloc.slots_for_positions(0, 2 * page_size)
    alloc.free_slots(slots)
    with pytest.raises(RuntimeError):
        alloc.free_slots(slots)
    assert _all_free(alloc)


def test_free_slots_must_start_on_page_boundary() -> None:
    alloc = PageAllocator(4, 16)
    slots = alloc.slots_for_positions(0, 20)
    with pytest.raises(RuntimeError):
        alloc.free_slots(slots[1:])
    alloc.free_slots(slots[16:])  # the partial second page
    alloc.free_slots(slots[:16])
    alloc.free_slots(torch.empty(0, dtype=torch.int64))
    assert _all_free(alloc)


# ---- slots_for_positions / pages_needed ---------------------------------------------------


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("steps", [[5], [1, 1, 1], [3, 14, 1, 16, 17, 2, 31], [16, 16], [15, 1, 1, 40]])
def test_slots_keep_offsets_across_extensions(page_size: int, steps: list[int]) -> None:
    alloc = PageAllocator(256, page_size)
    other = alloc.slots_for_positions(0, 3)  # interleaved request: pages are not contiguous
    slots = torch.empty(0, dtype=torch.int64)
    for n in steps:
        start, end = slots.numel(), slots.numel() + n
        want = alloc.pages_needed(start, end)
        before = alloc.num_free_pages
        grown = grow_slots(alloc, slots, n)
        assert grown.dtype == torch.int64 and grown.numel() == end
        assert before - alloc.num_free_pages == want
        slots = grown
        # interleave another request's allocation between extensions
        other = grow_slots(alloc, other, 2)
    pos = torch.arange(slots.numel())
    assert torch.equal(slots % page_size, pos % page_size)
    # positions of one page share one page
    pages = slots // page_size
    assert torch.equal(pages, pages[(pos // page_size) * page_size])
    assert int(pages.min()) >= 1
    assert len(set(slots.tolist()) | set(other.tolist())) == slots.numel() + other.numel()
    # freeing both hands every page back
    alloc.free_slots(slots)
    alloc.free_slots(other)
    assert _all_free(alloc)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_pages_needed_matches_slots_for_positions(page_size: int) -> None:
    for start in range(0, 3 * page_size + 2):
        for end in range(start, start + 2 * page_size + 3):
            alloc = PageAllocator(16, page_size)
            prior = alloc.slots_for_positions(0, start)
            before = alloc.num_free_pages
            grow_slots(alloc, prior, end - start)
            assert before - alloc.num_free_pages == alloc.pages_needed(start, end), (start, end)
    assert alloc.pages_needed(5, 5) == 0
    assert alloc.pages_needed(5, 3) == 0


def test_slots_for_positions_out_of_slots_changes_nothing() -> None:
    alloc = PageAllocator(4, 16)  # three usable pages
    slots = alloc.slots_for_positions(0, 20)
    free = alloc.num_free_pages
    with pytest.raises(OutOfSlots):
        grow_slots(alloc, slots, 12 + 17)  # needs 2 new pages, 1 free
    assert alloc.num_free_pages == free
    # filling the partial page needs no new page even when none is left after
    more = grow_slots(alloc, slots, 12 + 16)
    assert alloc.num_free_pages == 0
    assert torch.equal(more % 16, torch.arange(48) % 16)
    with pytest.raises(ValueError, match="not a multiple of page_size"):
        alloc.slots_for_positions(20, 24)


# ---- property: random alloc / extend / free -----------------------------------------------

_ops = st.lists(
    st.tuples(st.sampled_from(["new", "extend", "extend", "free"]), st.integers(0, 1000), st.integers(0, 40)),
    max_size=60,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(page_size=st.sampled_from(PAGE_SIZES), num_pages=st.integers(2, 12), ops=_ops)
def test_random_alloc_extend_free(page_size: int, num_pages: int, ops: list[tuple[str, int, int]]) -> None:
    alloc = PageAllocator(num_pages, page_size)
    reqs: dict[int, list[int]] = {}
    next_id = 0

    def check() -> None:
        live = [s for slots in reqs.values() for s in slots]
        assert len(live) == len(set(live)), "slot handed out twice"
        assert all(s >= page_size for s in live), "page 0 handed out"
        assert all(s < num_pages * page_size for s in live)
        held = {s // page_size for s in live}
        assert held.isdisjoint(alloc._free), "a live page is on the free list"
        assert len(held) + alloc.num_free_pages == num_pages - 1, "pages leaked"
        for slots in reqs.values():
            assert all(s % page_size == p % page_size for p, s in enumerate(slots))

    for op, pick, n in ops:
        if op == "new" or not reqs:
            start, rid = 0, next_id
        else:
            rid = sorted(reqs)[pick % len(reqs)]
            start = len(reqs[rid])
            if op == "free":
                alloc.free_slots(torch.tensor(reqs.pop(rid), dtype=torch.int64))
                check()
                continue
        need = alloc.pages_needed(start, start + n)
        before = alloc.num_free_pages
        if need > before:
            with pytest.raises(OutOfSlots):
                grow_slots(alloc, torch.tensor(reqs.get(rid, []), dtype=torch.int64), n)
            assert alloc.num_free_pages == before
        else:
            new = grow_slots(alloc, torch.tensor(reqs.get(rid, []), dtype=torch.int64), n)[start:].tolist()
            assert len(new) == n
            assert before - alloc.num_free_pages == need
            if rid == next_id:
                next_id += 1
                reqs[rid] = []
            reqs[rid].extend(new)
        check()

    for rid in list(reqs):
        alloc.free_slots(torch.tensor(reqs.pop(rid), dtype=torch.int64))
    assert _all_free(alloc)


# ---- KVPool --------------------------------------------------------------------------------


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_kv_pool_layout(page_size: int) -> None:
    pool = KVPool(3, 2, 4, max_total_tokens=40, page_size=page_size, dtype=torch.float32, device="cpu")
    pages = -(-40 // page_size) + 1
    assert pool.num_slots == pages * page_size
    assert pool.allocator.capacity_slots >= 40
    for buf in pool.k_buffers + pool.v_buffers:
        assert buf.shape == (pool.num_slots, 2, 4)
        assert not buf.any()  # zeros: padded reads are finite
    assert KVPool.bytes_per_token(3, 2, 4, torch.bfloat16) == 2 * 3 * 2 * 4 * 2


def test_kv_pool_store_and_copy_slots_every_layer() -> None:
    num_layers = 4
    pool = KVPool(num_layers, 2, 3, max_total_tokens=64, page_size=16, dtype=torch.float32, device="cpu")
    g = torch.Generator().manual_seed(0)
    all_slots = torch.arange(pool.num_slots)
    for layer in range(num_layers):
        k = torch.randn(pool.num_slots, 2, 3, generator=g)
        v = torch.randn(pool.num_slots, 2, 3, generator=g)
        pool.store(layer, all_slots, k, v)
        assert torch.equal(pool.k_buffers[layer], k) and torch.equal(pool.v_buffers[layer], v)
    before_k = [b.clone() for b in pool.k_buffers]
    before_v = [b.clone() for b in pool.v_buffers]
    src = torch.tensor([16, 17, 18, 40])
    dst = torch.tensor([33, 34, 35, 60])
    pool.copy_slots(src, dst)
    untouched = torch.ones(pool.num_slots, dtype=torch.bool)
    untouched[dst] = False
    for layer in range(num_layers):
        for after, before in ((pool.k_buffers[layer], before_k[layer]), (pool.v_buffers[layer], before_v[layer])):
            assert torch.equal(after[dst], before[src]), f"layer {layer} not copied"
            assert torch.equal(after[untouched], before[untouched])


def test_kv_pool_store_casts_dtype() -> None:
    pool = KVPool(1, 1, 2, max_total_tokens=8, page_size=1, dtype=torch.bfloat16, device="cpu")
    k = torch.tensor([[[1.5, -2.0]]])
    pool.store(0, torch.tensor([3]), k, 2 * k)
    assert pool.k_buffers[0].dtype == torch.bfloat16
    assert torch.equal(pool.v_buffers[0][3].float(), 2 * k[0])


# ---- ReqSlotTable ------------------------------------------------------------------------


def test_req_to_token_pool() -> None:
    pool = ReqSlotTable(3, 8)
    assert pool.table.shape == (3, 8) and pool.table.dtype == torch.int64
    rows = [pool.alloc() for _ in range(3)]
    assert sorted(rows) == [0, 1, 2] and pool.num_free == 0
    with pytest.raises(OutOfSlots):
        pool.alloc()
    pool.free(rows[1])
    assert pool.alloc() == rows[1]
