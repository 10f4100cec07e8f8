"""The FlashInfer backend's glue, on CPU: page tables from slot layouts, and the engine on
the backend (with a stand-in `flashinfer` of the documented semantics, fake_flashinfer.py)
giving transformers' greedy tokens, eager and through the CUDA-graph twin (one wrapper per
captured size, re-planned with padding rows at every replay). The real kernels are checked
on the GPU in test_backends_gpu.py and test_cuda_graph.py."""

from __future__ import annotations

import importlib
import sys

import pytest
import torch
from conftest import TinyModel, grow_slots, make_prompts
from graph_twin import EagerDecodeGraphs

from rollout import Engine, EngineConfig, SamplingParams
from rollout.attention.page_table import page_table
from rollout.cache.kv_pool import PageAllocator


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_page_table_matches_allocator_layout(page_size: int) -> None:
    alloc = PageAllocator(200, page_size)
    g = torch.Generator().manual_seed(page_size)
    lens = [1, page_size, page_size + 1, 37, 3 * page_size, 2]
    slots, pages_of = [], []
    for n in lens:  # grow each request in random chunks, as prefill chunks and decodes do
        s = torch.empty(0, dtype=torch.int64)
        while s.numel() < n:
            step = min(n - s.numel(), int(torch.randint(1, 9, (1,), generator=g)))
            s = grow_slots(alloc, s, step)
        slots.append(s)
        pages_of.append(s[::page_size] // page_size)
    pt = page_table(lens, torch.cat(slots), page_size)
    assert pt.indptr.dtype == pt.indices.dtype == pt.last_page_len.dtype == torch.int32
    assert pt.indptr.tolist() == [0, *torch.tensor([len(p) for p in pages_of]).cumsum(0).tolist()]
    assert pt.indices.tolist() == torch.cat(pages_of).tolist()
    assert pt.last_page_len.tolist() == [n - (len(p) - 1) * page_size for n, p in zip(lens, pages_of)]
    sub = pt.rows(2, 5)
    assert sub.indptr[0] == 0 and sub.indices.tolist() == torch.cat(pages_of[2:5]).tolist()
    assert sub.last_page_len.tolist() == pt.last_page_len[2:5].tolist()
    with pytest.raises(ValueError, match="at least one KV token"):
        page_table([3, 0], torch.arange(3), page_size)


@pytest.fixture
def fake_flashinfer(monkeypatch):
    import fake_flashinfer as fake

    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    monkeypatch.delitem(sys.modules, "rollout.attention.flashinfer_backend", raising=False)
    yield fake
    sys.modules.pop("rollout.attention.flashinfer_backend", None)


def test_flashinfer_refused_clearly_when_missing(llama: TinyModel, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # import raises ImportError
    monkeypatch.delitem(sys.modules, "rollout.attention.flashinfer_backend", raising=False)
    with pytest.raises(ValueError, match="'flashinfer' is not available"):
        Engine(EngineConfig(model=llama.path, attention="flashinfer"))
    importlib.invalidate_caches()


@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("page_size", [1, 16])
def test_engine_on_flashinfer_glue_matches_transformers(llama: TinyModel, fake_flashinfer, page_size: int,
                                                        graphs: bool) -> None:
    prompts = make_prompts(llama.vocab_size, [3, 17, 9, 20], seed=40)
    prompts.append(prompts[1] + [5, 6, 7])  # an extend over a cached prefix
    lengths = [9, 3, 6, 12, 5]  # requests finish one by one: decode batches shrink and pad up the ladder
    engine = Engine(EngineConfig(model=llama.path, attention="flashinfer", page_size=page_size, max_running_requests=4))
    backend = engine.runner.backend
    assert backend.name == "flashinfer"
    if graphs:
        engine.runner.graphs = EagerDecodeGraphs(engine.model, backend, max_bs=4, max_context=64, device=engine.device)
        engine.runner.graphs.capture()
        assert sorted(backend.graph_decode) == [1, 2, 4]
    params = [SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True) for n in lengths]
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    assert [o.token_ids for o in outs] == [llama.greedy(p, n) for p, n in zip(prompts, lengths)]
    assert outs[4].num_cached_tokens > 0
    assert backend.prefill.wrapper.num_plans > 0
    if graphs:
        assert engine.runner.graphs.num_replays > 0
        # every replay re-planned its size's wrapper (capture planned each once)
        assert sum(p.wrapper.num_plans - 1 for p in backend.graph_decode.values()) == engine.runner.graphs.num_replays
    else:
        assert backend.decode.wrapper.num_plans > 0


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU twin: Triton runs on CPU tensors only under TRITON_INTERPRET=1 "
                    "(set where there is no GPU); on a GPU test_cuda_graph replays auto's real 1-row Triton graphs")
