"""Verify steps laid out as decode rows (ModelRunner._prepare_rows): the same tokens as the
extend layout and as transformers; on CPU the decode-graph replay logic runs them through
the graph twin (Triton under TRITON_INTERPRET=1), on CUDA real graphs give eager's tokens."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from conftest import TinyModel, make_prompts  # noqa: E402
from rollout import Engine, EngineConfig, SamplingParams  # noqa: E402
from rollout.kernels.options import KernelOptions  # noqa: E402

NEW = 20


def _prompts(vocab: int) -> list[list[int]]:
    loops = [[(7 * i + j) % vocab for j in range(3)] * 5 for i in range(3)]  # repetitive: drafts accepted
    return loops + make_prompts(vocab, [6, 13], seed=90)


def _count_rows(engine: Engine) -> list[int]:
    calls = [0]
    inner = engine.runner._prepare_rows

    def spy(batch):
        calls[0] += 1
        return inner(batch)

    engine.runner._prepare_rows = spy  # type: ignore[method-assign]
    return calls


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_rows_layout_equals_extend_layout(llama: TinyModel, temperature: float) -> None:
    prompts = _prompts(llama.vocab_size)
    params = SamplingParams(temperature=temperature, max_new_tokens=NEW, ignore_eos=True, seed=4, n=2)
    outs = {}
    for rows_max in (None, 0):
        engine = Engine(EngineConfig(model=llama.path, speculative="ngram", speculative_governor=False, page_size=16,
                                     kernel_options=KernelOptions(verify_rows_max=rows_max)))
        calls = _count_rows(engine)
        outs[rows_max] = engine.generate(input_ids=prompts, sampling_params=params)
        assert (calls[0] > 0) == (rows_max is None)
        assert engine.stats().counters["verify_steps"] > 0
    assert [o.token_ids for o in outs[None]] == [o.token_ids for o in outs[0]]
    for a, b in zip(outs[None], outs[0]):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0)
    if temperature == 0:
        for out, prompt in zip(outs[None][::2], prompts):
            assert out.token_ids == llama.greedy(prompt, NEW)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU twin; on CUDA test_real_graphs_verify_like_eager covers it")
def test_graph_twin_replays_verify_steps(llama: TinyModel) -> None:
    pytest.importorskip("triton", reason="triton is not installed")
    from graph_twin import EagerDecodeGraphs

    prompts = _prompts(llama.vocab_size)[2:]  # one repetitive prompt (long runs), two random (rejections)
    engine = Engine(EngineConfig(model=llama.path, attention="triton", page_size=16, speculative="ngram",
                                 speculative_governor=False))
    # rows up to 3 x (1 + 4): padded up a short ladder (the interpreter is slow)
    graphs = engine.runner.graphs = EagerDecodeGraphs(engine.model, engine.runner.backend, max_bs=15,
                                                      max_context=64, device=engine.device)
    graphs.sizes = [4, 8, 15]
    graphs.capture()
    calls = _count_rows(engine)
    outs = engine.generate(input_ids=prompts, sampling_params=SamplingParams(temperature=0, max_new_tokens=12,
                                                                             ignore_eos=True))
    assert [o.token_ids for o in outs] == [llama.greedy(p, 12) for p in prompts]
    assert calls[0] > 0 and graphs.num_replays >= calls[0]  # every verify step replayed a graph


@pytest.mark.skipif(not torch.cuda.is_available(), reason="real CUDA graphs need a GPU")
@pytest.mark.parametrize("drafter", ["ngram", "draft"])
def test_real_graphs_verify_like_eager(llama: TinyModel, drafter: str) -> None:
    prompts = _prompts(llama.vocab_size)
    params = SamplingParams(temperature=1.0, max_new_tokens=NEW, seed=3, ignore_eos=True, n=2)
    kw = dict(device="cuda", max_total_tokens=4096, speculative=drafter, speculative_governor=False,
              draft_model=llama.path if drafter == "draft" else None)
    eager = Engine(EngineConfig(model=llama.path, cuda_graph=False, **kw))
    graphed = Engine(EngineConfig(model=llama.path, cuda_graph_max_bs=16, **kw))
    a = eager.generate(input_ids=prompts, sampling_params=params)
    b = graphed.generate(input_ids=prompts, sampling_params=params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    greedy = SamplingParams(temperature=0, max_new_tokens=NEW, ignore_eos=True)  # the repetitive prompts loop: drafts
    replays = graphed.runner.graphs.num_replays
    assert [o.token_ids for o in graphed.generate(input_ids=prompts, sampling_params=greedy)] == \
        [llama.greedy(p, NEW) for p in prompts]
    assert graphed.stats().counters["verify_steps"] > 0 and graphed.runner.graphs.num_replays > replays


# Plain decoding's outputs by (model, prompts, sampling, config): an engine run is the same
# every time, and under the Triton interpreter the reference run costs about a second; the
# tests below ask for the same one several times (each sharing mode, each of eager and twin).
_PLAIN: dict[str, list] = {}


def _plain(llama: TinyModel, prompts, params, **config) -> list:
    key = repr((llama.path, prompts, params, sorted(config.items())))
    if key not in _PLAIN:
        _PLAIN[key] = Engine(EngineConfig(model=llama.path, **config)).generate(input_ids=prompts,
                                                                              sampling_params=params)
    return _PLAIN[key]


def _tree_engine(llama: TinyModel, prompts, params, **config) -> tuple[Engine, list]:
    """An engine whose drafter grows trees with plain decoding's continuation behind decoys."""
    from tree_oracle import OracleTree, plug

    want = _plain(llama, prompts, params, **config)
    plain: dict = {}
    for out in want:
        plain.setdefault(tuple(prompts[out.prompt_index]), []).append(out.token_ids)
    engine = Engine(EngineConfig(model=llama.path, speculative="ngram", speculative_governor=False,
                                 num_speculative_tokens=4, **config))
    plug(engine, OracleTree(plain, llama.vocab_size, 4, 8), engine.runner.tree_rows_max)
    return engine, want


