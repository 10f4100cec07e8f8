"""What the OpenAI endpoint needs from an engine, and an in-process implementation.

`EngineBackend` is four async calls: generate (whole outputs), stream (token deltas),
abort, model_info. Two implementations: `InProcessBackend` here (an `Engine` in this
process, its step loop in a background thread) and a wrapper around the engine process's
client (`rollout.server.client.AsyncRolloutClient`), so the HTTP layer runs in front of
either without knowing which.

InProcessBackend: one thread owns the Engine, nothing else touches it. Requests reach it
through a thread-safe queue of commands; after every step it reads the new tokens of the
requests being streamed and hands them back to the event loop through each stream's
asyncio queue (loop.call_soon_threadsafe). The engine knows nothing about text here: the
HTTP layer tokenizes and detokenizes.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from rollout.request import RolloutOutput, SamplingParams

if TYPE_CHECKING:
    from rollout.engine import Engine

log = logging.getLogger("rollout.server")


@dataclass
class StreamDelta:
    """New tokens of one request (one sample). The last delta of a request has
    finished=True, its finish_reason and the whole RolloutOutput (weight versions, ...).
    A first delta with no tokens says the request was accepted."""

    request_id: str
    token_ids: list[int]
    logprobs: list[float]
    text: str | None = None  # the engine process may send text; the HTTP layer makes its own
    finished: bool = False
    finish_reason: str | None = None
    output: RolloutOutput | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per token, when asked for


@dataclass(frozen=True)
class ModelInfo:
    context_len: int
    vocab_size: int
    weight_version: int
    lora_adapters: tuple[str, ...] = ()


class EngineBackend(Protocol):
    async def generate(self, input_ids: Sequence[Sequence[int]], sampling_params: SamplingParams | None = None, *,
                       lora_name: str | None = None) -> list[RolloutOutput]:
        """Run prompts to completion; one output per sample, prompt-major then sample."""

    def stream(self, input_ids: Sequence[int], sampling_params: SamplingParams | None = None, *,
               request_id: str | None = None, lora_name: str | None = None) -> AsyncIterator[StreamDelta]:
        """One prompt (its n samples: request ids `request_id`, or `request_id-i` for n > 1),
        as deltas until every sample has finished. Leaving the iterator early aborts the
        samples still running."""

    async def abort(self, request_id: str) -> None: ...

    async def model_info(self) -> ModelInfo: ...

    async def pause_generation(self, mode: str) -> None:
        """Engine.pause_generation; its refusals (ValueError, RuntimeError) raised as they are."""

    async def continue_generation(self) -> None: ...


# ---- in process ---------------------------------------------------------------------------

class _Sink:
    """Where the engine thread sends one stream's deltas: an asyncio queue on a loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, deltas: bool) -> None:
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.deltas = deltas  # False: only the final output of each request (generate)

    def put(self, item: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop has closed: nobody is listening any more
            pass


@dataclass
class _Add:
    prompts: list[Sequence[int]]
    params: SamplingParams
    request_id: str | None
    lora_name: str | None
    sink: _Sink
    accepted: asyncio.Future


@dataclass
class _Call:
    fn: Callable[[Engine], Any]
    loop: asyncio.AbstractEventLoop
    result: asyncio.Future


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Tracked:
    sink: _Sink
    sent: int = 0  # output tokens already sent as deltas


@dataclass
class _Stop:
    done: threading.Event = field(default_factory=threading.Event)


def _resolve(loop: asyncio.AbstractEventLoop, future: asyncio.Future, result: Any = None,
             error: BaseException | None = None) -> None:
    def settle() -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    try:
        loop.call_soon_threadsafe(settle)
    except RuntimeError:
        pass


class EngineLoopStopped(RuntimeError):
    """The in-process engine's loop is closed or failed: the server's fault, not a refusal."""


class InProcessBackend:
    """An Engine in this process, stepped by one background thread that alone touches it."""

    def __init__(self, engine: Engine, *, idle_poll_s: float = 0.05) -> None:
        self.engine = engine
        self._idle_poll_s = idle_poll_s  # how often an asleep engine is looked at again
        self._commands: queue.Queue = queue.Queue()
        self._tracked: dict[str, _Tracked] = {}  # engine thread only
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="rollout-engine-loop", daemon=True)
        self._thread.start()

    # ---- the event loop's side ----------------------------------------------------------
    async def generate(self, input_ids: Sequence[Sequence[int]], sampling_params: SamplingParams | None = None, *,
                       lora_name: str | None = None) -> list[RolloutOutput]:
        loop = asyncio.get_running_loop()
        sink = _Sink(loop, deltas=False)
        rids = await self._add(list(input_ids), sampling_params or SamplingParams(), None, lora_name, sink)
        done: dict[str, RolloutOutput] = {}
        try:
            while len(done) < len(rids):
                item = await sink.queue.get()
                if isinstance(item, BaseException):
                    raise item
                done[item.request_id] = item.output
        finally:
            for rid in rids:
                if rid not in done:
                    self._commands.put(_Abort(rid))  # no await: this runs under cancellation too
        return [done[rid] for rid in rids]

    async def stream(self, input_ids: Sequence[int], sampling_params: SamplingParams | None = None, *,
                     request_id: str | None = None, lora_name: str | None = None) -> AsyncIterator[StreamDelta]:
        loop = asyncio.get_running_loop()
        sink = _Sink(loop, deltas=True)
        rids = await self._add([input_ids], sampling_params or SamplingParams(), request_id, lora_name, sink)
        running = set(rids)
        try:
            for rid in rids:
                yield StreamDelta(rid, [], [])
            while running:
                item = await sink.queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    running.discard(item.request_id)
                yield item
        finally:
            for rid in running:  # the caller left early (a client disconnected): free the KV now
                self._commands.put(_Abort(rid))

    async def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    async def model_info(self) -> ModelInfo:
        return await self.call(_model_info)

    async def pause_generation(self, mode: str) -> None:
        await self.call(lambda engine: engine.pause_generation(mode))  # "abort": the next step hands outputs out

    async def continue_generation(self) -> None:
        await self.call(lambda engine: engine.continue_generation())

    async def call(self, fn: Callable[[Engine], Any]) -> Any:
        """Run fn(engine) on the engine thread between steps (stats, weight updates, adapters)."""
        loop = asyncio.get_running_loop()
        result = loop.create_future()
        self._send(_Call(fn, loop, result))
        return await result

    def close(self, timeout: float = 10.0) -> None:
        """Stop the engine thread (callers still waiting get an error). Safe to call twice."""
        if not self._thread.is_alive():
            return
        stop = _Stop()
        self._commands.put(stop)
        stop.done.wait(timeout)

    async def _add(self, prompts: list[Sequence[int]], params: SamplingParams, request_id: str | None,
                   lora_name: str | None, sink: _Sink) -> list[str]:
        accepted = sink.loop.create_future()
        self._send(_Add(prompts, params, request_id, lora_name, sink, accepted))
        return await accepted

    def _send(self, command: Any) -> None:
        if self._failure is not None:
            raise EngineLoopStopped(f"the engine loop has stopped: {self._failure!r}")
        if not self._thread.is_alive():
            raise EngineLoopStopped("the engine loop is not running (closed)")
        self._commands.put(command)

    # ---- the engine thread's side -----------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                busy = engine.has_unfinished()
                asleep = bool(engine.memory.asleep or engine.memory.weights_discarded)
                try:
                    if not busy:
                        command = self._commands.get()  # idle: sleep until there is something to do
                    elif asleep:
                        command = self._commands.get(timeout=self._idle_poll_s)
                    else:
                        command = self._commands.get_nowait()
                except queue.Empty:
                    command = None
                stepped = False
                while command is not None:
                    if isinstance(command, _Stop):
                        self._fail_all(EngineLoopStopped("the engine loop was closed"))
                        command.done.set()
                        return
                    stepped |= self._handle(command)
                    try:
                        command = self._commands.get_nowait()
                    except queue.Empty:
                        command = None
                if engine.has_unfinished() or stepped:
                    self._deliver(engine.step())
        except BaseException as exc:  # a bug in a step: fail every caller instead of hanging them
            log.exception("engine loop stopped")
            self._failure = exc
            self._fail_all(exc)

    def _handle(self, command: Any) -> bool:
        """Run one command; True when outputs may be waiting (a call that paused requests)."""
        engine = self.engine
        if isinstance(command, _Add):
            added: list[str] = []
            try:
                for i, ids in enumerate(command.prompts):
                    rid = command.request_id if len(command.prompts) == 1 else None
                    added.extend(engine.add_request(ids, command.params, request_id=rid, prompt_index=i,
                                                    lora_name=command.lora_name))
            except Exception as exc:  # a refused prompt: take back the ones before it
                for rid in added:
                    engine.abort(rid)
                _resolve(command.sink.loop, command.accepted, error=exc)
                return False
            for rid in added:
                self._tracked[rid] = _Tracked(command.sink)
            _resolve(command.sink.loop, command.accepted, added)
        elif isinstance(command, _Abort):
            output = engine.abort(command.request_id)
            if output is not None:
                self._deliver([output])
        elif isinstance(command, _Call):
            try:
                _resolve(command.loop, command.result, command.fn(engine))
            except Exception as exc:
                _resolve(command.loop, command.result, error=exc)
            return True
        return False

    def _deliver(self, finished: list[RolloutOutput]) -> None:
        """Send the new tokens of every streamed request, then the finished ones' outputs."""
        done = {out.request_id: out for out in finished}
        scheduler = self.engine.scheduler
        for req in (*scheduler.running, *scheduler.waiting):  # one pass, not a find() per stream
            tracked = self._tracked.get(req.rid)
            if tracked is None or not tracked.sink.deltas or req.rid in done or len(req.output_ids) <= tracked.sent:
                continue
            start, end = tracked.sent, len(req.output_ids)
            top = req.top_logprobs[start:end] if req.params.top_logprobs else None
            tracked.sink.put(StreamDelta(req.rid, req.output_ids[start:end], req.logprobs[start:end], top_logprobs=top))
            tracked.sent = end
        for rid, out in done.items():
            tracked = self._tracked.pop(rid, None)
            if tracked is None:
                continue
            start = tracked.sent
            top = out.top_logprobs[start:] if out.top_logprobs is not None else None
            tracked.sink.put(StreamDelta(rid, out.token_ids[start:], out.logprobs[start:], out.text, True,
                                         out.finish_reason, out, top))

    def _fail_all(self, exc: BaseException) -> None:
        sinks = {id(t.sink): t.sink for t in self._tracked.values()}
        self._tracked.clear()
        for sink in sinks.values():
            sink.put(exc)
        while True:  # commands still queued: their callers are waiting too
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Add):
                _resolve(command.sink.loop, command.accepted, error=exc)
            elif isinstance(command, _Call):
                _resolve(command.loop, command.result, error=exc)
            elif isinstance(command, _Stop):
                command.done.set()


def _model_info(engine: Engine) -> ModelInfo:
    adapters = tuple(a.name for a in engine.list_lora_adapters()) if engine.lora is not None else ()
    return ModelInfo(engine.context_len, engine.model_config.vocab_size, engine.weight_version, adapters)
