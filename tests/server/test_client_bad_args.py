"""Bad arguments through the client raise what in-process Engine raises (ValueError or
TypeError, the same message naming the field), whether the client refuses them before
sending or the engine process refuses them; a refused batch leaves nothing queued."""

from __future__ import annotations

import time

import pytest
import torch
from server_fixtures import reference, server, text_model  # noqa: F401 (fixtures)

from rollout import SamplingParams

G = SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True)

BAD_GENERATE = {
    "out of vocabulary": dict(input_ids=[[1, 2], [1, 2, 10_000]]),
    "empty prompt": dict(input_ids=[[1], []]),
    "negative id": dict(input_ids=[[1, -1]]),
    "str token": dict(input_ids=[["a"]]),
    "bool token": dict(input_ids=[[True, 2]]),
    "float token": dict(input_ids=[[1.0, 2]]),
    "flat list": dict(input_ids=[1, 2, 3]),
    "params count": dict(input_ids=[[1]], sampling_params=[G, G]),
    "unknown adapter": dict(input_ids=[[1], [2]], lora_name=[None, "nope"]),
    "adapter count": dict(input_ids=[[1]], lora_name=["a", "b"]),
    "one str prompt": dict(prompts="text"),
    "both prompts": dict(input_ids=[[1]], prompts=["x"]),
    "no prompts": dict(),
    "past the context": dict(input_ids=[[1]], sampling_params=SamplingParams(max_new_tokens=10**6)),
    "stop token id": dict(input_ids=[[1]], sampling_params=SamplingParams(stop_token_ids=[10_000])),
    "top_logprobs": dict(input_ids=[[1]], sampling_params=SamplingParams(top_logprobs=10_000)),
    "text past the context": dict(prompts=["ok", "x" * 600]),
    "None params entry": dict(input_ids=[[1]], sampling_params=[None]),
    "dict params entry": dict(input_ids=[[1]], sampling_params=[{"n": 1}]),
    "int text prompt": dict(prompts=[1]),
    "1-D tensor": dict(input_ids=torch.tensor([1, 2])),
    "float tensor": dict(input_ids=torch.tensor([[1.0, 2.0]])),
    "int adapter name": dict(input_ids=[[1]], lora_name=3),
    "int input_ids": dict(input_ids=5),
}


def _raised(fn):
    with pytest.raises((ValueError, TypeError)) as info:
        fn()
    return info.value


@pytest.mark.parametrize("case", list(BAD_GENERATE))
def test_generate_refuses_what_in_process_refuses(server, reference, case) -> None:
    kwargs = BAD_GENERATE[case]
    want = _raised(lambda: reference.generate(**kwargs))
    got = _raised(lambda: server.generate(**kwargs))
    assert type(got) is type(want) and str(got) == str(want), case
    stats = server.stats()
    assert stats.num_waiting == 0 and stats.num_running == 0, "a refused batch left requests queued"


def test_add_request_refusals_name_the_field(server, reference) -> None:
    for kwargs in (dict(input_ids=[1, 500]), dict(input_ids=[]), dict(input_ids=[1], lora_name="nope"),
                   dict(input_ids=[1], sampling_params=SamplingParams(max_new_tokens=10**6)),
                   dict(input_ids=[1], sampling_params="greedy"), dict(), dict(input_ids=[1], request_id=5),
                   dict(input_ids=[1], request_id=""), dict(input_ids=[1], lora_name=3), dict(prompt=""),
                   dict(input_ids=torch.tensor([[1, 2]]))):
        want = _raised(lambda: reference.add_request(**kwargs))
        got = _raised(lambda: server.add_request(**kwargs))
        assert type(got) is type(want) and str(got) == str(want), (kwargs, got, want)
    # a request id in use: refused, the first one keeps running
    ids = server.add_request([1, 2, 3], G, request_id="dup")
    with pytest.raises(ValueError, match="dup"):
        server.add_request([1, 2, 3], G, request_id="dup")
    assert [o.request_id for o in server.get_outputs(ids, timeout=30)] == ["dup"]
    assert server._boxes == {}, "a refused add left its mailbox open"


def test_request_id_held_until_its_output_is_handed_out(server) -> None:
    """The engine forgets a request once it finishes; the client still owes its output, so
    the id stays taken until get_outputs / poll_outputs hands it out (CI once saw a 4-token
    request finish before the second add reached the engine, and both were accepted)."""
    pair = SamplingParams(temperature=0, max_new_tokens=4, n=2, ignore_eos=True)
    ids = server.add_request([1, 2, 3], G, request_id="held") + server.add_request([1, 2], pair, request_id="pair")
    deadline = time.monotonic() + 30
    while (server.stats().num_running or server.stats().num_waiting) and time.monotonic() < deadline:
        time.sleep(0.01)
    for rid, params in (("held", G), ("pair", pair), ("pair-1", G)):
        with pytest.raises(ValueError, match=f"'{rid}' is already in use"):
            server.add_request([1, 2, 3], params, request_id=rid)
    assert [o.request_id for o in server.get_outputs(ids, timeout=30)] == ["held", "pair-0", "pair-1"]
    again = server.add_request([1, 2, 3], G, request_id="held")  # handed out: free again
    assert [o.request_id for o in server.get_outputs(again, timeout=30)] == ["held"]
    assert server.poll_outputs() == [] and server._boxes == {}


def test_other_calls_refuse_bad_values(server) -> None:
    with pytest.raises(ValueError, match="level"):
        server.sleep(level=3)
    with pytest.raises(ValueError, match="tags"):
        server.wake(["nope"])
    with pytest.raises(ValueError, match="pause_mode"):
        server.update_weights([], pause_mode="later")
    with pytest.raises(TypeError, match="path"):
        server.update_weights_from_disk(3)
    assert server.health().ok
