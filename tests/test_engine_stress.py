"""Randomized workloads through the whole engine: mixed prompt lengths, n samples with
shared prompts, tight KV (retraction), small prefill budgets (chunking), page sizes 1 and
16, radix on and off, aborts in the middle, overlap scheduling, speculative decoding (with
repetitive prompts, so drafts are accepted and rejected). Every request must come back,
seeded outputs must equal the same requests run alone in a roomy engine without
speculation, and no KV may leak."""

from __future__ import annotations

import random

import pytest

from conftest import TinyModel
from rollout import Engine, EngineConfig, SamplingParams


def _workload(rng: random.Random, vocab: int, repetitive: bool = False) -> list[tuple[list[int], SamplingParams]]:
    base = [rng.randrange(vocab) for _ in range(rng.randint(5, 40))]
    if repetitive:  # short patterns repeated: n-gram and suffix drafts find matches
        base = [rng.randrange(vocab) for _ in range(rng.randint(2, 5))] * 8
    items = []
    for i in range(rng.randint(4, 8)):
        # half the prompts share a prefix, so the radix tree and forks are exercised
        prompt = (base[: rng.randint(1, len(base))] if rng.random() < 0.5 else []) + [
            rng.randrange(vocab) for _ in range(rng.randint(1, 30))
        ]
        params = SamplingParams(
            temperature=rng.choice([0.0, 1.0]), top_p=rng.choice([1.0, 0.9]), max_new_tokens=rng.randint(1, 12),
            n=rng.choice([1, 1, 3]), seed=rng.randrange(1000), ignore_eos=True,
        )
        items.append((prompt, params))
    return items


@pytest.mark.parametrize("mode", ["sync", "overlap", "ngram", "suffix", "draft"])
@pytest.mark.parametrize("seed", range(10))
def test_random_workloads_finish_identically_without_leaks(llama: TinyModel, seed: int, mode: str) -> None:
    _run_workload(llama, seed, mode)


def _run_workload(llama: TinyModel, seed: int, mode: str):
    rng = random.Random(seed)
    speculative = mode if mode in ("ngram", "suffix", "draft") else None
    items = _workload(rng, llama.vocab_size, repetitive=speculative is not None)
    page_size = rng.choice([1, 16])
    roomy = Engine(EngineConfig(model=llama.path, page_size=page_size))
    expected = roomy.generate(input_ids=[p for p, _ in items], sampling_params=[s for _, s in items])

    tight = Engine(EngineConfig(
        model=llama.path, page_size=page_size, enable_radix_cache=rng.random() < 0.7,
        max_total_tokens=(128 if page_size == 16 else 80), max_prefill_tokens=rng.choice([16, 32, 64]),
        max_running_requests=rng.choice([2, 4, 16]), overlap_schedule=mode == "overlap", speculative=speculative,
        speculative_governor=False, draft_model=llama.path if mode == "draft" else None,  # its own draft: long runs
    ))
    ids = [tight.add_request(p, s, request_id=f"r{i}") for i, (p, s) in enumerate(items)]
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

    flat_ids = [rid for group in ids for rid in group]
    assert sorted(outs) == sorted(flat_ids), "every request comes back exactly once"
    for rid, want in zip(flat_ids, expected):
        got = outs[rid]
        if rid == victim and got.finish_reason == "abort":
            assert got.token_ids == want.token_ids[: len(got.token_ids)]
        else:
            assert got.token_ids == want.token_ids, rid
            assert got.finish_reason == "length"
    tight.flush_cache()
    alloc = tight.kv.allocator
    assert alloc.num_free_pages == alloc.num_pages - 1, "KV pages leaked"
    assert tight.kv.req_table.num_free == tight.kv.req_table.max_requests, "request rows leaked"
    if tight.draft is not None:
        assert tight.draft.pool.allocator.num_free_slots == tight.draft.capacity, "draft KV leaked"
    if mode == "suffix":  # aborted and retracted samples took their counts with them
        assert tight.speculation.drafter.tracked_requests() == 0
    return tight.counters


def test_speculative_stress_runs_do_draft(llama: TinyModel) -> None:
    """The speculative workloads above must exercise verification: drafts accepted and rejected."""
    drafted = accepted = 0
    for seed in range(3):
        counters = _run_workload(llama, seed, "suffix")
        drafted, accepted = drafted + counters.drafted_tokens, accepted + counters.accepted_tokens
    assert drafted > accepted > 0
