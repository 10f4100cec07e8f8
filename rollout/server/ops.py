"""What each request does to the engine. `EngineOps.run` serves one request as its row in
optable.py says: the row's Engine call (on the loop, or on a background thread), or the
handler of the op's name here, `<op>(identity, call_id, request)`. Either returns the
reply's result, or DEFERRED when the answer comes later (a generate's outputs, a weight
sync that waits for its trainer).

The handlers are the ops that are more than one Engine call, with two rules of the engine
process applied on the way in:
- text never reaches the step loop: text prompts go to the text thread to be tokenized
  first, and `stop` strings are taken out of the SamplingParams the engine gets (the text
  thread watches for them, text_worker.py);
- an operation that waits on another party (joining a weight-sync group, a CUDA IPC update
  before the trainer sends) waits on a background thread; only the update itself runs on
  the loop (background.py).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

from rollout.request import SamplingParams
from rollout.server import codec, protocol
from rollout.server.background import Background
from rollout.server.optable import BACKGROUND, HANDLER, Op
from rollout.server.sessions import Sessions
from rollout.server.text_worker import Route, TextWorker, Tokenized, Watch

if TYPE_CHECKING:
    from rollout.engine import Engine

DEFERRED = object()  # the handler answers later


class Server(Protocol):
    """What the handlers ask of the engine process (EngineServer, engine_process.py)."""

    def send(self, identity: bytes, message: protocol.Message) -> None: ...

    def send_error(self, identity: bytes, call_id: int | None, error: BaseException) -> None: ...

    def abort_rids(self, rids: list[str]) -> list[str]:
        """Abort requests that clients follow (their outputs go to them); returns those aborted."""
        ...

    def stop(self) -> None: ...

    def keep_text_off_loop(self) -> None: ...


class EngineOps:
    """`server`: the engine process, for replies and for what it owns (the requests clients
    follow, its loop); `started`: when it started (time.monotonic), for health."""

    def __init__(self, engine: Engine, server: Server, sessions: Sessions, text: TextWorker, background: Background,
                 limits: protocol.Limits, started: float) -> None:
        self.engine = engine
        self.server = server
        self.sessions = sessions
        self.text = text
        self.background = background
        self.limits = limits
        self.started = started

    def run(self, op: Op, identity: bytes, call_id: int, request: protocol.Request) -> Any:
        if op.run == HANDLER or op.engine is None:  # (a row that is no HANDLER names its Engine method)
            return getattr(self, op.name)(identity, call_id, request)
        call = functools.partial(getattr(self.engine, op.engine), **op.engine_kwargs(request))
        if op.run == BACKGROUND:
            # Off the loop, so other clients are served meanwhile: the call waits on other parties
            # (init_weight_sync_group: every rank joining) and touches nothing the loop reads
            # until it has returned (the group is set once joined; its users are refused meanwhile).
            self.background.start(identity, call_id, op.name, call)
            return DEFERRED
        return codec.to_plain(call())

    # ---- introspection -----------------------------------------------------------------------
    def _model_info(self) -> protocol.ModelInfo:
        e = self.engine
        lora = bool(e.config.enable_lora)
        return protocol.ModelInfo(
            model_path=e.config.model, vocab_size=e.model_config.vocab_size, context_len=e.context_len,
            has_tokenizer=self.text.tokenizer is not None, eos_token_ids=sorted(e.eos_token_ids),
            device=str(e.device), dtype=e.config.dtype, enable_lora=lora, max_lora_rank=e.config.max_lora_rank if lora else None,
        )

    def hello(self, identity: bytes, call_id: int, request: protocol.Hello) -> protocol.ServerInfo:
        return protocol.ServerInfo(protocol.PROTOCOL_VERSION, identity.hex(), self._model_info(),
                                   self.limits.max_header_bytes, self.limits.max_tensor_bytes)

    def model_info(self, identity: bytes, call_id: int, request: protocol.GetModelInfo) -> protocol.ModelInfo:
        return self._model_info()

    def health(self, identity: bytes, call_id: int, request: protocol.Health) -> protocol.HealthInfo:
        stats = self.engine.stats()
        return protocol.HealthInfo(True, stats.weight_version, stats.num_running, stats.num_waiting, len(self.sessions),
                                   time.monotonic() - self.started)

    def shutdown(self, identity: bytes, call_id: int, request: protocol.Shutdown) -> None:
        self.server.stop()

    # ---- generation ----------------------------------------------------------------------------
    def generate(self, identity: bytes, call_id: int, request: protocol.Generate) -> Any:
        if request.prompts is not None:
            self._need_tokenizer("prompt text given but the engine has no tokenizer; pass input_ids")
            self.text.tokenize(identity, call_id, request)
            return DEFERRED
        return self._start_generate(identity, call_id, request)

    def add(self, identity: bytes, call_id: int, request: protocol.Add) -> Any:
        if request.prompt is not None:
            self._need_tokenizer("prompt text given but the engine has no tokenizer; pass input_ids")
            self.text.tokenize(identity, call_id, request)
            return DEFERRED
        return self._start_add(identity, call_id, request)

    def continue_tokenized(self, item: Tokenized) -> None:
        if item.error is not None:
            self.server.send_error(item.identity, item.call_id, item.error)
            return
        try:
            if isinstance(item.request, protocol.Generate):
                result = self._start_generate(item.identity, item.call_id, item.request)
            else:
                result = self._start_add(item.identity, item.call_id, item.request)
        except Exception as error:
            self.server.send_error(item.identity, item.call_id, error)
            return
        if result is not DEFERRED:
            self.server.send(item.identity, protocol.Reply(item.call_id, result))

    def _start_generate(self, identity: bytes, call_id: int, request: protocol.Generate) -> Any:
        if not request.input_ids:
            self.server.send(identity, protocol.Reply(call_id, None, []))
            return DEFERRED
        session = self.sessions.open(identity)
        added: list[tuple[list[str], str, tuple[str, ...]]] = []
        try:
            for i, (ids, params, lora_name) in enumerate(zip(request.input_ids, request.sampling_params, request.lora_names)):
                engine_params, stop = self._split_stop(params)
                base = session.new_base()
                rids = self.engine.add_request(ids, engine_params, request_id=session.prefix + base, prompt_index=i,
                                               lora_name=lora_name)
                added.append((rids, base, stop))
        except Exception:
            # in-process generate refuses a batch whole; the engine has no call that checks a
            # prompt without queueing it, so take back what was queued before the bad one
            for rids, _, _ in added:
                for rid in rids:
                    self.engine.abort(rid)
            self.sessions.discard_if_idle(identity)
            raise
        route = Route(identity, call_id, session.prefix)
        watches = []
        for rids, base, stop in added:
            for rid in rids:
                self.sessions.track(session, rid, call_id, base, needs_deltas=bool(stop))
                watches.append(Watch(rid, route, stream=False, stop=stop))
        self.text.follow(watches, generate=True)
        return DEFERRED

    def _start_add(self, identity: bytes, call_id: int, request: protocol.Add) -> dict:
        session = self.sessions.open(identity)
        engine_params, stop = self._split_stop(request.sampling_params)
        base = request.request_id if request.request_id is not None else session.new_base()
        try:
            rids = self.engine.add_request(request.input_ids, engine_params, request_id=session.prefix + base,
                                           lora_name=request.lora_name)
        except Exception:
            self.sessions.discard_if_idle(identity)
            raise
        route = Route(identity, call_id, session.prefix)
        for rid in rids:
            self.sessions.track(session, rid, call_id, base, needs_deltas=request.stream or bool(stop))
        self.text.follow([Watch(rid, route, request.stream, stop) for rid in rids], generate=False)
        return {"request_ids": [rid[len(session.prefix) :] for rid in rids]}

    def _split_stop(self, params: SamplingParams) -> tuple[SamplingParams, tuple[str, ...]]:
        """The engine gets the params without stop strings; the text thread watches them."""
        if not params.stop:
            return params, ()
        self._need_tokenizer("stop strings need a tokenizer; this engine has none (use stop_token_ids)")
        return dataclasses.replace(params, stop=()), params.stop

    def _need_tokenizer(self, message: str) -> None:
        if self.text.tokenizer is None:
            raise ValueError(message)

    def abort(self, identity: bytes, call_id: int, request: protocol.Abort) -> dict:
        session = self.sessions.get(identity)
        rids = self.sessions.find(session, request.request_id) if session is not None else []
        prefix = identity.hex() + "/"
        return {"aborted": [rid[len(prefix) :] for rid in self.server.abort_rids(rids)]}

    def cancel(self, identity: bytes, call_id: int, request: protocol.Cancel) -> dict:
        session = self.sessions.get(identity)
        rids = sorted(session.calls.get(request.call_id, ())) if session is not None else []
        prefix = identity.hex() + "/"
        return {"aborted": [rid[len(prefix) :] for rid in self.server.abort_rids(rids)]}

    # ---- weights -------------------------------------------------------------------------------
    def update_weights_from_ipc(self, identity: bytes, call_id: int, request: protocol.UpdateWeightsFromIpc) -> Any:
        """Bind the endpoint and wait for the trainer on a background thread; when its first
        message is in, the update itself runs on the loop (the same calls as
        Engine.update_weights_from_ipc, split where the wait ends)."""
        if self.engine.device.type != "cuda":
            raise ValueError(f"update_weights_from_ipc: CUDA IPC needs a CUDA engine; this one is on {self.engine.device}")
        # the engine's own choice of where the stream goes (base weights, draft model, an
        # adapter), so that the arguments are checked as in-process update_weights_from_ipc does
        apply = self.engine.weights.applier(request.lora_name, request.full, request.pause_mode, request.target)
        background, device = self.background, self.engine.device

        def on_trainer_message(stream: Iterable) -> int:
            stream = iter(stream)
            first = list(itertools.islice(stream, 1))  # blocks this thread until the trainer sends
            return background.run_on_loop(lambda: apply(itertools.chain(first, stream)))

        def job() -> int:
            from weightsync.transports.cuda_ipc import CudaIpcReceiver

            receiver = CudaIpcReceiver(request.endpoint, device=device, timeout_s=request.timeout_s)
            try:
                return receiver.serve_once(on_trainer_message)
            finally:
                receiver.close()

        self.background.start(identity, call_id, request.op, job)
        return DEFERRED

    def update_weights_from_distributed(self, identity: bytes, call_id: int,
                                        request: protocol.UpdateWeightsFromDistributed) -> int:
        self._group_idle(request.op)
        # On the loop: the broadcast is the update itself (call it when the trainer is about to send).
        return self.engine.update_weights_from_distributed(full=request.full, pause_mode=request.pause_mode,
                                                           lora_name=request.lora_name, target=request.target)

    def destroy_weight_sync_group(self, identity: bytes, call_id: int, request: protocol.DestroyWeightSyncGroup) -> None:
        self._group_idle(request.op)
        self.engine.destroy_weight_sync_group()

    def _group_idle(self, op: str) -> None:
        if self.background.running == "init_weight_sync_group":
            raise RuntimeError(f"{op}: the engine is still joining the weight-sync group")

    # ---- LoRA ----------------------------------------------------------------------------------
    def update_lora_adapters(self, identity: bytes, call_id: int, request: protocol.UpdateLoraAdapters) -> dict:
        return self.engine.update_lora_adapters(request.updates(), pause_mode=request.pause_mode)

    # ---- memory --------------------------------------------------------------------------------
    def wake(self, identity: bytes, call_id: int, request: protocol.Wake) -> Any:
        try:
            return codec.to_plain(self.engine.wake(request.tags))
        finally:
            self.server.keep_text_off_loop()
