"""Property: the prefix cache never serves KV across (adapter, adapter version).

Random runs of requests under the base model and two adapters, with adapter updates (the
engine retracts that adapter's running requests, drops its cached KV and bumps its
version) between them. Every slot is labelled with the cache key of the request that
computed its KV; whenever a request is admitted with a cached prefix, every prefix slot
must carry the request's own key."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollout.cache.kv_pool import KVPool, ReqSlotTable
from rollout.cache.manager import KVManager
from rollout.request import Req, SamplingParams

ADAPTERS = [None, "x", "y"]
_ops = st.lists(
    st.tuples(st.sampled_from(["start", "start", "start", "finish", "update"]), st.integers(0, 2),
              st.integers(0, 3), st.integers(1, 12)),
    max_size=40,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(page_size=st.sampled_from([1, 4]), ops=_ops)
def test_cache_never_crosses_adapter_or_version(page_size: int, ops) -> None:
    pool = KVPool(1, 1, 2, 256, page_size, torch.float32, "cpu")
    kv = KVManager(pool, ReqSlotTable(16, 256 + page_size), enable_radix=True)
    label: dict[int, object] = {}  # slot -> cache key of the request that computed its KV
    version = {name: 0 for name in ADAPTERS if name}
    running: list[Req] = []
    stems = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [5, 5, 5, 5, 5, 5, 5, 5], [1, 2, 3, 4, 5, 6, 7, 8, 1, 2]]
    hits = 0
    for i, (op, adapter_i, stem_i, tail) in enumerate(ops):
        adapter = ADAPTERS[adapter_i]
        if op == "start":
            if len(running) >= 8:
                continue
            prompt = stems[stem_i] + [10 + t for t in range(tail)]
            req = Req(rid=f"r{i}", prompt_ids=prompt, params=SamplingParams(max_new_tokens=4), seed=0,
                      lora_name=adapter, lora_version=version.get(adapter, 0) if adapter else 0)
            n = kv.admit(req, 10_000)
            if n is None:
                continue
            prefix = kv.table[req.req_pool_idx, : req.num_computed_tokens].tolist()
            hits += bool(prefix)
            assert all(label[s] == req.cache_key for s in prefix), "KV served across (adapter, version)"
            for s in kv.table[req.req_pool_idx, req.num_computed_tokens : req.num_computed_tokens + n].tolist():
                label[s] = req.cache_key  # "compute" the rest under this request's key
            req.num_computed_tokens += n
            running.append(req)
        elif op == "finish" and running:
            kv.release(running.pop(stem_i % len(running)))
        elif op == "update" and adapter is not None:
            for req in [r for r in running if r.lora_name == adapter]:  # retracted first, as the engine does
                running.remove(req)
                kv.release(req)
            kv.drop_adapter(adapter)
            version[adapter] += 1
    for req in running:
        kv.release(req)
    kv.flush()
    assert pool.allocator.num_free_pages == pool.allocator.num_pages - 1, "pages leaked"


def test_drop_adapter_leaves_other_namespaces() -> None:
    pool = KVPool(1, 1, 2, 64, 1, torch.float32, "cpu")
    kv = KVManager(pool, ReqSlotTable(8, 65), enable_radix=True)
    reqs = [Req(rid=str(i), prompt_ids=[1, 2, 3, 4], params=SamplingParams(), seed=0, lora_name=name)
            for i, name in enumerate(["x", "y", None])]
    for req in reqs:
        kv.admit(req, 100)
        req.num_computed_tokens = 4
        kv.release(req)
    assert kv.tree.total_size == 12
    kv.drop_adapter("x")
    assert kv.tree.total_size == 8 and pool.allocator.num_free_slots == 64 - 8
    again = Req(rid="again", prompt_ids=[1, 2, 3, 4, 5], params=SamplingParams(), seed=0, lora_name="y")
    kv.admit(again, 100)
    assert again.num_computed_tokens == 4, "y's cache survives an update of x"
