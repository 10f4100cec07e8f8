"""Prefill chunks laid out as decode rows (ModelRunner._prepare_rows), so a small prefill
replays a decode CUDA graph: the same tokens and log-probs as the extend layout and as
transformers, with prefix-cache hits, chunked prefill, retraction, n > 1 and LoRA. On CPU the
layout runs eagerly when forced (extend_rows_kv), and through the graph twin (Triton under
TRITON_INTERPRET=1) the way a GPU replays it; on CUDA real graphs give eager's tokens."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from conftest import TinyModel, make_prompts  # noqa: E402
from rollout import Engine, EngineConfig, SamplingParams  # noqa: E402
from rollout.kernels.options import KernelOptions  # noqa: E402
from rollout.model.runner import EXTEND_ROWS_KV, ModelRunner  # noqa: E402
from rollout.request import Req  # noqa: E402
from rollout.batch import ScheduledBatch  # noqa: E402

NEW = 8


def _spy_rows(engine: Engine) -> list[int]:
    """Counts, per step laid out as rows, the prefill tokens in it."""
    seen: list[int] = []
    inner = engine.runner._prepare_rows

    def spy(batch: ScheduledBatch):
        seen.append(sum(n for r, n in zip(batch.reqs, batch.extend_lens)
                        if not (n == 1 and r.output_ids) and not r.draft_tokens))
        return inner(batch)

    engine.runner._prepare_rows = spy  # type: ignore[method-assign]
    return seen


def _run(model: TinyModel, prompts, params, rows: bool, **kw):
    engine = Engine(EngineConfig(model=model.path, kernel_options=KernelOptions(extend_rows_kv=1 << 30 if rows else 0),
                                 **kw))
    seen = _spy_rows(engine)
    return engine, engine.generate(input_ids=prompts, sampling_params=params), seen


@pytest.mark.parametrize("page_size", [1, 16])
def test_prefill_rows_match_transformers(tiny_model: TinyModel, page_size: int) -> None:
    prompts = make_prompts(tiny_model.vocab_size, [5, 17, 1, 9], seed=60)
    params = SamplingParams(temperature=0, max_new_tokens=NEW, ignore_eos=True, logprobs_mode="raw")
    _, rows, seen = _run(tiny_model, prompts, params, True, page_size=page_size)
    _, extend, none = _run(tiny_model, prompts, params, False, page_size=page_size)
    assert seen and seen[0] == sum(map(len, prompts)) and not none  # the prefill step ran as rows
    for a, b, prompt in zip(rows, extend, prompts):
        assert a.token_ids == b.token_ids == tiny_model.greedy(prompt, NEW)
        torch.testing.assert_close(torch.tensor(a.logprobs), tiny_model.logprobs(prompt, a.token_ids), atol=1e-4, rtol=0)
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


def test_prefix_hits_chunks_retraction_and_forks(llama: TinyModel) -> None:
    """Rows start past a cached prefix, chunks that end short of the prompt sample nothing,
    resumed requests (retracted under a tight pool) re-extend as rows, n = 3 forks; sampled
    at T = 1 with seeds, the rows layout draws the extend layout's tokens."""
    shared = make_prompts(llama.vocab_size, [14], seed=61)[0]
    tails = make_prompts(llama.vocab_size, [3, 9, 6, 1], seed=62)
    prompts = [shared + t for t in tails]
    params = SamplingParams(temperature=1.0, max_new_tokens=12, ignore_eos=True, seed=5, n=3)
    kw = dict(page_size=4, max_prefill_tokens=8, max_total_tokens=96)
    outs = {}
    for rows in (True, False):
        engine, _, seen = _run(llama, prompts[:1], params, rows, **kw)  # the shared prefix into the cache
        outs[rows] = engine.generate(input_ids=prompts, sampling_params=params)
        stats = engine.stats()
        assert stats.counters["retractions"] > 0 and stats.prefix_cache_hit_rate > 0
        assert bool(seen) == rows
    assert [o.token_ids for o in outs[True]] == [o.token_ids for o in outs[False]]
    for a, b in zip(outs[True], outs[False]):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0)
    greedy = SamplingParams(temperature=0, max_new_tokens=NEW, ignore_eos=True)
    engine, outs_g, _ = _run(llama, prompts, greedy, True, **kw)
    assert [o.token_ids for o in outs_g] == [llama.greedy(p, NEW) for p in prompts]


class _Graphs:
    def __init__(self, max_bs: int) -> None:
        self.max_bs = max_bs


