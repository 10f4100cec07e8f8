"""SamplingParams.priority and deadline_s on the tiny Llama, against transformers: a higher
priority is admitted first and retracted last under KV pressure; a request past its
deadline ends with its tokens so far ("deadline"), running or waiting, with overlap too;
every other request is transformers' greedy run and no KV is left behind."""

from __future__ import annotations

import time

import pytest

from conftest import TinyModel, make_prompts
from rollout import Engine, EngineConfig, SamplingParams

NEW = 12


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_new_tokens=NEW, ignore_eos=True, **kw)


def _run(engine: Engine) -> list:
    """Every output, in the order they finished."""
    done = []
    while engine.has_unfinished():
        done.extend(engine.step())
    return done


def _no_leak(engine: Engine) -> None:
    engine.flush_cache()
    assert engine.kv.used_slots() == 0 and engine.scheduler.num_deadlines == 0
    assert engine.scheduler.num_prioritized == 0


def test_a_higher_priority_is_admitted_first(llama: TinyModel) -> None:
    prompts = make_prompts(llama.vocab_size, [5, 7, 4], seed=70)
    engine = Engine(EngineConfig(model=llama.path, max_running_requests=1))
    low, mid, high = (engine.add_request(p, _greedy(priority=k))[0] for p, k in zip(prompts, (-1, 0, 5)))
    done = _run(engine)
    assert [o.request_id for o in done] == [high, mid, low]  # one runs at a time: finish order is admission order
    for out, prompt in zip(done, prompts[::-1]):
        assert out.token_ids == llama.greedy(prompt, NEW)
    _no_leak(engine)


def test_a_step_short_of_kv_retracts_the_lowest_priority(llama: TinyModel) -> None:
    """The low-priority request runs first, alone; the high-priority ones admitted after it
    are newer, so the newest-first rule alone would retract one of them."""
    prompts = make_prompts(llama.vocab_size, [9, 9, 9], seed=71)
    engine = Engine(EngineConfig(model=llama.path, page_size=4, max_total_tokens=48))
    retracted: list[int] = []
    retract = engine.scheduler.retract

    def spy(req, **kw):
        retracted.append(req.params.priority)
        return retract(req, **kw)

    engine.scheduler.retract = spy
    ids = [engine.add_request(prompts[0], _greedy(priority=-2))[0]]
    engine.step()
    ids += [engine.add_request(p, _greedy(priority=3))[0] for p in prompts[1:]]
    outs = {o.request_id: o for o in _run(engine)}
    assert retracted and retracted[0] == -2, "the first retraction takes the lowest priority, not the newest"
    for rid, prompt in zip(ids, prompts):
        assert outs[rid].token_ids == llama.greedy(prompt, NEW)
    _no_leak(engine)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_past_its_deadline_a_request_ends_with_its_tokens(llama: TinyModel, overlap: bool) -> None:
    prompts = make_prompts(llama.vocab_size, [6, 8, 5], seed=72)
    engine = Engine(EngineConfig(model=llama.path, max_running_requests=2, overlap_schedule=overlap))
    timed = engine.add_request(prompts[0], _greedy(deadline_s=0.5))[0]
    other = engine.add_request(prompts[1], _greedy())[0]
    queued = engine.add_request(prompts[2], _greedy(deadline_s=0.5))[0]  # waits: two run at a time
    done = {o.request_id: o for o in engine.step() + engine.step() + engine.step()}
    assert not done and engine.scheduler.num_deadlines == 2
    time.sleep(0.6)
    done = {o.request_id: o for o in _run(engine)}
    for rid, prompt in ((timed, prompts[0]), (queued, prompts[2])):
        out = done[rid]
        assert out.finish_reason == "deadline" and len(out.logprobs) == len(out.token_ids)
        assert out.token_ids == llama.greedy(prompt, NEW)[: len(out.token_ids)]
    assert len(done[timed].token_ids) >= 2 and done[queued].token_ids == []
    assert done[other].finish_reason == "length" and done[other].token_ids == llama.greedy(prompts[1], NEW)
    assert engine.counters.deadline_requests == 2
    _no_leak(engine)


def test_bad_priorities_and_deadlines_are_refused_by_name() -> None:
    with pytest.raises(TypeError, match=r"SamplingParams.priority='high': expected an int"):
        SamplingParams(priority="high")
    with pytest.raises(TypeError, match=r"SamplingParams.priority=1.5: expected an int"):
        SamplingParams(priority=1.5)
    with pytest.raises(ValueError, match=r"SamplingParams.deadline_s=-1.0: must be > 0"):
        SamplingParams(deadline_s=-1)
    with pytest.raises(TypeError, match=r"SamplingParams.deadline_s='soon': expected a number"):
        SamplingParams(deadline_s="soon")


def test_deadlines_under_kv_pressure_leave_nothing_behind(llama: TinyModel) -> None:
    """Requests retracted for KV and resumed, some of them past their deadline meanwhile:
    each ends once, as "deadline" or "length", with a prefix of transformers' greedy run."""
    prompts = make_prompts(llama.vocab_size, [9, 9, 9, 9], seed=73)
    engine = Engine(EngineConfig(model=llama.path, page_size=4, max_total_tokens=48))
    params = [_greedy(deadline_s=0.3 if i % 2 else None) for i in range(len(prompts))]
    ids = [engine.add_request(p, k)[0] for p, k in zip(prompts[:2], params)]
    outs = {o.request_id: o for o in engine.step() + engine.step()}
    ids += [engine.add_request(p, k)[0] for p, k in zip(prompts[2:], params[2:])]  # newer: admitted, they grow short
    outs.update({o.request_id: o for o in engine.step() + engine.step() + engine.step()})
    time.sleep(0.4)
    for out in _run(engine):
        assert out.request_id not in outs, "an output handed out twice"
        outs[out.request_id] = out
    assert set(outs) == set(ids) and engine.counters.retractions > 0
    for i, (rid, prompt) in enumerate(zip(ids, prompts)):
        out = outs[rid]
        assert out.finish_reason == ("deadline" if i % 2 else "length")
        assert out.token_ids == llama.greedy(prompt, NEW)[: len(out.token_ids)]
    _no_leak(engine)
