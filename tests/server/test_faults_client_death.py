"""A client that goes away has its requests aborted and their KV freed, seen from another
client's stats: a raw DEALER that sends an add and closes its socket, a client process
killed in the middle of a generate (its connection closes), and one stopped (SIGSTOP: the
connection stays open but answers no heartbeat; the shared engine gives up on it after its
--client-timeout-s of 1 s)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import msgpack
import zmq
from server_fixtures import server, text_model  # noqa: F401 (fixtures)

from rollout import SamplingParams
from rollout.server import protocol
from rollout.server.codec import to_plain

ROOT = Path(__file__).resolve().parents[2]
LONG = SamplingParams(temperature=1.0, max_new_tokens=480, ignore_eos=True, seed=0)


def wait_for(condition, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def test_a_dealer_that_adds_and_closes(server) -> None:
    # 64 samples of 480 tokens: ~2.5 s of steps on a 2-core VM, far longer than the engine takes
    # to notice the closed socket (its probe every 0.2 s); 4 samples (0.35 s) sometimes finished first
    before = server.stats()
    assert before.num_running == 0 and before.kv_used_tokens == 0
    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    socket.connect(server.address)
    header = {"v": protocol.PROTOCOL_VERSION, "id": 1, "op": "add",
              "args": {"sampling_params": to_plain(SamplingParams(temperature=0, max_new_tokens=480, ignore_eos=True, n=64)),
                       "input_ids": list(range(1, 30))}}
    socket.send_multipart([msgpack.packb(header)])
    assert socket.poll(10_000), "no acknowledgement"
    reply = protocol.decode_message(socket.recv_multipart(), protocol.Limits())
    assert isinstance(reply, protocol.Reply) and len(reply.result["request_ids"]) == 64
    assert server.health().num_clients == 1
    wait_for(lambda: server.stats().kv_used_tokens > 0, 10, "the requests to be scheduled")
    socket.close(linger=0)
    context.term()
    stats = wait_for(lambda: (s := server.stats()).num_running + s.num_waiting == 0 and s, 5, "the engine to abort them")
    assert stats.kv_used_tokens == 0 and server.health().num_clients == 0
    assert stats.counters["aborted_requests"] == before.counters["aborted_requests"] + 64


CLIENT = textwrap.dedent("""
    import sys
    from rollout import SamplingParams
    from rollout.server import RolloutClient
    client = RolloutClient(sys.argv[1])
    print("connected", flush=True)
    sys.stdin.readline()  # both clients start generating at once
    params = SamplingParams(temperature=1.0, max_new_tokens=480, n=int(sys.argv[2]), ignore_eos=True, seed=1)
    client.generate(input_ids=[[1, 2, 3], [4, 5, 6]], sampling_params=params)
    print("finished", flush=True)  # never: the test kills or stops this process first
""")


def _client_process(address: str, n: int) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    return subprocess.Popen([sys.executable, "-c", CLIENT, address, str(n)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=env)


def test_client_processes_killed_or_stopped_mid_generate(server) -> None:
    before = server.stats()
    # both at once (one interpreter start-up's wait); the stopped one asks for more work so
    # that it is still running when its heartbeats time out
    killed, stopped = _client_process(server.address, 8), _client_process(server.address, 24)
    try:
        for process in (killed, stopped):
            assert process.stdout.readline().strip() == "connected"
        for process in (killed, stopped):
            process.stdin.write("go\n")
            process.stdin.flush()
        wait_for(lambda: server.health().num_clients == 2, 30, "both clients' requests to run")
        assert server.stats().kv_used_tokens > 0
        stopped.send_signal(signal.SIGSTOP)
        killed.kill()
        killed.wait(10)
        # killed: its connection closed, noticed at the next probe
        wait_for(lambda: server.health().num_clients == 1, 2.0, "the killed client's requests to be aborted")
        # stopped: no heartbeat answered for --client-timeout-s (1 s)
        stats = wait_for(lambda: (s := server.stats()).num_running + s.num_waiting == 0 and s, 5.0,
                         "the stopped client's requests to be aborted")
        assert stats.kv_used_tokens == 0 and server.health().num_clients == 0
        # aborted, not finished: 2 prompts x (8 + 24) samples
        assert stats.counters["aborted_requests"] == before.counters["aborted_requests"] + 2 * (8 + 24)
    finally:
        for process in (killed, stopped):
            process.kill()
            process.wait(10)
    out = server.generate(input_ids=[[7, 8]], sampling_params=SamplingParams(temperature=0, max_new_tokens=3))
    assert len(out[0].token_ids) == 3
