"""A GenerationJob through an EngineBackend, as per-choice events.

Streamed and whole responses are built from the same events, so a streamed response
concatenates to the whole one: each sample's tokens go one at a time through its StopText
(stable text, stop strings), and a sample whose text reaches a stop string is aborted in
the engine; its tokens end at the one that completed the stop. Choice i of prompt p is
index p * n + i, as OpenAI numbers them.

A job without stop strings that is not streamed goes to the backend as one `generate`
call (one round trip to an engine process); everything else goes through `stream`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from rollout.request import RolloutOutput
from rollout.server.openai_backend import EngineBackend, StreamDelta
from rollout.server.openai_detok import StopText
from rollout.server.openai_protocol import GenerationJob


@dataclass
class ChoiceEvent:
    """What one choice gained: text, tokens (their log-probs and top alternatives), and,
    on its last event, how it finished and the engine's output for it."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    text_offsets: list[int] = field(default_factory=list)  # where each token's text starts in the choice's text
    finish_reason: str | None = None
    output: RolloutOutput | None = None
    weight_versions: list[tuple[int, int, int]] | None = None  # final: spans over the choice's tokens

    @property
    def empty(self) -> bool:
        return not self.text and not self.token_ids and self.finish_reason is None


class ChoiceState:
    def __init__(self, index: int, prompt_index: int, tokenizer, stop: tuple[str, ...]) -> None:
        self.index = index
        self.prompt_index = prompt_index
        self.text = StopText(tokenizer, stop)
        self.num_tokens = 0
        self.finished = False

    @property
    def stopped(self) -> bool:
        return self.text.stopped

    def feed(self, token_ids: Sequence[int], logprobs: Sequence[float],
             top_logprobs: Sequence[list[tuple[int, float]]] | None) -> ChoiceEvent:
        event = ChoiceEvent(self.index)
        for k, token in enumerate(token_ids):
            if self.text.stopped:
                break  # sampled after the stop string: not part of the choice
            event.text_offsets.append(len(self.text.text))
            event.text += self.text.add(token)
            event.token_ids.append(token)
            event.logprobs.append(logprobs[k])
            if top_logprobs is not None:
                event.top_logprobs.append(list(top_logprobs[k]))
        self.num_tokens += len(event.token_ids)
        return event

    def finish(self, output: RolloutOutput | None, finish_reason: str | None) -> ChoiceEvent:
        self.finished = True
        reason = "stop" if self.text.stopped else (finish_reason or "abort")
        event = ChoiceEvent(self.index, text=self.text.finish(), finish_reason=reason, output=output)
        if output is not None:
            event.weight_versions = clip_spans(output.weight_versions, self.num_tokens)
        return event


def clip_spans(spans: Sequence[tuple[int, int, int]], end: int) -> list[tuple[int, int, int]]:
    """(version, start, end) spans cut to the first `end` tokens."""
    return [(v, s, min(e, end)) for v, s, e in spans if s < end]


async def run_choices(backend: EngineBackend, tokenizer, job: GenerationJob, request_id: str) -> AsyncIterator[ChoiceEvent]:
    """Events for every choice of the job; each choice's last event has its finish_reason.
    Yields an empty event first for each prompt the engine accepted (so a refusal raises
    before a streamed response has started)."""
    n = job.n
    states = {}
    for p in range(len(job.prompts)):
        for i in range(n):
            rid = f"{request_id}-{p}" if n == 1 else f"{request_id}-{p}-{i}"
            states[rid] = ChoiceState(p * n + i, p, tokenizer, job.stop)

    if not job.stream and not job.stop:
        outputs = await backend.generate(job.prompts, job.params, lora_name=job.lora_name)
        for state, out in zip(states.values(), outputs):
            yield state.feed(out.token_ids, out.logprobs, out.top_logprobs)
            yield state.finish(out, out.finish_reason)
        return

    streams = [backend.stream(ids, job.params, request_id=f"{request_id}-{p}", lora_name=job.lora_name)
               for p, ids in enumerate(job.prompts)]
    async for delta in _merge(streams):
        state = states.get(delta.request_id)
        if state is None or state.finished:
            continue
        if delta.token_ids and not state.stopped:
            event = state.feed(delta.token_ids, delta.logprobs, delta.top_logprobs)
            yield event
            if state.stopped and not delta.finished:
                await backend.abort(delta.request_id)
        elif not delta.finished:
            yield ChoiceEvent(state.index)  # accepted (or tokens past a stop)
        if delta.finished:
            yield state.finish(delta.output, delta.finish_reason)


async def _merge(streams: list[AsyncIterator[StreamDelta]]) -> AsyncIterator[StreamDelta]:
    """Deltas of several streams as they come. Leaving early closes every stream (which
    aborts their requests)."""
    if len(streams) == 1:
        stream = streams[0]
        try:
            async for delta in stream:
                yield delta
        finally:
            await _close(stream)
        return
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(stream: AsyncIterator[StreamDelta]) -> None:
        try:
            async for delta in stream:
                queue.put_nowait(delta)
            queue.put_nowait(end)
        except Exception as exc:
            queue.put_nowait(exc)
        finally:
            await _close(stream)

    tasks = [asyncio.ensure_future(pump(s)) for s in streams]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is end:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()  # a pump's stream closes as it is cancelled (no await here: we may be cancelled too)


async def _close(stream: AsyncIterator) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        try:
            await aclose()
        except (RuntimeError, asyncio.CancelledError):
            pass
