"""Reference attention in plain torch (CPU and GPU): the backend every other is checked
against, and the CPU engine's fast path.

Three shapes of work, each batched where it can be:
- decodes (one new token): with few distinct KV lengths, one unmasked SDPA per length;
  otherwise their KV slots are gathered into a padded `[B, max_len]` index matrix once per
  step and each layer does one masked batched matmul over KV groups;
- fresh prefills (no cached prefix): the new tokens' own K/V are all there is to attend
  to, so no gather at all; prompts of equal length run as one causal SDPA call;
- extends over a cached prefix (chunks, cache hits, resumes): one request at a time with
  an explicit causal-with-offset mask.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.nn.functional as F

from rollout.attention.base import AttentionBackend
from rollout.batch import ForwardBatch

_MAX_LENGTH_GROUPS = 4  # above this many distinct decode lengths, one masked batched pass wins


class TorchAttention(AttentionBackend):
    name = "torch"
    slot_lists = True

    def plan(self, batch: ForwardBatch) -> None:
        super().plan(batch)
        device = batch.kv_indices.device
        nd = batch.num_decode
        self.decode_idx = self.decode_mask = None
        self.decode_groups: list[tuple[torch.Tensor, int, torch.Tensor]] = []
        if nd and len(set(batch.seq_lens[:nd])) <= _MAX_LENGTH_GROUPS:
            # Few distinct lengths (n samples of a prompt decode in lockstep): one unmasked
            # SDPA per length, several times faster on CPU than the masked matmuls below.
            by_len: dict[int, list[int]] = defaultdict(list)
            for i, n in enumerate(batch.seq_lens[:nd]):
                by_len[n].append(i)
            starts = batch.kv_indptr[:nd].long()
            for n, rows in by_len.items():
                row_t = torch.tensor(rows, device=device)
                idx = (starts[row_t][:, None] + torch.arange(n, device=device)).reshape(-1)
                self.decode_groups.append((row_t, n, batch.kv_indices[idx]))
        elif nd:
            lens = torch.tensor(batch.seq_lens[:nd], device=device)
            max_len = int(max(batch.seq_lens[:nd]))
            starts = batch.kv_indptr[:nd].long()
            offs = torch.arange(max_len, device=device)
            self.decode_mask = offs[None, :] < lens[:, None]  # [Bd, max_len]
            gather = (starts[:, None] + offs[None, :]).clamp(max=batch.kv_indices.numel() - 1)
            # Padded positions read slot 0 (the reserved padding page) and are masked out.
            self.decode_idx = torch.where(self.decode_mask, batch.kv_indices[gather], 0)
        # fresh prefills grouped by length: n -> token row offsets of each request
        fresh: dict[int, list[int]] = defaultdict(list)
        self.extends: list[tuple[int, int, torch.Tensor, torch.Tensor]] = []
        q_start = nd
        kv_start = sum(batch.seq_lens[:nd])
        for n, seq_len in zip(batch.extend_lens[nd:], batch.seq_lens[nd:]):
            if seq_len == n:
                fresh[n].append(q_start)
            else:
                kv_idx = batch.kv_indices[kv_start : kv_start + seq_len]
                # new token i sits at position seq_len - n + i and sees positions <= that
                q_pos = torch.arange(seq_len - n, seq_len, device=device)
                mask = torch.arange(seq_len, device=device)[None, :] <= q_pos[:, None]  # [n, seq_len]
                self.extends.append((q_start, q_start + n, kv_idx, mask))
            q_start += n
            kv_start += seq_len
        self.fresh = [
            (n, (torch.tensor(starts, device=device)[:, None] + torch.arange(n, device=device)).reshape(-1))
            for n, starts in fresh.items()
        ]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
               batch: ForwardBatch, out: torch.Tensor) -> None:
        hkv, d = self.num_kv_heads, self.head_dim
        group = self.num_heads // hkv
        for rows, n, kv_idx in self.decode_groups:
            b = rows.numel()
            keys = k_buf.index_select(0, kv_idx).view(b, n, hkv, d).transpose(1, 2)  # [b, Hkv, n, D]
            values = v_buf.index_select(0, kv_idx).view(b, n, hkv, d).transpose(1, 2)
            # the G query heads sharing a KV head attend as G query rows: no GQA expansion
            qg = q.index_select(0, rows).view(b, hkv, group, d)  # [b, Hkv, G, D]
            o = F.scaled_dot_product_attention(qg, keys, values, scale=self.scale)
            out.index_copy_(0, rows, o.reshape(b, self.num_heads, d))
        if self.decode_idx is not None:
            nd = batch.num_decode
            flat = self.decode_idx.reshape(-1)
            shape = (*self.decode_idx.shape, hkv, d)
            # index_select, not k_buf[idx]: several times faster for this gather on CPU
            keys = k_buf.index_select(0, flat).view(shape).transpose(1, 2)  # [Bd, Hkv, L, D]
            values = v_buf.index_select(0, flat).view(shape).transpose(1, 2)
            qg = q[:nd].reshape(nd, hkv, group, d)  # [Bd, Hkv, G, D]
            scores = torch.matmul(qg, keys.transpose(-1, -2)).float() * self.scale  # [Bd, Hkv, G, L]
            scores.masked_fill_(~self.decode_mask[:, None, None, :], float("-inf"))
            probs = torch.softmax(scores, dim=-1).to(q.dtype)
            out[:nd] = torch.matmul(probs, values).reshape(nd, self.num_heads, d)
        for n, rows in self.fresh:
            b = rows.numel() // n
            qs = q[rows].reshape(b, n, self.num_heads, d).transpose(1, 2)  # [b, H, n, D]
            ks = k[rows].reshape(b, n, hkv, d).transpose(1, 2)  # [b, Hkv, n, D]
            vs = v[rows].reshape(b, n, hkv, d).transpose(1, 2)
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=self.scale, enable_gqa=group > 1)
            out[rows] = o.transpose(1, 2).reshape(b * n, self.num_heads, d)
        for q_start, q_end, kv_idx, mask in self.extends:
            qs = q[q_start:q_end].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
            keys = k_buf.index_select(0, kv_idx).transpose(0, 1).unsqueeze(0)  # [1, Hkv, L, D]
            values = v_buf.index_select(0, kv_idx).transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qs, keys, values, attn_mask=mask, scale=self.scale, enable_gqa=group > 1)
            out[q_start:q_end] = o[0].transpose(0, 1)
