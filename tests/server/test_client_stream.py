"""Streaming through RolloutClient: deltas concatenate to the final output (tokens,
log-probs, text), which equals in-process generate; leaving a stream early or aborting it
mid-way aborts the request and frees its KV."""

from __future__ import annotations

import pytest
from server_fixtures import reference, same_output, server, text_model, wait_idle  # noqa: F401 (fixtures)

from rollout import SamplingParams


def _collect(deltas) -> dict[str, dict]:
    """Per request id: concatenated tokens, log-probs and text, and the final output."""
    got: dict[str, dict] = {}
    for delta in deltas:
        entry = got.setdefault(delta.request_id, dict(tokens=[], logprobs=[], text="", output=None, deltas=0))
        assert entry["output"] is None, "a delta after the finished one"
        entry["tokens"] += delta.token_ids
        entry["logprobs"] += delta.logprobs
        entry["text"] += delta.text or ""
        entry["deltas"] += 1
        assert len(delta.token_ids) == len(delta.logprobs)
        if delta.finished:
            assert delta.output is not None and delta.finish_reason == delta.output.finish_reason
            entry["output"] = delta.output
    return got


def _check_concatenation(got: dict) -> None:
    for rid, entry in got.items():
        out = entry["output"]
        assert out is not None, f"{rid} never finished"
        assert entry["tokens"] == out.token_ids and entry["logprobs"] == out.logprobs
        assert entry["text"] == out.text


def test_stream_deltas_concatenate_to_the_in_process_output(server, reference) -> None:
    params = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
    got = _collect(server.stream([5, 6, 7, 8], params))
    assert list(got) == ["req-0"] or len(got) == 1
    entry = next(iter(got.values()))
    assert entry["deltas"] > 2, "expected several deltas, not one at the end"
    _check_concatenation(got)
    same_output(entry["output"], reference.generate(input_ids=[[5, 6, 7, 8]], sampling_params=params)[0])


def test_stream_n_samples_of_a_text_prompt(server, reference) -> None:
    params = SamplingParams(temperature=1.0, max_new_tokens=16, n=3, seed=21, ignore_eos=True)
    got = _collect(server.stream(prompt="once upon", sampling_params=params, request_id="story"))
    assert sorted(got) == ["story-0", "story-1", "story-2"]
    _check_concatenation(got)
    want = reference.generate(prompts=["once upon"], sampling_params=params)
    for i, w in enumerate(want):
        same_output(got[f"story-{i}"]["output"], w)


def test_stream_with_a_stop_string_never_shows_it(server, reference) -> None:
    free = reference.generate(prompts=["the end"], sampling_params=SamplingParams(
        temperature=0, max_new_tokens=30, ignore_eos=True))[0]
    stop = free.text[8:11]
    params = SamplingParams(temperature=0, max_new_tokens=30, ignore_eos=True, stop=[stop])
    got = _collect(server.stream(prompt="the end", sampling_params=params))
    _check_concatenation(got)
    entry = next(iter(got.values()))
    assert entry["output"].finish_reason == "stop" and stop not in entry["text"]
    want = reference.generate(prompts=["the end"], sampling_params=params)[0]
    assert entry["output"].token_ids == want.token_ids and entry["output"].text == want.text
    assert entry["output"].logprobs == pytest.approx(want.logprobs, rel=1e-5, abs=1e-5)
    assert wait_idle(server).kv_used_tokens == 0


def test_leaving_a_stream_early_aborts_it_and_frees_its_kv(server) -> None:
    assert wait_idle(server).kv_used_tokens == 0
    params = SamplingParams(temperature=0, max_new_tokens=480, ignore_eos=True)
    stream = server.stream(list(range(1, 20)), params)
    first = next(stream)
    assert first.token_ids and not first.finished
    busy = server.stats()
    assert busy.num_running == 1 and busy.kv_used_tokens > 0
    stream.close()  # as a `break` out of the loop does
    stats = wait_idle(server)
    assert stats.num_running == 0 and stats.kv_used_tokens == 0
    assert stats.counters["aborted_requests"] > busy.counters["aborted_requests"]


def test_abort_mid_stream_ends_it_with_the_partial_output(server) -> None:
    params = SamplingParams(temperature=0, max_new_tokens=480, ignore_eos=True)
    deltas = []
    for delta in server.stream(list(range(30, 50)), params, request_id="cut"):
        deltas.append(delta)
        if len(deltas) == 2:
            assert server.abort("cut") is True
    got = _collect(deltas)
    _check_concatenation(got)
    out = got["cut"]["output"]
    assert out.finish_reason == "abort" and 0 < len(out.token_ids) < 480
    assert server.abort("cut") is False  # gone already
    assert wait_idle(server).kv_used_tokens == 0
