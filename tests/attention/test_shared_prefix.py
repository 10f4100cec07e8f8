"""Shared-prefix decode attention (rollout/attention/prefix_kernel.py) against a float64 reference,
and the host planner that groups rows by their tree-owned prefix (shared_prefix.py).

Without CUDA the kernels run under Triton's interpreter (set before triton is imported).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton", reason="triton is not installed; Triton attention kernels cannot be tested")

from rollout.attention import shared_prefix  # noqa: E402
from rollout.attention.prefix_kernel import members_max  # noqa: E402
from rollout.attention.triton_kernels import decode_attention  # noqa: E402
from rollout.request import Req, SamplingParams  # noqa: E402
from tests.attention.test_triton_kernels import DEVICE, reference_attention  # noqa: E402


def shared_case(layout: list[tuple[int, list[int]]], loners: list[int], heads: int, kv_heads: int, dim: int,
                dtype: torch.dtype, seed: int):
    """Rows of groups (prefix length, each member's own tokens after it) and loner rows (their
    KV lengths), interleaved in the batch; each group's members use the same prefix slots."""
    g = torch.Generator().manual_seed(seed)
    num_slots = sum(p + sum(own) for p, own in layout) + sum(loners) + 13
    free = torch.randperm(num_slots, generator=g).tolist()
    used: set[int] = set()

    def take(n: int) -> list[int]:
        out = [free.pop() for _ in range(n)]
        used.update(out)
        return out

    entries: list[tuple[int, list[int]]] = []  # (group or -1, slots)
    for gi, (p, own) in enumerate(layout):
        prefix = take(p)
        entries += [(gi, prefix + take(n)) for n in own]
    entries += [(-1, take(n)) for n in loners]
    order = torch.randperm(len(entries), generator=g).tolist()  # members and loners interleaved
    rows = [entries[i][1] for i in order]
    groups = [(p, [r for r, i in enumerate(order) if entries[i][0] == gi]) for gi, (p, _) in enumerate(layout)]
    k = torch.randn(num_slots, kv_heads, dim, generator=g)
    v = torch.randn(num_slots, kv_heads, dim, generator=g)
    unused = torch.tensor([s not in used for s in range(num_slots)])
    k[unused], v[unused] = float("nan"), float("nan")  # a stray read poisons the output
    lens = [len(r) for r in rows]
    indptr = torch.tensor([0, *np.cumsum(lens)], dtype=torch.int32)
    indices = torch.tensor([s for r in rows for s in r], dtype=torch.int32)
    q = torch.randn(len(rows), heads, dim, generator=g)
    return (q.to(dtype).to(DEVICE), k.to(dtype).to(DEVICE), v.to(dtype).to(DEVICE), indptr.to(DEVICE),
            indices.to(DEVICE), groups, rows)


def check(layout, loners, heads=8, kv_heads=2, dim=32, splits=1, dtype=torch.float32, seed=0, tol=1e-4):
    q, k, v, indptr, indices, groups, rows = shared_case(layout, loners, heads, kv_heads, dim, dtype, seed)
    # the groups really share their prefix slots (the case builder's own check)
    for p, members in groups:
        assert all(rows[m][:p] == rows[members[0]][:p] for m in members)
    scale = dim**-0.5
    shared = shared_prefix.pack(groups, len(rows), torch.device(DEVICE))
    out = torch.full_like(q, float("nan"))
    decode_attention(q, k, v, indptr, indices, scale, out=out, num_kv_splits=splits, shared=shared)
    assert torch.isfinite(out).all(), "a row's output was left unwritten"
    qo = torch.arange(len(rows) + 1, dtype=torch.int32)
    ref = reference_attention(q, k, v, qo, indptr.cpu(), indices.cpu(), scale)
    err = ((out.cpu().double() - ref).norm() / ref.norm()).item()
    assert err < tol, err
    plain = decode_attention(q, k, v, indptr, indices, scale, num_kv_splits=splits)
    return out, plain


@pytest.mark.parametrize("splits", [1, 3])
def test_groups_and_loners_match_reference(splits: int) -> None:
    # a group of 4 over a 50-token prefix (crosses blocks and both interpreter prefix splits),
    # one of 2 over 16 tokens (the second prefix split empty), members with 1 to 30 own
    # tokens, and loner rows between them
    out, plain = check([(50, [1, 7, 30, 3]), (16, [2, 1])], [5, 40], splits=splits, seed=splits)
    assert torch.allclose(out, plain, atol=1e-5)


def test_gqa_group_rows_fill_the_block() -> None:
    # 4 query heads a kv head: 4 members fill the interpreter's 16-row query block exactly
    assert members_max(8, 2, torch.float32, gpu=False) == 4
    check([(33, [1, 2, 3, 4])], [], heads=8, kv_heads=2, seed=5)


