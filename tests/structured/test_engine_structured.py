"""Structured output on the real SmolLM2, against xgrammar's own matcher (what is legal) and
transformers (the log-probs): a mixed batch, log-probs under the mask, retraction, overlap,
speculation, abort."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from conftest import SMOLLM2_KV_TOKENS
from rollout import Engine, EngineConfig, SamplingParams

from _structured_helpers import (  # noqa: E402, F401 (fixtures)
    REGEX, SCHEMAS, assert_follows_grammar, chat, check_text, reference_logits, xgr_compiler)

pytest.importorskip("xgrammar")

QUESTIONS = ["Describe a person as JSON with a name and an age.",
             "Give a weather report as JSON: city, sunny, scores.",
             "Is the sky blue? Answer yes or no and say why."]


def constrained_batch(tok, n: int = 4, temperature: float = 1.0):
    prompts = [chat(tok, q) for q in QUESTIONS]
    params = [SamplingParams(json_schema=SCHEMAS[0], temperature=temperature, n=n, seed=1, max_new_tokens=64),
              SamplingParams(json_schema=SCHEMAS[1], temperature=temperature, n=n, seed=2, max_new_tokens=64),
              SamplingParams(regex=REGEX, temperature=temperature, n=n, seed=3, max_new_tokens=64)]
    return prompts, params


def check_outputs(outs, params, n: int, compiler) -> None:
    for i, p in enumerate(params):
        group = outs[i * n : (i + 1) * n]
        for out in group:
            assert out.finish_reason == "stop", (out.finish_reason, out.text)
            check_text(p, out.text)
            assert_follows_grammar(compiler, p, out.token_ids)
        if n > 1:  # each sample walks its own matcher
            assert len({o.text for o in group}) > 1


@pytest.fixture(scope="module")
def engine(smollm2) -> Engine:
    """One engine for the tests that run plain schedules (each leaves no request behind)."""
    return Engine(EngineConfig(model=smollm2[0], page_size=16, max_total_tokens=SMOLLM2_KV_TOKENS))


@dataclass
class PlainRun:
    """One plain run of a mixed batch: the constrained rows (n = 4 sampled of each constraint,
    then n = 2 greedy) and two unconstrained requests after them."""

    prompts: list[list[int]]  # the constrained rows' prompts and parameters
    params: list[SamplingParams]
    outs: list  # the constrained rows' outputs: what every other schedule of them must emit
    free_prompts: list[list[int]]
    free: list[SamplingParams]
    free_outs: list
    compiled: int  # grammars the engine compiled (and failed to) for the batch
    failed: int


@pytest.fixture(scope="module")
def plain_run(smollm2, engine) -> PlainRun:
    tok = smollm2[1]
    prompts, params = constrained_batch(tok, n=4)
    params.append(SamplingParams(json_schema=SCHEMAS[0], temperature=0, n=2, max_new_tokens=64))
    prompts.append(prompts[0])
    free_prompts = [chat(tok, "Write a short poem."), chat(tok, "What is 2 + 2?")]
    free = [SamplingParams(temperature=1.0, n=2, seed=7, max_new_tokens=24), SamplingParams(temperature=0, max_new_tokens=24)]
    outs = engine.generate(input_ids=prompts + free_prompts, sampling_params=params + free)
    stats = engine.structured.compiler.stats
    return PlainRun(prompts, params, outs[:14], free_prompts, free, outs[14:], stats.compiled, stats.failed)


def test_mixed_batch_constrained_rows_parse_unconstrained_rows_unchanged(engine, plain_run, xgr_compiler) -> None:
    run = plain_run
    check_outputs(run.outs[:12], run.params[:3], 4, xgr_compiler)
    alone = engine.generate(input_ids=run.free_prompts, sampling_params=run.free)
    for mixed, ref in zip(run.free_outs, alone):
        assert mixed.token_ids == ref.token_ids
        torch.testing.assert_close(torch.tensor(mixed.logprobs), torch.tensor(ref.logprobs), atol=1e-4, rtol=0)
    assert run.compiled == 3 and run.failed == 0


def test_logprobs_raw_and_processed_against_transformers_with_the_same_mask(smollm2, engine, xgr_compiler) -> None:
    """processed: log-softmax of the masked, temperature-scaled logits; raw: of the model's own;
    greedy: each token is the argmax of transformers' masked logits (one teacher-forced pass)."""
    path, tok, hf = smollm2
    prompt = chat(tok, QUESTIONS[0])
    cases = [SamplingParams(json_schema=SCHEMAS[0], temperature=0.7, seed=5, max_new_tokens=48),
             SamplingParams(regex=REGEX, temperature=1.3, seed=6, max_new_tokens=48),
             SamplingParams(json_schema=SCHEMAS[1], temperature=0, max_new_tokens=48)]
    processed = engine.generate(input_ids=[prompt] * 3, sampling_params=cases)
    raw = engine.generate(input_ids=[prompt] * 3, sampling_params=[SamplingParams(**{**vars(p), "logprobs_mode": "raw"})
                                                                    for p in cases])
    for params, out, out_raw in zip(cases, processed, raw):
        assert out.token_ids == out_raw.token_ids and out.finish_reason == "stop"
        logits, masked = reference_logits(hf, xgr_compiler, params, prompt, out.token_ids)
        tokens = torch.tensor(out.token_ids)[:, None]
        ref_raw = torch.log_softmax(logits, -1).gather(-1, tokens)[:, 0]
        torch.testing.assert_close(torch.tensor(out_raw.logprobs), ref_raw, atol=2e-4, rtol=0)
        if params.greedy:
            assert out.token_ids == masked.argmax(-1).tolist()
            torch.testing.assert_close(torch.tensor(out.logprobs), ref_raw, atol=2e-4, rtol=0)  # greedy reports raw
        else:
            ref = torch.log_softmax(masked / params.temperature, -1).gather(-1, tokens)[:, 0]
            torch.testing.assert_close(torch.tensor(out.logprobs), ref, atol=2e-4, rtol=0)
            assert (ref > ref_raw).any()  # the mask moved mass: the two modes differ


