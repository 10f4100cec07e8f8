"""Which program of the deterministic attention kernel computes which token rows.

A step's new tokens are rows of q, grouped by request (request b owns rows
qo_indptr[b] : qo_indptr[b + 1]). The kernel (deterministic_triton.py) runs one program per
block of up to `tokens` consecutive new tokens of ONE request and one KV head, so a request's
prompt chunk shares every KV tile load among its rows; a decode is a block of one token.

What a block is made of never changes a row's result: each row still reduces over its own
KV in the same tiles, in the same order (the kernel's docstring says why), so this plan may
follow the batch freely. It is built on the host from the step's CPU lengths, with tensor ops
(no Python loop over tokens), and shipped in one copy.

A launch's table is int32 [4, P], one column per program:
  0: request (index into kv_indptr)
  1: its first row in q / out
  2: how many rows it computes (1..tokens)
  3: how many of the request's new tokens come after its first row (its KV ends that many
     slots before the request's: row t of the block sees kv_len - back + t slots)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RowBlocks:
    """One kernel launch: `table` [4, P] (on the kernel's device) and the most rows a
    program computes (a compile-time constant of the kernel)."""

    table: torch.Tensor
    tokens: int

    @property
    def num_programs(self) -> int:
        return self.table.shape[1]


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def heads_per_kv(num_heads: int, num_kv_heads: int) -> int:
    """The GQA group padded to a power of two: a block's MMA rows are its tokens x this."""
    return _next_power_of_2(num_heads // num_kv_heads)


def plan_row_blocks(extend_lens: list[int], max_tokens: int) -> list[tuple[torch.Tensor, int]]:
    """CPU tables ([4, P] int32, tokens) for a step: requests with one new token as blocks of
    one (the decode launch, the same one the CUDA graphs replay), the others in blocks of
    `tokens` = min(max_tokens, the longest extend rounded up to a power of two), so that
    verify steps of a few draft tokens do not run 64-row blocks. At most two launches."""
    ext = torch.tensor(extend_lens, dtype=torch.int64)  # [B]
    first = torch.cumsum(ext, 0) - ext  # [B]: each request's first row
    launches = []
    singles = torch.nonzero(ext == 1)[:, 0]
    if singles.numel():
        n = singles.numel()
        launches.append((torch.stack([singles, first[singles], torch.ones(n, dtype=torch.int64),
                                      torch.zeros(n, dtype=torch.int64)]), 1))
    multi = torch.nonzero(ext > 1)[:, 0]
    if multi.numel():
        tokens = max(1, min(max_tokens, _next_power_of_2(int(ext[multi].max()))))
        blocks = -(-ext[multi] // tokens)  # [B']: programs per request
        req = torch.repeat_interleave(multi, blocks)  # [P]
        block_start = torch.cumsum(blocks, 0) - blocks
        within = torch.arange(len(req)) - torch.repeat_interleave(block_start, blocks)  # block index in its request
        j0 = within * tokens  # the block's first new token, counted within its request
        launches.append((torch.stack([req, first[req] + j0, torch.clamp(ext[req] - j0, max=tokens),
                                      ext[req] - 1 - j0]), tokens))
    return [(t.to(torch.int32), tokens) for t, tokens in launches]


def decode_table(batch_size: int, device: torch.device) -> torch.Tensor:
    """The table of a decode-only batch (request b = row b, one token, nothing after it):
    what a CUDA graph reads (a static buffer, sliced per captured size)."""
    b = torch.arange(batch_size, dtype=torch.int32, device=device)
    return torch.stack([b, b, torch.ones_like(b), torch.zeros_like(b)])
