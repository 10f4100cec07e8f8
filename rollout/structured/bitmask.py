"""The step's token mask: filled on the host for the constrained rows only, applied to the
logits on the device.

The bits (xgrammar's layout: int32 words, bit j of word w allows token 32 w + j; a row per
logits row, as xgrammar's kernels index them) are filled into pinned host memory and copied
with `non_blocking=True`, so building the mask adds no host-device sync; a step without
constrained rows builds nothing and its sampling runs exactly as before. Rows without drafts are filled by xgrammar's BatchGrammarMatcher (C++
threads, outside the GIL); a request verifying drafts fills its rows in order, the matcher
stepping through its drafts (matcher.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rollout.device import to_device
from rollout.structured.matcher import GrammarState

_BITS = 32


@dataclass
class TokenMask:
    rows: list[int]  # the logits rows it constrains
    row_index: torch.Tensor  # [C] int64, device: the same rows
    bits: torch.Tensor  # [R, ceil(V / 32)] int32, device: one row per logits row (-1: all allowed); 1 = allowed


class MaskBuilder:
    def __init__(self, vocab_size: int, threads: int | str = "auto") -> None:
        import xgrammar as xgr

        self.words = (vocab_size + _BITS - 1) // _BITS
        self._batch = xgr.BatchGrammarMatcher(max_threads=threads)

    def build(self, rows: list[tuple[int, GrammarState, list[int]]], num_rows: int,
              device: torch.device) -> TokenMask | None:
        """`rows`: (first logits row, state, drafts) of each constrained request that samples
        this step, out of `num_rows`. A request finished while its token was in flight
        (overlap) gets no mask: its row's token is dropped at read back."""
        live = [(row, state, drafts) for row, state, drafts in rows if not state.terminated]
        if not live:
            return None
        pin = device.type == "cuda"
        bits = torch.full((num_rows, self.words), -1, dtype=torch.int32, pin_memory=pin)  # -1: all 32 bits set
        constrained: list[int] = []
        plain: list[Any] = []
        plain_rows: list[int] = []
        for row, state, drafts in live:
            constrained.extend(range(row, row + 1 + len(drafts)))
            if drafts:
                state.fill_rows(bits, row, drafts)
            else:
                plain.append(state.matcher)
                plain_rows.append(row)
        if plain:
            self._batch.batch_fill_next_token_bitmask(plain, bits, plain_rows)
        index = torch.tensor(constrained, dtype=torch.int64, pin_memory=pin)
        return TokenMask(constrained, to_device(index, device), to_device(bits, device))


@torch.inference_mode()  # the logits are inference tensors (the forward ran in that mode)
def apply_mask_(logits: torch.Tensor, mask: TokenMask) -> None:
    """Set the tokens each constrained row's grammar refuses to -inf, in place. [R, V]
    (The sampler takes the raw log-probs before this.) Other rows are not touched.

    On the host, xgrammar's C++ kernel; on the device, torch ops on device tensors only (the
    rows come as a device index, so nothing waits for the host)."""
    if logits.device.type == "cpu":
        import xgrammar as xgr

        xgr.apply_token_bitmask_inplace(logits, mask.bits, vocab_size=logits.shape[-1], indices=mask.rows, backend="cpu")
    else:
        apply_mask_torch_(logits, mask)


def apply_mask_torch_(logits: torch.Tensor, mask: TokenMask) -> None:
    """The device path of apply_mask_: torch ops, any device."""
    shifts = torch.arange(_BITS, device=logits.device, dtype=torch.int32)
    bits = mask.bits[mask.row_index]  # [C, W]
    allowed = ((bits[:, :, None] >> shifts) & 1).bool().reshape(bits.shape[0], -1)[:, : logits.shape[-1]]  # [C, V]
    logits[mask.row_index] = logits[mask.row_index].masked_fill(~allowed, float("-inf"))
