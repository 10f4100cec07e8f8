"""The step's token mask: filled on the host for the constrained rows only, applied to the
logits on the device.

The bits (xgrammar's layout: int32 words, bit j of word w allows token 32 w + j) are filled
into pinned host memory and copied with `non_blocking=True`, so building the mask adds no
host-device sync; a step without constrained rows builds nothing and its sampling runs
exactly as before. Rows without drafts are filled by xgrammar's BatchGrammarMatcher (C++
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
    rows: torch.Tensor  # [C] int64, device: the logits rows it constrains
    bits: torch.Tensor  # [C, ceil(V / 32)] int32, device: 1 = allowed


class MaskBuilder:
    def __init__(self, vocab_size: int, threads: int | str = "auto") -> None:
        import xgrammar as xgr

        self.vocab_size = vocab_size
        self.words = (vocab_size + _BITS - 1) // _BITS
        self._batch = xgr.BatchGrammarMatcher(max_threads=threads)

    def build(self, rows: list[tuple[int, GrammarState, list[int]]], device: torch.device) -> TokenMask | None:
        """`rows`: (first sampling row, state, drafts) of each constrained request that samples
        this step. A request finished while its token was in flight (overlap) gets no mask:
        its row's token is dropped at read back."""
        live = [(row, state, drafts) for row, state, drafts in rows if not state.terminated]
        if not live:
            return None
        num_rows = sum(1 + len(d) for _, _, d in live)
        pin = device.type == "cuda"
        bits = torch.full((num_rows, self.words), -1, dtype=torch.int32, pin_memory=pin)  # -1: all 32 bits set
        logits_rows: list[int] = []
        plain: list[Any] = []
        plain_at: list[int] = []
        for row, state, drafts in live:
            at = len(logits_rows)
            logits_rows.extend(range(row, row + 1 + len(drafts)))
            if drafts:
                state.fill_rows(bits, at, drafts)
            else:
                plain.append(state.matcher)
                plain_at.append(at)
        if plain:
            self._batch.batch_fill_next_token_bitmask(plain, bits, plain_at)
        rows_tensor = torch.tensor(logits_rows, dtype=torch.int64, pin_memory=pin)
        return TokenMask(to_device(rows_tensor, device), to_device(bits, device))


@torch.inference_mode()  # the logits are inference tensors (the forward ran in that mode)
def apply_mask_(logits: torch.Tensor, mask: TokenMask) -> None:
    """Set the tokens each constrained row's grammar refuses to -inf, in place. [B, V]
    (The sampler takes the raw log-probs before this.) Other rows are not touched."""
    shifts = torch.arange(_BITS, device=logits.device, dtype=torch.int32)
    allowed = ((mask.bits[:, :, None] >> shifts) & 1).bool().reshape(mask.bits.shape[0], -1)  # [C, 32 W]
    allowed = allowed[:, : logits.shape[-1]]
    logits[mask.rows] = logits[mask.rows].masked_fill(~allowed, float("-inf"))
