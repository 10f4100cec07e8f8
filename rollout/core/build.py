"""Construction: EngineConfig -> the model, the KV pools, the scheduler, the attention
backend and the runner (with its decode CUDA graphs), and the features' hooks.

The composition root: the only place that picks features (LoRA, speculative decoding) and
imports their packages; the step loop sees them through the hooks it defines
(core/hooks.py). One function so that construction can be re-run (waking from sleep) and so
that engine.py stays a facade. A draft model is built by the same functions as the target
(load_model, make_kv_pool, attach_backend). The KV pool is sized before graphs and workspace
because graphs bake its addresses in. Everything that launches a kernel gets the
config's one KernelOptions here, so graphs are captured with the options the engine was
built with.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from rollout.attention import make_backend
from rollout.cache.kv_pool import KVPool, ReqSlotTable
from rollout.cache.manager import KVManager
from rollout.config import EngineConfig
from rollout.core.hooks import NO_SPECULATION, Speculation
from rollout.distributed.tp import SINGLE, TensorParallel, tp_from_world
from rollout.kernels import first_non_finite
from rollout.metrics import Counters
from rollout.model.build import build_model, init_random_weights
from rollout.model.config import ModelConfig
from rollout.model.llama import Linear, LlamaModel
from rollout.model.loader import iter_checkpoint, load_weights
from rollout.model.parallel import check_tp_size
from rollout.model.runner import ModelRunner
from rollout.sampling import race
from rollout.scheduler import Scheduler

if TYPE_CHECKING:
    from lora.manager import LoraManager
    from speculative.draft_runner import DraftRunner

log = logging.getLogger("rollout")
_CPU_DEFAULT_TOKENS = 32768  # KV budget on CPU when max_total_tokens is not given


@dataclass
class EngineParts:
    model_config: ModelConfig
    model: LlamaModel
    tokenizer: object | None
    eos_token_ids: set[int]
    context_len: int
    kv_pool: KVPool
    req_table: ReqSlotTable
    kv: KVManager
    scheduler: Scheduler
    runner: ModelRunner
    lora: LoraManager | None  # adapters and their device slots (EngineConfig.enable_lora)
    draft: DraftRunner | None  # speculative="draft": the draft model, its KV pool and graphs
    tp: TensorParallel  # this rank's place in the engine's TP group (SINGLE without TP)
    counters: Counters
    speculation: Speculation  # the step loop's speculation hook (NO_SPECULATION: off)


def check_device(device: str) -> torch.device:
    """The engine's device, refused clearly when this torch cannot use it."""
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
            raise ValueError(f"EngineConfig.device={device!r}: torch {torch.__version__} ({build}) sees no CUDA "
                             "device; use device='cpu' or install a CUDA build of torch on a GPU machine")
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise ValueError(f"EngineConfig.device={device!r}: only {count} CUDA device(s) are visible")
    return dev


