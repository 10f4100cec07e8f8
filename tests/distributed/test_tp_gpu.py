"""Tensor parallelism on two GPUs (NCCL): the all-reduces and the logits gather captured in
the decode CUDA graphs, overlap scheduling on, and a weight update fanned out over NCCL.
Skipped without two GPUs (scripts/gpu_check.sh STAGES=tp runs it on nvidia-h200-x2)."""

from __future__ import annotations

import pytest
import torch

from conftest import TinyModel, make_prompts
from rollout import Engine, EngineConfig, SamplingParams
from rollout.distributed.tp_engine import TPEngine

pytestmark = [
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="tensor parallelism over NCCL needs 2 GPUs"),
    pytest.mark.whole_gpu,  # its engines size their KV caches from the free memory of both devices
]

GREEDY = SamplingParams(temperature=0, max_new_tokens=12, logprobs_mode="raw", ignore_eos=True)
SAMPLED = SamplingParams(temperature=1.0, top_k=20, max_new_tokens=12, n=3, seed=9, ignore_eos=True)


def test_tp2_on_two_gpus_equals_tp1_with_graphs_and_sync(llama: TinyModel) -> None:
    prompts = make_prompts(llama.vocab_size, [5, 11, 3, 8, 17], seed=3)
    one = Engine(EngineConfig(model=llama.path, device="cuda:0", page_size=4))
    want = one.generate(input_ids=prompts, sampling_params=GREEDY) + one.generate(input_ids=prompts, sampling_params=SAMPLED)
    del one
    with TPEngine(EngineConfig(model=llama.path, device="cuda:0", page_size=4, tensor_parallel_size=2)) as engine:
        graphs = engine.engine.runner.graphs
        assert graphs is not None and engine.engine.config.overlap  # the GPU defaults: graphs and overlap on
        got = engine.generate(input_ids=prompts, sampling_params=GREEDY) + \
            engine.generate(input_ids=prompts, sampling_params=SAMPLED)
        assert graphs.num_replays > 0  # decode steps replayed graphs holding the NCCL collectives
        for g, w in zip(got, want):
            assert g.token_ids == w.token_ids
            torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=1e-4, rtol=0)
        # the engine's weights back in, from CPU tensors: rank 0 fans them out over NCCL
        with torch.no_grad():
            doubled = [(n, p * 1.5 if "mlp" in n else p) for n, p in llama.hf.named_parameters()]
        assert engine.update_weights(doubled, full=True) == 1
        assert engine.update_weights(llama.hf.named_parameters(), full=True) == 2
        again = engine.generate(input_ids=prompts, sampling_params=GREEDY)
        assert [o.token_ids for o in again] == [o.token_ids for o in want[: len(prompts)]]
