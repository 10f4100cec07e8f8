"""Page-level view of a step's KV layout, for kernels that address KV by page.

The engine's ForwardBatch lists every KV *slot* of each request (`kv_indices`, token
granularity). Page-addressed kernels (FlashInfer) want, per request, the ids of its pages
in order and how many tokens its last page holds. Because a request's position p always
sits at offset p % page_size of its page (the pool's invariant), the page holding
positions [j*P, (j+1)*P) is `slot_of(j*P) // P`: one gather of every P-th slot.

Index arithmetic runs on the CPU from the step's CPU-side lengths (no device sync); only
the gather of slots runs on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rollout.device import to_device


@dataclass
class PageTable:
    indptr: torch.Tensor  # [B+1] int32, CPU: request b's pages are indices[indptr[b]:indptr[b+1]]
    indices: torch.Tensor  # [num_pages] int32, on the KV device
    last_page_len: torch.Tensor  # [B] int32, CPU: tokens in each request's last page (1..P)

    def rows(self, start: int, end: int) -> PageTable:
        """The page table of requests [start, end), re-based to start at 0."""
        lo, hi = int(self.indptr[start]), int(self.indptr[end])
        return PageTable(self.indptr[start : end + 1] - lo, self.indices[lo:hi], self.last_page_len[start:end])


def page_table(seq_lens: list[int], kv_indices: torch.Tensor, page_size: int) -> PageTable:
    """Page table of requests whose KV slots are `kv_indices` (CSR by `seq_lens`, every
    length >= 1)."""
    if any(n < 1 for n in seq_lens):
        raise ValueError(f"page_table: every request needs at least one KV token, got lengths {seq_lens}")
    lens = torch.tensor(seq_lens, dtype=torch.int64)
    ps = page_size
    num_pages = (lens + ps - 1) // ps
    indptr = torch.zeros(len(seq_lens) + 1, dtype=torch.int64)
    indptr[1:] = num_pages.cumsum(0)
    last = lens - (num_pages - 1) * ps
    if ps == 1:
        indices = kv_indices.to(torch.int32)
    else:
        tok_start = lens.cumsum(0) - lens
        total = int(indptr[-1])
        # global page g of request b starts at token tok_start[b] + (g - indptr[b]) * P
        first_slot_at = torch.repeat_interleave(tok_start - indptr[:-1] * ps, num_pages, output_size=total)
        first_slot_at += torch.arange(total, dtype=torch.int64) * ps
        idx = to_device(first_slot_at, kv_indices.device)
        indices = (kv_indices.index_select(0, idx) // ps).to(torch.int32)
    return PageTable(indptr.to(torch.int32), indices, last.to(torch.int32))
