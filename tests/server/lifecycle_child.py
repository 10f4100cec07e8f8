"""Run by test_client_lifecycle.py in a process of its own: clients of both kinds left in each
state of issue 49 (after EngineDeadError, a timeout, a failed connect, with a stream
abandoned, or just dropped), twice over. The first set is dropped in reference cycles and
collected: gc.collect() must return. The second is dropped in cycles and left for the
interpreter's exit, which must end. The parent kills the engine at DOOMED once this prints
"ready", writes a line to stdin when it has, and gives this process a time limit.

    python lifecycle_child.py DOOMED LIVE NOWHERE   (engine addresses: to be killed, running, none)
"""

from __future__ import annotations

import asyncio
import faulthandler
import gc
import sys
import threading
import weakref

from rollout import SamplingParams
from rollout.server import AsyncRolloutClient, EngineDeadError, EngineTimeoutError, RolloutClient

LONG = SamplingParams(temperature=1.0, max_new_tokens=480, ignore_eos=True, seed=0)


def drop_in_cycle(*objects: object) -> None:
    cycle = list(objects)
    cycle.append(cycle)


def raised(error_type: type[BaseException], call) -> BaseException:
    try:
        call()
    except error_type as error:
        return error  # its traceback holds the frames that held the client: a cycle, as in the issue
    raise AssertionError(f"expected {error_type.__name__}")


async def raised_async(error_type: type[BaseException], awaitable) -> BaseException:
    try:
        await awaitable
    except error_type as error:
        return error
    raise AssertionError(f"expected {error_type.__name__}")


async def drain(stream) -> None:
    async for _ in stream:
        pass


async def doomed_clients(address: str) -> tuple:
    """A sync client generating in a thread and an async client streaming, on the engine the
    parent kills (issue 49's steps 1-3)."""
    sync_client = RolloutClient(address)
    errors: list[BaseException] = []
    thread = threading.Thread(target=lambda: errors.append(
        raised(EngineDeadError, lambda: sync_client.generate(input_ids=[[1, 2, 3]], sampling_params=LONG))))
    thread.start()
    async_client = await AsyncRolloutClient.connect(address)
    stream = async_client.stream([4, 5, 6], LONG)
    await anext(stream)
    return sync_client, thread, errors, async_client, stream


async def see_them_dead(sync_client, thread, errors, async_client, stream) -> list[weakref.ref]:
    """Steps 3-5: the waiting calls and later ones raise EngineDeadError; the clients are
    dropped in cycles."""
    await asyncio.to_thread(thread.join, 30)
    assert len(errors) == 1, "the generate call did not raise EngineDeadError"
    drop_in_cycle(sync_client, thread, errors, raised(EngineDeadError, sync_client.stats))
    await raised_async(EngineDeadError, drain(stream))  # the deltas that arrived first, then the error
    drop_in_cycle(async_client, stream, await raised_async(EngineDeadError, async_client.stats()))
    return [weakref.ref(sync_client), weakref.ref(async_client)]


async def live_and_failed_clients(live: str, nowhere: str) -> list[weakref.ref]:
    """The other states, dropped in cycles: timed out, a stream abandoned, idle, failed connect."""
    timed_out, streaming, idle = RolloutClient(live), RolloutClient(live), RolloutClient(live)
    drop_in_cycle(timed_out, raised(EngineTimeoutError, lambda: timed_out.generate(
        input_ids=[[1, 2, 3]], sampling_params=LONG, timeout=0.05)))
    stream = streaming.stream([1, 2, 3], LONG)
    next(stream)
    drop_in_cycle(streaming, stream)
    drop_in_cycle(idle)
    drop_in_cycle(raised(EngineDeadError, lambda: RolloutClient(nowhere, connect_timeout_s=0.3)))
    refs = [weakref.ref(c) for c in (timed_out, streaming, idle)]
    del timed_out, streaming, stream, idle

    timed_out, streaming, idle = [await AsyncRolloutClient.connect(live) for _ in range(3)]
    lazy = AsyncRolloutClient(nowhere, timeout_s=0.3)  # connects at its first call
    drop_in_cycle(timed_out, await raised_async(EngineTimeoutError, timed_out.generate(
        input_ids=[[1, 2, 3]], sampling_params=LONG, timeout=0.05)))
    stream = streaming.stream([1, 2, 3], LONG)
    await anext(stream)
    drop_in_cycle(streaming, stream)
    drop_in_cycle(idle)
    drop_in_cycle(lazy, await raised_async(EngineDeadError, lazy.health()))
    drop_in_cycle(await raised_async(EngineDeadError, AsyncRolloutClient.connect(nowhere, connect_timeout_s=0.3)))
    return refs + [weakref.ref(c) for c in (timed_out, streaming, idle, lazy)]


async def run(doomed: str, live: str, nowhere: str) -> None:
    doomed_sets = [await doomed_clients(doomed) for _ in range(2)]
    print("ready", flush=True)
    await asyncio.to_thread(sys.stdin.readline)  # the parent has killed that engine
    collected = await see_them_dead(*doomed_sets.pop()) + await live_and_failed_clients(live, nowhere)
    gc.collect()
    # asyncio finalizes an abandoned async stream on the loop (its aclose() brings it, and the
    # client it holds, back for one turn): let the loop run that, then collect once more
    await asyncio.sleep(0.2)
    gc.collect()
    alive = [ref for ref in collected if ref() is not None]
    assert not alive, f"not collected: {[ref() for ref in alive]}"
    print(f"collected {len(collected)} clients", flush=True)
    left = await see_them_dead(*doomed_sets.pop()) + await live_and_failed_clients(live, nowhere)
    print(f"leaving {len(left)} clients for the exit", flush=True)


if __name__ == "__main__":
    faulthandler.dump_traceback_later(50, exit=True)  # a hang shows where, then ends
    asyncio.run(run(*sys.argv[1:4]))