@pytest.fixture
def group_any_rows(monkeypatch):
    """The tests' prompts and steps are short: group a verify's rows whatever their number."""
    from rollout.attention import shared_prefix

    monkeypatch.setattr(shared_prefix, "MIN_PREFIX_TOKENS", 8)
    monkeypatch.setattr(shared_prefix, "MIN_SHARED_TOKENS", 1)
    monkeypatch.setattr(shared_prefix, "SPAN_MIN_ROWS", 2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="real CUDA graphs need a GPU")
@pytest.mark.parametrize("attention", ["auto", "triton"])
@pytest.mark.parametrize("share", [True, False], ids=["context-once", "context-per-row"])
def test_real_graphs_verify_trees(llama: TinyModel, attention: str, share: bool, group_any_rows) -> None:
    """Trees in real graphs: FlashInfer's up to SMALL_DECODE_ROWS rows attend with Triton; with
    `share` each request's rows read its context once (shared_prefix.plan_spans)."""
    prompts = _prompts(llama.vocab_size)[1:4]  # 3 requests x (1 + 8 nodes) rows: within SMALL_DECODE_ROWS
    params = SamplingParams(temperature=1.0, max_new_tokens=NEW, seed=3, ignore_eos=True)
    engine, want = _tree_engine(llama, prompts, params, device="cuda", max_total_tokens=4096, cuda_graph_max_bs=64,
                                attention=attention, shared_prefix_attention=share)
    replays = engine.runner.graphs.num_replays
    got = engine.generate(input_ids=prompts, sampling_params=params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert engine.counters.accepted_tokens > engine.counters.verify_steps > 0 and engine.speculation.drafter.trees > 0
    assert engine.runner.graphs.num_replays > replays
    assert (engine.runner.graphs.num_shared_replays > 0) == share


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU twin (Triton under the interpreter); on CUDA "
                    "test_real_graphs_verify_trees runs the same grouping in real graphs")
@pytest.mark.parametrize("graphs", [False, True], ids=["eager-rows", "graph-twin"])
def test_tree_rows_read_their_context_once(llama: TinyModel, group_any_rows, graphs: bool) -> None:
    """A tree verify's rows (and a chain verify's) all start with the request's slots before
    the step: they are grouped to attend them once (shared_prefix.plan_spans), and the
    tokens and log-probs are the ungrouped engine's.

    [graph-twin] also runs tree rows through the Triton decode kernel (slot lists) in the
    graph replay path, every verify step a replay: sharing off, the graphs (which can share)
    replay ungrouped tree rows, the case a test of its own ran before with prompts too short
    to group."""
    pytest.importorskip("triton", reason="triton is not installed")
    from graph_twin import EagerDecodeGraphs
    prompts = make_prompts(llama.vocab_size, [12, 17], seed=93)
    params = SamplingParams(temperature=1.0, max_new_tokens=8, seed=5, ignore_eos=True)
    outs = {}
    for share in (True, False):
        engine, want = _tree_engine(llama, prompts, params, attention="triton", page_size=16, cuda_graph=False)
        engine.runner.share_prefixes = share
        if graphs:
            engine.runner.graphs = EagerDecodeGraphs(engine.model, engine.runner.backend, max_bs=18, max_context=64,
                                                     device=engine.device)
            engine.runner.graphs.sizes = [2, 9, 18]
            engine.runner.graphs.capture()
        backend, grouped = engine.runner.backend, []
        attend = backend.attend

        def spy(q, k, v, k_buf, v_buf, batch, out, attend=attend, backend=backend, grouped=grouped):
            if batch.slot_rows and backend.shared is not None:
                grouped.append(backend.shared.num_groups)
            return attend(q, k, v, k_buf, v_buf, batch, out)

        backend.attend = spy
        calls = _count_rows(engine)
        outs[share] = engine.generate(input_ids=prompts, sampling_params=params)
        assert [o.token_ids for o in outs[share]] == [o.token_ids for o in want]
        assert engine.counters.accepted_tokens > engine.counters.verify_steps > 0 and engine.speculation.drafter.trees > 0
        assert calls[0] > 0
        if graphs:  # (a replay attends the graph's static batch)
            assert engine.runner.graphs.num_replays >= calls[0]  # every verify step replayed a graph
            assert (engine.runner.graphs.num_shared_replays > 0) == share
        else:
            assert bool(grouped) == share, "tree rows grouped by their context exactly when sharing is on"
    for a, b in zip(outs[True], outs[False]):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)
