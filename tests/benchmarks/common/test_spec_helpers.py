"""The speculative benchmark's helpers (benchmarks/common/spec.py): the H200 projection gives
back the speedup table BENCHMARKS.md derived from the same verify-step costs, and the
drafters' host-cost workload drafts and verifies (no timing is asserted)."""

from __future__ import annotations

import pytest

from benchmarks.common.spec import host_cost, projected_speedup
from speculative.suffix import SuffixDrafter


# the speedup table of BENCHMARKS.md's latest GPU call (best k), by hand from its step costs:
# e.g. batch 1, a = 2: 3 tokens a step, 4.34 ms / 5.30 ms (k = 3)
@pytest.mark.parametrize(("accepted", "batch", "want"), [
    (0.5, 1, 1.5 * 4.34 / 5.23), (1.0, 1, 2 * 4.34 / 5.23), (2.0, 1, 3 * 4.34 / 5.30), (3.0, 1, 4 * 4.34 / 5.30),
    (0.5, 64, 1.5 * 8.60 / 13.00), (1.0, 64, 2 * 8.60 / 13.00), (2.0, 64, 3 * 8.60 / 16.06), (3.0, 64, 4 * 8.60 / 17.53),
])
def test_projection_reproduces_the_benchmarks_table(accepted: float, batch: int, want: float) -> None:
    assert projected_speedup(accepted, batch) == pytest.approx(want, rel=1e-9)


def test_projection_interpolates_between_batches_and_clamps_outside() -> None:
    at_8 = projected_speedup(1.0, 8)  # half way from 1 to 64 in log2
    assert projected_speedup(1.0, 64) < at_8 < projected_speedup(1.0, 1)
    assert at_8 == pytest.approx((projected_speedup(1.0, 1) + projected_speedup(1.0, 64)) / 2)
    assert projected_speedup(1.0, 256) == projected_speedup(1.0, 64)
    assert projected_speedup(0.0, 1) < 1.0, "no acceptance: a verify step costs more than a decode"


def test_batch1_trace_costs_each_step_as_it_ran() -> None:
    from benchmarks.common.spec import batch1_trace_speedup

    # verify steps of 4 and 2 drafts, 3 steps with none (overlap off), against 10 plain decodes
    want = 10 * 4.34 / (5.44 + 5.38 + 3 * 4.73)
    assert batch1_trace_speedup([4, 2], 3, 10) == pytest.approx(want, rel=1e-9)
    assert batch1_trace_speedup([9], 0, 10) == pytest.approx(10 * 4.34 / 5.62), "past the table: its widest verify"
    assert batch1_trace_speedup([], 10, 10) < 1.0, "nothing drafted: overlap off costs"
    # of the 3 draft-less steps, 2 overlapped and the step after one of those waited for it
    want = 10 * 4.34 / (5.44 + 5.38 + 2 * 4.73 + 4.34)
    assert batch1_trace_speedup([4, 2], 3, 10, overlapped=2, waited=1) == pytest.approx(want, rel=1e-9)
    assert batch1_trace_speedup([], 10, 10, overlapped=10, waited=0) == pytest.approx(1.0), "all overlapped: plain"
    assert batch1_trace_speedup([], 10, 10, overlapped=2, waited=5) == batch1_trace_speedup([], 10, 10), \
        "waits past the overlapped steps cost nothing more"


def test_host_cost_workload_drafts_and_accepts() -> None:
    small = dict(prompts=4, siblings=8, history=16, prompt_len=20, response_len=128, steps=16)
    point = host_cost(lambda: SuffixDrafter(4, 1 << 20, 1_000_000, coupled=False), **small)
    coupled = host_cost(lambda: SuffixDrafter(4, 1 << 20, 1_000_000), **small)
    assert point.drafted_per_step > 0 and coupled.drafted_per_step > 0
    assert coupled.accepted_per_verify > point.accepted_per_verify, "the synthetic policy draws with the real noise"


def test_draft_coverage_counts_matches_support_and_hits() -> None:
    from benchmarks.common.spec import Sample, draft_coverage

    prompt = [1, 2, 3]
    first = [Sample(prompt, [10, 11, 12, 13], seed=1), Sample(prompt, [10, 11, 14, 15], seed=2)]
    second = [Sample(prompt, [10, 11, 12, 13], seed=3), Sample(prompt, [20, 21], seed=4)]
    c = draft_coverage(first, second, temperature=1.0)
    # positions 1..3 of the first sample (all matched, each draw among the continuations) and
    # position 1 of the second ((3, 20) never occurred: no match)
    assert (c.positions, c.matched, c.in_support) == (4, 3, 3)
    assert c.point == 2, "after (10, 11) the latest continuation is 14, not the 12 drawn"
    assert c.coupled >= 2


