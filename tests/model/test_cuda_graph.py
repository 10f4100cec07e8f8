"""Decode CUDA graphs. On CPU: the replay logic (static buffers, padding up the ladder,
split count fixed at capture) runs with each "graph" replayed eagerly, Triton under
TRITON_INTERPRET=1. On CUDA: real graphs give the same tokens as eager execution."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="triton is not installed")

from conftest import TinyModel, make_prompts  # noqa: E402
from rollout import Engine, EngineConfig, SamplingParams  # noqa: E402
from rollout.model.cuda_graph import DecodeGraphs, batch_size_ladder  # noqa: E402

GREEDY = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)


class _EagerGraph:
    """Stands in for torch.cuda.CUDAGraph: replay() re-runs the captured function into
    the same output buffer, reading the same static inputs."""

    def __init__(self, fn, out: torch.Tensor) -> None:
        self.fn, self.out = fn, out

    def replay(self) -> None:
        self.out.copy_(self.fn())


class EagerDecodeGraphs(DecodeGraphs):
    @torch.inference_mode()
    def capture(self) -> None:
        for bs in reversed(self.sizes):
            fb = self._static_batch(bs)

            def fn(fb=fb, bs=bs):
                self.backend.plan_capture(fb, self.max_context)  # a real graph keeps this plan baked in
                return self.model.logits(self.model(fb.input_ids, fb.positions, self.backend))

            self.logits[bs] = fn().clone()
            self.graphs[bs] = _EagerGraph(fn, self.logits[bs])


def test_ladder() -> None:
    assert batch_size_ladder(4) == [1, 2, 4]
    assert batch_size_ladder(20) == [1, 2, 4, 8, 16, 20]
    assert batch_size_ladder(256)[-3:] == [224, 240, 256]


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU twin; on CUDA test_real_graphs_give_eager_tokens covers it")
@pytest.mark.parametrize("page_size", [1, 16])
def test_graph_replay_logic_matches_transformers(llama: TinyModel, page_size: int) -> None:
    # 4 requests finishing one after another: decode batches of 4, 3 (padded to 4), 2, 1
    prompts = make_prompts(llama.vocab_size, [3, 11, 6, 9], seed=30)
    lengths = [9, 3, 6, 12]
    engine = Engine(EngineConfig(model=llama.path, attention="triton", page_size=page_size))
    engine.runner.graphs = EagerDecodeGraphs(engine.model, engine.runner.backend, max_bs=4, max_context=64,
                                             device=engine.device)
    engine.runner.graphs.capture()
    params = [SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True) for n in lengths]
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    assert [o.token_ids for o in outs] == [llama.greedy(p, n) for p, n in zip(prompts, lengths)]
    assert engine.runner.graphs.num_replays == max(lengths) - 1  # every step after the prefill


@pytest.mark.skipif(not torch.cuda.is_available(), reason="real CUDA graphs need a GPU")
def test_real_graphs_give_eager_tokens(llama: TinyModel) -> None:
    prompts = make_prompts(llama.vocab_size, [3, 11, 6, 20, 1], seed=31)
    params = SamplingParams(temperature=1.0, max_new_tokens=12, seed=3, ignore_eos=True)
    # small KV pools: two engines in one process must not take the whole GPU between them
    eager = Engine(EngineConfig(model=llama.path, device="cuda", cuda_graph=False, max_total_tokens=4096))
    graphed = Engine(EngineConfig(model=llama.path, device="cuda", cuda_graph_max_bs=8, max_total_tokens=4096))
    assert graphed.runner.graphs is not None and eager.runner.graphs is None
    a = eager.generate(input_ids=prompts, sampling_params=params)
    b = graphed.generate(input_ids=prompts, sampling_params=params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert graphed.runner.graphs.num_replays > 0
    assert [o.token_ids for o in graphed.generate(input_ids=prompts, sampling_params=GREEDY)] == \
        [llama.greedy(p, 6) for p in prompts]
