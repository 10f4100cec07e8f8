"""The scheduler without a model: chunked prefill under a token budget, decode vs extend,
admission by KV budget, retraction of the newest request."""

from __future__ import annotations

import torch

from rollout.cache.kv_pool import KVPool, ReqSlotTable
from rollout.cache.manager import KVManager
from rollout.config import EngineConfig
from rollout.request import Req, SamplingParams
from rollout.scheduler import Scheduler


def make(max_tokens: int = 256, budget: int = 16, page_size: int = 1) -> Scheduler:
    cfg = EngineConfig(model="unused", max_prefill_tokens=budget, page_size=page_size, max_total_tokens=max_tokens)
    pool = KVPool(1, 1, 4, max_tokens, page_size, torch.float32, "cpu")
    return Scheduler(cfg, KVManager(pool, ReqSlotTable(8, max_tokens + page_size), enable_radix=True))


def req(rid: str, n: int) -> Req:
    return Req(rid=rid, prompt_ids=list(range(1, n + 1)), params=SamplingParams(max_new_tokens=4), seed=0)


def advance(batch) -> None:
    """What the engine does after a forward: counters up, one token for each that sampled."""
    for i, (r, n) in enumerate(zip(batch.reqs, batch.extend_lens)):
        samples = batch.produces_token(i)
        r.num_computed_tokens += n
        if samples:
            r.output_ids.append(7)


def test_a_one_token_chunk_is_an_extend_not_a_decode() -> None:
    sched = make(budget=16)
    a, b = req("a", 15), req("b", 10)
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    assert [r.rid for r in batch.reqs] == ["a", "b"] and batch.extend_lens == [15, 1]
    assert batch.num_decode == 0 and not batch.produces_token(1)
    advance(batch)
    batch = sched.schedule()
    assert [r.rid for r in batch.reqs] == ["a", "b"] and batch.extend_lens == [1, 9] and batch.num_decode == 1


def test_newest_request_is_retracted_when_kv_runs_out() -> None:
    sched = make(max_tokens=24, budget=64)
    first, second = req("first", 10), req("second", 10)
    sched.add(first)
    sched.add(second)
    advance(sched.schedule())  # both prefilled: 20 of 24 slots
    for _ in range(3):
        batch = sched.schedule()
        advance(batch)
        if batch.retracted:
            break
    assert [r.rid for r in batch.retracted] == ["second"]
    assert [r.rid for r in sched.running] == ["first"] and [r.rid for r in sched.waiting] == ["second"]
    assert second.output_ids, "a retracted request keeps its tokens"
    assert second.req_pool_idx is None and second.num_computed_tokens == 0


def test_retract_all_without_keeping_kv_caches_nothing_and_leaks_nothing() -> None:
    """A weight update, an adapter update or sleep retracts running requests and then drops
    their KV (made by what is being replaced): keep_kv=False frees each request's own KV
    instead of inserting it into the tree, and leaves a prefix it shares with the tree to the
    tree, so after the flush every slot is free."""
    for keep_kv in (True, False):
        sched = make(max_tokens=256, budget=64, page_size=4)
        cached = req("cached", 12)  # finishes first: its prompt is in the tree
        sched.add(cached)
        while cached in sched.running or cached in sched.waiting:
            batch = sched.schedule()
            advance(batch)
            for r in list(sched.running):
                if len(r.output_ids) >= r.params.max_new_tokens:
                    sched.remove(r)
        kv = sched.kv
        in_tree = kv.tree.total_size
        assert in_tree > 0
        hit, fresh = req("hit", 16), req("fresh", 9)  # "hit" starts with cached's 12 prompt tokens
        sched.add(hit)
        sched.add(fresh)
        advance(sched.schedule())
        advance(sched.schedule())
        assert hit.num_prefix_tokens > 0, "the second request reused the first one's cached prompt"
        retracted = sched.retract_all(keep_kv=keep_kv)
        assert {r.rid for r in retracted} == {"hit", "fresh"} and not sched.running
        assert all(r.req_pool_idx is None and r.output_ids for r in retracted), "they keep their tokens"
        if keep_kv:
            assert kv.tree.total_size > in_tree  # their KV went to the tree
        else:
            assert kv.tree.total_size == in_tree  # only what the tree held before
            assert kv.allocator.num_free_slots == kv.capacity - in_tree  # the rest is free
        kv.flush()
        assert kv.allocator.num_free_slots == kv.capacity, "a retraction leaked KV slots"
