"""Engine: the facade. generate(), the add_request / step / abort loop, stats() and
update_weights(); the work is done by the parts in rollout/core/ (build, intake, step loop,
outputs), the scheduler, the KV manager and the model runner.

Everything a caller hands the engine is validated before it is accepted, so a bad request
raises and leaves the requests already accepted untouched.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence

import torch

from rollout.config import EngineConfig
from rollout.core.build import attach_backend, build_parts, check_device
from rollout.core.intake import Intake, Limits
from rollout.core.memory import TAGS, MemorySaver, SleepStats
from rollout.core.outputs import Outputs
from rollout.core.step import StepLoop
from rollout.distributed.tp import TensorParallel
from rollout.metrics import EngineStats
from rollout.model.loader import apply_writes, plan_writes
from rollout.request import Req, RolloutOutput, SamplingParams
from rollout.structured.service import StructuredOutput
from rollout.lora_api import LoraAdaptersMixin
from rollout.validate import check_bool, check_int, check_pause_mode, named_tensor_list
from rollout.weight_updates import WeightUpdatesMixin

log = logging.getLogger("rollout")


class Engine(WeightUpdatesMixin, LoraAdaptersMixin):
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

        self.weight_version = 0
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
        self._pending: list[RolloutOutput] = []  # finished outputs not yet handed out
        self.memory = MemorySaver(self.model, [*self.kv_pool.k_buffers, *self.kv_pool.v_buffers],
                                  self.lora.device_tensors() if self.lora is not None else [], self.device,
                                  draft=self.draft.model if self.draft is not None else None,
                                  draft_kv=self.draft.kv_tensors() if self.draft is not None else [])

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
                    self._pending.append(out)
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
        return self.scheduler.has_work() or self.loop.inflight is not None

    # ---- the step loop ----------------------------------------------------------------
    def step(self) -> list[RolloutOutput]:
        """Run one scheduler -> model -> sampler step; returns the requests that finished.

        With overlap scheduling, a step launches its batch and then reads the previous
        step's tokens back while the device works: outputs arrive one step later."""
        t0 = time.perf_counter()
        finished, self._pending = self._pending, []
        if self.memory.asleep or self.memory.weights_discarded:
            return finished  # accepted requests wait for wake() (and, after level 2, a full sync)
        finished.extend(self.loop.step(self.weight_version))
        self.counters.step_seconds += time.perf_counter() - t0
        return finished

    def _pause(self, pause_mode: str, affected: Callable[[Req], bool] | None = None) -> None:
        """Stop the requests an update affects (all, or those `affected` selects) from
        running on: "wait" runs them to completion, "abort" finishes them as aborted,
        "retract" sends them back to waiting to resume later. Every caller replaces what made
        their KV (the weights, an adapter) or releases it (sleep), so it is dropped, not cached."""
        self._pending.extend(self.loop.drain())
        hit = affected or (lambda req: True)
        if pause_mode == "wait":
            while self.loop.inflight is not None or any(hit(r) for r in (*self.scheduler.running, *self.scheduler.waiting)):
                done = self.step()  # step() hands out (and rebinds) _pending: extend the new list after it
                self._pending.extend(done)
        elif pause_mode == "abort":
            for req in [r for r in (*self.scheduler.running, *self.scheduler.waiting) if hit(r)]:
                out = self.abort(req.rid)
                if out is not None:
                    self._pending.append(out)
        else:
            self.counters.retractions += len(self.scheduler.retract_all(hit, keep_kv=False))

    # ---- weights ----------------------------------------------------------------------
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
        check_bool(full, "full")
        check_pause_mode(pause_mode)
        if "weights" in self.memory.asleep:
            raise RuntimeError("update_weights: the weights are asleep; wake(['weights']) first")
        if self.memory.weights_discarded and not full:
            raise ValueError("update_weights: sleep(level=2) discarded the weights; the next update must be full=True")
        # every TP rank takes the stream and validates its shard, then all write or none does
        # (a rank whose stream or shard fails makes every rank refuse: TensorParallel.agree)
        writes, draft_writes = self.tp.agree(lambda: self._plan_update(named_tensors, full, target), "update_weights")
        if writes is not None:
            self._pause(pause_mode)
        if draft_writes is not None:  # between steps the draft holds no step's work: no pause
            apply_writes(draft_writes)
        if writes is not None:
            apply_writes(writes)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if writes is not None:
            self.kv.flush()
            self.speculation.policy_changed()
            self.memory.weights_discarded = False
            self.weight_version += 1
        if draft_writes is not None:
            self.speculation.draft_updated(self.weight_version)
        return self.weight_version

    def _plan_update(self, named_tensors: Iterable, full: bool, target: str) -> tuple[list | None, list | None]:
        """(the target's writes, the draft's), all validated; None where nothing goes."""
        pairs, draft_pairs = self._split_draft(named_tensor_list(named_tensors), target)
        draft_writes = self.draft.plan_update(draft_pairs, full) if draft_pairs else None  # type: ignore[union-attr]
        writes = plan_writes(self.model, pairs, full=full) if pairs or draft_writes is None else None
        return writes, draft_writes

    def _split_draft(self, pairs: list, target: str) -> tuple[list, list]:
        """(the target's tensors, the draft's): by `target`, or by the "draft." name prefix."""
        if target not in ("model", "draft"):
            raise ValueError(f"update_weights: target={target!r}: expected 'model' or 'draft'")
        if target == "draft":
            mine, draft = [], pairs
        else:
            mine = [(n, t) for n, t in pairs if not n.startswith("draft.")]
            draft = [(n[len("draft."):], t) for n, t in pairs if n.startswith("draft.")]
        if draft and self.draft is None:
            raise ValueError(f"update_weights: {'target=' + repr(target) if target == 'draft' else repr(pairs[0][0])}"
                             " names the draft model, and this engine has none (speculative='draft')")
        if target == "draft" and not draft:
            raise ValueError("update_weights(target='draft'): no tensors given")
        return mine, draft

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
        self._pending.extend(self.loop.drain())
        self.counters.retractions += len(self.scheduler.retract_all(keep_kv=False))
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
        )

    def flush_cache(self) -> None:
        """Drop the prefix cache (only possible with no request running)."""
        if self.scheduler.running:
            raise RuntimeError("flush_cache: requests are running")
        self.kv.flush()


def _progress_line(done: int, total: int, tokens: int, seconds: float) -> None:
    rate = tokens / seconds if seconds else 0.0
    print(f"\r  {done}/{total} samples done, {tokens} tokens generated, {rate:.1f} tok/s", end="", flush=True)
