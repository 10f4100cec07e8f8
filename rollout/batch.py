"""The step's two batches, the typed boundary between the scheduler and the runner.

ScheduledBatch (CPU) is the scheduler's choice: which requests compute how many tokens this
step. ForwardBatch (device) is the runner's layout of it: everything one model step needs,
as tensors, which the attention backends plan from. In both, requests with exactly one new
token (decodes) come first, so `input_ids[:num_decode]` are their tokens; the rest are
extends (prefill chunks, resumed requests). Per-request ragged layouts use CSR offsets
(indptr).

Knows requests' counters and draft fields; nothing of how the batch was chosen or is run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from rollout.request import Req


@dataclass
class ScheduledBatch:
    reqs: list[Req]  # decodes (1 new token) first, then extends
    extend_lens: list[int]  # tokens each request computes this step
    num_decode: int
    retracted: list[Req] = field(default_factory=list)

    def produces_token(self, i: int) -> bool:
        """Does request i reach the end of its known tokens (and drafts) this step, and so
        sample (one token per draft position, plus one)?"""
        req = self.reqs[i]
        return req.num_computed_tokens + self.extend_lens[i] == req.seq_len + len(req.draft_tokens)

    def samplers(self) -> list[Req]:
        """The requests that sample this step, in batch order."""
        if self.num_decode == len(self.reqs):  # decode-only: a decode always samples
            return list(self.reqs)
        return [r for i, r in enumerate(self.reqs) if self.produces_token(i)]


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
    # LoRA (None when the engine has no adapters enabled): which token rows run which
    # adapter slot, grouped by slot (rollout/model/lora_segments.py).
    lora: LoraInputs | None = None
    # Decode rows grouped by a shared KV prefix (n samples of a prompt), for attention that
    # reads each prefix once per group (rollout/attention/prefix_kernel.py); None: no groups.
    shared: SharedPrefixes | None = None
    # Decode rows whose KV slot lists are not pages in position order (draft tree nodes):
    # only a backend with slot_lists may attend them.
    slot_rows: bool = False

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens)

    @property
    def lora_active(self) -> bool:
        """Does any token of this step run an adapter (host-side, no sync)."""
        return self.lora is not None and self.lora.num_lora_rows > 0


@dataclass
class LoraInputs:
    """A step's LoRA segments on the device: rows row_ids[seg_indptr[g]:seg_indptr[g+1]] run
    slot seg_slots[g]. Padded to T rows and one segment per slot, so shapes depend only on
    the batch (CUDA-graph static buffers)."""

    row_ids: torch.Tensor  # [T] int32
    seg_indptr: torch.Tensor  # [S+1] int32
    seg_slots: torch.Tensor  # [S] int32
    num_lora_rows: int  # host: rows that run an adapter (row_ids past it are padding)


@dataclass
class SharedPrefixes:
    """Decode rows whose KV starts with the same slots, in groups: the rows of group g are
    grp_rows[grp_indptr[g]:grp_indptr[g+1]], and the first grp_len[g] slots of each one's KV
    are the same. Sized for B rows and max(1, B // 2) groups (a group has >= 2 rows), groups
    past the step's with length 0, so shapes depend only on B (CUDA-graph static buffers)."""

    row_skip: torch.Tensor  # [B] int32: shared tokens at the start of each row's KV (0: none)
    grp_len: torch.Tensor  # [G] int32
    grp_indptr: torch.Tensor  # [G+1] int32
    grp_rows: torch.Tensor  # [B] int32
    num_groups: int  # host
    shared_tokens: int  # host: KV tokens the groups read once instead of once a row

    @staticmethod
    def max_groups(rows: int) -> int:
        return max(1, rows // 2)
