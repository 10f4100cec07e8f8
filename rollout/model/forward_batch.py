"""ForwardBatch: everything one model step needs, as tensors on the device.

Built by the runner from a ScheduledBatch. Requests with exactly one new token (decodes)
come first, so `input_ids[:num_decode]` are their tokens; the rest are extends (prefill
chunks, resumed requests). Per-request ragged layouts use CSR offsets (indptr).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    out_cache_loc: torch.Tensor  # [T] int64: slot that receives each new token's K/V
    qo_indptr: torch.Tensor  # [B+1] int32: request b's new tokens are rows qo_indptr[b]:qo_indptr[b+1]
    kv_indptr: torch.Tensor  # [B+1] int32: request b's KV slots are kv_indices[kv_indptr[b]:kv_indptr[b+1]]
    kv_indices: torch.Tensor  # [sum(seq_lens)] int64
    logits_indices: torch.Tensor  # [R] int64: rows of the hidden states to turn into logits
    # The same facts on the CPU, for planning without a device sync.
    extend_lens: list[int]
    seq_lens: list[int]  # KV length of each request after this step
    num_decode: int
    # LoRA (None when the engine has no adapters enabled): each request's adapter slot (-1:
    # base model), one segment per request (rows qo_indptr[b]:qo_indptr[b+1]).
    lora_slots: torch.Tensor | None = None  # [B] int32
    lora_active: bool = False  # host: any request on an adapter

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens)
