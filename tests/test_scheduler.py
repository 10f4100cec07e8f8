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