def test_successor_model_makes_greedy_decoding_a_fixed_walk() -> None:
    """The governor bench's model (benchmarks/common/spec_governor.py): after the rewrite, greedy
    decoding from any prompt follows the permutation, so a rollout's history predicts it."""
    from rollout import Engine, EngineConfig, SamplingParams
    from benchmarks.common.spec_governor import successor_model
    from rollout.model.shapes import write_shape_dir

    engine = Engine(EngineConfig(model=write_shape_dir("tiny"), dtype="float32", device="cpu", load_format="dummy",
                                 page_size=16, max_running_requests=4))
    perm = successor_model(engine, seed=3).tolist()
    prompts = [[7, 300, 41, 9], [120, 5]]
    outs = engine.generate(input_ids=prompts, sampling_params=SamplingParams(temperature=0, max_new_tokens=12,
                                                                            ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        walk, token = [], prompt[-1]
        for _ in range(12):
            token = perm[token]
            walk.append(token)
        assert out.token_ids == walk


def test_batch1_replay_counts_verifies_that_leave_the_leading_chain() -> None:
    """The step-by-step replay (spec_tree.batch1_ahead_trace) on a prompt with two earlier
    samples that branch: point-mass drafts chain the latest one, and a sample that takes the
    older branch is accepted through the tree's other nodes, whose KV the engine then moves."""
    from rollout import SamplingParams
    from benchmarks.common.spec_tree import batch1_ahead_trace
    from rollout.request import Req

    prompt = [1, 2, 3, 4]
    older = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19]
    newer = [10, 11, 12, 13, 24, 25, 26, 27, 28, 29]
    params = SamplingParams(temperature=0, max_new_tokens=len(older), ignore_eos=True)
    drafter = SuffixDrafter(8, 1 << 20, 1 << 20, coupled=False)
    for i, response in enumerate((older, newer)):
        req = Req(rid=f"earlier{i}", prompt_ids=prompt, params=params, seed=0)
        req.output_ids = list(response)
        drafter.observe_finished(req)
    for future, moves in ((newer, False), (older, True)):  # the chain follows the latest sample
        trace = batch1_ahead_trace(drafter, [(prompt, params, list(future))], depth=8, nodes=16, mode="drain")
        assert sum(a + 1 for r, a, *_ in trace.steps) == len(future) - 1, "every token after the first, once"
        verifies = [(a, moved) for r, a, _, moved in trace.steps if r > 1]
        assert verifies and all(moved <= a for a, moved in verifies)
        assert any(moved for _, moved in verifies) == moves


def test_replayed_steps_cost_their_rows_waits_and_moves() -> None:
    from benchmarks.common.spec import ahead_trace_speedup

    table, decode = {1: 5.0, 9: 6.0, 17: 7.0}, 4.0
    # a waited verify of 9 rows, a plain step launched ahead (less the 1 ms gap), a waited
    # verify of 17 rows whose path moved KV: 10 tokens against plain decoding's 4 ms each
    steps = [(9, 3, True, 0), (1, 0, False, 0), (17, 4, True, 2)]
    assert ahead_trace_speedup(steps, 10, table, decode) == pytest.approx(40 / (6 + 4 + 7))
    assert ahead_trace_speedup(steps, 10, table, decode, move_ms=1.5) == pytest.approx(40 / (6 + 4 + 7 + 1.5))
    assert ahead_trace_speedup([s[:3] for s in steps], 10, table, decode, move_ms=1.5) == \
        pytest.approx(40 / 17), "traces saved before moves were counted: no move cost"
    assert ahead_trace_speedup([(13, 2, True, 0)], 3, table, decode) == pytest.approx(12 / 6.5), "rows interpolate"


def test_charged_projection_adds_moves_and_drafting_on_waited_steps() -> None:
    from benchmarks.common.spec import H200_2026_12_06_DECODE_MS, H200_2026_12_06_ROWS_MS, ahead_trace_speedup
    from benchmarks.common.spec_tree import AheadTrace, _charged

    steps = ((9, 3, True, 0), (1, 0, False, 0), (17, 4, True, 2), (1, 0, True, 0))
    trace = AheadTrace("drain", 8, 16, 1, 10, steps, 0.5)
    decode_ms = H200_2026_12_06_DECODE_MS
    base = 10 * decode_ms / ahead_trace_speedup(steps, 10, H200_2026_12_06_ROWS_MS, decode_ms)
    # one move of 0.2 ms (the 17-row verify's), drafting 0.5 ms on each of the 3 waited steps
    assert _charged(trace, decode_ms, 0.2) == pytest.approx(10 * decode_ms / (base + 0.2 + 1.5))
