"""rollout.model.lora_segments.plan_segments: a step's rows grouped by adapter slot, base rows
dropped, padding for CUDA graphs. Checked on examples and, as a property, against a per-token loop."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout.model.lora_segments import SegmentPlan, plan_segments


def naive_plan(slots: list[int], extend_lens: list[int]) -> tuple[list[int], list[int], list[int]]:
    """(row_ids, seg_indptr, seg_slots), one token at a time."""
    token_slots = [slot for slot, n in zip(slots, extend_lens) for _ in range(n)]
    row_ids, indptr, seg_slots = [], [0], []
    for slot in sorted({s for s in token_slots if s >= 0}):
        row_ids += [row for row, s in enumerate(token_slots) if s == slot]
        indptr.append(len(row_ids))
        seg_slots.append(slot)
    return row_ids, indptr, seg_slots


def as_lists(plan: SegmentPlan) -> tuple[list[int], list[int], list[int]]:
    for name in ("row_ids", "seg_indptr", "seg_slots"):
        array = getattr(plan, name)
        assert array.dtype == np.int32 and array.ndim == 1, name
    return plan.row_ids.tolist(), plan.seg_indptr.tolist(), plan.seg_slots.tolist()


def test_decode_rows_grouped_by_slot_and_base_rows_dropped() -> None:
    plan = plan_segments([2, -1, 0, 2, 0, -1, 5], [1] * 7)
    assert as_lists(plan) == ([2, 4, 0, 3, 6], [0, 2, 4, 5], [0, 2, 5])
    assert (plan.num_rows, plan.num_segments, plan.num_lora_rows) == (5, 3, 5)


def test_prefill_requests_keep_their_rows_contiguous_and_in_order() -> None:
    # rows: req0 0-2 (slot 1), req1 3 (base), req2 4-7 (slot 0), req3 none, req4 8-9 (slot 1)
    plan = plan_segments([1, -1, 0, 3, 1], [3, 1, 4, 0, 2])
    assert as_lists(plan) == ([4, 5, 6, 7, 0, 1, 2, 8, 9], [0, 4, 9], [0, 1])  # slot 3 has no rows: no segment


def test_padding_adds_empty_segments_and_uncovered_rows() -> None:
    plan = plan_segments([1, -1, 1], [1, 1, 1], num_rows=3, num_segments=4)
    assert as_lists(plan) == ([0, 2, 0], [0, 2, 2, 2, 2], [1, -1, -1, -1])
    assert (plan.num_rows, plan.num_segments, plan.num_lora_rows) == (3, 4, 2)


@pytest.mark.parametrize("slots,lens", [([], []), ([-1, -1], [1, 4]), ([3, 2], [0, 0])],
                         ids=["empty", "base", "no-rows"])
def test_batches_without_lora_rows_have_no_segments(slots: list[int], lens: list[int]) -> None:
    assert as_lists(plan_segments(slots, lens)) == ([], [0], [])
    assert as_lists(plan_segments(slots, lens, num_rows=2, num_segments=2)) == ([0, 0], [0, 0, 0], [-1, -1])


def test_numpy_inputs() -> None:
    plan = plan_segments(np.array([1, 0, 1], dtype=np.int64), np.array([2, 1, 1]))
    assert as_lists(plan) == ([2, 0, 1, 3], [0, 1, 4], [0, 1])


def test_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="one length"):
        plan_segments([0, 1], [1])
    with pytest.raises(ValueError, match="extend_lens"):
        plan_segments([0, 1], [2, -1])
    with pytest.raises(ValueError, match="slots must be >= -1"):
        plan_segments([0, -2], [1, 1])
    with pytest.raises(ValueError, match="num_rows"):
        plan_segments([0, 1], [1, 1], num_rows=1)
    with pytest.raises(ValueError, match="num_segments"):
        plan_segments([0, 1], [1, 1], num_segments=1)


requests = st.lists(st.tuples(st.integers(-1, 5), st.integers(0, 4)), max_size=12)


@settings(max_examples=200, deadline=None)
@given(requests, st.integers(0, 3), st.integers(0, 3))
def test_matches_a_per_token_loop(batch: list[tuple[int, int]], extra_rows: int, extra_segments: int) -> None:
    slots, lens = [s for s, _ in batch], [n for _, n in batch]
    row_ids, indptr, seg_slots = naive_plan(slots, lens)
    assert as_lists(plan_segments(slots, lens)) == (row_ids, indptr, seg_slots)
    padded = plan_segments(slots, lens, num_rows=len(row_ids) + extra_rows,
                           num_segments=len(seg_slots) + extra_segments)
    assert as_lists(padded) == (row_ids + [0] * extra_rows, indptr + [indptr[-1]] * extra_segments,
                                seg_slots + [-1] * extra_segments)
