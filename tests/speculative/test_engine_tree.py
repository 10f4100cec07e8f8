"""Draft trees in the engine (CPU, float32, tiny checkpoint): a tree's rows attend to the
context and their own ancestors only, its draws use each node's depth for the noise, and the
accepted path's KV is moved into position order. So outputs equal plain decoding token for
token (greedy and seeded sampling, n > 1 forks, tight KV with retraction, requests admitted
while others verify trees), greedy log-probs match transformers within 1e-4, and no KV slot
leaks. The drafter here knows plain decoding's outputs and hides them behind decoy branches,
so the right path is rarely the first (the KV moves run) and trees accept what a chain of
the decoys never would."""

from __future__ import annotations

import pytest
import torch

from conftest import TinyModel, make_prompts
from rollout import Engine, EngineConfig, SamplingParams
from rollout.scheduler import Scheduler
from speculative.speculator import Speculator
from tree_oracle import OracleTree, plug


def _plain(engine: Engine, prompts, params) -> tuple[list, dict[tuple[int, ...], list[list[int]]]]:
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    by_prompt: dict[tuple[int, ...], list[list[int]]] = {}
    for out in outs:
        by_prompt.setdefault(tuple(prompts[out.prompt_index]), []).append(out.token_ids)
    return outs, by_prompt


def _tree_engine(llama: TinyModel, plain, **config) -> Engine:
    engine = Engine(EngineConfig(model=llama.path, speculative="ngram", speculative_governor=False,
                                 num_speculative_tokens=6, **config))
    plug(engine, OracleTree(plain, llama.vocab_size, 6, 12))
    return engine


@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_trees_equal_plain_decoding_and_transformers(llama: TinyModel, page_size: int) -> None:
    prompts = make_prompts(llama.vocab_size, [5, 9, 14], seed=80)
    params = SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True, logprobs_mode="raw")
    want, plain = _plain(Engine(EngineConfig(model=llama.path, page_size=page_size)), prompts, params)
    engine = _tree_engine(llama, plain, page_size=page_size)
    got = engine.generate(input_ids=prompts, sampling_params=params)
    for out, prompt in zip(got, prompts):
        assert out.token_ids == llama.greedy(prompt, 20)
        assert torch.allclose(torch.tensor(out.logprobs), llama.logprobs(prompt, out.token_ids), atol=1e-4)
    c = engine.counters
    # every verify finds the right branch behind the decoys (a chain of the first branch would
    # accept nothing): runs of up to 6 drafts a step
    assert c.verify_steps > 0 and c.accepted_tokens >= 4 * c.verify_steps, (c.verify_steps, c.accepted_tokens)
    engine.flush_cache()
    assert engine.kv.used_slots() == 0, "a tree's KV leaked"


def test_sampled_trees_with_forks_equal_plain_decoding(llama: TinyModel) -> None:
    """n = 4 samples a prompt: their continuations branch, and the tree holds them all; each
    node draws with its depth's noise, so the same tokens as plain decoding."""
    prompts = make_prompts(llama.vocab_size, [6, 10], seed=81)
    params = [SamplingParams(temperature=t, max_new_tokens=16, seed=s, n=4, ignore_eos=True, top_p=p)
              for t, s, p in ((1.0, 5, 1.0), (0.8, 6, 0.9))]
    want, plain = _plain(Engine(EngineConfig(model=llama.path)), prompts, params)
    engine = _tree_engine(llama, plain)
    got = engine.generate(input_ids=prompts, sampling_params=params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for x, y in zip(got, want):
        assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-5)
    assert engine.counters.accepted_tokens > engine.counters.verify_steps  # the trees carried runs


