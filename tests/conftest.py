"""Shared fixtures: tiny random HF checkpoints (Llama, Llama-3 rope scaling, Qwen2, Qwen3)
written with transformers' save_pretrained, and the HF reference for greedy decoding. On
CUDA, tests marked whole_gpu run with no other test at once (gpu_lock.py)."""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

import pytest
import torch
from gpu_lock import GpuLock

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# One intra-op thread per core: xdist's workers (and the engine, TP and launcher processes they
# start, through OMP_NUM_THREADS) split the cores between them. More threads than cores makes
# OpenMP's barriers spin on threads that are not running: two SmolLM2 decodes side by side on
# this 2-core VM took 8 to 18 times the CPU time at 2 threads each as at 1 (2026-12-07).
_THREADS = max(1, min(2, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))
torch.set_num_threads(_THREADS)
os.environ.setdefault("OMP_NUM_THREADS", str(_THREADS))
# Without CUDA, Triton kernels run under the interpreter; it must be on before triton's first
# import, which any test module (or peft / transformers) may trigger during collection.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The interpreter lists each triton.language module's builtins once, not on every helper call.
from interpreter_builtins import list_builtins_once  # noqa: E402

list_builtins_once()

# Tests marked whole_gpu run with no other test at once, whatever -n (gpu_lock.py); on a
# machine without CUDA nothing is locked.
_GPU_LOCK = GpuLock.for_visible_devices() if torch.cuda.is_available() else None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if _GPU_LOCK is None:
        return (yield)
    whole = item.get_closest_marker("whole_gpu") is not None
    with _GPU_LOCK.hold(exclusive=whole):
        if whole:  # what earlier tests of this process left in reference cycles is freed now, not mid-test
            _release_cuda_memory()
        try:
            return (yield)
        finally:
            if whole:  # what it cached goes back to the device, for the tests after it
                _release_cuda_memory()


def _release_cuda_memory() -> None:
    gc.collect()
    torch.cuda.empty_cache()


_COMMON = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)


def _make(kind: str):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(**_COMMON, tie_word_embeddings=False))
    if kind == "llama3":  # Llama-3 rope scaling, tied embeddings, MHA
        cfg = dict(_COMMON, num_key_value_heads=4)
        rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32, "rope_theta": 500000.0}
        return LlamaForCausalLM(LlamaConfig(**cfg, rope_parameters=rope, tie_word_embeddings=True))
    if kind == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**_COMMON, tie_word_embeddings=True))
    if kind == "qwen3":  # explicit head_dim different from hidden / heads, q/k norm
        return Qwen3ForCausalLM(Qwen3Config(**_COMMON, head_dim=32, tie_word_embeddings=False))
    raise ValueError(kind)


class TinyModel:
    def __init__(self, kind: str, path: Path) -> None:
        torch.manual_seed(1234)
        self.hf = _make(kind).eval()
        # Random init is nearly flat; sharpen it so greedy argmaxes are not near-ties.
        with torch.no_grad():
            for name, p in self.hf.named_parameters():
                if "norm" not in name:
                    p.mul_(4.0)
        self.hf.config.architectures = [type(self.hf).__name__]
        self.hf.save_pretrained(path)
        self.path = str(path)
        self.kind = kind
        self.vocab_size = self.hf.config.vocab_size

    @torch.no_grad()
    def greedy(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        out = self.hf.generate(
            torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
            eos_token_id=None, pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        )
        return out[0, len(prompt):].tolist()

    @torch.no_grad()
    def logprobs(self, prompt: list[int], completion: list[int]) -> torch.Tensor:
        """log_softmax of HF's logits at each completion token (what a trainer recomputes)."""
        ids = torch.tensor([prompt + completion])
        logits = self.hf(ids).logits[0, len(prompt) - 1 : -1].float()
        return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


@pytest.fixture(scope="session", params=["llama", "llama3", "qwen2", "qwen3"])
def tiny_model(request, tmp_path_factory) -> TinyModel:
    return TinyModel(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="session")
def llama(tmp_path_factory) -> TinyModel:
    return TinyModel("llama", tmp_path_factory.mktemp("llama_single"))


def make_prompts(vocab_size: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in lengths]


def grow_slots(alloc, slots: torch.Tensor, n: int) -> torch.Tensor:
    """A request's slots grown by n positions as KVManager does: the rest of its partial last
    page first (already its own), then whole new pages from the allocator."""
    start, ps = slots.numel(), alloc.page_size
    take = min((ps - start % ps) % ps, n)
    fill = torch.arange(int(slots[-1]) + 1, int(slots[-1]) + 1 + take, dtype=torch.int64) if take else slots[:0]
    return torch.cat([slots, fill, alloc.slots_for_positions(start + take, start + n)])


@pytest.fixture(scope="session")
def smollm2():
    """The real default model, SmolLM2-135M-Instruct (fetched once): (its dir, the HF tokenizer,
    the HF model in float32, the reference)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rollout.model.fetch import fetch_default_model

    path = fetch_default_model()
    tok = AutoTokenizer.from_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return str(path), tok, hf


# The KV budget of SmolLM2 engines in tests (EngineConfig.max_total_tokens): their batches take
# under 1500 tokens, and the CPU default (32768) zeroes 1.5 GB per engine, a third of building one.
SMOLLM2_KV_TOKENS = 2048