def cuda_free_bytes(device: torch.device) -> int:
    """Free device memory, counting blocks torch's caching allocator holds but does not
    use (an earlier engine's KV, say) as free: the driver reports them as taken."""
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def build_parts(config: EngineConfig, device: torch.device, tp: TensorParallel | None = None) -> EngineParts:
    """`tp`: the TP group to use; None builds one from the default group (every rank of
    the world builds its engine at once, TP groups of consecutive ranks)."""
    cfg = ModelConfig.from_dir(config.model)
    check_tp_size(cfg, config.tensor_parallel_size)  # before any group: a refusal costs nothing
    if tp is None:
        tp = tp_from_world(config.tensor_parallel_size, device) if config.tensor_parallel_size > 1 else SINGLE
    if tp.size != config.tensor_parallel_size:
        raise ValueError(f"EngineConfig.tensor_parallel_size={config.tensor_parallel_size} but the given TP group has "
                         f"{tp.size} ranks")
    context_len = cfg.max_position_embeddings
    model = load_model(config, cfg, config.model, device, tp, config.seed)
    if config.deterministic:
        model.make_batch_invariant()
        _warm_batch_invariant(config, model, device)
    tokenizer = load_tokenizer(config.model) if config.load_tokenizer else None
    eos = set(cfg.eos_token_ids)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        eos.add(int(tokenizer.eos_token_id))

    lora = build_lora(config, cfg, model, device) if config.enable_lora else None
    # before KV sizing: its weights and KV share the budget
    draft = build_draft(config, cfg, device) if config.draft_model is not None else None
    extra_per_token = 0
    if draft is not None:
        c = draft.model_config
        extra_per_token = KVPool.bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim, config.torch_dtype)
    max_tokens = config.max_total_tokens or _default_kv_tokens(config, cfg, device, tp, extra_per_token)
    # Every TP rank must hold the same tokens (the same scheduler runs on each): the
    # smallest budget, when free memory differs between the GPUs.
    max_tokens = tp.min_int(max_tokens)
    kv_pool = make_kv_pool(config, cfg, max_tokens, config.page_size, device, tp)  # this rank's KV heads
    table_width = min(context_len, kv_pool.allocator.capacity_slots) + config.page_size
    req_table = ReqSlotTable(config.max_running_requests + 1, table_width)
    kv = KVManager(kv_pool, req_table, config.enable_radix_cache)
    runner = ModelRunner(model, None, req_table.table, device, lora.pool if lora is not None else None,
                         config.kernel_options)
    runner.share_prefixes = config.shared_prefix_attention
    counters = Counters()
    speculation = build_speculation(config, context_len, kv, counters, runner, draft)
    scheduler = Scheduler(config, kv, lora, speculation)
    log.info("KV cache: %d tokens fit (%d pages of %d, %.1f GiB) on %s", kv.capacity,
             kv_pool.allocator.num_pages - 1, config.page_size,
             2 * sum(b.numel() * b.element_size() for b in kv_pool.k_buffers) / 2**30, device)
    if draft is not None:
        # as many tokens as the target's pool: the draft holds the same sequences (unshared)
        draft.pool = make_kv_pool(config, draft.model_config, max_tokens, 1, device)
        log.info("draft model %s: %.2f GiB of weights, KV for %d tokens (%.2f GiB)", draft.path,
                 draft.weight_bytes() / 2**30, max_tokens, max_tokens * extra_per_token / 2**30)
        attach_draft(config, draft)
    attach_backend(config, cfg, runner, kv_pool, min(context_len, kv.capacity))
    if device.type == "cuda":
        # The first weight update would otherwise compile the finiteness kernel (~1 s on a
        # fresh machine): an RL run's step 1 should cost what every later step does.
        first_non_finite([torch.zeros(1, dtype=config.torch_dtype, device=device)])
        # ... and the first sampled (temperature > 0) step the sampler's race kernel, at the
        # vocabulary's width (Triton specializes on it; a [1, 1] warm-up compiled another variant)
        race(torch.zeros(1, cfg.vocab_size, device=device), torch.zeros(1, dtype=torch.int64, device=device),
             torch.zeros(1, dtype=torch.int64, device=device))
    return EngineParts(cfg, model, tokenizer, eos, context_len, kv_pool, req_table, kv, scheduler, runner, lora, draft, tp,
                       counters, speculation)


def load_model(config: EngineConfig, cfg: ModelConfig, path: str, device: torch.device, tp: TensorParallel = SINGLE,
               seed: int = 0) -> LlamaModel:
    """The model of `cfg` on `device` (this rank's shard): `path`'s checkpoint, or random
    weights from `seed` (load_format="dummy"). The target's and a draft model's."""
    model = build_model(cfg, cfg.max_position_embeddings, config.torch_dtype, device, tp, config.kernel_options)
    if config.load_format == "dummy":
        init_random_weights(model, seed)
    else:
        load_weights(model, iter_checkpoint(path), full=True)
    return model


def make_kv_pool(config: EngineConfig, cfg: ModelConfig, max_tokens: int, page_size: int, device: torch.device,
                 tp: TensorParallel = SINGLE) -> KVPool:
    """A KV pool for `cfg`'s layers and this rank's KV heads, of `max_tokens` tokens."""
    return KVPool(cfg.num_layers, cfg.num_kv_heads // tp.size, cfg.head_dim, max_tokens, page_size,
                  config.torch_dtype, device, config.kernel_options)


def _warm_batch_invariant(config: EngineConfig, model: LlamaModel, device: torch.device) -> None:
    """Compile the deterministic matmul for every shape and row count a step may give it now,
    not inside a rollout step (batch_invariant.warm_up says why)."""
    from rollout.kernels import batch_invariant

    shapes = {tuple(m.weight.shape) for m in model.modules() if isinstance(m, Linear)}
    shapes.add(tuple(model.embed_tokens.weight.shape))  # the lm_head's, when tied
    start = time.perf_counter()
    # a step's rows: a prefill chunk plus the decodes batched with it
    calls = batch_invariant.warm_up(shapes, config.max_prefill_tokens + config.max_running_requests,
                                    config.torch_dtype, device, model.options)
    if calls:
        log.info("deterministic matmul: %d kernel variants warmed in %.1f s", calls, time.perf_counter() - start)


