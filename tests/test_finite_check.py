"""FiniteCheck (rollout/finite_check.py): tensors checked in chunks as they are added, with
one sync at the end, and the loader's use of it (a check the caller started as the stream
arrived, plus tensors it did not see) naming the first bad tensor in stream order."""

from __future__ import annotations

import torch

from rollout.finite_check import FiniteCheck
from rollout.model.loader import WeightWrite, _check_finite


def _tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.float32, torch.bfloat16, torch.float64] * 3
    return [torch.randn(50 + 7 * i, generator=g).to(dtype) for i, dtype in enumerate(dtypes)]


def test_chunked_check_flags_exactly_the_bad_tensors():
    for chunk_bytes in (None, 1, 300, 1 << 30):  # one launch per group at the end ... one per tensor
        tensors = _tensors()
        for i, value in ((2, float("nan")), (7, float("inf")), (16, float("-inf")), (17, float("nan"))):
            tensors[i][i] = value
        check = FiniteCheck(chunk_bytes)
        assert [check.add(t) for t in tensors] == list(range(len(tensors)))
        assert check.bad() == [2, 7, 16, 17]
        assert all(check.covers(t) for t in tensors) and not check.covers(torch.zeros(1))


def test_a_clean_stream_has_nothing_flagged():
    check = FiniteCheck(64)
    for t in _tensors():
        check.add(t)
    assert check.bad() == []


def _writes(tensors: list[torch.Tensor]) -> list[WeightWrite]:
    return [WeightWrite(f"w{i}", torch.empty_like(t), None, t) for i, t in enumerate(tensors)]


def test_loader_names_the_first_bad_write_whether_checked_early_or_late():
    tensors = _tensors()
    tensors[9][0] = float("nan")  # seen by the early check
    tensors[4][3] = float("inf")  # not seen by it: checked by the loader itself, and first
    check = FiniteCheck(1)
    for i, t in enumerate(tensors):
        if i != 4:
            check.add(t)
    try:
        _check_finite(_writes(tensors), check)
    except ValueError as error:
        assert "'w4' has non-finite values" in str(error)
    else:
        raise AssertionError("a NaN/Inf update was accepted")
    tensors[4][3] = 0.0
    check = FiniteCheck(1)
    for i, t in enumerate(tensors):
        if i != 4:
            check.add(t)
    try:
        _check_finite(_writes(tensors), check)
    except ValueError as error:
        assert "'w9' has non-finite values" in str(error)
    else:
        raise AssertionError("a NaN update was accepted")
    tensors[9][0] = 1.0
    _check_finite(_writes(tensors), FiniteCheck(1))  # nothing covered, nothing bad: no error
