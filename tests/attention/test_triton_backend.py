"""The engine on the Triton attention backend (under TRITON_INTERPRET=1 on CPU) gives
transformers' greedy tokens, with page sizes 1 and 16 and a cached prefix."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="triton is not installed")

from conftest import TinyModel, make_prompts  # noqa: E402
from rollout import Engine, EngineConfig, SamplingParams  # noqa: E402


@pytest.mark.whole_gpu  # on CUDA its engine sizes its KV cache from the device's free memory
@pytest.mark.parametrize("page_size", [1, 16])
def test_triton_backend_matches_transformers(llama: TinyModel, page_size: int) -> None:
    prompts = make_prompts(llama.vocab_size, [3, 17, 9], seed=12)
    prompts.append(prompts[1] + [5, 6, 7])  # hits the cache of prompt 1 (extend over a prefix)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # compiled on a GPU, interpreted on CPU
    engine = Engine(EngineConfig(model=llama.path, attention="triton", page_size=page_size, max_running_requests=3,
                                 device=device, cuda_graph=False))
    assert engine.runner.backend.name == "triton"
    outs = engine.generate(input_ids=prompts, sampling_params=SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True))
    assert [o.token_ids for o in outs] == [llama.greedy(p, 6) for p in prompts]
    assert outs[3].num_cached_tokens > 0
