"""The mask op against xgrammar's own (apply_token_bitmask_inplace), and draft rows: each row's
mask is the state after the drafts before it, the matcher rolled back after; drafts are
trimmed at the first one the grammar refuses."""

from __future__ import annotations

from concurrent.futures import Future

import pytest
import torch

from rollout.structured.bitmask import MaskBuilder, TokenMask, apply_mask_, apply_mask_torch_
from rollout.structured.matcher import GrammarState
from rollout.structured.spec import GrammarSpec

from _structured_helpers import xgr_compiler  # noqa: E402, F401 (fixtures)

xgr = pytest.importorskip("xgrammar")


def _naive(logits: torch.Tensor, bits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """Bit j of word w allows token 32 w + j (xgrammar's layout), one token at a time."""
    out = logits.clone()
    for r in rows:
        for t in range(logits.shape[-1]):
            if not (int(bits[r, t // 32]) >> (t % 32)) & 1:
                out[r, t] = float("-inf")
    return out


@pytest.mark.parametrize("path", ["host", "device"])
def test_apply_mask_on_the_constrained_rows_only(path: str) -> None:
    gen = torch.Generator().manual_seed(0)
    vocab = 200  # not a multiple of 32: the last word is partly padding
    logits = torch.randn(6, vocab, generator=gen)
    bits = torch.randint(-(2**31), 2**31 - 1, (6, (vocab + 31) // 32), dtype=torch.int32, generator=gen)
    rows = [1, 4, 5]
    expected = _naive(logits, bits, rows)
    got = logits.clone()
    apply = apply_mask_ if path == "host" else apply_mask_torch_  # the torch ops the GPU runs, on CPU tensors
    apply(got, TokenMask(rows, torch.tensor(rows), bits))
    assert torch.equal(got, expected)
    assert torch.equal(got[[0, 2, 3]], logits[[0, 2, 3]])


def _state(xgr_compiler, regex: str) -> GrammarState:
    done: Future = Future()
    done.set_result(xgr_compiler.compile_regex(regex))
    return GrammarState(GrammarSpec("regex", regex), done, [2])


def test_draft_rows_and_trimming(smollm2, xgr_compiler) -> None:
    tok = smollm2[1]
    regex = r"(abc|abd)[0-9]+;"
    state = _state(xgr_compiler, regex)
    text_ids = tok.encode("abd12;", add_special_tokens=False)
    assert state.legal_prefix(text_ids + text_ids) == len(text_ids)  # the second copy is refused at once
    assert state.legal_prefix([tok.encode("x", add_special_tokens=False)[0]]) == 0

    builder = MaskBuilder(len(tok))
    plain = _state(xgr_compiler, regex)
    mask = builder.build([(0, plain, []), (2, state, text_ids)], 3 + len(text_ids), torch.device("cpu"))
    assert mask.rows == [0, *range(2, 3 + len(text_ids))]
    reference = xgr.GrammarMatcher(xgr_compiler.compile_regex(regex), override_stop_tokens=[2])
    expected = xgr.allocate_token_bitmask(3 + len(text_ids), len(tok))  # row 1: unconstrained, all allowed
    reference.fill_next_token_bitmask(expected, 0)
    reference.fill_next_token_bitmask(expected, 2)
    for j, t in enumerate(text_ids):
        assert reference.accept_token(t)
        reference.fill_next_token_bitmask(expected, 3 + j)
    assert torch.equal(mask.bits, expected)
    # rolled back: the state still accepts the drafts from the start, then ends at EOS
    for t in text_ids:
        assert not state.accept(t)
    assert state.accept(2) and state.terminated
    assert builder.build([(0, state, [])], 1, torch.device("cpu")) is None  # a finished grammar has no mask