def attach_backend(config: EngineConfig, cfg: ModelConfig, runner: ModelRunner | DraftRunner, kv_pool: KVPool,
                   max_context: int, attention: str | None = None, name: str = "model") -> None:
    """A fresh attention backend (its workspace) and decode CUDA graphs for a runner (the
    target's or a draft model's): at start-up, and again on wake (graphs and plans bake the
    KV pool's addresses in). `attention`: the backend (None: the target's, by the config)."""
    if attention is None:
        attention = "deterministic" if config.deterministic else config.attention
    device = runner.device
    runner.graphs = None
    tp = runner.model.tp  # this rank's heads
    runner.backend = make_backend(attention, kv_pool, cfg.num_heads // tp.size, cfg.num_kv_heads // tp.size,
                                  cfg.head_dim, config.device, config.kernel_options)
    start = time.perf_counter()
    if launches := runner.backend.warm_up():
        log.info("%s attention: %d launch shapes warmed in %.1f s", attention, launches, time.perf_counter() - start)
    if device.type == "cuda" and config.cuda_graph and runner.backend.graphable:
        max_bs = min(config.max_running_requests, config.cuda_graph_max_bs)
        if config.speculative is not None:  # a verify step replays a decode graph of requests x (1 + k) rows
            max_bs *= 1 + config.num_speculative_tokens
        start = time.perf_counter()
        runner.capture_decode_graphs(max_bs, max_context)
        log.info("%s: captured decode CUDA graphs for batch sizes up to %d in %.1f s", name, max_bs,
                 time.perf_counter() - start)
    if device.type == "cuda":
        # The 1 - fraction left after KV holds graphs, attention workspace and activations.
        log.info("GPU memory after KV, graphs and workspace: %.1f GiB free for activations",
                 cuda_free_bytes(device) / 2**30)


def build_draft(config: EngineConfig, target: ModelConfig, device: torch.device) -> DraftRunner:
    """The draft model (speculative="draft"), checked against the target's vocabulary and
    tokenizer; its KV pool and backend come once the target's KV is sized."""
    from speculative.draft_runner import DraftRunner

    path = config.draft_model
    assert path is not None
    cfg = ModelConfig.from_dir(path)
    if cfg.vocab_size != target.vocab_size:
        raise ValueError(f"EngineConfig.draft_model={path!r}: vocabulary of {cfg.vocab_size} tokens, the "
                         f"target's has {target.vocab_size}: a draft model must share the target's tokenizer")
    check_same_tokenizer(path, config.model)
    model = load_model(config, cfg, path, device, seed=config.seed + 1)
    return DraftRunner(model, cfg, path, device, config.kernel_options.draft_rows_max)


def attach_draft(config: EngineConfig, draft: DraftRunner) -> None:
    """The draft model's attention backend and decode graphs over its pool (at start-up and
    on wake): rows = requests x (1 + k), so the catch-up after a verify runs as decode rows."""
    assert draft.pool is not None
    attach_backend(config, draft.model_config, draft, draft.pool, min(draft.context_len, draft.capacity), config.attention,
                   "draft model")


def build_speculation(config: EngineConfig, context_len: int, kv: KVManager, counters: Counters, runner: ModelRunner,
                      draft: DraftRunner | None) -> Speculation:
    """The step loop's speculation hook: speculative decoding's Speculator, or the null hook."""
    if config.speculative is None:
        return NO_SPECULATION
    from speculative import make_speculator

    attach = (lambda: attach_draft(config, draft)) if draft is not None else None
    return make_speculator(config, context_len, kv, counters, runner.tree_rows_max, draft, attach)


def build_lora(config: EngineConfig, cfg: ModelConfig, model: LlamaModel, device: torch.device) -> LoraManager:
    """Adapter slots (sized by the config's limits) and a hook on every targeted projection.
    Built before the KV pool, so the KV budget on GPU is what is left after the slots."""
    from lora.manager import LoraManager
    from lora.pool import LoraPool

    pool = LoraPool(cfg, config.max_loras_per_batch, config.max_lora_rank, config.lora_target_modules,
                    config.torch_dtype, device, model.tp, config.kernel_options)
    for layer, name, linear in model.projections():
        linear.lora = pool.hook(layer, name)
    log.info("LoRA: %d slots of rank <= %d on %s (%.2f GiB)", pool.num_slots, pool.max_rank,
             "/".join(config.lora_target_modules), pool.nbytes() / 2**30)
    return LoraManager(pool, cfg, config.torch_dtype, config.max_lora_rank, config.max_loaded_loras)


def _default_kv_tokens(config: EngineConfig, cfg: ModelConfig, device: torch.device, tp: TensorParallel,
                       extra_per_token: int = 0) -> int:
    if device.type != "cuda":
        return _CPU_DEFAULT_TOKENS
    per_token = KVPool.bytes_per_token(cfg.num_layers, cfg.num_kv_heads // tp.size, cfg.head_dim, config.torch_dtype)
    per_token += extra_per_token  # a draft model's KV for the same token
    return max(1024, int(cuda_free_bytes(device) * config.gpu_memory_fraction) // per_token)


def load_tokenizer(path: str):
    if not any((Path(path) / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def check_same_tokenizer(draft_dir: str, target_dir: str) -> None:
    """When both checkpoints carry a tokenizer, their vocabularies must map the same strings
    to the same ids (equal sizes alone do not make a shared tokenizer)."""
    a, b = load_tokenizer(draft_dir), load_tokenizer(target_dir)
    if a is None or b is None:
        return
    va, vb = a.get_vocab(), b.get_vocab()
    if va != vb:
        diff = next((t for t in va if vb.get(t) != va[t]), None)
        raise ValueError(f"EngineConfig.draft_model={draft_dir!r}: its tokenizer differs from the target's "
                         f"(token {diff!r} is {va.get(diff)} there and {vb.get(diff)} in the target)")
