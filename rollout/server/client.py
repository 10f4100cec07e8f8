"""RolloutClient: the Engine's API, served by an engine process (rollout.server).

    with RolloutClient.launch(model="path/to/hf_dir", device="cuda", dtype="bfloat16") as client:
        outs = client.generate(input_ids=prompts, sampling_params=SamplingParams(n=8, seed=0))
        for delta in client.stream([1, 2, 3], SamplingParams(max_new_tokens=64)):
            print(delta.token_ids, delta.text)
        client.update_weights_from_disk("ckpt/step-100")

Results equal in-process Engine.generate (the same tokens, log-probs, versions). Every call
has a timeout (`timeout_s`, per call `timeout=`); if the engine process is gone, every
waiting and later call raises EngineDeadError naming the address, at once for a closed
connection, within `heartbeat_timeout_s` for a hung process, never a hang.

Thread-safe: calls from several threads share the socket under a lock, and each reply
finds its caller by call id. The trainer side of a weight sync needs the engine to be
listening while it sends: pass wait=False and call .result() after sending.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from rollout.request import RolloutOutput, SamplingParams
from rollout.server import client_core as core
from rollout.server import protocol
from rollout.server.errors import EngineDeadError
from rollout.server.launch import EngineProcess, spawn_engine


class PendingCall:
    """A call sent and not yet answered (wait=False)."""

    def __init__(self, client: RolloutClient, call_id: int, op: str) -> None:
        self._client, self.call_id, self.op = client, call_id, op

    def result(self, timeout: float | None = None) -> Any:
        return self._client._finish(self.call_id, self.op, timeout)


class RolloutClient:
    def __init__(self, address: str, *, timeout_s: float = core.DEFAULT_TIMEOUT_S,
                 connect_timeout_s: float = core.DEFAULT_CONNECT_TIMEOUT_S,
                 heartbeat_timeout_s: float = core.DEFAULT_HEARTBEAT_TIMEOUT_S,
                 _process: EngineProcess | None = None) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.engine_process = _process
        self._lock = threading.RLock()
        self._zmq = core.ClientSockets(self, zmq.Context(), self._lock)
        self._stop_process = core.stop_on_collect(self, _process) if _process is not None else None
        self._socket = self._zmq.socket(zmq.DEALER)
        self._dead: str | None = None
        self._connected = False  # a connection to the engine was made (the monitor saw it)
        self._boxes: dict[int, deque] = {}
        self._adds = core.OpenAdds()
        self._ids = itertools.count(1)
        self.info: protocol.ServerInfo | None = None
        try:
            core.configure_socket(self._socket, address, heartbeat_timeout_s)
            self._monitor = self._zmq.monitor(self._socket, core.MONITOR_EVENTS)
            self._poller = zmq.Poller()
            self._poller.register(self._socket, zmq.POLLIN)
            self._poller.register(self._monitor, zmq.POLLIN)
            self._socket.connect(address)
            self.info = self._call(protocol.Hello(), connect_timeout_s, "connect")
        except BaseException:
            self.close()
            raise
        if self.info.protocol != protocol.PROTOCOL_VERSION:
            self.close()
            raise EngineDeadError(f"the engine at {address} speaks protocol {self.info.protocol}, "
                                  f"this client {protocol.PROTOCOL_VERSION}")

    @classmethod
    def launch(cls, model: str | Path, *, address: str | None = None, startup_timeout_s: float = 600.0,
               server_args: Sequence[str] = (), stdout: Any = None, stderr: Any = None, **engine_config: Any) -> RolloutClient:
        """Start an engine process (EngineConfig options as keywords) on a fresh ipc path and
        connect once it is healthy; close() shuts it down. `server_args`: more command-line
        options (e.g. ["--client-timeout-s", "5"])."""
        process = spawn_engine(model, engine_config, address=address, server_args=list(server_args),
                               stdout=stdout, stderr=stderr)
        try:
            return cls(process.address, connect_timeout_s=startup_timeout_s, _process=process)
        except BaseException:
            process.process.kill()
            process.stop()
            raise

    # ---- the Engine's API ------------------------------------------------------------------------
    def generate(self, input_ids: Sequence[Sequence[int]] | None = None,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 prompts: Sequence[str] | None = None, lora_name: str | None | Sequence[str | None] = None,
                 timeout: float | None = None) -> list[RolloutOutput]:
        """As Engine.generate: one output per sample, prompt-major then sample."""
        request = core.generate_request(input_ids, sampling_params, prompts, lora_name)
        call_id = self._send(request)
        try:
            return self._finish(call_id, "generate", timeout)
        except (EngineDeadError, KeyboardInterrupt, TimeoutError):
            self._cancel_quietly(call_id)
            raise

    def stream(self, input_ids: Sequence[int] | None = None, sampling_params: SamplingParams | None = None, *,
               prompt: str | None = None, request_id: str | None = None, lora_name: str | None = None,
               timeout: float | None = None) -> Iterator[protocol.StreamDelta]:
        """Yield StreamDeltas for one prompt (each of its n samples, interleaved), the last of
        each sample with finished=True and its output. Leaving the loop early aborts it."""
        request = core.add_request(input_ids, sampling_params, prompt, request_id, lora_name, stream=True)
        return self._stream(request, timeout)

    def _stream(self, request: protocol.Add, timeout: float | None) -> Iterator[protocol.StreamDelta]:
        call_id = self._send(request)
        done = False
        try:
            left = set(self._finish(call_id, "add", timeout, keep=True))
            while left:
                message = self._next(call_id, timeout, "stream")
                yield from core.stream_deltas(message, left)
            done = True
        finally:
            with self._lock:
                self._boxes.pop(call_id, None)
            if not done:
                self._cancel_quietly(call_id)

    def add_request(self, input_ids: Sequence[int] | None = None, sampling_params: SamplingParams | None = None, *,
                    prompt: str | None = None, request_id: str | None = None, lora_name: str | None = None,
                    timeout: float | None = None) -> list[str]:
        """Queue one prompt; returns its samples' request ids. Their outputs: get_outputs()."""
        request = core.add_request(input_ids, sampling_params, prompt, request_id, lora_name, stream=False)
        with self._lock:
            self._collect_adds()
            self._adds.check_free(request)
        call_id = self._send(request)
        try:
            ids = self._finish(call_id, "add", timeout, keep=True)
        except BaseException as error:
            with self._lock:
                self._boxes.pop(call_id, None)  # refused or given up on: nothing more is read for it
            if not isinstance(error, Exception) or isinstance(error, TimeoutError):
                self._cancel_quietly(call_id)  # accepted after all, nobody would collect it
            raise
        with self._lock:
            self._adds.pending[call_id] = set(ids)
            self._collect_adds()
        return ids

    def poll_outputs(self) -> list[RolloutOutput]:
        """Outputs of add_request'ed requests that finished since the last call (no waiting)."""
        with self._lock:
            self._pump(0)
            self._collect_adds()
            return self._adds.take_outputs(None) or []

    def get_outputs(self, request_ids: Iterable[str], timeout: float | None = None) -> list[RolloutOutput]:
        """Wait for these add_request'ed requests to finish; their outputs, in this order."""
        wanted = list(request_ids)
        limit = self.timeout_s if timeout is None else timeout
        deadline = time.monotonic() + limit
        while True:
            with self._lock:
                self._collect_adds()
                done = self._adds.take_outputs(wanted)
                if done is not None:
                    return done
                self._check_alive("get_outputs", limit)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise core.timeout_error(self.address, "get_outputs", limit)
                self._pump(min(remaining, 0.1))

    def abort(self, request_id: str, *, timeout: float | None = None) -> bool:
        """Abort a request (one sample, or all samples of a prompt by its base id). Its output,
        marked "abort", goes to whoever waits for it (stream, generate, get_outputs)."""
        return self._call(protocol.Abort(request_id), timeout, "abort")

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, full: bool = False,
                       pause_mode: str = "retract", target: str = "model", timeout: float | None = None) -> int:
        """Send tensors in the request itself (raw frames): small models and tests; a large
        model goes by disk, CUDA IPC or broadcast."""
        request = protocol.UpdateWeights(full=full, pause_mode=pause_mode, target=target,
                                         named_tensors=core.tensor_pairs(named_tensors))
        return self._call(request, timeout, "update_weights")

    def update_weights_from_disk(self, path: str | Path, *, full: bool = True, pause_mode: str = "retract",
                                 lora_name: str | None = None, target: str = "model", timeout: float | None = None) -> int:
        request = protocol.UpdateWeightsFromDisk(core.path_arg(path), full, pause_mode, lora_name, target)
        return self._call(request, timeout, "update_weights_from_disk")

    def update_weights_from_ipc(self, endpoint: str, *, full: bool = True, pause_mode: str = "retract",
                                timeout_s: float = 300.0, lora_name: str | None = None, target: str = "model",
                                wait: bool = True, timeout: float | None = None) -> int | PendingCall:
        """The engine serves one CUDA IPC update on `endpoint` (the trainer's CudaIpcSender.send
        goes there). wait=False returns at once: send, then .result()."""
        request = protocol.UpdateWeightsFromIpc(endpoint, full, pause_mode, timeout_s, lora_name, target)
        return self._maybe_wait(request, wait, timeout)

    def init_weight_sync_group(self, master_addr: str, master_port: int, rank_offset: int, world_size: int,
                               backend: str = "gloo", *, timeout_s: float = 300.0, join_timeout_s: float | None = None,
                               wait: bool = True, timeout: float | None = None) -> None | PendingCall:
        """Join the trainer's group (every rank joins at once: wait=False, then the trainer's
        own open_group, then .result())."""
        request = protocol.InitWeightSyncGroup(master_addr, master_port, rank_offset, world_size, backend,
                                               timeout_s, join_timeout_s)
        return self._maybe_wait(request, wait, timeout)

    def update_weights_from_distributed(self, *, full: bool = True, pause_mode: str = "retract",
                                        lora_name: str | None = None, target: str = "model", wait: bool = True,
                                        timeout: float | None = None) -> int | PendingCall:
        request = protocol.UpdateWeightsFromDistributed(full, pause_mode, lora_name, target)
        return self._maybe_wait(request, wait, timeout)

    def destroy_weight_sync_group(self, *, timeout: float | None = None) -> None:
        self._call(protocol.DestroyWeightSyncGroup(), timeout, "destroy_weight_sync_group")

    def load_lora_adapter(self, name: str, path: str | Path | None = None, *, tensors: Any = None, config: Any = None,
                          timeout: float | None = None):
        """A PEFT directory (on the engine's file system), or tensors (sent as raw frames) with a
        LoraConfig or its dict. Returns the engine's LoraAdapterInfo."""
        return self._call(core.load_lora_request(name, path, tensors, config), timeout, "load_lora_adapter")

    def unload_lora_adapter(self, name: str, *, timeout: float | None = None) -> None:
        self._call(protocol.UnloadLoraAdapter(name), timeout, "unload_lora_adapter")

    def update_lora_adapter(self, name: str, named_tensors: Iterable[tuple[str, torch.Tensor]], *,
                            pause_mode: str = "retract", timeout: float | None = None) -> int:
        request = protocol.UpdateLoraAdapter(name, pause_mode, core.tensor_pairs(named_tensors))
        return self._call(request, timeout, "update_lora_adapter")

    def update_lora_adapters(self, updates: Mapping[str, Iterable[tuple[str, torch.Tensor]]], *,
                             pause_mode: str = "retract", timeout: float | None = None) -> dict[str, int]:
        """Several adapters updated atomically (as Engine.update_lora_adapters); returns each new version."""
        return self._call(core.lora_updates_request(updates, pause_mode), timeout, "update_lora_adapters")

    def list_lora_adapters(self, *, timeout: float | None = None) -> list:
        return self._call(protocol.ListLoraAdapters(), timeout, "list_lora_adapters")

    def sleep(self, level: int = 1, *, timeout: float | None = None) -> Any:
        """As Engine.sleep (returns its SleepStats): requests already accepted wait for wake()
        (a stream or get_outputs just waits longer); new ones are refused at once with an
        EngineError (RuntimeError) saying the engine is asleep."""
        return self._call(protocol.Sleep(level), timeout, "sleep")

    def wake(self, tags: Sequence[str] | None = None, *, timeout: float | None = None) -> Any:
        return self._call(protocol.Wake(list(tags) if tags is not None else None), timeout, "wake")

    def flush_cache(self, *, timeout: float | None = None) -> None:
        """Drop the engine's prefix cache (refused while requests run)."""
        self._call(protocol.FlushCache(), timeout, "flush_cache")

    def pause_generation(self, mode: str = "abort", *, timeout: float | None = None) -> None:
        """As Engine.pause_generation: "abort", "retract" or "in_place". Calls already made
        (generate, streams) wait for continue_generation(); with "abort" they return their
        requests' partial outputs, finish_reason "abort"."""
        self._call(protocol.PauseGeneration(mode), timeout, "pause_generation")

    def continue_generation(self, *, timeout: float | None = None) -> None:
        self._call(protocol.ContinueGeneration(), timeout, "continue_generation")

    def stats(self, *, timeout: float | None = None):
        return self._call(protocol.Stats(), timeout, "stats")

    def health(self, *, timeout: float | None = None) -> protocol.HealthInfo:
        return self._call(protocol.Health(), timeout, "health")

    def model_info(self, *, timeout: float | None = None) -> protocol.ModelInfo:
        return self._call(protocol.GetModelInfo(), timeout, "model_info")

    def shutdown(self, *, timeout: float | None = None) -> None:
        """Stop the engine process (its requests are aborted; every client is told)."""
        self._call(protocol.Shutdown(), timeout, "shutdown")

    def close(self) -> None:
        """Disconnect; a launched engine process is shut down and waited for. A client dropped
        without it is closed when collected, or at interpreter exit, and its launched engine
        process is sent SIGTERM (client_core.ClientSockets)."""
        process, self.engine_process = self.engine_process, None
        if process is not None and self._dead is None and self.info is not None:
            try:
                self._call(protocol.Shutdown(), 10.0, "shutdown")
            except Exception:
                pass  # it is stopped below either way
        self._zmq.close()
        if process is not None:
            self._stop_process.detach()  # stopped here, and waited for
            process.stop()

    def __enter__(self) -> RolloutClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- calls and replies ------------------------------------------------------------------------
    def _maybe_wait(self, request: protocol.Request, wait: bool, timeout: float | None) -> Any:
        pending = PendingCall(self, self._send(request), request.op)
        return pending.result(timeout) if wait else pending

    def _call(self, request: protocol.Request, timeout: float | None, what: str) -> Any:
        return self._finish(self._send(request), request.op, timeout, what=what)

    def _send(self, request: protocol.Request, *, answered: bool = True) -> int:
        """Send a request; its answers go to a mailbox (none when not `answered`: dropped)."""
        with self._lock:
            self._check_alive(request.op, None)
            call_id = next(self._ids)
            frames = protocol.encode_request(call_id, request)
            core.check_frames(frames, self.info)
            if answered:
                self._boxes[call_id] = deque()
            try:
                self._socket.send_multipart(frames, copy=False)
            except zmq.Again:
                self._boxes.pop(call_id, None)
                raise core.dead_error(f"the engine at {self.address} takes no messages", request.op,
                                      self.heartbeat_timeout_s) from None
        return call_id

    def _finish(self, call_id: int, op: str, timeout: float | None, *, keep: bool = False, what: str | None = None) -> Any:
        """Wait for a call's answer; `keep` leaves its mailbox open for the events that follow."""
        try:
            return core.result_of(op, self._next(call_id, timeout, what or op))
        finally:
            if not keep:
                self._boxes.pop(call_id, None)

    def _next(self, call_id: int, timeout: float | None, what: str) -> protocol.Message:
        limit = self.timeout_s if timeout is None else timeout
        deadline = time.monotonic() + limit
        while True:
            with self._lock:
                box = self._boxes.get(call_id)
                if box:
                    return box.popleft()
                self._check_alive(what, limit)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise core.timeout_error(self.address, what, limit, self._connected)
                self._pump(min(remaining, 0.1))

    def _pump(self, wait_s: float) -> None:
        """Read what arrived (waiting up to wait_s for something) into the callers' mailboxes."""
        events = dict(self._poller.poll(int(wait_s * 1000)))
        if self._monitor in events:
            while self._monitor.poll(0):
                event = recv_monitor_message(self._monitor)["event"]
                if event == zmq.EVENT_CONNECTED:
                    self._connected = True
                elif event == zmq.EVENT_DISCONNECTED:
                    self._dead = core.dead_message(self.address, self.heartbeat_timeout_s)
        while True:
            try:
                frames = self._socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._connected = True  # whatever the monitor has said so far
            message = protocol.decode_message(frames, protocol.Limits())
            call_id = getattr(message, "call_id", None)
            box = self._boxes.get(call_id) if call_id is not None else None
            if box is not None:  # else a call given up on (a closed stream): dropped
                box.append(message)

    def _collect_adds(self) -> None:
        for call_id in list(self._adds.pending):
            box = self._boxes.get(call_id)
            while box:
                self._adds.take(call_id, box.popleft())
            if call_id not in self._adds.pending:
                self._boxes.pop(call_id, None)

    def _check_alive(self, what: str, timeout: float | None) -> None:
        if self._dead is None and self.engine_process is not None:
            code = self.engine_process.exit_code()
            if code is not None:
                self._dead = f"the engine process at {self.address} exited with code {code} (see its stderr)"
        if self._dead is not None:
            raise core.dead_error(self._dead, what, timeout)

    def _cancel_quietly(self, call_id: int) -> None:
        """Best effort: the engine aborts what the call started (its KV is freed)."""
        if self._dead is None:
            try:
                self._send(protocol.Cancel(call_id), answered=False)
            except Exception:
                pass