@pytest.mark.parametrize("config", [dict(max_total_tokens=256, overlap_schedule=True),
                                    dict(max_total_tokens=256, speculative="suffix", speculative_governor=False)],
                         ids=["tight-kv-overlap", "tight-kv-suffix-speculation"])
def test_retraction_overlap_and_speculation_give_the_plain_run(smollm2, xgr_compiler, plain_run, config: dict) -> None:
    """Seeded samples do not depend on the batch, so a run that retracts (matchers kept with
    the tokens), overlaps steps (the mask waits for the token in flight) or verifies drafts
    (trimmed to the grammar, the matcher stepping through them and rolled back) emits the
    plain run's tokens exactly."""
    path = smollm2[0]
    prompts, params, plain = plain_run.prompts, plain_run.params, plain_run.outs
    engine = Engine(EngineConfig(model=path, page_size=16, **config))
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    torch.testing.assert_close(torch.tensor([lp for o in outs for lp in o.logprobs]),
                               torch.tensor([lp for o in plain for lp in o.logprobs]), atol=1e-4, rtol=0)
    c = engine.stats().counters
    assert c["retractions"] > 0
    if "speculative" in config:
        assert c["verify_steps"] > 0 and c["accepted_tokens"] > 0
    check_outputs(outs[:12], params[:3], 4, xgr_compiler)
    engine.flush_cache()
    assert engine.kv.used_slots() == 0


def test_a_request_waits_for_its_grammar_while_others_run_and_aborts_cleanly(smollm2, engine, xgr_compiler) -> None:
    """A grammar still compiling (a Future planted in the cache, left pending) holds back its
    requests only: an unconstrained request runs to the end meanwhile; one waiting request is
    aborted; once the grammar is there the other runs and follows it. Aborting a running
    constrained request frees its KV."""
    import re
    from concurrent.futures import Future

    tok = smollm2[1]
    prompt = chat(tok, QUESTIONS[2])
    params = SamplingParams(regex=REGEX, temperature=0, max_new_tokens=32)
    compiling: Future = Future()
    engine.structured.compiler._cache[params.constraint] = compiling
    [held] = engine.add_request(prompt, params)
    [dropped] = engine.add_request(prompt, params)
    [free] = engine.add_request(chat(tok, "Say hi."), SamplingParams(temperature=0, max_new_tokens=8))
    done: dict = {}
    while free not in done:
        done.update((o.request_id, o) for o in engine.step())
    assert done[free].token_ids and {r.rid for r in engine.scheduler.waiting} == {held, dropped}
    out = engine.abort(dropped)
    assert out.finish_reason == "abort" and out.token_ids == []
    compiling.set_result(xgr_compiler.compile_regex(REGEX))
    while held not in done:
        done.update((o.request_id, o) for o in engine.step())
    assert done[held].finish_reason == "stop" and re.fullmatch(REGEX, done[held].text)

    [running] = engine.add_request(prompt, params)
    while not engine.scheduler.running or not engine.scheduler.running[0].output_ids:
        engine.step()
    out = engine.abort(running)
    assert out.finish_reason == "abort" and out.token_ids
    assert not engine.has_unfinished()
    engine.flush_cache()
    assert engine.kv.used_slots() == 0