def _req(prompt_len: int, computed: int = 0, outputs: int = 0) -> Req:
    req = Req(rid="r", prompt_ids=list(range(prompt_len)), params=SamplingParams(), seed=0)
    req.output_ids = list(range(outputs))
    req.num_computed_tokens = computed
    return req


def test_budget_and_graph_size_decide(llama: TinyModel) -> None:
    engine = Engine(EngineConfig(model=llama.path))
    runner = engine.runner

    def with_budget(budget: int | None) -> ModelRunner:
        """The engine's runner built with this KernelOptions.extend_rows_kv, and a graph of 512."""
        other = ModelRunner(engine.model, runner.backend, runner.table, runner.device,
                            options=KernelOptions(extend_rows_kv=budget))
        other.graphs = _Graphs(max_bs=512)  # type: ignore[assignment]
        return other

    prefill = ScheduledBatch([_req(128)], [128], num_decode=0)  # 128 rows read 8256 KV tokens
    decode = _req(10, computed=10, outputs=1)
    assert runner.graphs is None and not runner._as_rows(prefill)  # CPU: no graph to replay, no rows
    runner.graphs = _Graphs(max_bs=512)  # type: ignore[assignment]
    assert runner._as_rows(prefill) and EXTEND_ROWS_KV >= 8256
    assert with_budget(8256)._as_rows(prefill)
    assert not with_budget(8255)._as_rows(prefill)
    hit = ScheduledBatch([decode, _req(200, computed=100)], [1, 100], num_decode=1)  # past a 100-token prefix
    assert runner._as_rows(hit)  # 100 x 100 + 5050 KV reads
    assert not with_budget(15049)._as_rows(hit)
    runner.graphs = _Graphs(max_bs=100)  # type: ignore[assignment]
    assert not runner._as_rows(hit)  # 101 rows: more than the largest graph
    assert not runner._as_rows(ScheduledBatch([decode], [1], num_decode=1))  # plain decodes: their own layout


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU twin; on CUDA test_real_graphs_prefill_like_eager covers it")
@pytest.mark.parametrize("page_size", [1, 16])
def test_graph_twin_replays_prefill_steps(llama: TinyModel, page_size: int) -> None:
    pytest.importorskip("triton", reason="triton is not installed")
    from graph_twin import EagerDecodeGraphs

    prompts = make_prompts(llama.vocab_size, [3, 11, 6, 9], seed=63)  # 29 prefill rows: the graph of 32
    engine = Engine(EngineConfig(model=llama.path, attention="triton", page_size=page_size))
    graphs = engine.runner.graphs = EagerDecodeGraphs(engine.model, engine.runner.backend, max_bs=32, max_context=64,
                                                      device=engine.device)
    graphs.sizes = [4, 32]  # the interpreter is slow: a short ladder
    graphs.capture()
    seen = _spy_rows(engine)
    outs = engine.generate(input_ids=prompts, sampling_params=SamplingParams(temperature=0, max_new_tokens=2,
                                                                             ignore_eos=True))
    assert [o.token_ids for o in outs] == [llama.greedy(p, 2) for p in prompts]
    assert seen == [29] and graphs.num_replays == 2  # the prefill and the decode step, both replayed


@pytest.mark.skipif(not torch.cuda.is_available(), reason="real CUDA graphs need a GPU")
def test_real_graphs_prefill_like_eager(llama: TinyModel) -> None:
    prompts = make_prompts(llama.vocab_size, [3, 11, 6, 20, 1, 40], seed=64)
    params = SamplingParams(temperature=1.0, max_new_tokens=12, seed=3, ignore_eos=True, n=2)
    kw = dict(device="cuda", max_total_tokens=4096)
    eager = Engine(EngineConfig(model=llama.path, cuda_graph=False, **kw))
    graphed = Engine(EngineConfig(model=llama.path, cuda_graph_max_bs=128, **kw))
    seen = _spy_rows(graphed)
    a = eager.generate(input_ids=prompts, sampling_params=params)
    b = graphed.generate(input_ids=prompts, sampling_params=params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert seen and seen[0] == sum(map(len, prompts))
    for x, y in zip(a, b):
        torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-4, rtol=0)
    replays = graphed.runner.graphs.num_replays
    greedy = SamplingParams(temperature=0, max_new_tokens=NEW, ignore_eos=True)
    graphed.flush_cache()
    assert [o.token_ids for o in graphed.generate(input_ids=prompts, sampling_params=greedy)] == \
        [llama.greedy(p, NEW) for p in prompts]
    assert graphed.runner.graphs.num_replays == replays + NEW  # the prefill replayed too
