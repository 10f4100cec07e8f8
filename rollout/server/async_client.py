"""AsyncRolloutClient: RolloutClient's API for asyncio (zmq.asyncio), for servers that hold
many requests in flight on one event loop (the OpenAI-compatible endpoint).

    client = await AsyncRolloutClient.connect("ipc:///tmp/engine.sock")   # or await ...launch(model=...)
    outs = await client.generate(input_ids=prompts, sampling_params=params)
    async for delta in client.stream(prompt="Hi", sampling_params=SamplingParams(max_new_tokens=32)):
        print(delta.text, end="")

The same messages, timeouts and errors as the blocking client (client_core.py). One
reader task hands each message to the queue of the call it answers; a watcher task marks
the client dead when the socket monitor sees the connection close (or a launched process
exit), and every waiting call raises EngineDeadError. Use it from one event loop. The tasks
hold the client weakly: one dropped without close() is collected while the loop runs on.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import weakref
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from rollout.request import RolloutOutput, SamplingParams
from rollout.server import client_core as core
from rollout.server import protocol
from rollout.server.errors import EngineDeadError, ProtocolError
from rollout.server.launch import EngineProcess, spawn_engine

log = logging.getLogger("rollout.server")
_DEAD = object()  # put in every waiting queue when the engine is found gone


class AsyncRolloutClient:
    def __init__(self, address: str, *, timeout_s: float = core.DEFAULT_TIMEOUT_S,
                 heartbeat_timeout_s: float = core.DEFAULT_HEARTBEAT_TIMEOUT_S,
                 _process: EngineProcess | None = None) -> None:
        """Connects lazily; prefer `await AsyncRolloutClient.connect(address)`, which checks
        the engine answers and speaks this protocol."""
        self.address = address
        self.timeout_s = timeout_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.engine_process = _process
        self.info: protocol.ServerInfo | None = None
        self._zmq = core.ClientSockets(self, zmq.asyncio.Context())
        self._stop_process = core.stop_on_collect(self, _process) if _process is not None else None
        self._socket = self._zmq.socket(zmq.DEALER)
        core.configure_socket(self._socket, address, heartbeat_timeout_s)
        self._monitor = self._zmq.monitor(self._socket, core.MONITOR_EVENTS)
        self._socket.connect(address)
        self._queues: dict[int, asyncio.Queue] = {}
        self._adds = core.OpenAdds()
        self._adds_changed = asyncio.Event()
        self._ids = itertools.count(1)
        self._tasks: list[asyncio.Task] = []
        self._dead: str | None = None
        self._connected = False  # a connection to the engine was made (the monitor saw it)

    @classmethod
    async def connect(cls, address: str, *, connect_timeout_s: float = core.DEFAULT_CONNECT_TIMEOUT_S,
                      **options: Any) -> AsyncRolloutClient:
        client = cls(address, **options)
        try:
            client.info = await client._call(protocol.Hello(), connect_timeout_s, "connect")
        except BaseException:
            await client.close()
            raise
        if client.info.protocol != protocol.PROTOCOL_VERSION:
            await client.close()
            raise EngineDeadError(f"the engine at {address} speaks protocol {client.info.protocol}, "
                                  f"this client {protocol.PROTOCOL_VERSION}")
        return client

    @classmethod
    async def launch(cls, model: str | Path, *, address: str | None = None, startup_timeout_s: float = 600.0,
                     server_args: Sequence[str] = (), stdout: Any = None, stderr: Any = None,
                     **engine_config: Any) -> AsyncRolloutClient:
        process = spawn_engine(model, engine_config, address=address, server_args=list(server_args),
                               stdout=stdout, stderr=stderr)
        try:
            return await cls.connect(process.address, connect_timeout_s=startup_timeout_s, _process=process)
        except BaseException:
            process.process.kill()
            await asyncio.to_thread(process.stop)
            raise

    # ---- the Engine's API ------------------------------------------------------------------------
    async def generate(self, input_ids: Sequence[Sequence[int]] | None = None,
                       sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                       prompts: Sequence[str] | None = None, lora_name: str | None | Sequence[str | None] = None,
                       timeout: float | None = None) -> list[RolloutOutput]:
        call_id = await self._send(core.generate_request(input_ids, sampling_params, prompts, lora_name))
        try:
            return await self._finish(call_id, "generate", timeout)
        except (asyncio.CancelledError, TimeoutError):
            self._cancel_quietly(call_id)  # the caller gave up: free the engine's KV
            raise

    async def stream(self, input_ids: Sequence[int] | None = None, sampling_params: SamplingParams | None = None, *,
                     prompt: str | None = None, request_id: str | None = None, lora_name: str | None = None,
                     timeout: float | None = None) -> AsyncIterator[protocol.StreamDelta]:
        """StreamDeltas for one prompt (its n samples interleaved); the last of each sample has
        finished=True and its output. Leaving early (break, aclose, cancellation) aborts it."""
        request = core.add_request(input_ids, sampling_params, prompt, request_id, lora_name, stream=True)
        call_id = await self._send(request)
        done = False
        try:
            left = set(await self._finish(call_id, "add", timeout, keep=True))
            while left:
                message = await self._next(call_id, timeout, "stream")
                for delta in core.stream_deltas(message, left):
                    yield delta
            done = True
        finally:
            self._queues.pop(call_id, None)
            if not done:
                self._cancel_quietly(call_id)

    async def add_request(self, input_ids: Sequence[int] | None = None, sampling_params: SamplingParams | None = None,
                          *, prompt: str | None = None, request_id: str | None = None, lora_name: str | None = None,
                          timeout: float | None = None) -> list[str]:
        request = core.add_request(input_ids, sampling_params, prompt, request_id, lora_name, stream=False)
        self._adds.check_free(request)
        call_id = await self._send(request)
        try:
            ids = await self._finish(call_id, "add", timeout, keep=True)
        except BaseException as error:
            self._queues.pop(call_id, None)  # refused or given up on: nothing more is read for it
            if not isinstance(error, Exception) or isinstance(error, TimeoutError):
                self._cancel_quietly(call_id)  # accepted after all (cancelled, timed out), nobody would collect it
            raise
        self._adds.pending[call_id] = set(ids)
        queue = self._queues.pop(call_id)  # from here on the reader hands its events to _adds
        while not queue.empty():
            message = queue.get_nowait()
            if message is not _DEAD:
                self._adds.take(call_id, message)
        return ids

    async def poll_outputs(self) -> list[RolloutOutput]:
        return self._adds.take_outputs(None) or []

    async def get_outputs(self, request_ids: Iterable[str], timeout: float | None = None) -> list[RolloutOutput]:
        wanted = list(request_ids)
        limit = self.timeout_s if timeout is None else timeout
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limit
        while True:
            done = self._adds.take_outputs(wanted)
            if done is not None:
                return done
            self._check_alive("get_outputs", limit)
            self._adds_changed.clear()
            try:
                await asyncio.wait_for(self._adds_changed.wait(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                raise core.timeout_error(self.address, "get_outputs", limit) from None

    async def abort(self, request_id: str, *, timeout: float | None = None) -> bool:
        return await self._call(protocol.Abort(request_id), timeout, "abort")

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, full: bool = False,
                             pause_mode: str = "retract", target: str = "model", timeout: float | None = None) -> int:
        request = protocol.UpdateWeights(full=full, pause_mode=pause_mode, target=target,
                                         named_tensors=core.tensor_pairs(named_tensors))
        return await self._call(request, timeout, "update_weights")

    async def update_weights_from_disk(self, path: str | Path, *, full: bool = True, pause_mode: str = "retract",
                                       lora_name: str | None = None, target: str = "model",
                                       timeout: float | None = None) -> int:
        request = protocol.UpdateWeightsFromDisk(core.path_arg(path), full, pause_mode, lora_name, target)
        return await self._call(request, timeout, "update_weights_from_disk")

    async def update_weights_from_ipc(self, endpoint: str, *, full: bool = True, pause_mode: str = "retract",
                                      timeout_s: float = 300.0, lora_name: str | None = None, target: str = "model",
                                      timeout: float | None = None) -> int:
        request = protocol.UpdateWeightsFromIpc(endpoint, full, pause_mode, timeout_s, lora_name, target)
        return await self._call(request, timeout, "update_weights_from_ipc")

    async def init_weight_sync_group(self, master_addr: str, master_port: int, rank_offset: int, world_size: int,
                                     backend: str = "gloo", *, timeout_s: float = 300.0,
                                     join_timeout_s: float | None = None, timeout: float | None = None) -> None:
        request = protocol.InitWeightSyncGroup(master_addr, master_port, rank_offset, world_size, backend,
                                               timeout_s, join_timeout_s)
        await self._call(request, timeout, "init_weight_sync_group")

    async def update_weights_from_distributed(self, *, full: bool = True, pause_mode: str = "retract",
                                              lora_name: str | None = None, target: str = "model",
                                              timeout: float | None = None) -> int:
        request = protocol.UpdateWeightsFromDistributed(full, pause_mode, lora_name, target)
        return await self._call(request, timeout, "update_weights_from_distributed")

    async def destroy_weight_sync_group(self, *, timeout: float | None = None) -> None:
        await self._call(protocol.DestroyWeightSyncGroup(), timeout, "destroy_weight_sync_group")

    async def load_lora_adapter(self, name: str, path: str | Path | None = None, *, tensors: Any = None,
                                config: Any = None, timeout: float | None = None):
        return await self._call(core.load_lora_request(name, path, tensors, config), timeout, "load_lora_adapter")

    async def unload_lora_adapter(self, name: str, *, timeout: float | None = None) -> None:
        await self._call(protocol.UnloadLoraAdapter(name), timeout, "unload_lora_adapter")

    async def update_lora_adapter(self, name: str, named_tensors: Iterable[tuple[str, torch.Tensor]], *,
                                  pause_mode: str = "retract", timeout: float | None = None) -> int:
        request = protocol.UpdateLoraAdapter(name, pause_mode, core.tensor_pairs(named_tensors))
        return await self._call(request, timeout, "update_lora_adapter")

    async def update_lora_adapters(self, updates: Mapping[str, Iterable[tuple[str, torch.Tensor]]], *,
                                   pause_mode: str = "retract", timeout: float | None = None) -> dict[str, int]:
        return await self._call(core.lora_updates_request(updates, pause_mode), timeout, "update_lora_adapters")

    async def list_lora_adapters(self, *, timeout: float | None = None) -> list:
        return await self._call(protocol.ListLoraAdapters(), timeout, "list_lora_adapters")

    async def sleep(self, level: int = 1, *, timeout: float | None = None) -> Any:
        return await self._call(protocol.Sleep(level), timeout, "sleep")

    async def wake(self, tags: Sequence[str] | None = None, *, timeout: float | None = None) -> Any:
        return await self._call(protocol.Wake(list(tags) if tags is not None else None), timeout, "wake")

    async def flush_cache(self, *, timeout: float | None = None) -> None:
        await self._call(protocol.FlushCache(), timeout, "flush_cache")

    async def pause_generation(self, mode: str = "abort", *, timeout: float | None = None) -> None:
        await self._call(protocol.PauseGeneration(mode), timeout, "pause_generation")

    async def continue_generation(self, *, timeout: float | None = None) -> None:
        await self._call(protocol.ContinueGeneration(), timeout, "continue_generation")

    async def stats(self, *, timeout: float | None = None):
        return await self._call(protocol.Stats(), timeout, "stats")

    async def health(self, *, timeout: float | None = None) -> protocol.HealthInfo:
        return await self._call(protocol.Health(), timeout, "health")

    async def model_info(self, *, timeout: float | None = None) -> protocol.ModelInfo:
        return await self._call(protocol.GetModelInfo(), timeout, "model_info")

    async def shutdown(self, *, timeout: float | None = None) -> None:
        await self._call(protocol.Shutdown(), timeout, "shutdown")

    async def close(self) -> None:
        """As RolloutClient.close (and, as there, a client dropped without it is closed when
        collected, or at interpreter exit)."""
        process, self.engine_process = self.engine_process, None
        if process is not None and self._dead is None and self.info is not None:
            try:
                await self._call(protocol.Shutdown(), 10.0, "shutdown")
            except Exception:
                pass
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        self._zmq.close()
        if process is not None:
            self._stop_process.detach()  # stopped here, and waited for
            await asyncio.to_thread(process.stop)

    async def __aenter__(self) -> AsyncRolloutClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---- calls and replies ------------------------------------------------------------------------
    async def _call(self, request: protocol.Request, timeout: float | None, what: str) -> Any:
        return await self._finish(await self._send(request), request.op, timeout, what=what)

    async def _send(self, request: protocol.Request) -> int:
        self._check_alive(request.op, None)
        if not self._tasks:
            me = weakref.ref(self)
            self._tasks = [asyncio.create_task(_read(me, self._socket)), asyncio.create_task(_watch(me, self._monitor))]
        call_id = next(self._ids)
        frames = protocol.encode_request(call_id, request)
        core.check_frames(frames, self.info)
        self._queues[call_id] = asyncio.Queue()
        try:
            await asyncio.wait_for(self._socket.send_multipart(frames, copy=False), self.heartbeat_timeout_s)
        except asyncio.TimeoutError:
            self._queues.pop(call_id, None)
            raise core.dead_error(f"the engine at {self.address} takes no messages", request.op,
                                  self.heartbeat_timeout_s) from None
        return call_id

    async def _finish(self, call_id: int, op: str, timeout: float | None, *, keep: bool = False,
                      what: str | None = None) -> Any:
        try:
            return core.result_of(op, await self._next(call_id, timeout, what or op))
        finally:
            if not keep:
                self._queues.pop(call_id, None)

    async def _next(self, call_id: int, timeout: float | None, what: str) -> protocol.Message:
        limit = self.timeout_s if timeout is None else timeout
        queue = self._queues[call_id]
        if queue.empty():
            self._check_alive(what, limit)
        try:
            message = await asyncio.wait_for(queue.get(), limit)
        except asyncio.TimeoutError:
            raise core.timeout_error(self.address, what, limit, self._connected) from None
        if message is _DEAD:
            queue.put_nowait(_DEAD)  # for this call's next wait too
            raise core.dead_error(self._dead or "the engine is gone", what, limit)
        return message

    def _take(self, frames: list) -> None:
        """A message to the queue of the call it answers (add_request's to _adds)."""
        self._connected = True  # whatever the monitor has said so far
        try:
            message = protocol.decode_message(frames, protocol.Limits())
        except ProtocolError as error:
            log.warning("dropped a malformed message from the engine at %s: %s", self.address, error)
            return
        call_id = getattr(message, "call_id", None)
        if call_id in self._adds.pending:
            self._adds.take(call_id, message)
            self._adds_changed.set()
        elif call_id in self._queues:
            self._queues[call_id].put_nowait(message)

    def _watched(self, event: dict | None) -> bool:
        """A monitor event, or none for 200 ms (then a launched process is looked at); False
        once the engine is found gone."""
        if event is None:
            code = self.engine_process.exit_code() if self.engine_process is not None else None
            if code is not None:
                self._mark_dead(f"the engine process at {self.address} exited with code {code} (see its stderr)")
        elif event["event"] == zmq.EVENT_CONNECTED:
            self._connected = True
        elif event["event"] == zmq.EVENT_DISCONNECTED:
            self._mark_dead(core.dead_message(self.address, self.heartbeat_timeout_s))
        return self._dead is None

    def _mark_dead(self, reason: str) -> None:
        self._dead = reason
        for queue in self._queues.values():
            queue.put_nowait(_DEAD)
        self._adds_changed.set()

    def _check_alive(self, what: str, timeout: float | None) -> None:
        if self._dead is not None:
            raise core.dead_error(self._dead, what, timeout)

    def _cancel_quietly(self, call_id: int) -> None:
        """Best effort, without waiting (it runs while a task is being cancelled)."""
        if self._dead is not None or self._socket.closed:
            return
        frames = protocol.encode_request(next(self._ids), protocol.Cancel(call_id))
        future = self._socket.send_multipart(frames)
        future.add_done_callback(lambda f: f.cancelled() or f.exception())


# The client's two tasks hold it weakly, between messages only: a client dropped without
# close() is collected while its event loop runs on (its finalizer closes the sockets, which
# cancels these tasks' waits and so ends them) instead of living as long as the loop.
async def _read(client: weakref.ref, socket: zmq.asyncio.Socket) -> None:
    while True:
        frames = await socket.recv_multipart()
        me = client()
        if me is None:
            return
        me._take(frames)
        del me


async def _watch(client: weakref.ref, monitor: zmq.asyncio.Socket) -> None:
    """The connection closing (or a launched process exiting) marks the client dead."""
    poller = zmq.asyncio.Poller()
    poller.register(monitor, zmq.POLLIN)
    while True:
        event = parse_monitor_message(await monitor.recv_multipart()) if await poller.poll(200) else None
        me = client()
        if me is None or not me._watched(event):
            return
        del me
