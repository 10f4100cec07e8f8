"""The engine process going away, on an engine process of this module's own (small caps:
a 64 KiB frame limit): a frame above the cap drops only that connection; a stopped engine
(SIGSTOP: the connection stays open, no heartbeats) and a killed one make waiting and later
calls raise EngineDeadError within the heartbeat timeout, never a hang; an engine that
cannot start makes launch() fail with its exit code; a non-loopback address is refused
unless --allow-remote."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgpack
import pytest
import torch
import zmq
from server_fixtures import SERVER_ARGS, text_model  # noqa: F401 (fixtures)
from zmq.utils.monitor import recv_monitor_message

from rollout import SamplingParams
from rollout.server import AsyncRolloutClient, EngineDeadError, RolloutClient, protocol
from rollout.server.engine_process import ServerConfig, check_server_address

ROOT = Path(__file__).resolve().parents[2]
CAP = 64 << 10
LONG = SamplingParams(temperature=1.0, max_new_tokens=480, n=16, ignore_eos=True, seed=2)


@pytest.fixture(scope="module")
def own_engine(text_model):
    client = RolloutClient.launch(text_model.path, server_args=[
        "--max-header-bytes", str(CAP), "--max-tensor-bytes", str(CAP), "--client-timeout-s", "1.0", "--log-level", "WARNING"],
        num_threads=1)
    yield client
    client.engine_process.process.kill()
    client.close()


def _timed(fn):
    start = time.monotonic()
    with pytest.raises(EngineDeadError) as info:
        fn()
    return time.monotonic() - start, str(info.value)


def test_a_frame_above_the_cap_drops_that_connection_only(own_engine) -> None:
    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    monitor = socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    socket.connect(own_engine.address)
    header = {"v": protocol.PROTOCOL_VERSION, "id": 1, "op": "update_weights", "args": {},
              "tensors": [{"name": "w", "dtype": "uint8", "shape": [CAP + 1]}]}
    socket.send_multipart([msgpack.packb(header), b"\0" * (CAP + 1)])
    assert monitor.poll(5000), "the engine kept a connection that sent a frame above its cap"
    assert recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED
    assert not socket.poll(200)  # and sent no reply
    monitor.close(linger=0)
    socket.close(linger=0)
    context.term()
    # the engine serves on; a client refuses such a frame before sending it
    assert own_engine.health().ok
    with pytest.raises(ValueError, match=f"exceeds the engine's {CAP}-byte cap"):
        own_engine.update_weights([("model.embed_tokens.weight", torch.zeros(CAP))])
    assert own_engine.generate(input_ids=[[1, 2]], sampling_params=SamplingParams(max_new_tokens=2))[0].token_ids


def test_a_stopped_engine_is_declared_dead_within_the_heartbeat_timeout(own_engine) -> None:
    client = RolloutClient(own_engine.address, heartbeat_timeout_s=1.0, timeout_s=60)
    process = own_engine.engine_process.process
    timer = threading.Timer(0.3, process.send_signal, (signal.SIGSTOP,))
    timer.start()
    try:
        elapsed, message = _timed(lambda: client.generate(input_ids=[[1, 2, 3]] * 4, sampling_params=LONG))
        assert elapsed < 5.0 and own_engine.address in message and "heartbeat" in message
        elapsed, _ = _timed(lambda: client.health())  # and every later call, at once
        assert elapsed < 0.1
    finally:
        timer.join()
        process.send_signal(signal.SIGCONT)
        client.close()
    # resumed, it serves new clients (older connections may have been dropped: while stopped
    # the engine heard no heartbeat either, and its own --client-timeout-s is 1 s)
    with RolloutClient(own_engine.address) as fresh:
        assert fresh.health().ok


def test_a_killed_engine_fails_waiting_and_later_calls(own_engine) -> None:
    address, process = own_engine.address, own_engine.engine_process.process
    asyncio_errors: list[BaseException] = []
    raised: list[float] = []  # when the asyncio stream raised

    async def async_wait(ready: threading.Event) -> None:
        client = await AsyncRolloutClient.connect(address, timeout_s=60)
        try:
            async def waiting():
                # 128 x 480 tokens, more than the KV holds at once: runs for seconds after the kill
                async for _ in client.stream([4, 5, 6], dataclasses.replace(LONG, n=128)):
                    ready.set()
            with pytest.raises(EngineDeadError):
                await waiting()
            raised.append(time.monotonic())
            with pytest.raises(EngineDeadError):
                await client.stats()
        except BaseException as error:
            asyncio_errors.append(error)
        finally:
            await client.close()

    sync_client = RolloutClient(address, timeout_s=60)
    ready = threading.Event()
    thread = threading.Thread(target=asyncio.run, args=(async_wait(ready),))
    thread.start()
    assert ready.wait(30)
    killed_at = time.monotonic() + 0.3
    threading.Timer(0.3, process.kill).start()
    elapsed, message = _timed(lambda: sync_client.generate(input_ids=[[1, 2, 3]], sampling_params=LONG))
    assert time.monotonic() - killed_at < 3.0 and "is gone" in message and address in message
    elapsed, _ = _timed(lambda: sync_client.stats())
    assert elapsed < 0.1
    thread.join(30)
    assert not asyncio_errors, asyncio_errors
    assert raised[0] - killed_at < 3.0
    # the launching client knows the process exited, and says so
    _, message = _timed(lambda: own_engine.health())
    assert "is gone" in message or "exited with code" in message
    sync_client.close()
    # once the process is gone for good (a killed process closes its sockets only after
    # unmapping its memory: a connection can still be accepted, and then dropped, before),
    # a new client finds nothing listening there, and says so rather than "busy"
    process.wait(30)
    elapsed, message = _timed(lambda: RolloutClient(address, connect_timeout_s=0.5))
    assert elapsed < 3.0 and f"no engine is listening at {address}" in message
    _, message = _timed(lambda: asyncio.run(AsyncRolloutClient.connect(address, connect_timeout_s=0.5)))
    assert "no engine is listening" in message


def test_an_engine_that_cannot_start_fails_launch(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["NoSuchModel"], "model_type": "none"}))
    start = time.monotonic()
    with pytest.raises(EngineDeadError, match="exited with code"):
        RolloutClient.launch(tmp_path, startup_timeout_s=60, stderr=subprocess.DEVNULL)
    assert time.monotonic() - start < 30


def test_non_loopback_addresses_are_refused_without_allow_remote(text_model) -> None:
    for address in ("ipc:///tmp/x.sock", "tcp://127.0.0.1:5555", "tcp://localhost:5555", "tcp://[::1]:5555"):
        assert check_server_address(address) == address
    for address in ("tcp://0.0.0.0:5555", "tcp://10.1.2.3:5555", "tcp://*:5555", "tcp://example.com:80"):
        with pytest.raises(ValueError, match="--allow-remote"):
            ServerConfig(address)
        assert ServerConfig(address, allow_remote=True).address == address
    with pytest.raises(ValueError):
        ServerConfig("udp://1.2.3.4:5", allow_remote=True)
    out = subprocess.run([sys.executable, "-m", "rollout.server", "--model", text_model.path, "--address",
                          "tcp://0.0.0.0:5555", *SERVER_ARGS], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "is not loopback" in out.stderr and "--allow-remote" in out.stderr
