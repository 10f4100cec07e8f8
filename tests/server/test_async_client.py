"""AsyncRolloutClient against the shared engine process: generate and streams equal the
in-process engine, many calls in flight at once on one event loop, add_request /
get_outputs / abort, and a cancelled call (or a stream left early) aborts its requests."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from conftest import make_prompts
from server_fixtures import reference, same_output, server, text_model, wait_idle  # noqa: F401 (fixtures)

from rollout import SamplingParams
from rollout.server import AsyncRolloutClient

SAMPLED = SamplingParams(temperature=1.0, max_new_tokens=12, seed=61, ignore_eos=True, top_logprobs=2)
LONG = SamplingParams(temperature=0, max_new_tokens=480, ignore_eos=True)


def _run(server, body):
    async def main():
        client = await AsyncRolloutClient.connect(server.address, timeout_s=60)
        try:
            return await body(client)
        finally:
            await client.close()

    return asyncio.run(main())


def test_generate_equals_in_process(server, reference, text_model) -> None:
    prompts = make_prompts(text_model.vocab_size, [4, 10], seed=70)
    outs = _run(server, lambda c: c.generate(input_ids=prompts, sampling_params=SAMPLED))
    for got, want in zip(outs, reference.generate(input_ids=prompts, sampling_params=SAMPLED), strict=True):
        same_output(got, want)
    texts = _run(server, lambda c: c.generate(prompts=["async"], sampling_params=SAMPLED))
    same_output(texts[0], reference.generate(prompts=["async"], sampling_params=SAMPLED)[0])


def test_stream_deltas_concatenate(server, reference) -> None:
    params = SamplingParams(temperature=0.9, max_new_tokens=20, n=2, seed=62, ignore_eos=True)

    async def body(client):
        return [d async for d in client.stream(prompt="stream me", sampling_params=params, request_id="s")]

    deltas = _run(server, body)
    want = reference.generate(prompts=["stream me"], sampling_params=params)
    for i, w in enumerate(want):
        mine = [d for d in deltas if d.request_id == f"s-{i}"]
        assert len(mine) > 1 and mine[-1].finished and not any(d.finished for d in mine[:-1])
        out = mine[-1].output
        assert sum((d.token_ids for d in mine), []) == out.token_ids
        assert sum((d.logprobs for d in mine), []) == out.logprobs
        assert "".join(d.text or "" for d in mine) == out.text
        same_output(out, w)


def test_concurrent_calls_on_one_loop(server, reference, text_model) -> None:
    prompts = make_prompts(text_model.vocab_size, [3, 5, 7, 9, 11, 4], seed=71)

    async def streamed(client, prompt):
        return [d async for d in client.stream(prompt, SAMPLED)][-1].output

    async def added(client, prompt):
        ids = await client.add_request(prompt, SAMPLED)
        return (await client.get_outputs(ids, timeout=60))[0]

    async def body(client):
        calls = [client.generate(input_ids=[p], sampling_params=SAMPLED) for p in prompts[:2]]
        calls += [streamed(client, p) for p in prompts[2:4]] + [added(client, p) for p in prompts[4:]]
        calls.append(client.stats())
        return await asyncio.gather(*calls)

    *outs, stats = _run(server, body)
    outs = [o[0] if isinstance(o, list) else o for o in outs]
    for prompt, got in zip(prompts, outs, strict=True):
        # tokens are seeded per request: the same in any batch; log-probs to rounding
        same_output(got, reference.generate(input_ids=[prompt], sampling_params=SAMPLED)[0], exact_logprobs=False)
    assert stats.kv_capacity_tokens > 0


def test_abort_and_poll_outputs(server) -> None:
    async def body(client):
        ids = await client.add_request(list(range(5, 25)), LONG, request_id="stop-me")
        assert await client.abort("stop-me") is True
        (out,) = await client.get_outputs(ids, timeout=30)
        quick = await client.add_request([1, 2, 3], SAMPLED)
        for _ in range(3000):
            polled = await client.poll_outputs()
            if polled:
                return out, quick, polled
            await asyncio.sleep(0.01)
        raise AssertionError("poll_outputs never returned the finished request")

    out, quick, polled = _run(server, body)
    assert out.finish_reason == "abort" and len(out.token_ids) < 480
    assert [o.request_id for o in polled] == quick and polled[0].finish_reason == "length"
    assert wait_idle(server).kv_used_tokens == 0


def test_request_id_held_until_handed_out(server) -> None:
    """As the sync client: a finished request's id stays taken until its output is collected."""
    async def body(client):
        ids = await client.add_request([1, 2, 3], SAMPLED, request_id="held-async")
        for _ in range(3000):  # finished in the engine (its output may still be on the way)
            stats = await client.stats()
            if not stats.num_running and not stats.num_waiting:
                break
            await asyncio.sleep(0.01)
        with pytest.raises(ValueError, match="'held-async' is already in use"):
            await client.add_request([1, 2, 3], SAMPLED, request_id="held-async")
        first = await client.get_outputs(ids, timeout=30)
        again = await client.get_outputs(await client.add_request([1, 2, 3], SAMPLED, request_id="held-async"), timeout=30)
        return first, again

    first, again = _run(server, body)
    assert [o.request_id for o in first + again] == ["held-async"] * 2 and first[0].token_ids == again[0].token_ids


@pytest.mark.parametrize("how", ["cancel generate", "leave stream"])
def test_giving_up_aborts_and_frees_kv(server, how) -> None:
    async def body(client):
        if how == "cancel generate":
            task = asyncio.create_task(client.generate(input_ids=[list(range(3, 23))], sampling_params=LONG))
            while (await client.stats()).num_running == 0:
                await asyncio.sleep(0.005)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        else:  # `break` alone leaves an async generator open until it is collected: aclosing
            async with contextlib.aclosing(client.stream(list(range(3, 23)), LONG)) as stream:
                async for _ in stream:
                    assert (await client.stats()).num_running == 1
                    break
        for _ in range(500):  # this client still connected: the abort is the cancel's, not a dead client's
            stats = await client.stats()
            if stats.num_running == 0:
                return stats
            await asyncio.sleep(0.01)
        raise AssertionError("the request kept running")

    stats = _run(server, body)
    assert stats.kv_used_tokens == 0 and stats.num_waiting == 0
