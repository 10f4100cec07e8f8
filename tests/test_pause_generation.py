"""Engine.pause_generation / continue_generation in-process, on the tiny Llama against
transformers: "abort" ends requests with a prefix of transformers' greedy tokens, "retract"
and "in_place" resume to transformers' tokens and log-probs (with overlap scheduling, the
step in flight lands first); a weight update while paused reaches the held requests; bad
calls are refused by name and nothing accepted is lost or leaked."""

from __future__ import annotations

import copy
import threading

import pytest
import torch

from conftest import TinyModel, make_prompts
from rollout import Engine, EngineConfig, SamplingParams
from weightsync.trainer import iter_hf_weights

NEW = 8
GREEDY = SamplingParams(temperature=0, max_new_tokens=NEW, ignore_eos=True, logprobs_mode="raw")


def _engine(llama: TinyModel, overlap: bool = False) -> Engine:
    # 8 prompt tokens a step: after 2 steps some requests run (one mid-prefill) and the rest wait
    return Engine(EngineConfig(model=llama.path, page_size=4, max_prefill_tokens=8, overlap_schedule=overlap))


def _start(engine: Engine, prompts: list[list[int]], steps: int, params: SamplingParams = GREEDY) -> list[str]:
    ids = [engine.add_request(p, params)[0] for p in prompts]
    for _ in range(steps):
        assert not engine.step(), "nothing finishes this early"
    return ids


def _drain(engine: Engine) -> dict:
    outs = {o.request_id: o for o in engine.step()}  # outputs a pause finished come first
    while engine.has_unfinished():
        outs.update({o.request_id: o for o in engine.step()})
    return outs


def _assert_transformers(llama: TinyModel, prompt: list[int], out) -> None:
    assert out.token_ids == llama.greedy(prompt, NEW)
    torch.testing.assert_close(torch.tensor(out.logprobs), llama.logprobs(prompt, out.token_ids), atol=1e-4, rtol=0)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_held_requests_resume_to_transformers_tokens(llama: TinyModel, mode: str, overlap: bool) -> None:
    prompts = make_prompts(llama.vocab_size, [5, 9, 3, 7], seed=60)
    engine = _engine(llama, overlap)
    ids = _start(engine, prompts, steps=2)
    running = len(engine.scheduler.running)
    assert 0 < running < len(prompts) and engine.scheduler.waiting
    engine.pause_generation(mode)
    assert engine.stats().generation_paused == mode and engine.loop.inflight is None
    if mode == "in_place":  # they keep their KV
        assert len(engine.scheduler.running) == running and engine.kv.used_slots() > 0
    else:  # every one waits again, its KV kept in the prefix cache (nothing that made it changed)
        assert not engine.scheduler.running and len(engine.scheduler.waiting) == len(prompts)
        assert engine.kv.tree.evictable_size > 0
    made = engine.counters.generated_tokens
    for _ in range(3):  # nothing runs while paused, and has_unfinished says so
        assert not engine.has_unfinished() and engine.step() == []
    assert engine.counters.generated_tokens == made
    engine.continue_generation()
    outs = _drain(engine)
    assert set(outs) == set(ids), "no request may be lost"
    for rid, prompt in zip(ids, prompts):
        _assert_transformers(llama, prompt, outs[rid])
    if mode == "retract":
        assert engine.counters.retractions == running
    engine.flush_cache()
    assert engine.kv.used_slots() == 0


def test_abort_ends_every_request_with_its_partial_output(llama: TinyModel) -> None:
    prompts = make_prompts(llama.vocab_size, [5, 9, 3, 7], seed=61)
    engine = _engine(llama, overlap=True)
    ids = _start(engine, prompts, steps=2)
    waiting = {req.rid for req in engine.scheduler.waiting}
    engine.pause_generation("abort")
    outs = _drain(engine)  # the step after the pause hands the aborted outputs out
    assert set(outs) == set(ids) and waiting
    assert all(not outs[rid].token_ids for rid in waiting) and any(outs[rid].token_ids for rid in ids)
    for rid, prompt in zip(ids, prompts):
        out = outs[rid]
        assert out.finish_reason == "abort" and len(out.logprobs) == len(out.token_ids) < NEW
        assert out.token_ids == llama.greedy(prompt, NEW)[: len(out.token_ids)]
    assert engine.stats().num_running == engine.stats().num_waiting == 0
    engine.continue_generation()
    engine.flush_cache()
    assert engine.kv.used_slots() == 0


def test_seeded_samples_resume_as_if_never_paused(llama: TinyModel) -> None:
    prompts = make_prompts(llama.vocab_size, [6, 4], seed=62)
    params = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=NEW, n=3, seed=5, ignore_eos=True)
    want = _engine(llama).generate(input_ids=prompts, sampling_params=params)
    engine = _engine(llama)
    for p in prompts:
        engine.add_request(p, params)
    for _ in range(4):
        engine.step()
    engine.pause_generation("retract")
    engine.continue_generation()
    got = sorted(_drain(engine).values(), key=lambda o: (o.prompt_index, o.request_id))
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


