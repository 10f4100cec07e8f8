"""Deterministic mode (EngineConfig.deterministic): a request's tokens and log-probs are bit
for bit the same alone and inside mixed batches, with different prefill chunk sizes, with the
prefix cache on and off, after retraction, with overlap scheduling, and with speculation; and
they still equal transformers (greedy tokens) and its log-probs closely.

Bitwise means `==` on the float lists. The default mode is not held to this: its matmuls
pick algorithms by the number of rows (rollout/kernels/batch_invariant.py says by how much)."""

from __future__ import annotations

import pytest
import torch

from conftest import TinyModel, make_prompts
from rollout import Engine, EngineConfig, SamplingParams
from rollout.kernels import batch_invariant
from rollout.kernels.options import KernelOptions

NEW = 10
SAMPLED = SamplingParams(temperature=1.0, max_new_tokens=NEW, seed=11, ignore_eos=True, logprobs_mode="raw")
GREEDY = SamplingParams(temperature=0, max_new_tokens=NEW, ignore_eos=True)


def _run(model: TinyModel, prompts, params, **config):
    engine = Engine(EngineConfig(model=model.path, deterministic=True, **config))
    return [(o.token_ids, o.logprobs) for o in engine.generate(input_ids=prompts, sampling_params=params)]


@pytest.fixture(scope="module")
def cases(llama: TinyModel):
    probe = make_prompts(llama.vocab_size, [37, 9], seed=1)
    others = make_prompts(llama.vocab_size, [5, 61, 2, 23, 14, 40], seed=2)
    return probe, others


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_alone_equals_every_mix(llama: TinyModel, cases, params) -> None:
    probe, others = cases
    alone = _run(llama, probe, params)
    mixes = {
        "batched with others": dict(prompts=others[:3] + probe + others[3:], config={}),
        "chunks of 8": dict(prompts=others + probe, config=dict(max_prefill_tokens=8)),
        "chunks of 24, no radix": dict(prompts=probe + others, config=dict(max_prefill_tokens=24, enable_radix_cache=False)),
        "tight KV: retraction": dict(prompts=others + probe, config=dict(max_total_tokens=128, max_prefill_tokens=16)),
        "overlap": dict(prompts=others[:2] + probe, config=dict(overlap_schedule=True)),
        "page 16": dict(prompts=probe + others[:2], config=dict(page_size=16)),
    }
    for name, mix in mixes.items():
        outs = _run(llama, mix["prompts"], params, **mix["config"])
        got = [outs[mix["prompts"].index(p)] for p in probe]
        assert got == alone, name
    # a request on its own: every step a batch of one row (check_deterministic's "alone")
    assert [_run(llama, [p], params)[0] for p in probe] == alone, "one request at a time"


def test_prefix_cache_hits_change_nothing(llama: TinyModel, cases) -> None:
    """The second request's prompt extends the first's sequence: its prefix comes from the
    tree (decode-computed KV included); the same request on a fresh engine recomputes it."""
    probe, _ = cases
    engine = Engine(EngineConfig(model=llama.path, deterministic=True))
    first = engine.generate(input_ids=[probe[0]], sampling_params=GREEDY)[0]
    follow_up = probe[0] + first.token_ids + probe[1][:5]
    hit = engine.generate(input_ids=[follow_up], sampling_params=SAMPLED)[0]
    assert hit.num_cached_tokens > len(probe[0])
    fresh = Engine(EngineConfig(model=llama.path, deterministic=True, enable_radix_cache=False))
    cold = fresh.generate(input_ids=[follow_up], sampling_params=SAMPLED)[0]
    assert (hit.token_ids, hit.logprobs) == (cold.token_ids, cold.logprobs)


def test_speculation_changes_nothing(llama: TinyModel, cases) -> None:
    probe, others = cases
    repetitive = [p[:6] * 6 for p in probe]  # n-gram drafts get accepted
    alone = _run(llama, repetitive, GREEDY)
    spec = _run(llama, others[:2] + repetitive, GREEDY, speculative="ngram", speculative_governor=False)[2:]
    assert spec == alone


def test_still_equals_transformers(llama: TinyModel, cases) -> None:
    probe, others = cases
    prompts = probe + others
    outs = _run(llama, prompts, GREEDY)
    assert [t for t, _ in outs] == [llama.greedy(p, NEW) for p in prompts]
    engine = Engine(EngineConfig(model=llama.path, deterministic=True))
    out = engine.generate(input_ids=[probe[0]], sampling_params=SAMPLED)[0]
    want = llama.logprobs(probe[0], out.token_ids)
    assert out.logprobs == pytest.approx(want, abs=1e-4)


def test_refused_combinations_name_the_field(llama: TinyModel) -> None:
    with pytest.raises(ValueError, match="attention='triton' with deterministic=True"):
        EngineConfig(model=llama.path, deterministic=True, attention="triton")
    with pytest.raises(ValueError, match="enable_lora=True with deterministic=True"):
        EngineConfig(model=llama.path, deterministic=True, enable_lora=True)
    with pytest.raises(TypeError, match="EngineConfig.deterministic"):
        EngineConfig(model=llama.path, deterministic="yes")


# --- the kernels ------------------------------------------------------------------------------


def test_blocked_linear_rows_do_not_depend_on_the_batch() -> None:
    g = torch.Generator().manual_seed(0)
    for k, n in ((576, 1536), (1536, 576), (64, 4096)):
        weight = torch.randn(n, k, generator=g)
        x = torch.randn(130, k, generator=g)
        full = batch_invariant.linear(x, weight)
        assert torch.allclose(full, x @ weight.T, atol=1e-3)
        for m in (1, 2, 7, 16, 17, 64, 100):
            assert torch.equal(batch_invariant.linear(x[:m], weight), full[:m]), (k, n, m)
        shuffled = torch.randperm(130, generator=g)
        assert torch.equal(batch_invariant.linear(x[shuffled], weight), full[shuffled])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter run on CPU tensors; on a GPU the kernels run "
                    "for real in tests/kernels/test_batch_invariant.py and the deterministic attention tests")
