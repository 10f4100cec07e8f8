"""An OpenAI-compatible HTTP endpoint in front of an engine: /v1/completions,
/v1/chat/completions (both streamed as server-sent events too) and /v1/models, with the
token-id extension (docs/openai.md, "The token-id extension") a trainer needs; and SGLang's
/pause_generation and /continue_generation.

    python -m rollout.server.openai_http --model DIR [--port 8000] [--engine-address ADDR]

FastAPI on uvicorn. The HTTP layer owns the text: prompts are tokenized (chat templates
applied) here and outputs detokenized here; the engine behind the `EngineBackend` sees
token ids only. It listens on 127.0.0.1 unless told otherwise (--host with --allow-remote):
it has no authentication.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import inspect
import ipaddress
import json
import logging
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from rollout.server.openai_backend import EngineBackend, EngineLoopStopped
from rollout.server.openai_choices import ChoiceEvent, run_choices
from rollout.server.openai_format import Formatter
from rollout.server.openai_protocol import ApiError, GenerationJob, Limits, engine_error, parse_chat, parse_completion

log = logging.getLogger("rollout.server")


class OpenAIServer:
    """The endpoint's handlers over one backend and one tokenizer."""

    def __init__(self, backend: EngineBackend, tokenizer, model_name: str, limits: Limits | None = None) -> None:
        self.backend = backend
        self.tokenizer = tokenizer
        self.model_name = model_name
        self._limits = limits  # None: asked of the backend on the first request

    async def limits(self) -> Limits:
        if self._limits is None:
            info = await self.backend.model_info()
            self._limits = Limits(info.context_len, info.vocab_size)
        return self._limits

    async def models(self) -> dict:
        info = await self.backend.model_info()
        created = int(time.time())
        base = {"id": self.model_name, "object": "model", "created": created, "owned_by": "rollout-engine",
                "root": self.model_name, "parent": None, "max_model_len": info.context_len,
                "weight_version": info.weight_version}
        adapters = [{"id": name, "object": "model", "created": created, "owned_by": "rollout-engine",
                     "root": self.model_name, "parent": self.model_name, "max_model_len": info.context_len}
                    for name in info.lora_adapters]
        return {"object": "list", "data": [base, *adapters]}

    async def generate(self, request: Request, kind: str) -> Response:
        body = await _json_body(request)
        parse = parse_completion if kind == "completion" else parse_chat
        job = parse(body, self.tokenizer, await self.limits())
        job = dataclasses.replace(job, lora_name=await self._adapter(job))
        prefix = "cmpl" if kind == "completion" else "chatcmpl"
        response_id = f"{prefix}-{uuid.uuid4().hex}"
        fmt = Formatter(self.tokenizer, job, response_id, int(time.time()), job.model or self.model_name)
        events = run_choices(self.backend, self.tokenizer, job, response_id)
        if not job.stream:
            collected = await _collect_until_disconnect(request, events)
            if collected is None:
                return Response(status_code=499)  # the client hung up (nginx's code); nobody reads this
            return JSONResponse(fmt.response(collected))
        try:
            first = await anext(events)  # the engine accepted the prompts, or a refusal becomes a 400
        except (ValueError, TypeError) as exc:
            raise engine_error(exc) from exc
        return StreamingResponse(_sse(fmt, job, first, events), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    async def _adapter(self, job: GenerationJob) -> str | None:
        """The LoRA adapter a request names: `lora_name`, or `model` naming a loaded adapter."""
        name = job.model
        if job.lora_name is None and (not name or name == self.model_name):
            return None
        info = await self.backend.model_info()
        if job.lora_name is not None:
            if name and name not in (self.model_name, job.lora_name):
                raise ApiError(f"model={name!r} and lora_name={job.lora_name!r} disagree", "lora_name")
            if job.lora_name not in info.lora_adapters:
                raise ApiError(f"lora_name={job.lora_name!r} is not loaded (loaded: {list(info.lora_adapters)})",
                               "lora_name", 404, code="model_not_found")
            return job.lora_name
        if name in info.lora_adapters:
            return name
        raise ApiError(f"The model `{name}` does not exist (served: {[self.model_name, *info.lora_adapters]})",
                       "model", 404, code="model_not_found")


async def _engine_call(call, param: str | None) -> None:
    """An engine control call whose refusal (a bad value, the wrong state) is the caller's 400."""
    try:
        await call
    except EngineLoopStopped:
        raise  # not a refusal: the server's own error
    except (ValueError, TypeError, RuntimeError) as exc:  # through the engine process: EngineError, a RuntimeError
        raise ApiError(str(exc), param) from exc


async def _json_body(request: Request) -> object:
    raw = await request.body()
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(f"the request body is not valid JSON: {exc}") from exc


async def _collect_until_disconnect(request: Request, events: AsyncIterator[ChoiceEvent]) -> list[ChoiceEvent] | None:
    """All events of a non-streamed request; a client that hangs up first has its requests
    aborted (their KV freed) instead of generating for nobody; None then."""
    async def collect() -> list[ChoiceEvent]:
        try:
            return [event async for event in events]
        except (ValueError, TypeError) as exc:
            raise engine_error(exc) from exc

    work = asyncio.ensure_future(collect())
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()  # closes the streams or the generate call: their requests are aborted
    if not work.done() or work.cancelled():
        return None
    return work.result()


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _sse(fmt: Formatter, job: GenerationJob, first: ChoiceEvent, events: AsyncIterator[ChoiceEvent]):
    """The stream's bytes. A client that disconnects cancels this generator, which closes
    the engine streams under it: their requests are aborted and their KV freed."""
    try:
        for chunk in fmt.opening_chunks():
            yield _event(chunk)
        chunk = fmt.chunk(first)
        if chunk is not None:
            yield _event(chunk)
        async for event in events:
            chunk = fmt.chunk(event)
            if chunk is not None:
                yield _event(chunk)
        if job.include_usage:
            yield _event(fmt.usage_chunk())
    except (ValueError, TypeError) as exc:  # a later prompt refused after the stream began
        yield _event(engine_error(exc).body())
    except Exception as exc:
        log.exception("stream failed")
        yield _event(ApiError(f"the engine failed: {exc}", type_="server_error", status=500).body())
    finally:
        await events.aclose()
    yield "data: [DONE]\n\n"


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def build_app(backend: EngineBackend, tokenizer, model_name: str, limits: Limits | None = None) -> FastAPI:
    """The FastAPI app: the routes, and OpenAI-style error bodies for every refusal and failure."""
    server = OpenAIServer(backend, tokenizer, model_name, limits)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        close = getattr(backend, "close", None)  # the engine thread, or the engine process's client
        if close is not None and inspect.isawaitable(result := close()):
            await result

    app = FastAPI(title="rollout-engine OpenAI-compatible endpoint", docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=lifespan)
    app.state.openai = server

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(ConnectionError)
    @app.exception_handler(TimeoutError)
    async def engine_unavailable(request: Request, exc: Exception) -> JSONResponse:
        error = ApiError(f"the engine is unavailable: {exc}", type_="server_error", status=503)
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(Exception)
    async def engine_failed(request: Request, exc: Exception) -> JSONResponse:
        log.exception("request failed")
        error = ApiError(f"internal error: {type(exc).__name__}: {exc}", type_="server_error", status=500)
        return JSONResponse(error.body(), status_code=error.status)

    @app.get("/v1/models")
    async def models() -> dict:
        return await server.models()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await server.generate(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await server.generate(request, "chat")

    @app.get("/health")
    async def health() -> dict:
        return {"ok": True}

    # SGLang's RL endpoints for pausing (its request body: {"mode": ...}, "abort" when absent)
    @app.post("/pause_generation")
    async def pause_generation(request: Request) -> dict:
        body = await _json_body(request) if await request.body() else {}
        if not isinstance(body, dict) or set(body) - {"mode"}:
            raise ApiError(f"pause_generation: expected a JSON object with at most 'mode', got {body!r}", "mode")
        mode = body.get("mode", "abort")
        await _engine_call(backend.pause_generation(mode), "mode")
        return {"ok": True, "mode": mode}

    @app.post("/continue_generation")
    async def continue_generation() -> dict:
        await _engine_call(backend.continue_generation(), None)
        return {"ok": True}

    return app


# ---- serving --------------------------------------------------------------------------------

def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_host(host: str, allow_remote: bool) -> str:
    if not is_loopback(host) and not allow_remote:
        raise ValueError(f"--host {host}: not a loopback address; the endpoint has no authentication, so serving "
                         "beyond this machine needs --allow-remote")
    return host


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


class ServerThread:
    """uvicorn serving an app from a background thread (tests; an endpoint beside a trainer
    in one process). Binds 127.0.0.1 by default; port 0 picks a free port (`.port`)."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, allow_remote: bool = False) -> None:
        import uvicorn

        self.socket = bind(check_host(host, allow_remote), port)
        self.host, self.port = host, self.socket.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]},
                                       name="openai-http", daemon=True)

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/v1"

    def start(self, timeout: float = 30.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self.socket.close()


def load_tokenizer(model_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m rollout.server.openai_http", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="checkpoint directory (its tokenizer and chat template are used)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--allow-remote", action="store_true", help="allow a --host beyond this machine (no auth!)")
    parser.add_argument("--served-model-name", default=None, help="the `model` clients send (default: the dir's name)")
    parser.add_argument("--engine-address", default=None,
                        help="front a running engine process (rollout.server) instead of an engine in this process")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-total-tokens", type=int, default=None, help="KV cache budget in tokens")
    parser.add_argument("--enable-lora", action="store_true")
    parser.add_argument("--lora", action="append", default=[], metavar="NAME=DIR", help="load a PEFT adapter at start")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        check_host(args.host, args.allow_remote)
    except ValueError as exc:
        parser.error(str(exc))
    backend, limits = _make_backend(args, parser)
    name = args.served_model_name or Path(args.model).resolve().name
    app = build_app(backend, load_tokenizer(args.model), name, limits)
    import uvicorn

    log.info("serving %s at http://%s:%d/v1", name, args.host, args.port)
    uvicorn.Server(uvicorn.Config(app, log_level="info")).run(sockets=[bind(args.host, args.port)])


def _make_backend(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[EngineBackend, Limits | None]:
    if args.engine_address is not None:
        if args.lora or args.enable_lora:
            parser.error("--lora / --enable-lora configure an in-process engine; load adapters in the engine process")
        from rollout.server.openai_client_backend import ClientBackend

        return ClientBackend(args.engine_address), None  # connects, and reads the limits, on the first request
    from rollout import Engine, EngineConfig
    from rollout.server.openai_backend import InProcessBackend

    loras = []
    for item in args.lora:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            parser.error(f"--lora {item!r}: expected NAME=DIR")
        loras.append((name, path))
    engine = Engine(EngineConfig(model=args.model, device=args.device, dtype=args.dtype,
                                 max_total_tokens=args.max_total_tokens, enable_lora=args.enable_lora or bool(loras)))
    for name, path in loras:
        engine.load_lora_adapter(name, path)
    limits = Limits(engine.context_len, engine.model_config.vocab_size)
    return InProcessBackend(engine), limits


if __name__ == "__main__":
    main()
