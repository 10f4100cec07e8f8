"""A client never hangs its process (issue 49): dropped without close(), in a reference
cycle, in any state (after EngineDeadError, a failed connect, a timeout, with a stream
abandoned, or idle), sync or async, the next gc.collect() returns at once, and the engine
sees the connection close and frees what the client had running. Before, pyzmq's
Context.__del__ could run before its sockets' in the cycle's garbage and wait forever in
term(). The same states at interpreter exit: lifecycle_child.py, in a process of its own.

The collections run with the automatic collector off and in a thread with a time limit, so a
regression fails the test instead of hanging whatever allocates next.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import weakref
from pathlib import Path

import pytest
from gc_checks import collect_within_limit, collector_off, drop_in_cycle, ordinary_collection_s
from server_fixtures import server, text_model  # noqa: F401 (fixtures)

from rollout import SamplingParams
from rollout.server import AsyncRolloutClient, EngineDeadError, EngineTimeoutError, RolloutClient
from rollout.server.launch import spawn_engine

ROOT = Path(__file__).resolve().parents[2]
CHILD = Path(__file__).with_name("lifecycle_child.py")
LONG = SamplingParams(temperature=1.0, max_new_tokens=480, ignore_eos=True, seed=0)
@pytest.fixture(scope="module")
def ordinary_s(server) -> float:
    return ordinary_collection_s()


def nowhere() -> str:
    """An address nothing listens at (an ipc path that is never bound)."""
    return f"ipc://{tempfile.gettempdir()}/rollout-nobody-{os.getpid()}-{time.monotonic_ns()}.sock"


def engine_idle(client: RolloutClient, timeout_s: float = 5.0) -> None:
    """The engine freed what the dropped clients had running (their connections closed)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = client.stats()
        if stats.num_running + stats.num_waiting == 0 and client.health().num_clients == 0:
            assert stats.kv_used_tokens == 0
            return
        assert time.monotonic() < deadline, f"the engine still runs a dropped client's requests: {stats}"
        time.sleep(0.02)


# ---- each state, sync and async, on the shared engine ---------------------------------------------
def _sync_idle(address: str) -> weakref.ref:
    client = RolloutClient(address)
    drop_in_cycle(client)
    return weakref.ref(client)


async def _async_idle(address: str) -> weakref.ref:
    client = await AsyncRolloutClient.connect(address)
    await client.health()
    drop_in_cycle(client)
    return weakref.ref(client)


def _sync_timed_out(address: str) -> weakref.ref:
    client = RolloutClient(address)
    with pytest.raises(EngineTimeoutError) as info:
        client.generate(input_ids=[[1, 2, 3]] * 4, sampling_params=LONG, timeout=0.05)
    drop_in_cycle(client, info)
    return weakref.ref(client)


async def _async_timed_out(address: str) -> weakref.ref:
    client = await AsyncRolloutClient.connect(address)
    with pytest.raises(EngineTimeoutError) as info:
        await client.generate(input_ids=[[1, 2, 3]] * 4, sampling_params=LONG, timeout=0.05)
    drop_in_cycle(client, info)
    return weakref.ref(client)


def _sync_stream_abandoned(address: str) -> weakref.ref:
    client = RolloutClient(address)
    stream = client.stream([1, 2, 3], dataclasses.replace(LONG, n=4))
    next(stream)
    drop_in_cycle(client, stream)
    return weakref.ref(client)


async def _async_stream_abandoned(address: str) -> weakref.ref:
    client = await AsyncRolloutClient.connect(address)
    stream = client.stream([1, 2, 3], dataclasses.replace(LONG, n=4))
    await anext(stream)
    drop_in_cycle(client, stream)
    return weakref.ref(client)


def _sync_failed_connect(address: str) -> weakref.ref:
    with pytest.raises(EngineDeadError, match="no engine is listening") as info:
        RolloutClient(nowhere(), connect_timeout_s=0.3)
    # the half-made client: __init__ closed it, and its frame in the traceback holds it
    client = next(frame.f_locals["self"] for frame, _ in traceback.walk_tb(info.tb)
                  if isinstance(frame.f_locals.get("self"), RolloutClient))
    drop_in_cycle(info)
    return weakref.ref(client)


async def _async_failed_connect(address: str) -> weakref.ref:
    client = AsyncRolloutClient(nowhere(), timeout_s=0.3)  # connects at its first call
    with pytest.raises(EngineDeadError, match="no engine is listening") as info:
        await client.health()
    with pytest.raises(EngineDeadError, match="no engine is listening"):
        await AsyncRolloutClient.connect(nowhere(), connect_timeout_s=0.3)
    drop_in_cycle(client, info)
    return weakref.ref(client)


