"""What each request does to the engine: `op_<name>(identity, call_id, request)` returns the
reply's result, or DEFERRED when the answer comes later (a generate's outputs, a weight
sync that waits for its trainer).

Mostly one engine call each, with two rules of the engine process applied on the way in:
- text never reaches the step loop: text prompts go to the text thread to be tokenized
  first, and `stop` strings are taken out of the SamplingParams the engine gets (the text
  thread watches for them, text_worker.py);
- an operation that waits on another party (joining a weight-sync group, a CUDA IPC update
  before the trainer sends) waits on a background thread; only the update itself runs on
  the loop (background.py).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable
from typing import Any

from rollout.request import SamplingParams
from rollout.server import codec, protocol
from rollout.server.text_worker import Route, Tokenized, Watch

DEFERRED = object()  # the handler answers later


class EngineOps:
    """Mixed into EngineServer (engine_process.py), whose state it uses: engine, sessions,
    text, background, config, started, running, step_pending, send, send_error, abort_rids,
    keep_text_off_loop."""

    # ---- introspection -----------------------------------------------------------------------
    def model_info(self) -> protocol.ModelInfo:
        e = self.engine
        lora = bool(e.config.enable_lora)
        return protocol.ModelInfo(
            model_path=e.config.model, vocab_size=e.model_config.vocab_size, context_len=e.context_len,
            has_tokenizer=self.text.tokenizer is not None, eos_token_ids=sorted(e.eos_token_ids),
            device=str(e.device), dtype=e.config.dtype, enable_lora=lora, max_lora_rank=e.config.max_lora_rank if lora else None,
        )

    def op_hello(self, identity: bytes, call_id: int, request: protocol.Hello) -> protocol.ServerInfo:
        limits = self.config.limits
        return protocol.ServerInfo(protocol.PROTOCOL_VERSION, identity.hex(), self.model_info(),
                                   limits.max_header_bytes, limits.max_tensor_bytes)

    def op_model_info(self, identity: bytes, call_id: int, request: protocol.GetModelInfo) -> protocol.ModelInfo:
        return self.model_info()

    def op_stats(self, identity: bytes, call_id: int, request: protocol.Stats):
        return self.engine.stats()

    def op_health(self, identity: bytes, call_id: int, request: protocol.Health) -> protocol.HealthInfo:
        import time

        stats = self.engine.stats()
        return protocol.HealthInfo(True, stats.weight_version, stats.num_running, stats.num_waiting, len(self.sessions),
                                   time.monotonic() - self.started)

    def op_shutdown(self, identity: bytes, call_id: int, request: protocol.Shutdown) -> None:
        self.running = False

    # ---- generation ----------------------------------------------------------------------------
    def op_generate(self, identity: bytes, call_id: int, request: protocol.Generate) -> Any:
        if request.prompts is not None:
            self._need_tokenizer("prompt text given but the engine has no tokenizer; pass input_ids")
            self.text.tokenize(identity, call_id, request)
            return DEFERRED
        return self._start_generate(identity, call_id, request)

    def op_add(self, identity: bytes, call_id: int, request: protocol.Add) -> Any:
        if request.prompt is not None:
            self._need_tokenizer("prompt text given but the engine has no tokenizer; pass input_ids")
            self.text.tokenize(identity, call_id, request)
            return DEFERRED
        return self._start_add(identity, call_id, request)

    def continue_tokenized(self, item: Tokenized) -> None:
        if item.error is not None:
            self.send_error(item.identity, item.call_id, item.error)
            return
        start = self._start_generate if isinstance(item.request, protocol.Generate) else self._start_add
        try:
            result = start(item.identity, item.call_id, item.request)
        except Exception as error:
            self.send_error(item.identity, item.call_id, error)
            return
        if result is not DEFERRED:
            self.send(item.identity, protocol.Reply(item.call_id, result))

    def _start_generate(self, identity: bytes, call_id: int, request: protocol.Generate) -> Any:
        if not request.input_ids:
            self.send(identity, protocol.Reply(call_id, None, []))
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

    def op_abort(self, identity: bytes, call_id: int, request: protocol.Abort) -> dict:
        session = self.sessions.get(identity)
        rids = self.sessions.find(session, request.request_id) if session is not None else []
        prefix = identity.hex() + "/"
        return {"aborted": [rid[len(prefix) :] for rid in self.abort_rids(rids)]}

    def op_cancel(self, identity: bytes, call_id: int, request: protocol.Cancel) -> dict:
        session = self.sessions.get(identity)
        rids = sorted(session.calls.get(request.call_id, ())) if session is not None else []
        prefix = identity.hex() + "/"
        return {"aborted": [rid[len(prefix) :] for rid in self.abort_rids(rids)]}

    # ---- weights -------------------------------------------------------------------------------
    def op_update_weights(self, identity: bytes, call_id: int, request: protocol.UpdateWeights) -> int:
        self.step_pending = True  # a pause may have finished requests: their outputs wait in the engine
        return self.engine.update_weights(request.tensors, full=request.full, pause_mode=request.pause_mode,
                                          target=request.target)

    def op_update_weights_from_disk(self, identity: bytes, call_id: int, request: protocol.UpdateWeightsFromDisk) -> int:
        self.step_pending = True
        return self.engine.update_weights_from_disk(request.path, full=request.full, pause_mode=request.pause_mode,
                                                    lora_name=request.lora_name, target=request.target)

    def op_update_weights_from_ipc(self, identity: bytes, call_id: int, request: protocol.UpdateWeightsFromIpc) -> Any:
        """Bind the endpoint and wait for the trainer on a background thread; when its first
        message is in, the update itself runs on the loop (the same calls as
        Engine.update_weights_from_ipc, split where the wait ends)."""
        if self.engine.device.type != "cuda":
            raise ValueError(f"update_weights_from_ipc: CUDA IPC needs a CUDA engine; this one is on {self.engine.device}")
        # the engine's own choice of where the stream goes (base weights, draft model, an
        # adapter), so that the arguments are checked as in-process update_weights_from_ipc does
        apply = self.engine.update_applier(request.lora_name, request.full, request.pause_mode, request.target)
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

    def op_init_weight_sync_group(self, identity: bytes, call_id: int, request: protocol.InitWeightSyncGroup) -> Any:
        # Joining waits for every rank; it only sets the engine's group once joined, which
        # nothing on the loop reads until update_weights_from_distributed (refused meanwhile).
        r = request
        self.background.start(identity, call_id, r.op, lambda: self.engine.init_weight_sync_group(
            r.master_addr, r.master_port, r.rank_offset, r.world_size, r.backend, timeout_s=r.timeout_s,
            join_timeout_s=r.join_timeout_s))
        return DEFERRED

    def op_update_weights_from_distributed(self, identity: bytes, call_id: int,
                                           request: protocol.UpdateWeightsFromDistributed) -> int:
        self._group_idle(request.op)
        self.step_pending = True
        # On the loop: the broadcast is the update itself (call it when the trainer is about to send).
        return self.engine.update_weights_from_distributed(full=request.full, pause_mode=request.pause_mode,
                                                           lora_name=request.lora_name, target=request.target)

    def op_destroy_weight_sync_group(self, identity: bytes, call_id: int, request: protocol.DestroyWeightSyncGroup) -> None:
        self._group_idle(request.op)
        self.engine.destroy_weight_sync_group()

    def _group_idle(self, op: str) -> None:
        if self.background.running == "init_weight_sync_group":
            raise RuntimeError(f"{op}: the engine is still joining the weight-sync group")

    # ---- LoRA ----------------------------------------------------------------------------------
    def op_load_lora_adapter(self, identity: bytes, call_id: int, request: protocol.LoadLoraAdapter):
        return self.engine.load_lora_adapter(request.name, request.path, tensors=request.tensors, config=request.config)

    def op_unload_lora_adapter(self, identity: bytes, call_id: int, request: protocol.UnloadLoraAdapter) -> None:
        self.step_pending = True  # unloading reads the step in flight back: its outputs wait in the engine
        self.engine.unload_lora_adapter(request.name)

    def op_update_lora_adapter(self, identity: bytes, call_id: int, request: protocol.UpdateLoraAdapter) -> int:
        self.step_pending = True
        return self.engine.update_lora_adapter(request.name, request.tensors, pause_mode=request.pause_mode)

    def op_list_lora_adapters(self, identity: bytes, call_id: int, request: protocol.ListLoraAdapters) -> list:
        return self.engine.list_lora_adapters()

    # ---- memory --------------------------------------------------------------------------------
    def op_sleep(self, identity: bytes, call_id: int, request: protocol.Sleep) -> Any:
        self.step_pending = True
        return _plain_or_none(self.engine.sleep(request.level))

    def op_wake(self, identity: bytes, call_id: int, request: protocol.Wake) -> Any:
        self.step_pending = True
        try:
            return _plain_or_none(self.engine.wake(request.tags))
        finally:
            self.keep_text_off_loop()


def _plain_or_none(value: Any) -> Any:
    try:
        return codec.to_plain(value)
    except TypeError:
        return None
