"""add_request / poll_outputs / get_outputs / abort through RolloutClient, against the
in-process engine's outputs for the same prompts and seeds."""

from __future__ import annotations

import time

import pytest
from server_fixtures import reference, same_output, server, text_model, wait_idle  # noqa: F401 (fixtures)

from rollout import SamplingParams
from rollout.server import EngineTimeoutError

PARAMS = SamplingParams(temperature=0.7, max_new_tokens=12, seed=99, ignore_eos=True)


def test_add_then_get_outputs_in_the_order_asked(server, reference) -> None:
    a = server.add_request([3, 4, 5], PARAMS, request_id="a")
    b = server.add_request(prompt="bee", sampling_params=SamplingParams(
        temperature=1.0, max_new_tokens=6, n=2, seed=4, ignore_eos=True), request_id="b")
    assert a == ["a"] and b == ["b-0", "b-1"]
    outs = server.get_outputs(b[::-1] + a, timeout=30)
    assert [o.request_id for o in outs] == ["b-1", "b-0", "a"]
    same_output(outs[2], reference.generate(input_ids=[[3, 4, 5]], sampling_params=PARAMS)[0], exact_logprobs=False)
    want_b = reference.generate(prompts=["bee"], sampling_params=SamplingParams(
        temperature=1.0, max_new_tokens=6, n=2, seed=4, ignore_eos=True))
    same_output(outs[0], want_b[1], exact_logprobs=False)
    same_output(outs[1], want_b[0], exact_logprobs=False)
    assert server.poll_outputs() == []  # handed out already


def test_poll_outputs_hands_each_output_out_once(server, reference) -> None:
    ids = server.add_request([9, 8, 7, 6], PARAMS) + server.add_request([1, 1, 2], PARAMS)
    seen: dict[str, object] = {}
    deadline = time.monotonic() + 30
    while len(seen) < 2 and time.monotonic() < deadline:
        for out in server.poll_outputs():
            assert out.request_id not in seen
            seen[out.request_id] = out
        time.sleep(0.01)
    assert sorted(seen) == sorted(ids)
    want = [reference.generate(input_ids=[prompt], sampling_params=PARAMS)[0] for prompt in ([9, 8, 7, 6], [1, 1, 2])]
    same_output(seen[ids[0]], want[0], exact_logprobs=False)
    same_output(seen[ids[1]], want[1], exact_logprobs=False)
    assert server.poll_outputs() == []


def test_abort_an_added_request(server) -> None:
    long = SamplingParams(temperature=0, max_new_tokens=480, ignore_eos=True)
    ids = server.add_request(list(range(40, 60)), long, request_id="long")
    assert server.abort("long") is True
    (out,) = server.get_outputs(ids, timeout=30)
    assert out.request_id == "long" and out.finish_reason == "abort" and len(out.token_ids) < 480
    assert server.abort("long") is False and server.abort("never-added") is False
    assert wait_idle(server).kv_used_tokens == 0


def test_abort_by_base_id_aborts_every_sample(server) -> None:
    long = SamplingParams(temperature=1.0, max_new_tokens=480, n=3, seed=1, ignore_eos=True)
    ids = server.add_request(list(range(60, 70)), long, request_id="many")
    assert server.abort("many") is True
    outs = server.get_outputs(ids, timeout=30)
    assert [o.finish_reason for o in outs] == ["abort"] * 3
    assert wait_idle(server).kv_used_tokens == 0


def test_get_outputs_times_out_and_the_request_keeps_running(server) -> None:
    long = SamplingParams(temperature=0, max_new_tokens=480, ignore_eos=True)
    ids = server.add_request(list(range(70, 90)), long, request_id="slow")
    with pytest.raises(EngineTimeoutError, match="get_outputs"):
        server.get_outputs(ids, timeout=0.01)
    stats = server.stats()
    assert stats.num_running + stats.num_waiting == 1  # a client's timeout is not an abort
    server.abort("slow")
    assert server.get_outputs(ids, timeout=30)[0].request_id == "slow"


def test_a_generate_that_times_out_is_aborted(server) -> None:
    long = SamplingParams(temperature=0, max_new_tokens=480, n=4, ignore_eos=True)
    before = server.stats().counters["aborted_requests"]
    with pytest.raises(EngineTimeoutError, match="generate"):
        server.generate(input_ids=[list(range(5, 15))], sampling_params=long, timeout=0.2)
    stats = wait_idle(server)
    assert stats.kv_used_tokens == 0 and stats.counters["aborted_requests"] == before + 4


def test_calls_from_several_threads_share_one_client(server, reference, text_model) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from conftest import make_prompts

    prompts = make_prompts(text_model.vocab_size, [4, 6, 8, 10, 5, 7], seed=80)

    def one(i: int):
        if i % 3 == 0:
            return server.generate(input_ids=[prompts[i]], sampling_params=PARAMS)[0]
        if i % 3 == 1:
            return [d for d in server.stream(prompts[i], PARAMS)][-1].output
        return server.get_outputs(server.add_request(prompts[i], PARAMS), timeout=60)[0]

    with ThreadPoolExecutor(6) as pool:
        outs = list(pool.map(one, range(6)))
    for prompt, got in zip(prompts, outs, strict=True):
        same_output(got, reference.generate(input_ids=[prompt], sampling_params=PARAMS)[0], exact_logprobs=False)


def test_flush_cache_drops_the_prefix_cache(server, reference) -> None:
    prompt = list(range(70, 90))
    params = SamplingParams(temperature=0, max_new_tokens=4)
    server.generate(input_ids=[prompt], sampling_params=params)
    assert server.generate(input_ids=[prompt], sampling_params=params)[0].num_cached_tokens > 0
    server.flush_cache()
    reference.flush_cache()
    got = server.generate(input_ids=[prompt], sampling_params=params)[0]
    assert got.num_cached_tokens == 0
    same_output(got, reference.generate(input_ids=[prompt], sampling_params=params)[0])
