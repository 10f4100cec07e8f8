"""The step loop's hooks (rollout/core/hooks.py): a plain engine runs on the null ones, and the
loop calls each hook once a step, never once a request (the decode path's host cost), with
the same tokens as its null hooks give."""

from __future__ import annotations

from collections import Counter

import pytest

from conftest import TinyModel, make_prompts
from rollout import Engine, EngineConfig, SamplingParams
from rollout.core.hooks import NO_SPECULATION, PLAIN_ROWS, Grammar, Speculation
from rollout.structured.service import StructuredOutput
from speculative.speculator import Speculator


class CountingSpeculation(Speculation):
    """The null hook, counting the calls."""

    def __init__(self) -> None:
        self.calls: Counter = Counter()

    def drain_for_drafts(self, running, overlap, drain):
        self.calls["drain_for_drafts"] += 1
        return super().drain_for_drafts(running, overlap, drain)

    def propose(self, running, overlap):
        self.calls["propose"] += 1
        return super().propose(running, overlap)

    def scheduled(self, batch):
        self.calls["scheduled"] += 1

    def rows(self, reqs):
        self.calls["rows"] += 1
        return super().rows(reqs)

    def finished(self, req):
        self.calls["finished"] += 1

    def end_step(self):
        self.calls["end_step"] += 1

    def verify_tokens(self, req, need, budget):
        self.calls["verify_tokens"] += 1
        return need


class CountingGrammar(Grammar):
    def __init__(self) -> None:
        self.calls: Counter = Counter()

    def constrained(self, reqs):
        self.calls["constrained"] += 1
        return False

    def mask(self, reqs, drafts, device):
        self.calls["mask"] += 1

    def accept(self, req, token):
        self.calls["accept"] += 1
        return False


def test_plain_and_speculative_engines_plug_their_hooks_in(llama: TinyModel) -> None:
    plain = Engine(EngineConfig(model=llama.path))
    assert plain.speculation is plain.loop.speculation is plain.scheduler.speculation is NO_SPECULATION
    assert isinstance(plain.loop.grammar, StructuredOutput)
    spec = Engine(EngineConfig(model=llama.path, speculative="ngram"))
    assert isinstance(spec.speculation, Speculator)
    assert spec.loop.speculation is spec.scheduler.speculation is spec.speculation
    layouts = []
    sample = plain.loop.sample

    def spy(forwarded, record_rows=None):
        layouts.append(forwarded.rows)
        return sample(forwarded, record_rows)

    plain.loop.sample = spy
    prompts = make_prompts(llama.vocab_size, [5, 9], seed=3)
    plain.generate(input_ids=prompts, sampling_params=SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True))
    assert layouts and all(rows is PLAIN_ROWS for rows in layouts), "one sampling row per request, every step"
    # no constrained request came in: the grammar hook answers without looking at requests
    assert not plain.structured.constrained(_Unreadable())


class _Unreadable(list):
    def __iter__(self):
        raise AssertionError("the grammar hook read the step's requests")


@pytest.mark.parametrize("overlap", [False, True])
def test_the_loop_calls_each_hook_once_a_step(llama: TinyModel, overlap: bool) -> None:
    prompts = make_prompts(llama.vocab_size, [4, 7, 11], seed=4)
    params = SamplingParams(temperature=1.0, max_new_tokens=8, seed=5, n=2, ignore_eos=True)
    config = EngineConfig(model=llama.path, overlap_schedule=overlap)
    want = Engine(config).generate(input_ids=prompts, sampling_params=params)
    engine = Engine(config)
    spec, grammar = CountingSpeculation(), CountingGrammar()
    engine.loop.speculation = engine.scheduler.speculation = spec
    engine.loop.grammar = grammar
    calls = 0
    step = engine.loop.step

    def counted(version):
        nonlocal calls
        calls += 1
        return step(version)

    engine.loop.step = counted
    got = engine.generate(input_ids=prompts, sampling_params=params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.logprobs for o in got] == [o.logprobs for o in want]
    steps = engine.counters.steps  # the loop's steps that ran a batch
    assert spec.calls["propose"] == calls and calls >= steps
    assert spec.calls["scheduled"] == spec.calls["rows"] == spec.calls["end_step"] == steps
    assert spec.calls["finished"] == len(got) and spec.calls["verify_tokens"] == 0
    assert spec.calls["drain_for_drafts"] == (steps if overlap else 0)  # with a step in flight, once a step
    assert grammar.calls == Counter(constrained=steps)
