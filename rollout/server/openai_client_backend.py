"""The engine process (rollout.server) as an EngineBackend: the OpenAI endpoint in front of
`AsyncRolloutClient`.

The client speaks the EngineBackend calls already; what this adds:
- it connects on first use, inside the event loop that serves HTTP (zmq.asyncio sockets and
  the client's reader task belong to one loop, which does not exist before uvicorn starts);
- model_info from three calls (the static model info, health for the weight version, the
  adapter list);
- top-k log-probs while streaming: the engine process's deltas carry tokens and their
  log-probs but not the top-k alternatives, which only the final output holds; a stream
  that asks for them is handed over whole when the sample ends (correct, not incremental).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

from rollout.request import RolloutOutput, SamplingParams
from rollout.server.openai_backend import ModelInfo, StreamDelta


class ClientBackend:
    def __init__(self, address: str, **client_options: Any) -> None:
        self.address = address
        self._options = client_options
        self._client = None
        self._lock: asyncio.Lock | None = None
        self._static = None  # the engine's ModelInfo: fixed for the process's life

    async def client(self):
        if self._client is None:
            from rollout.server.async_client import AsyncRolloutClient

            if self._lock is None:
                self._lock = asyncio.Lock()
            async with self._lock:
                if self._client is None:
                    self._client = await AsyncRolloutClient.connect(self.address, **self._options)
        return self._client

    async def generate(self, input_ids: Sequence[Sequence[int]], sampling_params: SamplingParams | None = None, *,
                       lora_name: str | None = None) -> list[RolloutOutput]:
        client = await self.client()
        return await client.generate(input_ids=[list(ids) for ids in input_ids], sampling_params=sampling_params,
                                     lora_name=lora_name)

    async def stream(self, input_ids: Sequence[int], sampling_params: SamplingParams | None = None, *,
                     request_id: str | None = None, lora_name: str | None = None) -> AsyncIterator[StreamDelta]:
        client = await self.client()
        whole = bool(sampling_params is not None and sampling_params.top_logprobs)
        sent: dict[str, int] = {}
        stream = client.stream(list(input_ids), sampling_params, request_id=request_id, lora_name=lora_name)
        try:
            async for delta in stream:
                rid = delta.request_id
                if rid not in sent:
                    sent[rid] = 0
                    yield StreamDelta(rid, [], [])  # accepted
                if not delta.finished:
                    if not whole and delta.token_ids:
                        sent[rid] += len(delta.token_ids)
                        yield StreamDelta(rid, list(delta.token_ids), list(delta.logprobs))
                    continue
                out = delta.output
                if out is None:  # cannot happen with this protocol; end the sample with what came
                    yield StreamDelta(rid, list(delta.token_ids), list(delta.logprobs), None, True,
                                      delta.finish_reason, None)
                    continue
                start = sent[rid]
                tops = out.top_logprobs[start:] if out.top_logprobs is not None else None
                yield StreamDelta(rid, out.token_ids[start:], out.logprobs[start:], out.text, True,
                                  out.finish_reason, out, tops)
        finally:
            await stream.aclose()

    async def abort(self, request_id: str) -> None:
        client = await self.client()
        await client.abort(request_id)

    async def pause_generation(self, mode: str) -> None:
        client = await self.client()
        await client.pause_generation(mode)

    async def continue_generation(self) -> None:
        client = await self.client()
        await client.continue_generation()

    async def model_info(self) -> ModelInfo:
        client = await self.client()
        if self._static is None:
            self._static = await client.model_info()
        health = await client.health()
        adapters: tuple[str, ...] = ()
        if self._static.enable_lora:
            adapters = tuple(_name(a) for a in await client.list_lora_adapters())
        return ModelInfo(self._static.context_len, self._static.vocab_size, health.weight_version, adapters)

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None


def _name(adapter: Any) -> str:
    return adapter["name"] if isinstance(adapter, dict) else adapter.name
