"""sleep / wake through RolloutClient: outputs after wake equal those before (and the
in-process engine's); a request accepted before sleep waits and finishes after wake (a
stream too); a new request while asleep is refused with a RuntimeError (EngineError) saying
so; staged wake lets weights be synced before the KV cache returns; level 2 needs a full
sync first."""

from __future__ import annotations

import pytest
from conftest import make_prompts
from server_fixtures import reference, same_output, server, text_model, wait_idle  # noqa: F401 (fixtures)

from rollout import SamplingParams
from rollout.server import EngineError, EngineTimeoutError
from weightsync.trainer import iter_hf_weights


@pytest.fixture(autouse=True)
def awake_after(server):
    """A failed test must not leave the shared engine asleep for the next one."""
    yield
    try:
        server.wake()
    except Exception:  # a level-2 sleep left without its sync: nothing more to do here
        pass

SAMPLED = SamplingParams(temperature=1.0, max_new_tokens=10, seed=31, ignore_eos=True)


def test_outputs_after_wake_equal_outputs_before(server, reference, text_model) -> None:
    prompts = make_prompts(text_model.vocab_size, [5, 8], seed=50)
    before = server.generate(input_ids=prompts, sampling_params=SAMPLED)
    stats = server.sleep(level=1)
    assert stats.level == 1 and stats.released_bytes.get("weights", 0) > 0 and stats.released_bytes.get("kv_cache", 0) > 0
    with pytest.raises(RuntimeError, match="the engine is asleep") as refused:
        server.generate(input_ids=prompts, sampling_params=SAMPLED)
    assert isinstance(refused.value, EngineError)
    with pytest.raises(RuntimeError, match="the engine is asleep"):
        server.add_request(prompts[0], SAMPLED)
    assert server.health().ok  # everything else is served while asleep
    stats = server.wake()
    assert stats.level == 0 and stats.restored_bytes == stats.released_bytes
    after = server.generate(input_ids=prompts, sampling_params=SAMPLED)
    for b, a, want in zip(before, after, reference.generate(input_ids=prompts, sampling_params=SAMPLED), strict=True):
        same_output(a, b, exact_logprobs=False)  # the prefix cache was flushed by sleep
        same_output(a, want)


def test_requests_accepted_before_sleep_finish_after_wake(server, reference) -> None:
    params = SamplingParams(temperature=1.0, max_new_tokens=300, seed=8, ignore_eos=True)  # still running at sleep()
    ids = server.add_request([7, 7, 7, 1], params)
    stream = server.stream([2, 4, 6, 8], params, request_id="sleeper")
    first = next(stream)
    server.sleep(level=1)
    with pytest.raises(EngineTimeoutError):
        server.get_outputs(ids, timeout=0.3)  # nothing runs while asleep
    health = server.health()
    assert health.num_running == 0 and health.num_waiting == 2
    server.wake(["weights"])
    server.wake(["kv_cache"])
    deltas = [first, *stream]
    assert deltas[-1].finished and deltas[-1].output.finish_reason == "length"
    assert sum((d.token_ids for d in deltas), []) == deltas[-1].output.token_ids
    added = server.get_outputs(ids, timeout=30)[0]
    for out, prompt in ((added, [7, 7, 7, 1]), (deltas[-1].output, [2, 4, 6, 8])):
        same_output(out, reference.generate(input_ids=[prompt], sampling_params=params)[0], exact_logprobs=False)
    assert wait_idle(server).kv_used_tokens == 0


def test_level2_refuses_until_a_full_sync(server, reference, text_model) -> None:
    prompts = make_prompts(text_model.vocab_size, [6], seed=51)
    server.sleep(level=2)
    server.wake(["weights"])
    original = list(iter_hf_weights(text_model.hf))
    with pytest.raises(ValueError, match="full=True"):
        server.update_weights(original[:1])
    with pytest.raises(RuntimeError, match="asleep"):
        server.generate(input_ids=prompts, sampling_params=SAMPLED)
    version = server.update_weights(original, full=True)
    assert version == reference.update_weights(original, full=True)  # keeps the two engines' versions equal
    server.wake(["kv_cache"])
    out = server.generate(input_ids=prompts, sampling_params=SAMPLED)[0]
    same_output(out, reference.generate(input_ids=prompts, sampling_params=SAMPLED)[0])
    assert out.weight_version == version


def test_sleep_refusals(server) -> None:
    server.sleep(level=1)
    try:
        with pytest.raises(RuntimeError, match="already asleep"):
            server.sleep(level=1)
        with pytest.raises(ValueError, match="needs the weights awake"):
            server.wake(["kv_cache"])
    finally:
        server.wake()
    assert server.generate(input_ids=[[1, 2]], sampling_params=SAMPLED)[0].finish_reason == "length"
