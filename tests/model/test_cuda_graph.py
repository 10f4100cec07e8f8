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
from graph_twin import EagerDecodeGraphs  # noqa: E402
from rollout import Engine, EngineConfig, SamplingParams  # noqa: E402
from rollout.model.cuda_graph import batch_size_ladder  # noqa: E402

GREEDY = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)


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


_BF16_D128 = dict(  # head_dim 128 in bf16: the shapes FlashInfer's kernels are built for
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=1024, hidden_size=256, intermediate_size=512,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=128, rms_norm_eps=1e-5,
    rope_theta=10000.0, max_position_embeddings=2048, tie_word_embeddings=False,
)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="real CUDA graphs need a GPU")
@pytest.mark.parametrize("attention", ["triton", "flashinfer", "auto"])  # auto: FlashInfer, Triton's 1-row graphs
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("heads", [4, 8], ids=["gqa2", "gqa4"])  # FlashInfer decodes GQA >= 4 on tensor cores
def test_real_graph_replay_matches_eager_logits(tmp_path, attention: str, page_size: int, heads: int) -> None:
    """Every decode step that replays a graph is recomputed eagerly on the same inputs (the
    K/V store is idempotent): the logits agree within bf16 tolerance, through batch sizes that
    pad up the ladder and contexts that cross pages."""
    import json

    if attention in ("flashinfer", "auto"):
        pytest.importorskip("flashinfer", reason="flashinfer is not installed on this machine")
    (tmp_path / "config.json").write_text(json.dumps(dict(_BF16_D128, num_attention_heads=heads)))
    engine = Engine(EngineConfig(model=str(tmp_path), dtype="bfloat16", device="cuda", load_format="dummy",
                                 attention=attention, page_size=page_size, cuda_graph_max_bs=8, max_total_tokens=8192))
    runner = engine.runner
    assert runner.backend.name == {"auto": "flashinfer+triton"}.get(attention, attention) and runner.graphs is not None
    forward, errs = runner.forward, []

    def both(fb):
        out = forward(fb)
        if runner.graphs is not None and runner.graphs.can_run(fb):
            graphed, graphs = out.clone(), runner.graphs
            runner.graphs = None
            try:
                eager = forward(fb)
            finally:
                runner.graphs = graphs
            errs.append(((graphed - eager).norm() / eager.norm()).item())
        return out

    runner.forward = both
    prompts = make_prompts(1024, [5, 40, 17, 100, 3, 64, 33], seed=32)
    lengths = [30, 8, 20, 12, 40, 3, 25]  # batches shrink 7 -> 1: padded sizes 8, 4, 2, 1
    engine.generate(input_ids=prompts, sampling_params=[SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True)
                                                         for n in lengths])
    assert len(errs) >= max(lengths) - 2 and runner.graphs.num_replays >= len(errs)
    assert max(errs) < 1e-2, f"graph vs eager logits: max relative error {max(errs):.2e}"