def test_trees_under_tight_kv_and_admission_equal_plain_decoding(llama: TinyModel, monkeypatch) -> None:
    """Retraction, and requests admitted into steps where others verify trees: such a step may
    run in the extend layout, so its trees fall back to their leading chain first."""
    prompts = make_prompts(llama.vocab_size, [5, 7, 9, 11, 6, 8], seed=82)
    params = SamplingParams(temperature=1.0, max_new_tokens=24, seed=3, n=2, ignore_eos=True)
    want, plain = _plain(Engine(EngineConfig(model=llama.path, page_size=4)), prompts, params)
    chained = []
    inner = Speculator.trees_to_chains

    def spy(self, batch):
        chained.append(sum(r.draft_parents is not None for r in batch.reqs[batch.num_decode :]))
        inner(self, batch)

    monkeypatch.setattr(Speculator, "trees_to_chains", spy)
    engine = _tree_engine(llama, plain, page_size=4, max_total_tokens=100, max_running_requests=6)
    got = engine.generate(input_ids=prompts, sampling_params=params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert engine.counters.retractions > 0 and engine.counters.verify_steps > 0
    assert sum(chained) > 0, "no tree met a prefill in its step"
    engine.flush_cache()
    assert engine.kv.used_slots() == 0 and engine.kv.allocator.num_free_pages == engine.kv.allocator.num_pages - 1


def test_trees_only_where_the_attention_reads_slot_lists(llama: TinyModel) -> None:
    """The drafter grows trees only while the step's rows fit `tree_rows` (0 for a backend that
    reads pages in position order, such as FlashInfer); otherwise chains."""
    engine = Engine(EngineConfig(model=llama.path, speculative="suffix", speculative_tree_nodes=8,
                                 speculative_governor=False))
    assert engine.runner.tree_rows_max() > 1000  # the torch backend, no graphs: any rows
    spec = engine.speculation
    prompt = [3, 4, 5, 6] * 6
    params = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    seen: list[bool] = []
    inner = spec.propose_all

    def record(running):
        inner(running)
        seen.extend(r.draft_parents is not None for r in running if r.draft_tokens)

    spec.propose_all = record
    plain = Engine(EngineConfig(model=llama.path)).generate(input_ids=[prompt], sampling_params=params)
    assert engine.generate(input_ids=[prompt], sampling_params=params)[0].token_ids == plain[0].token_ids
    spec.tree_rows = lambda: 0
    engine.flush_cache()
    trees = len(seen)
    assert engine.generate(input_ids=[prompt], sampling_params=params)[0].token_ids == plain[0].token_ids
    assert not any(seen[trees:]) and len(seen) > trees, "chains where trees cannot attend"


def test_tree_nodes_config_is_checked(llama: TinyModel) -> None:
    with pytest.raises(ValueError, match="speculative_tree_nodes"):
        EngineConfig(model=llama.path, speculative="draft", draft_model=llama.path, speculative_tree_nodes=8)
    with pytest.raises(ValueError, match="speculative_tree_nodes"):
        EngineConfig(model=llama.path, speculative="suffix", speculative_tree_nodes=65)


def test_trees_beside_chunked_prefills_equal_plain_decoding(llama: TinyModel, monkeypatch) -> None:
    """Prompts prefilled in chunks while others verify trees: a step holding a prompt's last
    token (scheduled as a decode: it samples the first output) has prefill work too, so its
    trees fall back to chains there as beside any other chunk."""
    prompts = make_prompts(llama.vocab_size, [5, 12, 6, 13], seed=83)
    params = SamplingParams(temperature=1.0, max_new_tokens=16, seed=4, ignore_eos=True)
    config = dict(max_running_requests=2, max_prefill_tokens=16)
    want, plain = _plain(Engine(EngineConfig(model=llama.path, **config)), prompts, params)
    met = []  # steps where a prompt's last token met a tree
    inner = Scheduler.schedule

    def spy(self):
        batch = inner(self)
        if batch is not None and any(not (r.output_ids or r.num_inflight) and n == 1
                                     for r, n in zip(batch.reqs, batch.extend_lens)):
            met.append(sum(r.draft_tokens != [] for r in batch.reqs))
        return batch

    monkeypatch.setattr(Scheduler, "schedule", spy)
    engine = _tree_engine(llama, plain, **config)
    got = engine.generate(input_ids=prompts, sampling_params=params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert engine.counters.verify_steps > 0 and engine.speculation.drafter.trees > 0
    assert sum(met) > 0, "no prompt's last token was scheduled beside drafts"
    engine.flush_cache()
    assert engine.kv.used_slots() == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU twin (the engine here runs on CPU, the kernel under the "
                    "interpreter); on CUDA KVPool.copy_slots is the kernel, run by test_verify_rows.py's real-graph tree tests")
def test_trees_and_forks_with_kv_moves_in_one_kernel_equal_plain_decoding(llama: TinyModel, monkeypatch) -> None:
    """The GPU's KV move (rollout/kernels/kv_copy.py: one launch, moves in order) under the
    interpreter, in place of the torch copy: the tree paths' moves and the forks' partial pages
    give plain decoding's tokens."""
    pytest.importorskip("triton", reason="triton is not installed")
    from rollout.cache.kv_pool import KVPool
    from rollout.kernels import kv_copy

    prompts = make_prompts(llama.vocab_size, [6, 10], seed=82)
    params = SamplingParams(temperature=1.0, max_new_tokens=16, seed=7, n=3, ignore_eos=True)
    want, plain = _plain(Engine(EngineConfig(model=llama.path, page_size=4)), prompts, params)
    engine = _tree_engine(llama, plain, page_size=4)
    moves = []

    def one_launch(pool, src, dst):
        moves.append(len(src))
        kv_copy.copy_slots([*pool.k_buffers, *pool.v_buffers], src, dst)

    monkeypatch.setattr(KVPool, "copy_slots", one_launch)
    got = engine.generate(input_ids=prompts, sampling_params=params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert len(moves) > 2 and engine.counters.accepted_tokens > engine.counters.verify_steps