def test_mha_and_unused_groups() -> None:
    # MHA (group 1): 16 members a block; 3 groups planned for 10 rows (5 slots): two left empty
    check([(20, [1, 1]), (17, [4, 9]), (64, [2, 2, 2])], [3, 1, 8], heads=2, kv_heads=2, dim=16, seed=9)


@pytest.mark.parametrize("dtype", [torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else []), ids=str)
def test_half(dtype: torch.dtype) -> None:
    check([(48, [3, 5, 1])], [12], heads=8, kv_heads=2, dtype=dtype, seed=3, tol=1e-2)


def test_pack_refuses_bad_groups() -> None:
    dev = torch.device("cpu")
    with pytest.raises(ValueError, match="distinct rows"):
        shared_prefix.pack([(8, [0, 1]), (8, [1, 2])], 4, dev)
    with pytest.raises(ValueError, match=">= 2 rows"):
        shared_prefix.pack([(8, [0])], 4, dev)
    with pytest.raises(ValueError, match="at most 1"):
        shared_prefix.pack([(8, [0, 1]), (8, [2, 3])], 3, dev)


def _req(row: int, prefix: int) -> Req:
    r = Req(rid=f"r{row}", prompt_ids=[1], params=SamplingParams(), seed=0)
    r.req_pool_idx, r.num_prefix_tokens = row, prefix
    return r


def test_group_rows_by_tree_prefix() -> None:
    table = np.arange(8 * 100, dtype=np.int64).reshape(8, 100)
    table[1, :64] = table[0, :64]  # rows 0-2 share 64 tree slots, row 3 only the first 32 of them
    table[2, :64] = table[0, :64]
    table[3, :32] = table[0, :32]
    table[5, :80] = table[4, :80]  # rows 4-5 share 80
    reqs = [_req(0, 64), _req(4, 80), _req(1, 64), _req(3, 64), _req(2, 64), _req(5, 80), _req(6, 0), _req(7, 90)]
    groups = shared_prefix.group_rows(reqs, table, members_max=16)
    assert sorted(groups) == [(64, [0, 2, 4]), (80, [1, 5])]  # row 3's prefix ends at its own slot
    assert shared_prefix.group_rows(reqs, table, members_max=2) == [(64, [0, 2]), (80, [1, 5])]  # a lone 3rd
    assert shared_prefix.group_rows(reqs, table, members_max=1) == []
    assert shared_prefix.plan(reqs, table, 16, torch.device("cpu"), min_shared=209) is None  # saves 2*64 + 80
    planned = shared_prefix.plan(reqs, table, 16, torch.device("cpu"), min_shared=208)
    assert planned is not None and planned.num_groups == 2 and planned.shared_tokens == 208
    assert planned.row_skip.tolist() == [64, 80, 64, 0, 64, 80, 0, 0]


def test_group_spans_groups_each_requests_rows() -> None:
    """A step as rows (a verify, a draft tree, a small prefill): each request's rows share its
    slots before the step, in chunks of at most members_max rows; a lone last row and a
    prefix below MIN_PREFIX_TOKENS are left alone."""
    spans = [(70, 0, 5), (64, 5, 1), (63, 6, 3), (100, 9, 4)]  # (prefix, first row, rows)
    assert shared_prefix.group_spans(spans, members_max=8) == [(70, [0, 1, 2, 3, 4]), (100, [9, 10, 11, 12])]
    assert shared_prefix.group_spans(spans, members_max=2) == [
        (70, [0, 1]), (70, [2, 3]), (100, [9, 10]), (100, [11, 12])]  # row 4 alone: no group
    assert shared_prefix.group_spans(spans, members_max=1) == []
    assert shared_prefix.group_spans(spans, members_max=8, min_prefix=63)[1] == (63, [6, 7, 8])
    cpu = torch.device("cpu")
    rows = shared_prefix.SPAN_MIN_ROWS  # a step of fewer rows groups none (13 rows: none)
    assert shared_prefix.plan_spans(spans, 13, 8, cpu, min_shared=1) is None
    assert shared_prefix.plan_spans(spans, rows, 8, cpu, min_shared=4 * 70 + 3 * 100 + 1) is None
    planned = shared_prefix.plan_spans(spans, rows, 8, cpu, min_shared=4 * 70 + 3 * 100)
    assert planned is not None and planned.num_groups == 2
    assert planned.row_skip.tolist() == [70] * 5 + [0] * 4 + [100] * 4 + [0] * (rows - 13)


@pytest.fixture
def low_thresholds(monkeypatch):
    # the tiny model's prompts are short: group any shared prefix of >= 8 tokens
    monkeypatch.setattr(shared_prefix, "MIN_PREFIX_TOKENS", 8)
    monkeypatch.setattr(shared_prefix, "MIN_SHARED_TOKENS", 1)


