"""EngineConfig: the one frozen, validated description of an engine.

It knows what the user asked for and the values derived from that; it does not know the
model's shapes (those live in ModelConfig, read from the checkpoint's config.json).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from os import PathLike

from rollout.kernels.options import KernelOptions
from rollout.validate import check_bool, check_float, check_int, check_str

_DTYPES = ("float32", "bfloat16", "float16")
_ATTENTION = ("auto", "torch", "triton", "flashinfer")
_POLICIES = ("fcfs", "lpm")
_SPECULATIVE = (None, "ngram", "suffix", "draft")
_LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class EngineConfig:
    model: str
    dtype: str = "float32"
    device: str = "cpu"
    # KV memory: a token budget. None -> on CPU 32768 tokens, on GPU what fits in
    # `gpu_memory_fraction` of the memory left after the weights.
    max_total_tokens: int | None = None
    gpu_memory_fraction: float = 0.85
    page_size: int = 1
    max_running_requests: int = 256
    # Per-step token budget for prefill: longer prompts are prefilled in chunks of it.
    max_prefill_tokens: int = 4096
    enable_radix_cache: bool = True
    schedule_policy: str = "fcfs"
    attention: str = "auto"
    # CUDA graphs for decode-only steps, batch sizes 1..min(max_running_requests,
    # cuda_graph_max_bs) (padded up a ladder). 512 covers a GRPO batch of 64 prompts x 8
    # samples, whose steps would otherwise run eager: measured faster and steadier on GPU as
    # graph replays (BENCHMARKS.md, "H200, 2026-12-01: nothing compiles inside a timing, graphs
    # to 512 rows").
    cuda_graph: bool = True
    cuda_graph_max_bs: int = 512
    # Decode rows whose KV starts with the same tree-owned prompt prefix (GRPO's n samples)
    # attend that prefix once per group (rollout/attention/shared_prefix.py), where the
    # backend can (Triton decode; `auto` on CUDA). On, decode graphs get a variant with it per
    # size. Measured faster on GPU for GRPO's n samples of a prompt (BENCHMARKS.md, "GRPO's
    # decode step: shared-prefix attention and the sampler's race"). In steps of at least 49 rows a
    # verify's rows (a chain's positions, a draft tree's nodes) read their request's context
    # once per group too (shared_prefix.SPAN_MIN_ROWS).
    # False: each row reads its KV whole.
    shared_prefix_attention: bool = True
    # Schedule and launch step t+1 before reading step t's tokens back (the host work of one
    # step hides behind the device work of the next). None: on for CUDA (measured faster on GPU,
    # most at batch 1, where the host's work is a large share of a step: BENCHMARKS.md, "Run 3
    # (H200, 2026-11-29): ..."), off on CPU, where the "device" is the host.
    overlap_schedule: bool | None = None
    # "auto": weights from the checkpoint's safetensors; "dummy": random weights of the
    # shapes in config.json, made on the device (benchmarks of large shapes, no download).
    load_format: str = "auto"
    # Load a tokenizer from the checkpoint dir when present (needed for prompts=, text, stop strings).
    load_tokenizer: bool = True
    seed: int = 0
    # torch intra-op threads (process-wide). None: left alone on CPU; 1 on CUDA, where the host
    # only runs small tensor ops and idle OpenMP workers compete with the scheduler for cores.
    num_threads: int | None = None
    # Multi-LoRA (lora/): adapters loaded at runtime and mixed in one batch. Off by default:
    # the device slots cost memory (8 slots of rank 64 on all seven modules of an 8B model:
    # ~2.7 GB in bf16), sized by these limits.
    enable_lora: bool = False
    max_loras_per_batch: int = 8  # device slots = most distinct adapters in one step
    max_lora_rank: int = 64
    max_loaded_loras: int | None = None  # adapters held in host memory; None: no limit
    # Speculative decoding (speculative/): "ngram" (lookup in the request's own tokens),
    # "suffix" (the request and earlier rollouts of the same prompt) or "draft" (a small model,
    # `draft_model`, sharing the target's tokenizer), num_speculative_tokens drafts per step at
    # most (adapted per request, down to none, to its acceptance). Verification is exact: a
    # request emits what plain decoding would have drawn.
    speculative: str | None = None
    num_speculative_tokens: int = 4
    draft_model: str | None = None  # HF checkpoint dir of the draft model (speculative="draft")
    # the trainer syncs the draft model too (update_weights(..., target="draft") or "draft."
    # names): drafting pauses after a target update until the draft's arrives, never drafting
    # from a stale policy; False: the draft is a fixed model that keeps drafting
    speculative_draft_sync: bool = True
    # suffix drafter: tokens of earlier rollouts kept (LRU over prompts), and whether they
    # survive a weight update (rollouts of the previous policy still draft well in RL)
    speculative_history_tokens: int = 4_000_000
    speculative_keep_history_on_update: bool = True
    # suffix drafter: where a prompt's own samples never continued the context, draft from the
    # earlier rollouts of other prompts under the same adapter namespace (speculative/suffix.py)
    speculative_cross_prompt: bool = True
    # "ngram" / "suffix": verify a draft tree of up to this many nodes a request (several
    # continuations where earlier rollouts branch, speculative/tree.py) instead of a chain, in
    # steps whose rows the attention can take as per-row KV slot lists (the torch and Triton
    # backends; with FlashInfer, the decode graphs of up to rollout.attention.SMALL_DECODE_ROWS
    # rows); 0: chains
    speculative_tree_nodes: int = 0
    # measure steps with drafting on and off and keep it off while plain decoding is faster
    # (speculative/governor.py); False: always draft (benchmarks of raw speculation)
    speculative_governor: bool = True
    # Batch-invariant, repeatable results (rollout/kernels/batch_invariant.py, attention/
    # deterministic_backend.py): a request's tokens and log-probs, bit for bit, do not depend on
    # what else is batched, prefill chunking, prefix-cache hits or retraction, and equal the
    # trainer-side recompute of rollout/rl/onpolicy.py. Costs speed (BENCHMARKS.md, "Deterministic
    # mode"); off by default.
    deterministic: bool = False
    # which of q/k/v/o/gate/up/down_proj adapters may target (slots are allocated for these)
    lora_target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    # Tensor parallelism (rollout/model/parallel.py): the model's heads, MLP columns and vocab
    # split over this many ranks (one GPU each), all running the same scheduler (SPMD). Under
    # torchrun every rank builds the Engine; from one process, TPEngine spawns the workers.
    tensor_parallel_size: int = 1
    # Internal: which kernels the engine launches (rollout/kernels/options.py), for benchmarks
    # that compare two choices in one process and tests that run the GPU kernels on CPU. None:
    # the engine's defaults, KernelOptions() (made here, once: its environment defaults).
    kernel_options: KernelOptions | None = None

    def __post_init__(self) -> None:
        f = "EngineConfig."
        if not isinstance(self.model, (str, PathLike)) or not str(self.model):
            raise ValueError(f"{f}model={self.model!r}: a checkpoint directory is required")
        object.__setattr__(self, "model", str(self.model))
        check_str(self.device, f + "device")
        for name in ("page_size", "max_running_requests", "max_prefill_tokens", "cuda_graph_max_bs", "seed"):
            check_int(getattr(self, name), f + name)
        for name in ("max_total_tokens", "num_threads"):
            if getattr(self, name) is not None:
                check_int(getattr(self, name), f + name, min=1)
        for name in ("enable_radix_cache", "cuda_graph", "load_tokenizer", "shared_prefix_attention"):
            check_bool(getattr(self, name), f + name)
        if self.overlap_schedule is not None:
            check_bool(self.overlap_schedule, f + "overlap_schedule")
        check_float(self.gpu_memory_fraction, f + "gpu_memory_fraction")
        if self.dtype not in _DTYPES:
            raise ValueError(f"{f}dtype={self.dtype!r}: expected one of {_DTYPES}")
        if not (self.device == "cpu" or re.fullmatch(r"cuda(:\d+)?", self.device)):
            raise ValueError(f"{f}device={self.device!r}: expected 'cpu' or 'cuda[:N]'")
        if not 0.0 < self.gpu_memory_fraction <= 1.0:
            raise ValueError(f"{f}gpu_memory_fraction={self.gpu_memory_fraction}: must be in (0, 1]")
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ValueError(f"{f}page_size={self.page_size}: must be a power of two >= 1")
        if self.max_running_requests < 1:
            raise ValueError(f"{f}max_running_requests={self.max_running_requests}: must be >= 1")
        if self.max_prefill_tokens < self.page_size:
            raise ValueError(f"{f}max_prefill_tokens={self.max_prefill_tokens}: must be >= page_size")
        if self.cuda_graph_max_bs < 1:
            raise ValueError(f"{f}cuda_graph_max_bs={self.cuda_graph_max_bs}: must be >= 1")
        if self.schedule_policy not in _POLICIES:
            raise ValueError(f"{f}schedule_policy={self.schedule_policy!r}: expected one of {_POLICIES}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"{f}load_format={self.load_format!r}: expected 'auto' or 'dummy'")
        check_bool(self.enable_lora, f + "enable_lora")
        check_int(self.max_loras_per_batch, f + "max_loras_per_batch", min=1)
        check_int(self.max_lora_rank, f + "max_lora_rank", min=1)
        if self.max_loaded_loras is not None:
            check_int(self.max_loaded_loras, f + "max_loaded_loras", min=1)
        modules = (self.lora_target_modules,) if isinstance(self.lora_target_modules, str) else self.lora_target_modules
        object.__setattr__(self, "lora_target_modules", tuple(modules))
        unknown = sorted(set(self.lora_target_modules) - set(_LORA_MODULES))
        if unknown or not self.lora_target_modules:
            raise ValueError(f"{f}lora_target_modules={self.lora_target_modules!r}: expected a non-empty subset of {_LORA_MODULES}")
        if self.speculative not in _SPECULATIVE:
            raise ValueError(f"{f}speculative={self.speculative!r}: expected one of {_SPECULATIVE}")
        check_int(self.num_speculative_tokens, f + "num_speculative_tokens", min=1, max=64)
        check_bool(self.speculative_draft_sync, f + "speculative_draft_sync")
        if self.draft_model is not None:
            if not isinstance(self.draft_model, (str, PathLike)) or not str(self.draft_model):
                raise ValueError(f"{f}draft_model={self.draft_model!r}: expected a checkpoint directory")
            object.__setattr__(self, "draft_model", str(self.draft_model))
        if (self.speculative == "draft") != (self.draft_model is not None):
            raise ValueError(f"{f}draft_model={self.draft_model!r} with speculative={self.speculative!r}: a draft "
                             "model is given exactly when speculative='draft'")
        check_int(self.speculative_history_tokens, f + "speculative_history_tokens", min=0)
        check_bool(self.speculative_keep_history_on_update, f + "speculative_keep_history_on_update")
        check_bool(self.speculative_cross_prompt, f + "speculative_cross_prompt")
        check_bool(self.speculative_governor, f + "speculative_governor")
        check_int(self.speculative_tree_nodes, f + "speculative_tree_nodes", min=0, max=64)
        if self.speculative_tree_nodes and self.speculative not in ("ngram", "suffix"):
            raise ValueError(f"{f}speculative_tree_nodes={self.speculative_tree_nodes} with speculative="
                             f"{self.speculative!r}: draft trees are grown by the 'ngram' and 'suffix' drafters")
        check_bool(self.deterministic, f + "deterministic")
        if self.deterministic and self.attention != "auto":
            raise ValueError(f"{f}attention={self.attention!r} with deterministic=True: deterministic mode uses its "
                             "own batch-invariant attention; leave attention='auto'")
        if self.deterministic and self.enable_lora:
            raise ValueError(f"{f}enable_lora=True with deterministic=True: the LoRA kernels are not batch-invariant "
                             "yet (an adapter's delta is computed per segment of rows)")
        if self.attention not in _ATTENTION:
            raise ValueError(f"{f}attention={self.attention!r}: expected one of {_ATTENTION}")
        check_int(self.tensor_parallel_size, f + "tensor_parallel_size", min=1)
        if self.tensor_parallel_size > 1:
            # Refused rather than run wrong: the speculation governor decides from step
            # times, which differ across ranks, and SPMD needs every rank to decide the same
            # (drafters themselves are deterministic; a draft model is replicated per rank).
            if self.speculative is not None and self.speculative_governor:
                raise ValueError(f"{f}speculative_governor=True with tensor_parallel_size={self.tensor_parallel_size}: "
                                 "the governor times steps, which differ across TP ranks; set speculative_governor=False")
            # Row-parallel outputs are summed across ranks: a + b is exact in either order,
            # but a sum of three or more follows the collective's chunking, i.e. the batch.
            if self.deterministic and self.tensor_parallel_size > 2:
                raise ValueError(f"{f}tensor_parallel_size={self.tensor_parallel_size} with deterministic=True: the "
                                 "all-reduce of more than two ranks is not batch-invariant; use at most 2")
        options = self.kernel_options
        if isinstance(options, dict):  # its JSON form (TPEngine's workers get the config as JSON)
            options = KernelOptions.from_dict(options)
        if options is None:
            options = KernelOptions()
        if not isinstance(options, KernelOptions):
            raise ValueError(f"{f}kernel_options={options!r}: expected a rollout.kernels.options.KernelOptions or None")
        object.__setattr__(self, "kernel_options", options)

    @property
    def overlap(self) -> bool:
        """Whether overlap scheduling is on (resolving the None default by device). Off with
        speculative decoding: the next step's drafts continue the tokens this step emits,
        so the host must have read them before it schedules."""
        if self.speculative is not None:
            return False
        return self.overlap_plain

    @property
    def overlap_plain(self) -> bool:
        """Overlap scheduling for steps that draft nothing because the speculation governor
        turned drafting off (and for every step without speculation): plain decoding as fast
        as it runs without speculation, which is what "never slower than off" is against
        (a batch-1 step is measurably faster with overlap: BENCHMARKS.md, speculative decoding,
        "H200, 2026-12-02: the verify cost re-measured ...")."""
        return self.device.startswith("cuda") if self.overlap_schedule is None else self.overlap_schedule

    @property
    def torch_dtype(self):
        import torch

        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[self.dtype]
