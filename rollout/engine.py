"""Engine: the facade. generate(), the add_request / step / abort loop, sleep / wake and
stats() are here; the work is done by the parts in rollout/core/ (build, intake, step loop,
outputs, pause), the scheduler, the KV manager and the model runner. Weight updates and
their transports are WeightSync's (rollout/weights.py), LoRA adapters LoraAdapters'
(rollout/adapters.py): each gets what it uses in its constructor, and the methods here
delegate to them.

Everything a caller hands the engine is validated before it is accepted, so a bad request
raises and leaves the requests already accepted untouched.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rollout.adapters import LoraAdapters
from rollout.config import EngineConfig
from rollout.core.build import attach_backend, build_parts, check_device
from rollout.core.intake import Intake, Limits
from rollout.core.memory import TAGS, MemorySaver, SleepStats
from rollout.core.outputs import Outputs
from rollout.core.pause import Outbox, Pause
from rollout.core.step import StepLoop
from rollout.distributed.tp import TensorParallel
from rollout.metrics import Counters, EngineStats
from rollout.request import Req, RolloutOutput, SamplingParams
from rollout.structured.service import StructuredOutput
from rollout.validate import check_int
from rollout.weights import WeightSync

if TYPE_CHECKING:
    from lora.flat import FlatLoraAdapter
    from lora.manager import LoraAdapterInfo

log = logging.getLogger("rollout")
PAUSE_MODES = ("abort", "retract", "in_place")


class Engine:
    def __init__(self, config: EngineConfig, *, tensor_parallel: TensorParallel | None = None) -> None:
        """`tensor_parallel`: this rank's TP group when tensor_parallel_size > 1 (None: TP
        groups of consecutive ranks of the default group; see rollout/distributed/tp.py)."""
        if not isinstance(config, EngineConfig):
            raise TypeError(f"Engine(config): expected an EngineConfig, got {type(config).__name__}")
        self.config = config
        self.device = check_device(config.device)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        elif self.device.type == "cuda" and torch.get_num_threads() > 1:
            # The host side of a GPU step is small tensor ops and Python; a pool of OpenMP
            # workers only competes with the scheduler for cores (vLLM's workers do the same).
            log.info("torch intra-op threads %d -> 1 (EngineConfig.num_threads overrides)", torch.get_num_threads())
            torch.set_num_threads(1)
        parts = build_parts(config, self.device, tensor_parallel)
        self.tp = parts.tp
        self.model_config = parts.model_config
        self.model = parts.model
        self.tokenizer = parts.tokenizer
        self.eos_token_ids = parts.eos_token_ids
        self.context_len = parts.context_len
        self.kv_pool, self.kv, self.scheduler, self.runner = parts.kv_pool, parts.kv, parts.scheduler, parts.runner

        self.counters = parts.counters
        self.outputs = Outputs(self.tokenizer, self.eos_token_ids, self.context_len)
        self.draft = parts.draft  # speculative="draft": the draft model's runner
        self.speculation = parts.speculation  # speculative decoding's hook (a null one when off)
        # json_schema / regex / grammar requests; xgrammar is loaded at the first one
        self.structured = StructuredOutput(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids)
        self.loop = StepLoop(self.scheduler, self.runner, self.kv, self.outputs, self.counters,
                             self.model_config.vocab_size, config.overlap_plain, self.speculation, self.structured)
        limits = Limits(self.model_config.vocab_size, self.context_len, self.kv.capacity - config.page_size)
        self.lora = parts.lora
        self.intake = Intake(limits, self.tokenizer, lambda rid: self.scheduler.find(rid) is not None, config.seed,
                             fork_samples=self.kv.tree is not None, lora=self.lora, structured=self.structured)
        self.memory = MemorySaver(self.model, [*self.kv_pool.k_buffers, *self.kv_pool.v_buffers],
                                  self.lora.device_tensors() if self.lora is not None else [], self.device,
                                  draft=self.draft.model if self.draft is not None else None,
                                  draft_kv=self.draft.kv_tensors() if self.draft is not None else [])
        self.outbox = Outbox()  # finished outputs not yet handed out: the next step() returns them
        self.generation_paused: str | None = None  # pause_generation's mode until continue_generation()
        self.pause = Pause(self.scheduler, self.loop, self.counters, self.outbox, self.step, self.abort,
                           lambda: self.memory.can_step and self.generation_paused is None)
        # the speculation hook is looked up per update: benchmarks swap engine.speculation
        self.adapters = LoraAdapters(self.lora, self.model_config, self.kv, self.scheduler, self.pause,
                                     lambda: self.speculation)
        self.weights = WeightSync(self.model, self.draft, self.tp, self.device, self.kv, self.memory, self.pause,
                                  self.adapters, lambda: self.speculation)

    # ---- requests in ------------------------------------------------------------------
    def add_request(
        self,
        input_ids: Sequence[int] | None = None,
        sampling_params: SamplingParams | None = None,
        *,
        prompt: str | None = None,
        request_id: str | None = None,
        prompt_index: int = 0,
        namespace: str | None = None,
        lora_name: str | None = None,
    ) -> list[str]:
        """Queue one prompt (its n samples), under adapter `lora_name` (None: the base
        model). Returns the samples' request ids."""
        self._check_serving()
        reqs = self.intake.make_reqs(input_ids, prompt, sampling_params or SamplingParams(), request_id,
                                     prompt_index, namespace, lora_name)
        for req in reqs:
            self.scheduler.add(req)
        return [r.rid for r in reqs]

    def generate(
        self,
        input_ids: Sequence[Sequence[int]] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        prompts: Sequence[str] | None = None,
        namespace: str | None = None,
        lora_name: str | None | Sequence[str | None] = None,
        progress: bool = False,
    ) -> list[RolloutOutput]:
        """Run prompts to completion. One output per sample, prompt-major then sample.
        `lora_name`: one adapter for every prompt, or a list with one per prompt."""
        self._check_serving()
        if self.generation_paused is not None:
            # generate() steps until its requests finish, and nothing runs until continue_generation()
            raise RuntimeError(f"generate: generation is paused (pause_generation(mode={self.generation_paused!r})); "
                               "continue_generation() first, or add_request() to queue requests for after it")
        items = self.intake.batch(input_ids, prompts, sampling_params)
        adapters = self.intake.lora_names(lora_name, len(items))
        # Validate every prompt before queueing any: a bad one must not leave half a batch.
        all_reqs: list[Req] = []
        for i, ((ids, text, params), adapter) in enumerate(zip(items, adapters)):
            all_reqs.extend(self.intake.make_reqs(ids, text, params, None, i, namespace, adapter))
        for req in all_reqs:
            self.scheduler.add(req)
        wanted = {r.rid for r in all_reqs}
        done: dict[str, RolloutOutput] = {}
        start = time.perf_counter()
        while len(done) < len(wanted):
            for out in self.step():
                if out.request_id in wanted:
                    done[out.request_id] = out
                else:
                    self.outbox.put([out])
            if progress:
                _progress_line(len(done), len(wanted), self.counters.generated_tokens, time.perf_counter() - start)
        if progress:
            print(flush=True)
        return [done[r.rid] for r in all_reqs]

    def abort(self, request_id: str) -> RolloutOutput | None:
        """Stop a request now; its output (with what it had) is returned, marked aborted."""
        req = self.scheduler.find(request_id)
        if req is None:
            return None
        return self.loop.abort(req, self.weight_version)

    def has_unfinished(self) -> bool:
        """Whether a step() would run anything (False while generation is paused)."""
        if self.generation_paused is not None:
            return False
        return self.scheduler.has_work() or self.loop.inflight is not None

    # ---- pausing generation -------------------------------------------------------------
    def pause_generation(self, mode: str = "abort") -> None:
        """Stop generating until continue_generation(), around a trainer's step or a sync of
        several engines (SGLang's pause_generation, vLLM's pause/resume; "abort" is both's
        default). `mode`:
        - "abort": running and waiting requests end now with their partial tokens and
          log-probs, finish_reason "abort" (their outputs come from the next step());
        - "retract": running requests go back to waiting with their tokens; their KV is
          released into the prefix cache, where they find it again unless a weight update
          flushes it first;
        - "in_place": running requests keep their KV and go on after continue_generation().
        While paused, new requests are accepted and wait, and weight and adapter updates,
        sleep and wake work as ever (an update's own pause_mode applies to the requests held
        here: "wait" cannot run them, so it retracts them)."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause_generation(mode={mode!r}): expected one of {list(PAUSE_MODES)}")
        if self.generation_paused is not None:
            raise RuntimeError(f"pause_generation: already paused (mode={self.generation_paused!r}); "
                               "continue_generation() first")
        if mode == "in_place":
            self.pause.drain()  # the step in flight lands; nothing more is scheduled
        else:
            self.pause(mode, keep_kv=True)
        self.generation_paused = mode

    def continue_generation(self) -> None:
        """Generation goes on: waiting requests are admitted, held ones step on."""
        if self.generation_paused is None:
            raise RuntimeError("continue_generation: generation is not paused")
        self.generation_paused = None

    # ---- the step loop ----------------------------------------------------------------
    def step(self) -> list[RolloutOutput]:
        """Run one scheduler -> model -> sampler step; returns the requests that finished.

        With overlap scheduling, a step launches its batch and then reads the previous
        step's tokens back while the device works: outputs arrive one step later."""
        t0 = time.perf_counter()
        finished = self.outbox.take()
        if not self.memory.can_step or self.generation_paused is not None:
            # accepted requests wait for wake() (and, after level 2, a full sync) or continue_generation()
            return finished
        finished.extend(self.loop.step(self.weight_version))
        self.counters.step_seconds += time.perf_counter() - t0
        return finished

    # ---- weights ----------------------------------------------------------------------
    @property
    def weight_version(self) -> int:
        """The policy's version: each update of the target model's weights adds one."""
        return self.weights.version

    def update_weights(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        full: bool = False,
        pause_mode: str = "retract",
        target: str = "model",
    ) -> int:
        """Replace weights in place from (HF name, tensor) pairs; returns the new version.

        `target="draft"` updates the draft model (speculative="draft") instead; with the
        default target, tensors named "draft.<HF name>" go to the draft in the same atomic
        update. A draft-only update keeps the weight version (the policy did not change).

        Everything is validated before anything is written: a bad update raises (naming
        the parameter) and the old weights keep serving. Then in-flight requests are
        paused by `pause_mode` ("wait": run them to completion first; "abort": finish them
        now as aborted; "retract": send them back to waiting, to resume under the new
        weights), the weights are written, the prefix cache is flushed (its KV was made by
        the old weights) and the version goes up.
        """
        return self.weights.update(named_tensors, full=full, pause_mode=pause_mode, target=target)

    def update_weights_from_disk(self, path: str | Path, *, full: bool = True, pause_mode: str = "retract",
                                 lora_name: str | None = None, target: str = "model") -> int:
        """Load an update from a safetensors directory (with or without an index), or with
        `lora_name` an adapter's new tensors from a PEFT directory (save_pretrained)."""
        return self.weights.update_from_disk(path, full=full, pause_mode=pause_mode, lora_name=lora_name,
                                             target=target)

    def update_weights_from_ipc(self, endpoint: str, *, full: bool = True, pause_mode: str = "retract",
                                timeout_s: float = 300.0, lora_name: str | None = None, target: str = "model") -> int:
        """Serve one CUDA IPC update on `endpoint` (loopback tcp or ipc://); the trainer's
        CudaIpcSender.send() returns the new version or raises with the engine's error."""
        return self.weights.update_from_ipc(endpoint, full=full, pause_mode=pause_mode, timeout_s=timeout_s,
                                            lora_name=lora_name, target=target)

    def init_weight_sync_group(self, master_addr: str, master_port: int, rank_offset: int, world_size: int,
                               backend: str = "gloo", *, timeout_s: float = 300.0,
                               join_timeout_s: float | None = None) -> None:
        """Join the trainer's weight-sync group as rank `rank_offset` (the trainer is rank 0).
        Every rank calls this with the same address; it returns once all have joined."""
        self.weights.init_group(master_addr, master_port, rank_offset, world_size, backend, timeout_s=timeout_s,
                                join_timeout_s=join_timeout_s)

    def update_weights_from_distributed(self, *, full: bool = True, pause_mode: str = "retract",
                                        lora_name: str | None = None, target: str = "model") -> int:
        """Receive one broadcast update from the trainer (it calls BroadcastSender.send)."""
        return self.weights.update_from_distributed(full=full, pause_mode=pause_mode, lora_name=lora_name,
                                                    target=target)

    def destroy_weight_sync_group(self) -> None:
        self.weights.destroy_group()

    # ---- LoRA adapters ----------------------------------------------------------------
    def load_lora_adapter(self, name: str, path: str | Path | None = None, *,
                          tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]] | None = None,
                          config: Mapping[str, Any] | None = None) -> LoraAdapterInfo:
        """Load a PEFT adapter under `name`: from a directory (adapter_config.json +
        adapter_model.safetensors; a pickled .bin is refused, never opened), or from a PEFT
        state dict (`get_peft_model_state_dict` names) plus a LoraConfig-style dict."""
        return self.adapters.load(name, path, tensors=tensors, config=config)

    def list_lora_adapters(self) -> list[LoraAdapterInfo]:
        return self.adapters.loaded()

    def update_lora_adapter(self, name: str, named_tensors: Iterable[tuple[str, torch.Tensor]] | FlatLoraAdapter, *,
                            pause_mode: str = "retract") -> int:
        """Replace some or all of an adapter's tensors in place, given by PEFT state-dict
        names or as one flat buffer (`lora.FlatLoraAdapter`: a dozen copies instead of one
        per tensor); returns its new version. Validated whole before anything is written;
        the requests running under it are paused by `pause_mode` ("retract": resume under
        the new version; "wait": finish under the old one first; "abort"); its cached KV is
        dropped. Other adapters and the base model keep serving, their caches untouched."""
        return self.adapters.update({name: named_tensors}, pause_mode=pause_mode)[name]

    def update_lora_adapters(self, updates: Mapping[str, Iterable[tuple[str, torch.Tensor]] | FlatLoraAdapter], *,
                             pause_mode: str = "retract") -> dict[str, int]:
        """`update_lora_adapter` for several adapters in one call: all of them validated
        (names, shapes, then every value with one host sync in all) before any is written,
        so a bad tensor in one leaves every adapter as it was. Returns each new version."""
        return self.adapters.update(updates, pause_mode=pause_mode)

    def unload_lora_adapter(self, name: str) -> None:
        """Refused while requests (running or waiting) use the adapter."""
        self.adapters.unload(name)

    # ---- sleep / wake -----------------------------------------------------------------
    def sleep(self, level: int = 1) -> SleepStats:
        """Give the device memory back (a colocated trainer's optimizer step needs it).

        Running requests are retracted first (their KV is released; they keep their tokens
        and resume after wake()); new requests are refused until wake(). level=1: weights to
        pinned host memory; level=2: weights dropped (the next update_weights(full=True)
        refills them). Both release the KV cache, LoRA slots, attention workspace and CUDA
        graphs, and return the memory to the device (not to torch's cache)."""
        level = check_int(level, "level", min=1, max=2)
        if self.memory.asleep:
            raise RuntimeError(f"sleep: already asleep ({sorted(self.memory.asleep)} released); wake() first")
        self.pause("retract")  # every request: its KV is released below
        self.kv.flush()
        if self.lora is not None:
            self.lora.evict_all()
        self.runner.graphs, self.runner.backend = None, None
        self.speculation.release()  # a draft model's sequences, graphs and backend
        self.memory.release_kv()
        self.memory.release_weights(level)
        self.memory.empty_cache()
        self.memory.stats.level = level
        self.memory.stats.sleeps += 1
        return self.memory.stats

    def wake(self, tags: Sequence[str] | None = None) -> SleepStats:
        """Take the memory back, all of it (tags=None) or in stages: "weights" first (a
        trainer can then sync into them before the KV cache returns), then "kv_cache" (KV
        pool, LoRA slots, attention workspace, CUDA graphs: graph capture runs the model, so
        the weights must be awake)."""
        tags = list(TAGS if tags is None else tags)
        unknown = [t for t in tags if t not in TAGS]
        if unknown or not tags:
            raise ValueError(f"wake(tags={tags!r}): expected a non-empty subset of {list(TAGS)}")
        if "weights" in tags and "weights" in self.memory.asleep:
            self.memory.restore_weights()
        if "kv_cache" in tags and "kv_cache" in self.memory.asleep:
            if "weights" in self.memory.asleep:
                raise ValueError("wake: 'kv_cache' needs the weights awake (graph capture runs the model); "
                                 "wake(['weights']) first or wake both")
            start = time.perf_counter()
            self.memory.restore_kv()
            if self.lora is not None:
                self.lora.rebind()  # the slots' per-layer views, onto the re-made buffers
            attach_backend(self.config, self.model_config, self.runner, self.kv_pool, min(self.context_len, self.kv.capacity))
            self.speculation.wake()  # a draft model's backend and graphs
            self.memory.stats.wake_seconds["kv_cache"] = time.perf_counter() - start
        if not self.memory.asleep:
            self.memory.stats.level = 0
        return self.memory.stats

    def _check_serving(self) -> None:
        if self.memory.asleep:
            raise RuntimeError(f"the engine is asleep ({sorted(self.memory.asleep)} released): wake() first")
        if self.memory.weights_discarded:
            raise RuntimeError("sleep(level=2) discarded the weights: update_weights(..., full=True) before new requests")

    # ---- introspection ----------------------------------------------------------------
    def stats(self) -> EngineStats:
        c = self.counters
        used = self.kv.used_slots()
        return EngineStats(
            tokens_per_second=c.generated_tokens / c.step_seconds if c.step_seconds else 0.0,
            prefix_cache_hit_rate=c.cached_prompt_tokens / c.prompt_tokens if c.prompt_tokens else 0.0,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_used_tokens=used,
            kv_capacity_tokens=self.kv.capacity,
            kv_usage=used / self.kv.capacity,
            weight_version=self.weight_version,
            counters=dict(vars(c)),
            mean_accepted_length=c.accepted_tokens / c.verify_steps if c.verify_steps else 0.0,
            draft_acceptance_rate=c.accepted_tokens / c.drafted_tokens if c.drafted_tokens else 0.0,
            draft_weight_version=self.speculation.draft_weight_version,
            draft_stale=self.speculation.draft_stale,
            generation_paused=self.generation_paused,
        )

    def flush_cache(self) -> None:
        """Drop the prefix cache (only possible with no request running)."""
        if self.scheduler.running:
            raise RuntimeError("flush_cache: requests are running")
        self.kv.flush()


def _progress_line(done: int, total: int, tokens: int, seconds: float) -> None:
    rate = tokens / seconds if seconds else 0.0
    print(f"\r  {done}/{total} samples done, {tokens} tokens generated, {rate:.1f} tok/s", end="", flush=True)