def test_small_decode_graphs_on_triton_give_transformers_tokens(llama: TinyModel, fake_flashinfer, page_size: int) -> None:
    """`auto` on CUDA (small_decode.py): FlashInfer (here its stand-in) for every eager step
    and the 2- and 4-row graphs, Triton's decode kernel (the interpreter) for the 1-row graph.
    As the batch shrinks through every size the tokens stay transformers' greedy ones, and
    Triton attends in the 1-row graph only."""
    pytest.importorskip("triton", reason="triton is not installed")
    from rollout.attention.small_decode import SmallDecode
    from rollout.attention.triton_backend import TritonAttention

    prompts = make_prompts(llama.vocab_size, [3, 17, 9, 20], seed=41)
    lengths = [9, 3, 6, 12]
    engine = Engine(EngineConfig(model=llama.path, attention="flashinfer", page_size=page_size, max_running_requests=4))
    fi = engine.runner.backend
    triton_attn = TritonAttention(fi.pool, fi.num_heads, fi.num_kv_heads, fi.head_dim)
    rows: list[int] = []
    attend = triton_attn.attend
    triton_attn.attend = lambda q, *rest: rows.append(q.shape[0]) or attend(q, *rest)
    backend = SmallDecode(fi, triton_attn, max_rows=1)
    assert backend.name == "flashinfer+triton"
    engine.runner.backend = backend
    engine.runner.graphs = EagerDecodeGraphs(engine.model, backend, max_bs=4, max_context=64, device=engine.device)
    engine.runner.graphs.capture()
    assert sorted(fi.graph_decode) == [2, 4]  # the 1-row graph has no FlashInfer wrapper
    captured = len(rows)
    params = [SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True) for n in lengths]
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    assert [o.token_ids for o in outs] == [llama.greedy(p, n) for p, n in zip(prompts, lengths)]
    layers = len(engine.model.layers)
    # (capture also ran Triton for the shared-prefix graphs of 2 and 4 rows; no prompt is shared here)
    assert len(rows) > captured and set(rows[captured:]) == {1} and (len(rows) - captured) % layers == 0
    assert engine.runner.graphs.num_shared_replays == 0
    # the last 3 decode steps ran the longest request alone: at least those replayed the 1-row graph
    assert (len(rows) - captured) // layers >= 3
    assert sum(p.wrapper.num_plans - 1 for p in fi.graph_decode.values()) > 0  # and the larger ones FlashInfer's


def test_small_decode_refuses_a_backend_without_graphs(llama: TinyModel, fake_flashinfer) -> None:
    from rollout.attention.small_decode import SmallDecode
    from rollout.attention.torch_backend import TorchAttention

    engine = Engine(EngineConfig(model=llama.path, attention="flashinfer", page_size=16, max_running_requests=2))
    fi = engine.runner.backend
    with pytest.raises(ValueError, match="two graphable backends.*'torch'"):
        SmallDecode(fi, TorchAttention(fi.pool, fi.num_heads, fi.num_kv_heads, fi.head_dim), max_rows=1)
