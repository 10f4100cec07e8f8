"""Which decode rows share a KV prefix: the host side of shared-prefix attention (prefix_kernel.py).

Two kinds of rows share one:
- Requests (`plan`). A request's first `num_prefix_tokens` KV slots are owned by the radix
  tree (rollout/cache/manager.py), so two requests share those slots exactly when their
  prefixes end at the same tree slot with the same length: a slot belongs to one node, and a
  node has one path from the root. n samples forked from one prompt, or the same prompt
  matched again from the cache, land in one group.
- One request's rows (`plan_spans`). A step laid out as rows (ModelRunner._prepare_rows: a
  verify's positions, a draft tree's nodes, a small prefill's tokens) gives each new token
  a row whose KV starts with the request's slots before the step. A 47-node tree's 48 rows
  each re-read that context, which makes attention a large part of a tree verify, but those
  reads hit L2, and below SPAN_MIN_ROWS rows the prefix pass's launch cost more than it
  saved. Past it, a step's requests' rows are grouped (BENCHMARKS.md, speculative decoding,
  "2026-12-07: the KV move on a GPU, where a tree verify's time goes, ...").
Planned per step from host state alone (no device sync) and shipped in one host-to-device copy.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from rollout.batch import SharedPrefixes
from rollout.device import to_device
from rollout.request import Req

# A group's prefix shorter than this is attended with the rest of its rows' KV: the pass of
# its own costs a launch a layer and saves little.
MIN_PREFIX_TOKENS = 64
# A step groups its rows only when the groups save reading at least this many KV tokens a
# layer (sum over groups of (rows - 1) x prefix): below it the extra launch outweighs them.
MIN_SHARED_TOKENS = 4096
# A step laid out as rows groups each request's rows only when it has at least this many
# rows. Up to 48 rows every step attends with the Triton decode (rollout.attention.SMALL_DECODE_ROWS)
# and its re-reads hit L2: the step is latency-bound and the prefix pass mostly costs more than
# it saves. Past 48 rows, rows not grouped attend with FlashInfer's pages, each reading the
# context from memory, and grouping wins (BENCHMARKS.md, speculative decoding, "2026-12-07: the
# KV move on a GPU, where a tree verify's time goes, ...").
SPAN_MIN_ROWS = 49


def group_rows(reqs: Sequence[Req], table: np.ndarray, members_max: int,
               min_prefix: int | None = None) -> list[tuple[int, list[int]]]:
    """(prefix length, rows) of each group of >= 2 rows, at most members_max rows each."""
    if members_max < 2:
        return []
    min_prefix = MIN_PREFIX_TOKENS if min_prefix is None else min_prefix
    by_prefix: dict[tuple[int, int], list[int]] = {}
    for i, req in enumerate(reqs):
        p = req.num_prefix_tokens
        if p >= min_prefix and req.req_pool_idx is not None:
            by_prefix.setdefault((int(table[req.req_pool_idx, p - 1]), p), []).append(i)
    groups = []
    for (_, p), rows in by_prefix.items():
        for at in range(0, len(rows), members_max):
            chunk = rows[at : at + members_max]
            if len(chunk) >= 2:
                groups.append((p, chunk))
    return groups


def group_spans(spans: Sequence[tuple[int, int, int]], members_max: int,
                min_prefix: int | None = None) -> list[tuple[int, list[int]]]:
    """(prefix length, rows) groups of each (prefix, first row, rows) span: a request's rows
    first_row .. first_row + rows - 1, whose KV all start with the same `prefix` slots; in
    chunks of at most members_max rows, >= 2 each."""
    if members_max < 2:
        return []
    min_prefix = MIN_PREFIX_TOKENS if min_prefix is None else min_prefix
    groups = []
    for prefix, first, n in spans:
        if prefix < min_prefix:
            continue
        for at in range(first, first + n, members_max):
            chunk = list(range(at, min(at + members_max, first + n)))
            if len(chunk) >= 2:
                groups.append((prefix, chunk))
    return groups


def pack(groups: Sequence[tuple[int, Sequence[int]]], num_rows: int, device: torch.device) -> SharedPrefixes:
    """The device form of `groups` for a step of num_rows rows (one copy)."""
    g_max = SharedPrefixes.max_groups(num_rows)
    if len(groups) > g_max:
        raise ValueError(f"{len(groups)} prefix groups for {num_rows} rows (at most {g_max})")
    row_skip = np.zeros(num_rows, dtype=np.int32)
    grp_len = np.zeros(g_max, dtype=np.int32)
    grp_indptr = np.zeros(g_max + 1, dtype=np.int32)
    grp_rows = np.zeros(num_rows, dtype=np.int32)
    at = shared = 0
    for g, (p, rows) in enumerate(groups):
        if len(rows) < 2 or p < 1:
            raise ValueError(f"prefix group {g}: needs >= 2 rows and a prefix, got {len(rows)} rows, prefix {p}")
        grp_len[g] = p
        grp_rows[at : at + len(rows)] = rows
        row_skip[list(rows)] = p
        at += len(rows)
        grp_indptr[g + 1] = at
        shared += (len(rows) - 1) * p
    grp_indptr[len(groups) + 1 :] = at
    if at > num_rows or len(set(int(r) for r in grp_rows[:at])) != at:
        raise ValueError("prefix groups must hold distinct rows of the step")
    packed = to_device(torch.from_numpy(np.concatenate([row_skip, grp_len, grp_indptr, grp_rows])), device)
    b, g = num_rows, g_max
    return SharedPrefixes(packed[:b], packed[b : b + g], packed[b + g : b + 2 * g + 1], packed[b + 2 * g + 1 :],
                          num_groups=len(groups), shared_tokens=shared)


def plan(reqs: Sequence[Req], table: np.ndarray, members_max: int, device: torch.device,
         min_shared: int | None = None) -> SharedPrefixes | None:
    """The step's groups, or None when they would save less than min_shared KV tokens."""
    return _worth(group_rows(reqs, table, members_max), len(reqs), device, min_shared)


def plan_spans(spans: Sequence[tuple[int, int, int]], num_rows: int, members_max: int, device: torch.device,
               min_shared: int | None = None) -> SharedPrefixes | None:
    """Groups of each request's rows (`group_spans`) in a step of num_rows rows, or None when
    the step has fewer than SPAN_MIN_ROWS rows or the groups would save less than min_shared
    KV tokens."""
    if num_rows < SPAN_MIN_ROWS:
        return None
    return _worth(group_spans(spans, members_max), num_rows, device, min_shared)


def _worth(groups: list[tuple[int, list[int]]], num_rows: int, device: torch.device,
           min_shared: int | None) -> SharedPrefixes | None:
    min_shared = MIN_SHARED_TOKENS if min_shared is None else min_shared
    if not groups or sum((len(rows) - 1) * p for p, rows in groups) < min_shared:
        return None
    return pack(groups, num_rows, device)
