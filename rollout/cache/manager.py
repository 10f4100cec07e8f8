"""KVManager: the one place that moves slots between requests, the radix tree and the
allocator. The scheduler asks it questions in token counts; it never sees a page.

Invariant per running request (row r of the request table):
  table[r, :num_prefix_tokens]                  slots owned by the tree (locked via last_node)
  table[r, num_prefix_tokens:num_allocated_slots]  slots the request owns
The page holding position num_allocated_slots - 1 is the request's whole, and its table
entries are written to the page's end (page-aligned prefixes make every boundary a page
boundary), so growing inside that page needs no allocation.
"""

from __future__ import annotations

import torch

from rollout.cache.kv_pool import KVPool, OutOfSlots, ReqSlotTable
from rollout.cache.radix import RadixCache
from rollout.request import AdapterKey, Req


class KVManager:
    def __init__(self, pool: KVPool, req_table: ReqSlotTable, enable_radix: bool) -> None:
        self.pool = pool
        self.allocator = pool.allocator
        self.req_table = req_table
        self.table = req_table.table
        self.page_size = pool.page_size
        self.tree = RadixCache(self.page_size, self.allocator.free_slots) if enable_radix else None

    # ---- capacity ---------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self.allocator.capacity_slots

    def available_slots(self) -> int:
        return self.allocator.num_free_slots + (self.tree.evictable_size if self.tree else 0)

    def used_slots(self) -> int:
        """Slots held by requests or locked in the tree (the cache's unlocked part is free to reclaim)."""
        return self.capacity - self.available_slots()

    def _ensure_pages(self, num_pages: int) -> bool:
        short = num_pages - self.allocator.num_free_pages
        if short > 0 and self.tree is not None:
            self.tree.evict(short * self.page_size)
        return self.allocator.num_free_pages >= num_pages

    def pages_to_extend(self, req: Req, new_len: int) -> int:
        return self.allocator.pages_needed(req.num_allocated_slots, new_len)

    # ---- admission --------------------------------------------------------------------
    def prefix_len(self, req: Req) -> int:
        """How many leading tokens the tree could serve (without locking): for ordering."""
        if self.tree is None:
            return 0
        slots, _ = self.tree.match_prefix(req.all_ids[: req.seq_len - 1], req.cache_key)
        return slots.numel()

    def admit(self, req: Req, num_new_tokens: int, reserve_pages: int = 0) -> int | None:
        """Give a waiting request a table row, its cached prefix (locked) and slots for the
        next `num_new_tokens` after the prefix (capped to what it lacks). Returns how many
        tokens it will compute, or None (nothing changed) when memory is short."""
        if self.req_table.num_free == 0:
            return None
        prefix_slots = torch.empty(0, dtype=torch.int64)
        node = None
        if self.tree is not None:
            # At least one token must be computed to get the logits for the next one.
            prefix_slots, node = self.tree.match_prefix(req.all_ids[: req.seq_len - 1], req.cache_key)
            self.tree.inc_lock(node)
        prefix = prefix_slots.numel()
        chunk = min(num_new_tokens, req.seq_len - prefix)
        need = self.allocator.pages_needed(prefix, prefix + chunk) + reserve_pages
        if not self._ensure_pages(need):
            if node is not None:
                self.tree.dec_lock(node)  # type: ignore[union-attr]
            return None
        row = self.req_table.alloc()
        self.table[row, :prefix] = prefix_slots
        req.req_pool_idx = row
        req.last_node = node
        req.num_prefix_tokens = prefix
        req.num_computed_tokens = prefix
        req.num_allocated_slots = prefix
        self._alloc(req, prefix + chunk)
        return chunk

    def extend(self, req: Req, new_len: int) -> bool:
        """Make sure slots exist for positions [0, new_len) of a running request."""
        have = req.num_allocated_slots
        if new_len <= have:
            return True
        if new_len <= -(-have // self.page_size) * self.page_size:  # _held_end, inlined: per request per step
            # inside its last page, which the table already holds: a decode's usual case, 15
            # steps in 16 at page 16, so it costs one comparison, not three calls
            req.num_allocated_slots = new_len
            return True
        pages = self.pages_to_extend(req, new_len)
        if pages and not self._ensure_pages(pages):
            return False
        self._alloc(req, new_len)
        return True

    def _held_end(self, req: Req) -> int:
        """The end of the request's last allocated page: the table holds slots up to it."""
        ps = self.page_size
        return -(-req.num_allocated_slots // ps) * ps

    def _alloc(self, req: Req, new_len: int) -> None:
        """Slots for positions [num_allocated_slots, new_len). Pages are taken whole and the
        table is written up to the end of the last new page, so the decodes that follow
        inside that page only move the counter: no tensor op per request per step."""
        start = req.num_allocated_slots
        if new_len <= start:
            return
        ps = self.page_size
        filled = self._held_end(req)
        if new_len <= filled:
            req.num_allocated_slots = new_len
            return
        end = min(-(-new_len // ps) * ps, self.table.shape[1])
        try:  # filled is page-aligned: only whole new pages are taken
            slots = self.allocator.slots_for_positions(filled, end)
        except OutOfSlots as e:  # callers check capacity first; reaching here is a bug
            raise RuntimeError(f"KV allocation failed after capacity check: {e}") from e
        self.table[req.req_pool_idx, filled:end] = slots
        req.num_allocated_slots = new_len

    def truncate(self, req: Req, new_len: int) -> None:
        """Give back the slots of positions >= new_len (rejected draft tokens): the page
        holding position new_len - 1 stays whole (the invariant above); pages after it are
        freed. Their KV was never inserted in the tree."""
        if new_len >= req.num_allocated_slots:
            return
        ps, width = self.page_size, self.table.shape[1]
        keep_end = min(-(-new_len // ps) * ps, width)
        old_end = min(-(-req.num_allocated_slots // ps) * ps, width)
        if old_end > keep_end:
            self.allocator.free_slots(self.table[req.req_pool_idx, keep_end:old_end].clone())
        req.num_allocated_slots = new_len

    # ---- release ----------------------------------------------------------------------
    def release(self, req: Req, *, cache: bool = True) -> None:
        """Finished, aborted or retracted: computed KV goes to the tree (when on and `cache`),
        the rest back to the allocator, the row is freed. The request keeps its tokens.
        cache=False frees the request's own KV outright (made by weights or an adapter about
        to be replaced, or about to be released by sleep), leaving the prefix it shares with
        the tree to the tree."""
        row = req.req_pool_idx
        if row is None:
            return
        slots = self.table[row, : req.num_allocated_slots].clone()
        start_free = req.num_prefix_tokens if self.tree is not None else 0
        if self.tree is not None and not cache:
            self.tree.dec_lock(req.last_node)  # type: ignore[arg-type]
        elif self.tree is not None:
            n = self.tree.aligned(req.num_computed_tokens)
            present = self.tree.insert(req.all_ids[:n], slots[:n], req.cache_key)
            # [prefix, present): the tree already had other slots for these tokens.
            self.allocator.free_slots(slots[req.num_prefix_tokens : present])
            start_free = n
            self.tree.dec_lock(req.last_node)  # type: ignore[arg-type]
        self.allocator.free_slots(slots[start_free:])
        self.req_table.free(row)
        req.req_pool_idx = None
        req.last_node = None
        req.num_prefix_tokens = 0
        req.num_computed_tokens = 0
        req.num_allocated_slots = 0

    # ---- n > 1: fork the leader's prompt KV -------------------------------------------
    def share_prompt(self, leader: Req) -> None:
        """Put the leader's computed prompt in the tree now (not at finish) so followers
        can lock it; the leader's table row is pointed at the tree's slots."""
        assert self.tree is not None
        row = leader.req_pool_idx
        n = self.tree.aligned(leader.num_computed_tokens)
        slots = self.table[row, :n].clone()
        present = self.tree.insert(leader.all_ids[:n], slots, leader.cache_key)
        self.allocator.free_slots(slots[leader.num_prefix_tokens : present])
        tree_slots, node = self.tree.match_prefix(leader.all_ids[:n], leader.cache_key)
        self.table[row, :n] = tree_slots
        self.tree.inc_lock(node)
        self.tree.dec_lock(leader.last_node)  # type: ignore[arg-type]
        leader.last_node = node
        leader.num_prefix_tokens = n

    def fork(self, leader: Req, follower: Req) -> bool:
        """Give `follower` the leader's computed prompt: whole pages shared through the
        tree, the partial last page copied. False (nothing changed) if memory is short."""
        assert self.tree is not None and leader.last_node is not None
        length = leader.num_computed_tokens
        shared = leader.num_prefix_tokens
        if self.req_table.num_free == 0 or not self._ensure_pages(self.allocator.pages_needed(shared, length)):
            return False
        row = self.req_table.alloc()
        self.table[row, :shared] = self.table[leader.req_pool_idx, :shared]
        self.tree.inc_lock(leader.last_node)
        follower.req_pool_idx = row
        follower.last_node = leader.last_node
        follower.num_prefix_tokens = shared
        follower.num_allocated_slots = shared
        self._alloc(follower, length)
        if length > shared:
            self.pool.copy_slots(self.table[leader.req_pool_idx, shared:length], self.table[row, shared:length])
        follower.num_computed_tokens = length
        return True

    def flush(self) -> None:
        if self.tree is not None:
            self.tree.flush()

    def drop_adapter(self, lora_name: str) -> None:
        """Drop the cached KV of every version of one adapter (updated or unloaded)."""
        if self.tree is not None:
            self.tree.drop_namespaces(lambda key: isinstance(key, AdapterKey) and key.lora_name == lora_name)
