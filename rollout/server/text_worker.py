"""The engine process's text thread: everything between token ids and a client's bytes that
the step loop must not wait for.

It tokenizes text prompts, detokenizes (stream text deltas, final text), watches for stop
strings, cuts outputs at them, and encodes every generation message (stream events, add
outputs, generate replies) ready to send. The step loop only moves token ids: it hands this
thread each step's new tokens and finished outputs through a queue and forwards the frames
it gets back (zmq sockets are single-threaded, so the loop owns the socket).

Why a thread in the engine process, not the client: the tokenizer belongs with the model
(a client needs no checkpoint files, no transformers, and two clients can never disagree
on it), and the work stays one queue hop from the loop instead of a socket hop. Why a
thread, not a process: HF fast tokenizers run in Rust and release the GIL for the heavy
part, and the loop's own waits (device work, zmq polls) release it too, so a thread overlaps
well enough, with no extra copy of outputs between processes.

Stop strings: the engine is handed SamplingParams without `stop`, so its step never
decodes. This thread feeds each step's tokens of such a request through a StopWatch; on a
hit it asks the loop to abort the request. The engine learns of the hit after the step in
which the loop handed over the tokens, so it may compute a few more tokens (typically one
step: the check runs while the next step does); those are discarded: the output is cut to
the tokens the text keeps (text.finish_output), exactly what in-process generate returns.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rollout.request import RolloutOutput
from rollout.server import protocol
from rollout.server.text import StopWatch, finish_output

log = logging.getLogger("rollout.server")


@dataclass(frozen=True)
class Route:
    """Where a request's news goes: the client's routing id, its call, and the prefix that
    turns the engine's request id back into the client's."""

    identity: bytes
    call_id: int
    prefix: str


@dataclass(frozen=True)
class Watch:
    rid: str  # the engine's request id
    route: Route
    stream: bool
    stop: tuple[str, ...]


# ---- what the thread hands the loop (through its inbox) --------------------------------------
@dataclass(frozen=True)
class Outbound:
    identity: bytes
    frames: list[Any]


@dataclass(frozen=True)
class StopHit:
    rid: str


@dataclass(frozen=True)
class Tokenized:
    identity: bytes
    call_id: int
    request: protocol.Generate | protocol.Add  # with input_ids filled in
    error: Exception | None = None


@dataclass
class _Followed:
    watch: Watch
    stop_watch: StopWatch | None
    sent_tokens: int = 0
    sent_text: str = ""
    received: int = 0  # tokens handed over by the loop so far


@dataclass
class _GenerateCall:
    route: Route
    rids: list[str]
    outputs: dict[str, RolloutOutput] = field(default_factory=dict)


class TextWorker:
    def __init__(self, tokenizer, post: Callable[[object], None]) -> None:
        self.tokenizer = tokenizer
        self._post = post  # hands one item to the loop and wakes it
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._followed: dict[str, _Followed] = {}
        self._generate_calls: dict[str, _GenerateCall] = {}  # by each of its request ids
        self._thread = threading.Thread(target=self._run, name="rollout-text", daemon=True)
        self._thread.start()

    # ---- called from the loop (each just queues a job) ---------------------------------------
    def tokenize(self, identity: bytes, call_id: int, request: protocol.Generate | protocol.Add) -> None:
        self._jobs.put((self._tokenize, (identity, call_id, request)))

    def follow(self, watches: list[Watch], generate: bool) -> None:
        """Requests just added: one add's samples, or a generate call's (one reply for all)."""
        self._jobs.put((self._follow, (watches, generate)))

    def step(self, deltas: list[tuple[str, list[int], list[float]]], finished: list[RolloutOutput]) -> None:
        self._jobs.put((self._step, (deltas, finished)))

    def forget(self, rids: list[str]) -> None:
        """The client is gone: drop what was kept for these requests, send nothing."""
        self._jobs.put((self._forget, (rids,)))

    def close(self, timeout_s: float = 5.0) -> None:
        self._jobs.put(None)
        self._thread.join(timeout_s)

    # ---- the thread --------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, args = job
            try:
                fn(*args)
            except Exception:  # a bug here must not silence every later output
                log.exception("text worker: %s failed", fn.__name__)

    def _tokenize(self, identity: bytes, call_id: int, request: protocol.Generate | protocol.Add) -> None:
        try:
            if isinstance(request, protocol.Generate):
                ids = [self.tokenizer.encode(text) for text in request.prompts or []]
                request = dataclasses.replace(request, prompts=None, input_ids=ids)
            else:
                request = dataclasses.replace(request, prompt=None, input_ids=self.tokenizer.encode(request.prompt))
        except Exception as error:
            self._post(Tokenized(identity, call_id, request, error))
            return
        self._post(Tokenized(identity, call_id, request))

    def _follow(self, watches: list[Watch], generate: bool) -> None:
        for w in watches:
            needs_text = self.tokenizer is not None and (w.stream or bool(w.stop))
            self._followed[w.rid] = _Followed(w, StopWatch(self.tokenizer, w.stop) if needs_text else None)
        if generate and watches:
            call = _GenerateCall(watches[0].route, [w.rid for w in watches])
            for w in watches:
                self._generate_calls[w.rid] = call

    def _step(self, deltas: list[tuple[str, list[int], list[float]]], finished: list[RolloutOutput]) -> None:
        events: dict[Route, protocol.Event] = {}
        for rid, token_ids, logprobs in deltas:
            f = self._followed.get(rid)
            if f is None:
                continue
            f.received += len(token_ids)
            if f.stop_watch is not None and f.stop_watch.stop_at is None and f.stop_watch.feed(token_ids) and f.watch.stop:
                self._post(StopHit(rid))
            if f.watch.stream:
                delta = self._delta(f, token_ids, logprobs)
                if delta.token_ids or delta.text:
                    self._event(events, f.watch.route).deltas.append(delta)
        for output in finished:
            self._finish(output, events)
        for route, event in events.items():
            self._post(Outbound(route.identity, protocol.encode_message(event)))

    def _delta(self, f: _Followed, token_ids: list[int], logprobs: list[float]) -> protocol.StreamDelta:
        """Tokens (never past a stop string) and text (never part of one) since the last delta."""
        stop_at = f.stop_watch.stop_at if f.stop_watch is not None else None
        start = f.received - len(token_ids)
        keep = len(token_ids) if stop_at is None else max(0, min(len(token_ids), stop_at - start))
        text = None
        if f.stop_watch is not None:
            shown = f.stop_watch.sendable_text()
            text, f.sent_text = shown[len(f.sent_text) :], shown
        f.sent_tokens += keep
        user_rid = f.watch.rid[len(f.watch.route.prefix) :]
        return protocol.StreamDelta(user_rid, token_ids[:keep], logprobs[:keep], text, False, None)

    def _finish(self, output: RolloutOutput, events: dict[Route, protocol.Event]) -> None:
        f = self._followed.pop(output.request_id, None)
        if f is None:
            return
        watch = f.watch
        stop_at = None
        if f.stop_watch is not None:
            f.stop_watch.feed(output.token_ids[f.stop_watch.num_tokens :])  # tokens no delta brought
            stop_at = f.stop_watch.stop_at if watch.stop else None
        output = finish_output(output, self.tokenizer, watch.stop, stop_at)
        output = dataclasses.replace(output, request_id=output.request_id[len(watch.route.prefix) :])
        call = self._generate_calls.pop(watch.rid, None)
        if call is not None:
            call.outputs[watch.rid] = output
            if len(call.outputs) == len(call.rids):
                reply = protocol.Reply(call.route.call_id, None, [call.outputs[rid] for rid in call.rids])
                self._post(Outbound(call.route.identity, protocol.encode_message(reply)))
            return
        event = self._event(events, watch.route)
        event.outputs.append(output)
        if watch.stream:
            text = None
            if output.text is not None:
                text = output.text[len(f.sent_text) :] if output.text.startswith(f.sent_text) else output.text
            event.deltas.append(protocol.StreamDelta(
                output.request_id, output.token_ids[f.sent_tokens :], output.logprobs[f.sent_tokens :], text,
                True, output.finish_reason, output))

    def _forget(self, rids: list[str]) -> None:
        for rid in rids:
            self._followed.pop(rid, None)
            self._generate_calls.pop(rid, None)

    @staticmethod
    def _event(events: dict[Route, protocol.Event], route: Route) -> protocol.Event:
        if route not in events:
            events[route] = protocol.Event(route.call_id)
        return events[route]