@pytest.mark.whole_gpu  # on CUDA its engine sizes its KV cache from the device's free memory
@pytest.mark.parametrize(("page_size", "graphs"), [(1, False), (16, True)], ids=["page1-eager", "page16-graph-twin"])
def test_engine_n_samples_attend_their_prompt_once(llama, low_thresholds, page_size: int, graphs: bool) -> None:
    """n = 4 samples of each of two prompts fork the prompt's KV; their decode steps group by
    it (the shared-prefix pass runs) and the log-probs stay transformers'; tokens and log-probs
    equal the engine's without grouping.

    Sampled, not greedy: a prompt's samples part after their first token, so a group's rows
    hold different queries and different KV past the prefix (greedy samples would be copies
    of each other, and a row reading a sibling's tail would go unseen). Each sampled token's
    log-prob against transformers' (HF's log_softmax at it) checks every row's attention as
    the greedy tokens did, in the same run as the grouping."""
    from conftest import make_prompts
    from rollout import Engine, EngineConfig, SamplingParams

    prompts = make_prompts(llama.vocab_size, [37, 21], seed=5)
    engine = Engine(EngineConfig(model=llama.path, attention="triton", page_size=page_size, max_running_requests=8,
                                 device=DEVICE, cuda_graph=False))
    backend = engine.runner.backend
    if graphs:
        from graph_twin import EagerDecodeGraphs

        engine.runner.graphs = EagerDecodeGraphs(engine.model, backend, max_bs=8, max_context=64, device=engine.device)
        engine.runner.graphs.capture()
    grouped: list[int] = []
    attend = backend.attend

    def spy(q, *rest):
        if backend.shared is not None:
            grouped.append(backend.shared.num_groups)
        return attend(q, *rest)

    backend.attend = spy
    # 3 tokens: the prefill's, then two grouped decode steps (the second reads the rows' own
    # sampled tails past the prefix); the interpreted steps are what this test costs on CPU
    sampled = SamplingParams(temperature=1.0, max_new_tokens=3, n=4, seed=3, ignore_eos=True)
    on = engine.generate(input_ids=prompts, sampling_params=sampled)
    assert grouped, "no decode step grouped the samples by their prompt"
    if graphs:  # (a graph's plan holds its static buffers, sized for its rows)
        assert engine.runner.graphs.num_shared_replays > 0
    else:
        assert max(grouped) == 2
    for out in on:
        torch.testing.assert_close(torch.tensor(out.logprobs), llama.logprobs(prompts[out.prompt_index], out.token_ids),
                                   atol=1e-4, rtol=0)
    assert len({tuple(o.token_ids) for o in on}) > 2, "the samples should part (seed 3): rows unlike their group's"
    engine.flush_cache()
    engine.runner.share_prefixes = False
    n_grouped = len(grouped)
    off = engine.generate(input_ids=prompts, sampling_params=sampled)
    assert len(grouped) == n_grouped  # off: nothing grouped
    for a, b in zip(on, off):
        assert a.token_ids == b.token_ids
        assert np.allclose(a.logprobs, b.logprobs, atol=1e-5)


@pytest.mark.whole_gpu  # on CUDA its engines size their KV caches from the device's free memory
def test_config_off_plans_no_groups_and_captures_no_shared_graphs(llama, low_thresholds) -> None:
    """EngineConfig(shared_prefix_attention=False): the runner never groups rows, and decode
    graphs get no shared-prefix variant (half the captures at start-up and on wake)."""
    from conftest import make_prompts
    from graph_twin import EagerDecodeGraphs
    from rollout import Engine, EngineConfig, SamplingParams

    with pytest.raises(TypeError, match="shared_prefix_attention"):
        EngineConfig(model=llama.path, shared_prefix_attention="yes")
    counts = {}
    for on in (True, False):
        engine = Engine(EngineConfig(model=llama.path, attention="triton", page_size=16, max_running_requests=8,
                                     device=DEVICE, cuda_graph=False, shared_prefix_attention=on))
        runner = engine.runner
        assert runner.share_prefixes is on
        runner.graphs = EagerDecodeGraphs(engine.model, runner.backend, max_bs=8, max_context=64,
                                          device=engine.device, share_prefixes=runner.share_prefixes)
        runner.graphs.capture()
        counts[on] = len(runner.graphs.graphs)
        params = SamplingParams(temperature=0, max_new_tokens=2, n=4, ignore_eos=True)  # one decode step
        engine.generate(input_ids=make_prompts(llama.vocab_size, [37], seed=5), sampling_params=params)
        assert (runner.graphs.num_shared_replays > 0) is on
    assert counts == {True: 2 * 4 - 1, False: 4}  # sizes 1, 2, 4, 8; one row never shares
