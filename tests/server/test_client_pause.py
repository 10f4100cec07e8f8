"""pause_generation / continue_generation through both clients of the shared engine process:
held requests make no tokens while paused and finish as the in-process engine's after
continue; "abort" returns a call's partial outputs; bad calls come back as errors naming what
is wrong. Every test leaves the engine unpaused."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from server_fixtures import reference, same_output, server, text_model, wait_idle  # noqa: F401 (fixtures)

from rollout import SamplingParams
from rollout.server import AsyncRolloutClient

PARAMS = SamplingParams(temperature=0.8, max_new_tokens=40, seed=17, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_new_tokens=480, ignore_eos=True)


def _generated(server) -> int:
    return server.stats().counters["generated_tokens"]


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_held_requests_wait_then_finish_as_in_process(server, reference, mode: str) -> None:
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    ids = [server.add_request(p, PARAMS)[0] for p in prompts]
    server.pause_generation(mode)
    try:
        assert server.stats().generation_paused == mode
        before = _generated(server)
        time.sleep(0.3)  # many loop turns of the engine process
        assert _generated(server) == before and server.poll_outputs() == []
    finally:
        server.continue_generation()
    outs = server.get_outputs(ids, timeout=60)
    for got, prompt in zip(outs, prompts, strict=True):  # one add_request each: prompt_index 0
        same_output(got, reference.generate(input_ids=[prompt], sampling_params=PARAMS)[0], exact_logprobs=False)
    assert wait_idle(server).generation_paused is None


def test_abort_returns_a_blocked_generate_its_partial_outputs(server, reference) -> None:
    """The call is made while paused, so it is surely blocked in the engine when generation
    continues and is aborted right after (a few steps later: the tiny model could otherwise
    finish all 480 tokens before a pause sent on a loaded machine arrives)."""
    wait_idle(server)
    got: list = []
    server.pause_generation("in_place")
    call = threading.Thread(target=lambda: got.extend(server.generate(input_ids=[[3, 1, 4]], sampling_params=LONG)))
    call.start()
    deadline = time.monotonic() + 30
    while server.stats().num_waiting == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    server.continue_generation()
    server.pause_generation("abort")
    try:
        call.join(30)
        assert not call.is_alive(), "the aborted call must return"
    finally:
        server.continue_generation()
    [out] = got
    assert out.finish_reason == "abort" and len(out.token_ids) < LONG.max_new_tokens
    assert len(out.logprobs) == len(out.token_ids)
    want = reference.generate(input_ids=[[3, 1, 4]], sampling_params=LONG)[0]
    assert out.token_ids == want.token_ids[: len(out.token_ids)]


def test_the_async_client_pauses_and_bad_calls_are_refused(server) -> None:
    async def body() -> None:
        client = await AsyncRolloutClient.connect(server.address, timeout_s=60)
        try:
            # the engine's error, raised here as its type
            with pytest.raises(RuntimeError, match="continue_generation: generation is not paused"):
                await client.continue_generation()
            with pytest.raises(ValueError, match=r"pause_generation\(mode='keep'\): expected one of"):
                await client.pause_generation("keep")
            await client.pause_generation("in_place")
            try:
                assert (await client.stats()).generation_paused == "in_place"
                with pytest.raises(RuntimeError, match=r"already paused \(mode='in_place'\)"):
                    await client.pause_generation("retract")
                pending = asyncio.ensure_future(client.generate(input_ids=[[2, 7]], sampling_params=PARAMS))
                await asyncio.sleep(0.2)
                assert not pending.done(), "a call made while paused waits for continue_generation"
            finally:
                await client.continue_generation()
            [out] = await asyncio.wait_for(pending, 60)
            assert out.finish_reason == "length" and len(out.token_ids) == PARAMS.max_new_tokens
        finally:
            await client.close()

    asyncio.run(body())
    assert wait_idle(server).generation_paused is None


def test_the_http_servers_engine_process_backend_pauses(server) -> None:
    """The OpenAI server in front of an engine process (--engine-address) pauses through it."""
    pytest.importorskip("fastapi")
    from rollout.server.openai_client_backend import ClientBackend

    async def body() -> None:
        backend = ClientBackend(server.address)
        try:
            await backend.pause_generation("retract")
            assert server.stats().generation_paused == "retract"
            await backend.continue_generation()
            with pytest.raises(RuntimeError, match="continue_generation: generation is not paused"):
                await backend.continue_generation()
        finally:
            await backend.close()

    asyncio.run(body())
    assert server.stats().generation_paused is None


def test_pause_over_http_in_front_of_the_engine_process(server, text_model) -> None:
    """The HTTP endpoints with the engine process behind them: its refusals (EngineError
    through the client) are 400s naming the reason, as in process."""
    pytest.importorskip("fastapi")
    import httpx

    from rollout.server.openai_client_backend import ClientBackend
    from rollout.server.openai_http import ServerThread, build_app, load_tokenizer

    http = ServerThread(build_app(ClientBackend(server.address), load_tokenizer(text_model.path), "tiny")).start()
    base = http.base_url.removesuffix("/v1")
    try:
        assert httpx.post(f"{base}/pause_generation", json={"mode": "retract"}, timeout=30).status_code == 200
        assert server.stats().generation_paused == "retract"
        assert httpx.post(f"{base}/continue_generation", timeout=30).status_code == 200
        again = httpx.post(f"{base}/continue_generation", timeout=30)
        assert again.status_code == 400 and "generation is not paused" in again.json()["error"]["message"]
    finally:
        http.stop()
    assert server.stats().generation_paused is None
