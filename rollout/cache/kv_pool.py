"""KV memory: per-layer K/V tensors addressed by slot, a page allocator, and the
request-to-slot table.

A slot holds one token's K and V for every layer. Slots come in pages of `page_size`;
a request's token at position p always sits at offset p % page_size of its page, so a
page-aligned prefix can be shared by handing over whole pages. Page 0 is never handed
out: padded rows (CUDA-graph batches, masked attention) write and read it harmlessly.
"""

from __future__ import annotations

import torch

from rollout import kernels
from rollout.kernels import KVTarget
from rollout.kernels.options import DEFAULT_OPTIONS, KernelOptions


class OutOfSlots(RuntimeError):
    pass


class PageAllocator:
    """Free list of page ids (CPU). O(1) alloc/free; double frees are caught."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 2:
            raise ValueError(f"KV pool too small: {num_pages} pages of {page_size} tokens")
        self.num_pages = num_pages
        self.page_size = page_size
        # Hand out low pages first: reuse keeps the working set small.
        self._free: list[int] = list(range(num_pages - 1, 0, -1))
        # a byte per page, not a tensor: a release frees a few pages at a time, and torch's
        # per-op overhead on tiny index tensors was most of a request's release
        self._is_free = bytearray(b"\x01") * num_pages
        self._is_free[0] = 0

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_free_slots(self) -> int:
        return len(self._free) * self.page_size

    @property
    def capacity_slots(self) -> int:
        return (self.num_pages - 1) * self.page_size

    def alloc_pages(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfSlots(f"need {n} pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        is_free = self._is_free
        for page in pages:
            is_free[page] = 0
        return pages

    def free_pages(self, pages: list[int]) -> None:
        if not pages:
            return
        is_free, num_pages = self._is_free, self.num_pages
        if len(set(pages)) != len(pages) or any(not 0 < p < num_pages or is_free[p] for p in pages):
            raise RuntimeError(f"double free or invalid page in {pages[:8]}...")
        for page in pages:
            is_free[page] = 1
        self._free.extend(pages)

    def free_slots(self, slots: torch.Tensor) -> None:
        """Free the pages of a page-aligned run of slots (its first slot starts a page)."""
        if slots.numel() == 0:
            return
        ps = self.page_size
        if ps == 1:
            self.free_pages(slots.tolist())
            return
        firsts = slots[::ps].tolist()  # each page's first slot (python ints: cheaper than a tensor op)
        if firsts[0] % ps:
            raise RuntimeError("free_slots: run does not start on a page boundary")
        self.free_pages([slot // ps for slot in firsts])

    def slots_for_positions(self, start: int, end: int) -> torch.Tensor:
        """Slots for positions [start, end) of a request, on new whole pages: `start` is
        page-aligned (a request's partial last page is already its own, so growth inside
        it needs no allocation; see KVManager._alloc)."""
        ps, n = self.page_size, end - start
        if n <= 0:
            return torch.empty(0, dtype=torch.int64)
        if start % ps:
            raise ValueError(f"slots_for_positions: start {start} is not a multiple of page_size {ps}")
        if ps == 1:
            return torch.tensor(self.alloc_pages(n), dtype=torch.int64)
        num_pages = -(-n // ps)
        if num_pages > len(self._free):
            raise OutOfSlots(f"need {num_pages} pages, {len(self._free)} free")
        pages = torch.tensor(self.alloc_pages(num_pages), dtype=torch.int64)
        return (pages[:, None] * ps + torch.arange(ps)).reshape(-1)[:n]

    def pages_needed(self, start: int, end: int) -> int:
        """New pages for positions [start, end): the page holding position start-1 is
        already owned, so only pages that begin inside the range are new."""
        ps = self.page_size
        return max(0, -(-end // ps) - (-(-start // ps)))


class KVPool:
    """Per-layer K/V buffers `[num_slots, num_kv_heads, head_dim]` and their allocator."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        max_total_tokens: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        options: KernelOptions = DEFAULT_OPTIONS,
    ) -> None:
        self.fused = options.fused  # the KV store's and copies' kernels (KernelOptions.fused)
        num_pages = -(-max_total_tokens // page_size) + 1  # +1: the reserved padding page
        self.allocator = PageAllocator(num_pages, page_size)
        self.page_size = page_size
        self.num_slots = num_pages * page_size
        self.num_layers = num_layers
        shape = (self.num_slots, num_kv_heads, head_dim)
        # zeros, not empty: padded reads must see finite values (0 * NaN is NaN).
        self.k_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()

    def target(self, layer_id: int, slots: torch.Tensor) -> KVTarget:
        return KVTarget(self.k_buffers[layer_id], self.v_buffers[layer_id], slots, self.fused)

    def store(self, layer_id: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        # slots: [num_tokens]; k, v: [num_tokens, num_kv_heads, head_dim]
        self.target(layer_id, slots).write(k, v)

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy every layer's KV from slots `src` to slots `dst` (CPU int tensors): a fork's
        partial page, a draft tree's accepted path. No move may read a slot an earlier move
        writes. On the GPU one launch for all layers (kernels/kv_copy.py says why)."""
        if kernels.use_fused(self.k_buffers[0], self.fused):
            kernels.kv_copy.copy_slots([*self.k_buffers, *self.v_buffers], src, dst)
            return
        for k, v in zip(self.k_buffers, self.v_buffers):
            k[dst] = k[src]
            v[dst] = v[src]


class ReqSlotTable:
    """Request row -> KV slot of each of its positions. CPU int64: the scheduler reads and writes it
    every step, and the runner ships only the slices a batch needs to the device."""

    def __init__(self, max_requests: int, max_context_len: int) -> None:
        self.table = torch.zeros((max_requests, max_context_len), dtype=torch.int64)
        self._free = list(range(max_requests - 1, -1, -1))
        self.max_requests = max_requests

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self) -> int:
        if not self._free:
            raise OutOfSlots("no free request rows")
        return self._free.pop()

    def free(self, row: int) -> None:
        self._free.append(row)