def test_the_gpu_kernels_under_the_interpreter(llama: TinyModel, monkeypatch) -> None:
    """The CUDA path (Triton matmul, the attention kernel in blocks of a request's tokens,
    fused norms at one row per program) run through the engine on CPU under
    TRITON_INTERPRET=1, its tl.dot reducing like an MMA (tests/mma_dot.py): alone, among
    others in chunks of 8 (blocks of 8 tokens, 16 MMA rows), a prompt in one chunk (one block
    of 32 tokens, 64 rows), and a prefix from the radix tree (decode-computed KV included)
    against a fresh engine: all bitwise the same, and greedy equals transformers."""
    pytest.importorskip("triton", reason="triton is not installed")
    from mma_dot import use_mma_dot

    use_mma_dot(monkeypatch)
    kernels = KernelOptions(fused=True, deterministic_triton=True)  # every kernel on CPU tensors
    probe = make_prompts(llama.vocab_size, [19], seed=5)
    others = make_prompts(llama.vocab_size, [4, 11], seed=6)
    # 2 tokens: the prefill's and one decode step's (whose KV the follow-up finds in the tree)
    params = SamplingParams(temperature=1.0, max_new_tokens=2, seed=2, ignore_eos=True)
    alone = _run(llama, probe, params, kernel_options=kernels)
    assert _run(llama, others + probe, params, max_prefill_tokens=8, kernel_options=kernels)[2:] == alone
    greedy = SamplingParams(temperature=0, max_new_tokens=2, ignore_eos=True)
    engine = Engine(EngineConfig(model=llama.path, deterministic=True, kernel_options=kernels))
    first = engine.generate(input_ids=probe, sampling_params=greedy)[0]
    assert first.token_ids == llama.greedy(probe[0], 2)
    follow_up = probe[0] + first.token_ids + others[0]
    hit = engine.generate(input_ids=[follow_up], sampling_params=params)[0]
    assert hit.num_cached_tokens > len(probe[0])
    cold = _run(llama, [follow_up], params, enable_radix_cache=False, kernel_options=kernels)[0]
    assert (hit.token_ids, hit.logprobs) == cold


def test_decode_graphs_replay_the_same_bits(llama: TinyModel, monkeypatch) -> None:
    """Decode steps replayed from graphs (the attention kernel's one-token launch reading the
    static table fixed at capture, batches padded up the ladder) give the bits of eager steps.
    CPU: the graph twin (tests/graph_twin.py) with the Triton path under the interpreter;
    CUDA: real graphs, bf16."""
    pytest.importorskip("triton", reason="triton is not installed")
    from mma_dot import use_mma_dot

    prompts = make_prompts(llama.vocab_size, [3, 11, 6], seed=30)
    params = [SamplingParams(temperature=1.0, max_new_tokens=n, seed=4, ignore_eos=True) for n in (5, 2, 4)]
    cuda = torch.cuda.is_available()
    device = dict(device="cuda", dtype="bfloat16", max_total_tokens=4096) if cuda else {}  # bf16: the MMA kernels
    if not cuda:  # every kernel on CPU tensors (interpreted)
        device = dict(kernel_options=KernelOptions(fused=True, deterministic_triton=True))
        use_mma_dot(monkeypatch)
    eager = Engine(EngineConfig(model=llama.path, deterministic=True, cuda_graph=False, **device))
    graphed = Engine(EngineConfig(model=llama.path, deterministic=True, cuda_graph_max_bs=4, **device))
    if not cuda:
        from graph_twin import EagerDecodeGraphs

        graphed.runner.graphs = EagerDecodeGraphs(graphed.model, graphed.runner.backend, max_bs=4, max_context=64,
                                                  device=graphed.device)
        graphed.runner.graphs.capture()
    assert eager.runner.graphs is None and graphed.runner.graphs is not None
    want = [(o.token_ids, o.logprobs) for o in eager.generate(input_ids=prompts, sampling_params=params)]
    got = [(o.token_ids, o.logprobs) for o in graphed.generate(input_ids=prompts, sampling_params=params)]
    assert got == want
    assert graphed.runner.graphs.num_replays >= 3  # batches of 3 (padded to 4), 2 and 1


def test_deterministic_with_two_tp_ranks(llama: TinyModel) -> None:
    """TP=2 (gloo, two processes): the row-parallel all-reduce adds two partial sums, exact in
    either order, so a probe is still bitwise the same alone and batched; more ranks are refused."""
    from rollout.distributed.tp_engine import TPEngine

    probe, others = make_prompts(llama.vocab_size, [21], seed=3), make_prompts(llama.vocab_size, [9, 30], seed=4)
    engine = TPEngine(EngineConfig(model=llama.path, deterministic=True, tensor_parallel_size=2))
    try:
        alone = [(o.token_ids, o.logprobs) for o in engine.generate(input_ids=probe, sampling_params=SAMPLED)]
        mixed = engine.generate(input_ids=others + probe, sampling_params=SAMPLED)[2:]
        assert [(o.token_ids, o.logprobs) for o in mixed] == alone
    finally:
        engine.close()
    with pytest.raises(ValueError, match="tensor_parallel_size=3 with deterministic=True"):
        EngineConfig(model=llama.path, deterministic=True, tensor_parallel_size=3)