@pytest.mark.parametrize("update_mode", ["retract", "wait"])
def test_a_weight_update_while_paused_reaches_the_held_requests(llama: TinyModel, update_mode: str) -> None:
    """The update's pause_mode applies to the requests held here: "retract" resumes them under
    the new weights; "wait" cannot run them to completion while paused, so it retracts them
    too (it does not wait forever). Tokens before the update are version 0's, the rest
    transformers' continuation under the new weights."""
    trained = copy.deepcopy(llama.hf)
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(3)) * 0.3 * p.std())
    prompts = make_prompts(llama.vocab_size, [5, 8], seed=63)
    engine = _engine(llama)
    ids = _start(engine, prompts, steps=4)
    engine.pause_generation("in_place")
    done: list[int] = []
    update = threading.Thread(target=lambda: done.append(
        engine.update_weights(iter_hf_weights(trained), full=True, pause_mode=update_mode)), daemon=True)
    update.start()
    update.join(60)
    assert done == [1], "the update under a pause must return"
    assert engine.stats().generation_paused == "in_place" and not engine.has_unfinished()
    engine.continue_generation()
    outs = _drain(engine)
    assert set(outs) == set(ids)
    for rid, prompt in zip(ids, prompts):
        out = outs[rid]
        (v0, _, cut), (v1, _, end) = out.weight_versions
        assert (v0, v1, end) == (0, 1, NEW) and 0 < cut < NEW
        assert out.token_ids[:cut] == llama.greedy(prompt, cut)
        ids_so_far = prompt + out.token_ids[:cut]
        with torch.no_grad():  # the mask given: with pad_token_id=0 transformers would mask any token 0
            rest = trained.generate(torch.tensor([ids_so_far]), max_new_tokens=NEW - cut, do_sample=False,
                                    eos_token_id=None, pad_token_id=0,
                                    attention_mask=torch.ones(1, len(ids_so_far), dtype=torch.long))
        assert out.token_ids[cut:] == rest[0, len(ids_so_far):].tolist()


def test_bad_calls_are_refused_and_requests_accepted_while_paused_wait(llama: TinyModel) -> None:
    engine = _engine(llama)
    with pytest.raises(ValueError, match=r"pause_generation\(mode='keep'\): expected one of \['abort', 'retract', 'in_place'\]"):
        engine.pause_generation("keep")
    with pytest.raises(RuntimeError, match="continue_generation: generation is not paused"):
        engine.continue_generation()
    engine.pause_generation("in_place")
    with pytest.raises(RuntimeError, match=r"already paused \(mode='in_place'\)"):
        engine.pause_generation("abort")
    prompt = make_prompts(llama.vocab_size, [6], seed=64)[0]
    with pytest.raises(RuntimeError, match="generate: generation is paused"):
        engine.generate(input_ids=[prompt], sampling_params=GREEDY)
    [rid] = engine.add_request(prompt, GREEDY)  # accepted; it waits
    assert engine.step() == [] and engine.stats().num_waiting == 1
    engine.continue_generation()
    out = _drain(engine)[rid]
    _assert_transformers(llama, prompt, out)
    assert engine.stats().generation_paused is None


def test_engines_paused_updated_and_continued_in_turn_behave_as_one(llama: TinyModel) -> None:
    """A trainer's multi-engine sync: pause every engine, update each, continue each. No token
    of either engine comes from the old weights after its pause, and the two engines' outputs
    are what one engine holding all the prompts gives through the same sequence."""
    trained = copy.deepcopy(llama.hf)
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(4)) * 0.3 * p.std())
    prompts = make_prompts(llama.vocab_size, [5, 8, 6, 4], seed=65)

    def run(groups: list[list[list[int]]]) -> list:
        engines = [Engine(EngineConfig(model=llama.path)) for _ in groups]  # whole prompts in one step
        ids = [_start(engine, group, steps=3) for engine, group in zip(engines, groups)]
        for engine in engines:
            engine.pause_generation("retract")
        for engine in engines:  # one at a time, as a trainer walks its engines
            assert engine.update_weights(iter_hf_weights(trained), full=True) == 1
        for engine in engines:
            engine.continue_generation()
        outs = []
        for engine, rids in zip(engines, ids):
            done = _drain(engine)
            outs.extend(done[rid] for rid in rids)
        return outs

    two = run([prompts[:2], prompts[2:]])
    one = run([prompts[:2] + prompts[2:]])
    for a, b in zip(two, one, strict=True):
        assert a.token_ids == b.token_ids and a.weight_versions == b.weight_versions
        assert a.weight_versions == [(0, 0, 3), (1, 3, NEW)]  # 3 steps: the prefill's token and 2 decodes
