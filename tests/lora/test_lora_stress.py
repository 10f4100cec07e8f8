"""Randomized workloads under adapters (tests/test_engine_stress.py's, with a random adapter or
the base model per request): fewer slots than adapters, tight KV (retraction), small prefill
budgets, page 1 and 16, radix on and off, an abort, overlap scheduling, suffix speculation with
chains and trees. Every request comes back under its own adapter, seeded outputs equal the same
requests in a roomy engine with a slot per adapter and no speculation, and neither KV nor a
slot reference leaks."""

from __future__ import annotations

import random

import pytest
from conftest import TinyModel
from test_engine_stress import _workload

from rollout import Engine, EngineConfig

pytest.importorskip("peft")
from peft_ref import ADAPTERS, PeftRef  # noqa: E402

NAMES = [*ADAPTERS, None]


@pytest.fixture(scope="module")
def ref(llama: TinyModel, tmp_path_factory) -> PeftRef:
    return PeftRef(llama, tmp_path_factory.mktemp("adapters"))


def _engine(llama: TinyModel, ref: PeftRef, **kw) -> Engine:
    engine = Engine(EngineConfig(model=llama.path, enable_lora=True, max_lora_rank=16, **kw))
    for name in ADAPTERS:
        engine.load_lora_adapter(name, ref.dirs[name])
    return engine


@pytest.mark.parametrize("mode", ["sync", "overlap", "suffix", "tree"])
@pytest.mark.parametrize("seed", range(4))
def test_random_adapter_workloads_finish_identically_without_leaks(llama: TinyModel, ref: PeftRef, seed: int,
                                                                   mode: str) -> None:
    _run(llama, ref, seed, mode)


def test_adapter_stress_runs_verify_trees_and_retract(llama: TinyModel, ref: PeftRef) -> None:
    """The workloads above must exercise what they claim: tree drafts accepted and rejected
    under adapters, and retraction."""
    trees: list[int] = []
    totals = [_run(llama, ref, seed, "tree", trees) for seed in range(4)]
    assert sum(trees) > 0, "no step verified a tree with a branch"
    drafted = sum(c.drafted_tokens for c in totals)
    accepted = sum(c.accepted_tokens for c in totals)
    assert drafted > accepted > 0
    assert sum(c.retractions for c in totals) > 0


def _run(llama: TinyModel, ref: PeftRef, seed: int, mode: str, trees: list[int] | None = None):
    """One workload; `trees` gets, per step, how many of its requests verified a branching tree."""
    rng = random.Random(1000 + seed)
    speculative = mode in ("suffix", "tree")
    items = _workload(rng, llama.vocab_size, repetitive=speculative)
    names = [rng.choice(NAMES) for _ in items]
    page_size = rng.choice([1, 16])
    roomy = _engine(llama, ref, page_size=page_size, max_loras_per_batch=len(ADAPTERS))
    expected = roomy.generate(input_ids=[p for p, _ in items], sampling_params=[s for _, s in items], lora_name=names)

    tight = _engine(
        llama, ref, page_size=page_size, enable_radix_cache=rng.random() < 0.7,
        max_total_tokens=(128 if page_size == 16 else 80), max_prefill_tokens=rng.choice([16, 32, 64]),
        max_running_requests=rng.choice([2, 4, 16]), overlap_schedule=mode == "overlap",
        max_loras_per_batch=rng.choice([1, 2]), speculative="suffix" if speculative else None,
        speculative_tree_nodes=8 if mode == "tree" else 0, speculative_governor=False,
    )
    if trees is not None:
        schedule = tight.scheduler.schedule

        def watched():
            batch = schedule()
            if batch is not None:
                trees.append(sum(r.draft_parents is not None and any(p != j - 1 for j, p in enumerate(r.draft_parents))
                                 for r in batch.reqs))
            return batch

        tight.scheduler.schedule = watched
    ids = [tight.add_request(p, s, request_id=f"r{i}", lora_name=name)
           for i, ((p, s), name) in enumerate(zip(items, names))]
    victim = rng.choice(ids)[0]
    outs, step = {}, 0
    while tight.has_unfinished():
        outs.update({o.request_id: o for o in tight.step()})
        step += 1
        if step == 3 and victim not in outs:
            aborted = tight.abort(victim)
            assert aborted is not None and aborted.finish_reason == "abort"
            outs[victim] = aborted
    outs.update({o.request_id: o for o in tight.step()})

    flat = [(rid, name) for group, name in zip(ids, names) for rid in group]
    assert sorted(outs) == sorted(rid for rid, _ in flat), "every request comes back exactly once"
    for (rid, name), want in zip(flat, expected):
        got = outs[rid]
        assert got.lora_name == name, rid
        if rid == victim and got.finish_reason == "abort":
            assert got.token_ids == want.token_ids[: len(got.token_ids)]
        else:
            assert got.token_ids == want.token_ids, (rid, name)
    tight.flush_cache()
    alloc = tight.kv.allocator
    assert alloc.num_free_pages == alloc.num_pages - 1, "KV pages leaked"
    assert tight.kv.req_table.num_free == tight.kv.req_table.max_requests, "request rows leaked"
    assert all(r == 0 for r in tight.lora.slot_refs), "slot references leaked"
    if speculative:
        assert tight.speculation.drafter.tracked_requests() == 0
    return tight.counters
