"""Engine: generate(), the add_request / step loop, stats() and update_weights().

The engine turns prompts into Reqs, steps the scheduler -> runner -> sampler loop and
emits RolloutOutputs. It validates everything a caller hands it before accepting it, so a
bad request raises and leaves the requests already accepted untouched.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from rollout.attention import make_backend
from rollout.cache.kv_pool import KVPool, ReqToTokenPool
from rollout.cache.manager import KVManager
from rollout.config import EngineConfig
from rollout.metrics import Counters, EngineStats
from rollout.model.build import build_model, init_random_weights
from rollout.model.config import ModelConfig
from rollout.model.loader import apply_writes, iter_checkpoint, load_weights, plan_writes
from rollout.model.runner import ModelRunner
from rollout.request import Req, RolloutOutput, SamplingParams, derive_seed
from rollout.sampling import SamplingBatch, sample
from rollout.scheduler import ScheduledBatch, Scheduler
from rollout.weight_updates import WeightUpdatesMixin

@dataclass
class _Launched:
    """A step whose sampled tokens are still on the device (or just copied back)."""

    reqs: list[Req]
    packed: torch.Tensor | None  # [len(reqs), 3 + 4k] float64: token, raw lp, processed lp, top-k
    event: torch.cuda.Event | None  # set when the copy to pinned host memory is done
    top_k: int
    version: int  # weight version that produced these tokens


_CPU_DEFAULT_TOKENS = 32768
log = logging.getLogger("rollout")
_PAUSE_MODES = ("wait", "abort", "retract")


class Engine(WeightUpdatesMixin):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = torch.device(config.device)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        elif self.device.type == "cuda" and torch.get_num_threads() > 1:
            # The host side of a GPU step is small tensor ops and Python; a pool of OpenMP
            # workers only competes with the scheduler for cores (vLLM's workers do the same).
            log.info("torch intra-op threads %d -> 1 (EngineConfig.num_threads overrides)", torch.get_num_threads())
            torch.set_num_threads(1)
        self.model_config = ModelConfig.from_dir(config.model)
        cfg = self.model_config
        self.context_len = cfg.max_position_embeddings
        self.model = build_model(cfg, self.context_len, config.torch_dtype, self.device)
        if config.load_format == "dummy":
            init_random_weights(self.model, config.seed)
        else:
            load_weights(self.model, iter_checkpoint(config.model), full=True)
        self.tokenizer = _load_tokenizer(config.model) if config.load_tokenizer else None
        self.eos_token_ids = set(cfg.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(int(self.tokenizer.eos_token_id))

        max_tokens = config.max_total_tokens or self._default_kv_tokens()
        self.kv_pool = KVPool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, max_tokens, config.page_size, config.torch_dtype, self.device)
        table_width = min(self.context_len, self.kv_pool.allocator.capacity_slots) + config.page_size
        self.req_pool = ReqToTokenPool(config.max_running_requests + 1, table_width)
        self.kv = KVManager(self.kv_pool, self.req_pool, config.enable_radix_cache)
        self.scheduler = Scheduler(config, self.kv)
        backend = make_backend(config.attention, self.kv_pool, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, config.device)
        self.runner = ModelRunner(self.model, backend, self.req_pool.table, self.device)
        log.info("KV cache: %d tokens fit (%d pages of %d, %.1f GiB) on %s", self.kv.capacity,
                 self.kv_pool.allocator.num_pages - 1, config.page_size,
                 2 * sum(b.numel() * b.element_size() for b in self.kv_pool.k_buffers) / 2**30, self.device)
        if self.device.type == "cuda" and config.cuda_graph and getattr(backend, "graphable", False):
            max_bs = min(config.max_running_requests, config.cuda_graph_max_bs)
            start = time.perf_counter()
            self.runner.capture_decode_graphs(max_bs, min(self.context_len, self.kv.capacity))
            log.info("captured decode CUDA graphs for batch sizes up to %d in %.1f s", max_bs, time.perf_counter() - start)
        if self.device.type == "cuda":
            # The KV pool is sized first (graphs bake its addresses in); the 1 - fraction left
            # holds graphs, attention workspace and activations: say what remains of it.
            free, _ = torch.cuda.mem_get_info(self.device)
            free += torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
            log.info("GPU memory after KV, graphs and workspace: %.1f GiB free for activations", free / 2**30)

        self.weight_version = 0
        self.counters = Counters()
        self._ids = itertools.count()
        self._pending: list[RolloutOutput] = []  # finished outputs not yet handed out
        self._inflight: _Launched | None = None  # overlap scheduling: the step not yet read back
        self._seed_rng = torch.Generator().manual_seed(config.seed)

    # ---- set-up helpers ---------------------------------------------------------------
    def _default_kv_tokens(self) -> int:
        cfg = self.model_config
        per_token = KVPool.bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, self.config.torch_dtype)
        if self.device.type == "cuda":
            # Count blocks torch's caching allocator holds but does not use (an earlier
            # engine's KV, say) as free: the driver reports them as taken.
            free, _ = torch.cuda.mem_get_info(self.device)
            free += torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
            return max(1024, int(free * self.config.gpu_memory_fraction) // per_token)
        return _CPU_DEFAULT_TOKENS

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
    ) -> list[str]:
        """Queue one prompt (its n samples). Returns the samples' request ids."""
        reqs = self._make_reqs(input_ids, prompt, sampling_params or SamplingParams(), request_id, prompt_index, namespace)
        for req in reqs:
            self.scheduler.add(req)
        return [r.rid for r in reqs]

    def _make_reqs(
        self,
        input_ids: Sequence[int] | None,
        prompt: str | None,
        params: SamplingParams,
        request_id: str | None,
        prompt_index: int,
        namespace: str | None,
    ) -> list[Req]:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        if input_ids is None:
            if prompt is None:
                raise ValueError("a request needs input_ids or a prompt")
            if self.tokenizer is None:
                raise ValueError("prompt text given but the engine has no tokenizer; pass input_ids")
            input_ids = self.tokenizer.encode(prompt)
        ids = [int(t) for t in input_ids]
        if not ids:
            raise ValueError(f"prompt {prompt_index}: empty prompt (no tokens)")
        vocab = self.model_config.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt {prompt_index}: token id {bad} is outside the vocabulary [0, {vocab})")
        total = len(ids) + params.max_new_tokens
        if total > self.context_len:
            raise ValueError(
                f"prompt {prompt_index}: {len(ids)} prompt tokens + max_new_tokens {params.max_new_tokens} = {total} "
                f"exceeds the model's context length {self.context_len}"
            )
        capacity = self.kv.capacity - self.config.page_size
        if total > capacity:
            raise ValueError(
                f"prompt {prompt_index}: {len(ids)} prompt tokens + max_new_tokens {params.max_new_tokens} = {total} "
                f"exceeds the whole KV budget of {capacity} tokens (max_total_tokens)"
            )
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this engine has none (use stop_token_ids)")
        base = request_id if request_id is not None else f"req-{next(self._ids)}"
        if self.scheduler.find(base) is not None or (params.n > 1 and self.scheduler.find(f"{base}-0")):
            raise ValueError(f"request id {base!r} is already in use")
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,), generator=self._seed_rng))
        reqs = [
            Req(
                rid=base if params.n == 1 else f"{base}-{i}",
                prompt_ids=ids,
                params=params,
                seed=derive_seed(seed, i),
                prompt_index=prompt_index,
                sample_index=i,
                namespace=namespace,
            )
            for i in range(params.n)
        ]
        if len(reqs) > 1 and self.kv.tree is not None:
            leader = reqs[0]
            leader.followers = reqs[1:]
            for follower in leader.followers:
                follower.leader = leader
        return reqs

    def generate(
        self,
        input_ids: Sequence[Sequence[int]] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        prompts: Sequence[str] | None = None,
        namespace: str | None = None,
        progress: bool = False,
    ) -> list[RolloutOutput]:
        """Run prompts to completion. One output per sample, prompt-major then sample."""
        if (input_ids is None) == (prompts is None):
            raise ValueError("generate() takes exactly one of input_ids= or prompts=")
        items: list = list(input_ids if input_ids is not None else prompts)  # type: ignore[arg-type]
        if sampling_params is None:
            params_list = [SamplingParams()] * len(items)
        elif isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(items)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(items):
                raise ValueError(f"sampling_params has {len(params_list)} entries for {len(items)} prompts")
        # Validate every prompt before queueing any: a bad one must not leave half a batch.
        all_reqs: list[Req] = []
        for i, (item, params) in enumerate(zip(items, params_list)):
            ids, text = (item, None) if input_ids is not None else (None, item)
            all_reqs.extend(self._make_reqs(ids, text, params, None, i, namespace))
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
        req.finish_reason = "abort"
        self.scheduler.remove(req)
        self.counters.aborted_requests += 1
        return self._output(req)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self._inflight is not None

    # ---- the step loop ----------------------------------------------------------------
    def step(self) -> list[RolloutOutput]:
        """Run one scheduler -> model -> sampler step; returns the requests that finished.

        With overlap scheduling, a step launches its batch and then reads the previous
        step's tokens back while the device works: outputs arrive one step later."""
        t0 = time.perf_counter()
        finished, self._pending = self._pending, []
        batch = self.scheduler.schedule()
        launched = self._launch(batch) if batch is not None else None
        if self.config.overlap:
            previous, self._inflight = self._inflight, launched
            if previous is not None:
                finished.extend(self._read_back(previous))
        elif launched is not None:
            finished.extend(self._read_back(launched))
        if batch is not None:
            self.counters.steps += 1
        self.counters.forward_seconds += time.perf_counter() - t0
        return finished

    def _launch(self, batch: ScheduledBatch) -> _Launched:
        """Forward and sample one batch; the results stay on the device until read back."""
        self.counters.retractions += len(batch.retracted)
        self._count_admissions(batch)
        fb = self.runner.prepare(batch)
        logits = self.runner.forward(fb)
        samplers = batch.samplers()
        for req, n in zip(batch.reqs, batch.extend_lens):
            req.num_computed_tokens += n
            self.counters.computed_tokens += n
        rows, samplers = self._fork_followers(samplers)
        if len(rows) != logits.shape[0]:
            logits = logits[torch.tensor(rows, device=logits.device)]
        if not samplers:
            return _Launched([], None, None, 0, self.weight_version)
        res = sample(logits, SamplingBatch.from_reqs(samplers, self.model_config.vocab_size, logits.device))
        if self.config.overlap:  # only then does a step read tokens it has not seen
            self.runner.record_tokens([r.req_pool_idx for r in samplers], res.token_ids)
        for req in samplers:
            req.num_inflight += 1
        # Everything the host needs, packed into one float64 tensor (token ids < 2**53 are
        # exact) for one transfer: the step's one host sync happens when it is read back.
        columns = [res.token_ids, res.raw_logprobs, res.processed_logprobs]
        k = 0
        if res.top_raw is not None:
            k = res.top_raw[0].shape[1]
            columns += [*res.top_raw, *res.top_processed]  # type: ignore[misc]
        packed = torch.cat([c.double().reshape(len(samplers), -1) for c in columns], dim=1)
        event = None
        if packed.is_cuda:
            host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            host.copy_(packed, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            packed = host
        return _Launched(samplers, packed, event, k, self.weight_version)

    def _read_back(self, launched: _Launched) -> list[RolloutOutput]:
        """Append a launched step's tokens (waiting for them if need be) and finish requests."""
        if launched.event is not None:
            launched.event.synchronize()
        if not launched.reqs:
            return []
        packed = launched.packed.tolist()
        k = launched.top_k
        finished = []
        for row, req in zip(packed, launched.reqs):
            req.num_inflight -= 1
            if req.finished:
                continue  # finished or aborted while this token was in flight: dropped
            mode = req.params.logprobs_mode
            lp = row[1] if mode == "raw" else row[2]
            top = None
            if req.params.top_logprobs:
                # per row: raw values, raw ids, processed values, processed ids (k each)
                base = 3 if mode == "raw" else 3 + 2 * k
                vals, ids = row[base : base + k], row[base + k : base + 2 * k]
                top = [(int(t), v) for t, v in zip(ids, vals)][: req.params.top_logprobs]
            token = int(row[0])
            req.append_token(token, lp, top, launched.version)
            self.counters.generated_tokens += 1
            if self._check_finish(req, token):
                self.scheduler.remove(req)
                self.counters.finished_requests += 1
                finished.append(self._output(req))
        return finished

    def _drain(self) -> None:
        """Read back the step in flight (before anything that must see every token)."""
        if self._inflight is not None:
            launched, self._inflight = self._inflight, None
            self._pending.extend(self._read_back(launched))

    def _count_admissions(self, batch: ScheduledBatch) -> None:
        for req in batch.reqs:
            if not req.counted:
                req.counted = True
                self.counters.prompt_tokens += len(req.prompt_ids)
                self.counters.cached_prompt_tokens += req.num_cached_tokens

    def _fork_followers(self, samplers: list[Req]) -> tuple[list[int], list[Req]]:
        """Leaders that just finished their prompt hand it (KV and last logits) to their
        waiting followers, which then sample their first token in this same step."""
        rows = list(range(len(samplers)))
        out = list(samplers)
        for i, leader in enumerate(samplers):
            if not leader.followers or leader.output_ids:
                continue
            self.kv.share_prompt(leader)
            for follower in leader.followers:
                follower.leader = None
                if follower.finished or follower not in self.scheduler.waiting:
                    continue
                if self.kv.fork(leader, follower):
                    self.scheduler.start_running(follower)
                    follower.counted = True
                    self.counters.prompt_tokens += len(follower.prompt_ids)
                    self.counters.cached_prompt_tokens += follower.num_cached_tokens
                    rows.append(i)
                    out.append(follower)
            leader.followers = []
        return rows, out

    def _check_finish(self, req: Req, token: int) -> bool:
        p = req.params
        if (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
            req.finish_reason = "stop"
        elif len(req.output_ids) >= p.max_new_tokens or req.known_len >= self.context_len:
            req.finish_reason = "length"
        elif p.stop and self._stop_string_hit(req):
            req.finish_reason = "stop"
        return req.finish_reason is not None

    def _stop_string_hit(self, req: Req) -> bool:
        assert self.tokenizer is not None
        window = max(len(s) for s in req.params.stop) + 8  # tokens are >= 1 char, so this covers any stop string
        tail = self.tokenizer.decode(req.output_ids[-window:], skip_special_tokens=True)
        return any(s in tail for s in req.params.stop)

    def _output(self, req: Req) -> RolloutOutput:
        text = None
        if self.tokenizer is not None:
            text = self.tokenizer.decode(req.output_ids, skip_special_tokens=True)
            cuts = [text.find(s) for s in req.params.stop if s in text]
            if cuts:
                text = text[: min(cuts)]
        return RolloutOutput.from_req(req, text, self.weight_version)

    # ---- weights ----------------------------------------------------------------------
    def update_weights(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        full: bool = False,
        pause_mode: str = "retract",
    ) -> int:
        """Replace weights in place from (HF name, tensor) pairs; returns the new version.

        Everything is validated before anything is written: a bad update raises (naming
        the parameter) and the old weights keep serving. Then in-flight requests are
        paused by `pause_mode` ("wait": run them to completion first; "abort": finish them
        now as aborted; "retract": send them back to waiting, to resume under the new
        weights), the weights are written, the prefix cache is flushed (its KV was made by
        the old weights) and the version goes up.
        """
        if pause_mode not in _PAUSE_MODES:
            raise ValueError(f"pause_mode={pause_mode!r}: expected one of {_PAUSE_MODES}")
        # Take the whole stream before judging it: a transport (a broadcast) must be read
        # to the end to stay in step with the trainer, even when the update is refused.
        writes = plan_writes(self.model, list(named_tensors), full=full)
        self._drain()
        if pause_mode == "wait":
            while self.has_unfinished():
                done = self.step()  # step() hands out (and clears) _pending: rebind after it
                self._pending.extend(done)
        elif pause_mode == "abort":
            for req in list(self.scheduler.running) + list(self.scheduler.waiting):
                out = self.abort(req.rid)
                if out is not None:
                    self._pending.append(out)
        else:
            self.counters.retractions += len(self.scheduler.retract_all())
        apply_writes(writes)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.kv.flush()
        self.weight_version += 1
        return self.weight_version

    # ---- introspection ----------------------------------------------------------------
    def stats(self) -> EngineStats:
        c = self.counters
        used = self.kv.used_slots()
        return EngineStats(
            tokens_per_second=c.generated_tokens / c.forward_seconds if c.forward_seconds else 0.0,
            prefix_cache_hit_rate=c.cached_prompt_tokens / c.prompt_tokens if c.prompt_tokens else 0.0,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_used_tokens=used,
            kv_capacity_tokens=self.kv.capacity,
            kv_usage=used / self.kv.capacity,
            weight_version=self.weight_version,
            counters=dict(vars(c)),
        )

    def flush_cache(self) -> None:
        """Drop the prefix cache (only possible with no request running)."""
        if self.scheduler.running:
            raise RuntimeError("flush_cache: requests are running")
        self.kv.flush()


def _load_tokenizer(path: str):
    if not any((Path(path) / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _progress_line(done: int, total: int, tokens: int, seconds: float) -> None:
    rate = tokens / seconds if seconds else 0.0
    print(f"\r  {done}/{total} samples done, {tokens} tokens generated, {rate:.1f} tok/s", end="", flush=True)