STATES = {
    "idle": (_sync_idle, _async_idle),
    "timed_out": (_sync_timed_out, _async_timed_out),
    "stream_abandoned": (_sync_stream_abandoned, _async_stream_abandoned),
    "failed_connect": (_sync_failed_connect, _async_failed_connect),
}


@pytest.mark.parametrize("kind", ["sync", "async"])
@pytest.mark.parametrize("state", list(STATES))
def test_a_dropped_client_is_collected_at_once(server, ordinary_s: float, state: str, kind: str) -> None:
    make_sync, make_async = STATES[state]
    with collector_off():
        ref = make_sync(server.address) if kind == "sync" else asyncio.run(make_async(server.address))
        collect_within_limit([ref], ordinary_s, "client")
    engine_idle(server)


# ---- after the engine was killed, here and in a process that then exits -------------------------
def test_clients_left_after_the_engine_was_killed(server, text_model, ordinary_s: float) -> None:
    """Issue 49's steps: a sync client generating in a thread and an async client streaming
    when the engine is SIGKILLed; both raise EngineDeadError, waiting and later calls alike,
    and are dropped in cycles (the thread's closure, the errors' tracebacks); the next
    gc.collect() returns. lifecycle_child.py does the same, and every other state, in a
    process that must then exit; its clients of the shared engine must leave nothing there."""
    engine = spawn_engine(text_model.path, {"num_threads": 1}, server_args=["--log-level", "WARNING"])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    child = subprocess.Popen([sys.executable, str(CHILD), engine.address, server.address, nowhere()], env=env,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(line) for line in child.stdout], daemon=True)
    reader.start()
    try:
        with collector_off():
            refs = _killed_under_clients(engine, child, lines)
            collect_within_limit(refs, ordinary_s, "client")
        child.stdin.write("killed\n")
        child.stdin.flush()
        try:
            child.wait(60)
        except subprocess.TimeoutExpired:
            pytest.fail("a process whose clients were left after a killed engine did not exit within 60s")
        reader.join(10)
        out = "".join(lines.get() for _ in range(lines.qsize()))
        err = child.stderr.read()
        assert child.returncode == 0 and "collected 9 clients" in out and "leaving 9 clients" in out, out + err
        assert "Traceback" not in err and "Exception ignored" not in err, err
    finally:
        child.kill()
        child.wait()
        engine.process.kill()
        engine.stop()
    engine_idle(server)


def _killed_under_clients(engine, child: subprocess.Popen, lines: queue.Queue) -> list[weakref.ref]:
    sync_client = RolloutClient(engine.address, connect_timeout_s=300)
    errors: list[BaseException] = []
    go, streaming = threading.Event(), threading.Event()

    def generate() -> None:
        try:
            sync_client.generate(input_ids=[[1, 2, 3]] * 4, sampling_params=LONG)
        except BaseException as error:
            errors.append(error)

    async def stream() -> weakref.ref:
        client = await AsyncRolloutClient.connect(engine.address, connect_timeout_s=300)
        await asyncio.to_thread(go.wait, 300)
        with pytest.raises(EngineDeadError) as waiting:
            async for _ in client.stream([4, 5, 6], dataclasses.replace(LONG, n=16)):
                streaming.set()
        with pytest.raises(EngineDeadError) as later:
            await client.stats()
        drop_in_cycle(client, waiting, later)
        return weakref.ref(client)

    async_refs: list[weakref.ref] = []
    async_thread = threading.Thread(target=lambda: async_refs.append(asyncio.run(stream())))
    async_thread.start()
    try:
        try:
            line = lines.get(timeout=300)
        except queue.Empty:
            line = ""
        if line.strip() != "ready":
            pytest.fail(f"the child process did not get ready: {line!r} "
                        f"{child.stderr.read() if child.poll() is not None else ''}")
        go.set()
        assert streaming.wait(60), "the async client's stream did not start"
        generating = threading.Thread(target=generate)
        generating.start()
        time.sleep(0.2)  # its 4 x 480 tokens take seconds: it is still waiting at the kill
        engine.process.send_signal(signal.SIGKILL)
        generating.join(30)
        assert len(errors) == 1 and isinstance(errors[0], EngineDeadError), errors
        with pytest.raises(EngineDeadError) as later:
            sync_client.stats()
    finally:
        go.set()
        async_thread.join(60)
    assert async_refs, "the async client did not raise EngineDeadError"
    drop_in_cycle(sync_client, generate, later)
    return [weakref.ref(sync_client), *async_refs]
