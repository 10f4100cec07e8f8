"""benchmarks.common.steady.split_steps: a run's steps split into decode-graph replays and the
rest, on CPU through the graph twin (each "graph" replayed eagerly, Triton interpreted)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="triton is not installed")

from conftest import TinyModel, make_prompts  # noqa: E402
from graph_twin import EagerDecodeGraphs  # noqa: E402
from rollout import Engine, EngineConfig, SamplingParams  # noqa: E402
from benchmarks.common.steady import split_steps  # noqa: E402


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU twin of the decode graphs")
def test_split_steps_counts_graph_replays_and_the_rest(llama: TinyModel) -> None:
    prompts = make_prompts(llama.vocab_size, [3, 11, 6, 9], seed=32)
    lengths = [5, 2, 3, 4]
    engine = Engine(EngineConfig(model=llama.path, attention="triton"))
    engine.runner.graphs = EagerDecodeGraphs(engine.model, engine.runner.backend, max_bs=4, max_context=64,
                                             device=engine.device)
    engine.runner.graphs.capture()
    for prompt, n in zip(prompts, lengths):
        engine.add_request(prompt, SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True))
    split = split_steps(engine)
    assert not engine.has_unfinished()
    # one prefill step for the four prompts, then a decode step (a replay) per token after the first
    assert len(split.eager) == 1 and len(split.graph) == max(lengths) - 1 == engine.runner.graphs.num_replays
    assert all(s > 0 for s in split.graph + split.eager)
    assert split.summary().startswith(f"graph steps {max(lengths) - 1}: ") and "; eager steps 1: " in split.summary()
