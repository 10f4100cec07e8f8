"""Finished rollouts -> the tensors a trainer scores: one typed batch, no dicts.

Two layouts of the same samples, both giving the logits that predict every response token:

rows (one sequence per sample): the prompt right-aligned to a common width P (left
padding), then the response left-aligned to the longest response R:

    [pad p0 p1 p2 | r0 r1 pad]                       width W = P + R

packed (one sequence per prompt, its n samples after it): the GRPO group's shared prompt
is computed once, as the engine's prefix cache does, and each response attends to the
prompt and to itself only (a 4D mask), at the positions it would have on its own:

    [pad p0 p1 p2 | a0 a1 pad | b0 b1 b2 | ...]      width W = P + n * R

The packed layout feeds the model P + n*R tokens per group instead of n*(P + R): 3x fewer
for SmolLM2's ~30-token chat prompts, 8 samples and 8-token answers. It needs a model that
takes a custom 4D float mask and explicit position ids (Llama, Qwen2/3, Mistral with the
sdpa or eager attention of transformers); the rows layout only needs a 2D padding mask.

In both layouts the logits that matter are the last W - P + 1 columns minus the last one
(a model that supports `logits_to_keep` projects only those onto the vocabulary), and
`predict_index[b, t]` says which of those columns predicts token t of sample b.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch

from rollout.request import RolloutOutput

LAYOUTS = ("packed", "rows")


@dataclass
class TrainBatch:
    # what the model reads: X sequences (X = samples for rows, groups for packed)
    input_ids: torch.Tensor  # [X, W] int64
    attention_mask: torch.Tensor  # rows: [X, W] int64 (0 on padding); packed: [X, 1, W, W] float additive
    position_ids: torch.Tensor  # [X, W] int64
    # what is scored: B samples (B = X * group_size for packed)
    source_row: torch.Tensor  # [B] int64: the sequence that holds sample b
    predict_index: torch.Tensor  # [B, R] int64: column (from P - 1) whose logits predict token t
    response_ids: torch.Tensor  # [B, R] int64 (0 on padding)
    response_mask: torch.Tensor  # [B, R] float32, 1 on response tokens
    rollout_logprobs: torch.Tensor  # [B, R] float32, the engine's log-probs (0 on padding)
    token_versions: torch.Tensor  # [B, R] int64, weight version that sampled each token (-1 on padding)
    advantages: torch.Tensor  # [B] float32
    prompt_width: int  # P
    group_size: int  # n: samples b = g * n ... g * n + n - 1 share prompt g
    layout: str

    @property
    def num_samples(self) -> int:
        return self.response_ids.shape[0]

    @property
    def num_groups(self) -> int:
        return self.num_samples // self.group_size

    @property
    def response_width(self) -> int:
        return self.response_ids.shape[1]

    @property
    def logits_to_keep(self) -> int:
        """Columns P - 1 .. W - 1: every column that predicts a response token (and the last)."""
        return self.input_ids.shape[1] - self.prompt_width + 1

    def groups(self, start: int, end: int) -> TrainBatch:
        """Groups (prompts) [start, end): a mini- or micro-batch that keeps groups whole."""
        n = self.group_size
        samples = slice(start * n, end * n)
        if self.layout == "packed":
            seqs, source = slice(start, end), self.source_row[samples] - start
        else:
            seqs, source = samples, self.source_row[samples] - start * n
        return TrainBatch(self.input_ids[seqs], self.attention_mask[seqs], self.position_ids[seqs], source,
                          self.predict_index[samples], self.response_ids[samples], self.response_mask[samples],
                          self.rollout_logprobs[samples], self.token_versions[samples], self.advantages[samples],
                          self.prompt_width, n, self.layout)

    def to(self, device: torch.device | str) -> TrainBatch:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return TrainBatch(**{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in values.items()})


def build_batch(outputs: Sequence[RolloutOutput], advantages: torch.Tensor, group_size: int,
                layout: str = "packed", versions: Sequence[Sequence[int]] | None = None, pad_id: int = 0,
                mask_dtype: torch.dtype = torch.float32) -> TrainBatch:
    """Outputs in groups of `group_size` consecutive samples of one prompt (prompt-major, as
    the engine returns them); `advantages` is [len(outputs)]; `versions`: per output, the
    version that sampled each token (default: the base weights' spans, weight_versions).
    mask_dtype: the model's dtype (the packed layout's additive mask meets its scores)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}: expected one of {LAYOUTS}")
    if not outputs or len(outputs) % group_size:
        raise ValueError(f"build_batch: {len(outputs)} rollouts do not make groups of {group_size}")
    if advantages.shape != (len(outputs),):
        raise ValueError(f"advantages: expected shape ({len(outputs)},), got {tuple(advantages.shape)}")
    for i, out in enumerate(outputs):
        if len(out.logprobs) != len(out.token_ids):
            raise ValueError(f"rollout {out.request_id}: {len(out.logprobs)} log-probs for {len(out.token_ids)} tokens")
        if not out.prompt_ids:
            raise ValueError(f"rollout {out.request_id}: empty prompt")
        if out.prompt_ids != outputs[i - i % group_size].prompt_ids:
            raise ValueError(f"rollout {out.request_id}: not the same prompt as the rest of its group")
    samples = len(outputs)
    prompt_width = max(len(o.prompt_ids) for o in outputs)
    response_width = max(1, max(len(o.token_ids) for o in outputs))
    response_ids = torch.zeros((samples, response_width), dtype=torch.int64)
    response_mask = torch.zeros((samples, response_width), dtype=torch.float32)
    rollout_logprobs = torch.zeros((samples, response_width), dtype=torch.float32)
    token_versions = torch.full((samples, response_width), -1, dtype=torch.int64)
    if versions is not None and [len(v) for v in versions] != [len(o.token_ids) for o in outputs]:
        raise ValueError("versions: expected one version per response token of every output")
    for b, out in enumerate(outputs):
        r = len(out.token_ids)
        if r:
            response_ids[b, :r] = torch.tensor(out.token_ids)
            response_mask[b, :r] = 1.0
            rollout_logprobs[b, :r] = torch.tensor(out.logprobs, dtype=torch.float32)
            token_versions[b, :r] = torch.tensor(list(versions[b]) if versions is not None else
                                                 versions_from_spans(out.weight_versions, out.weight_version, r))
    targets = (response_ids, response_mask, rollout_logprobs, token_versions, advantages.to(torch.float32))
    if layout == "rows":
        inputs = _rows(outputs, prompt_width, response_width, pad_id)
    else:
        inputs = _packed(outputs, group_size, prompt_width, response_width, pad_id, mask_dtype)
    return TrainBatch(*inputs, *targets, prompt_width, group_size, layout)


def versions_from_spans(spans: Sequence[tuple[int, int, int]] | None, default: int, length: int) -> list[int]:
    """Per-token versions from an output's (version, start, end) spans (`default` where none)."""
    per_token = [default] * length
    for version, start, end in spans or ():
        per_token[start:end] = [version] * (end - start)
    return per_token


def _rows(outputs: Sequence[RolloutOutput], prompt_width: int, response_width: int, pad_id: int):
    samples, width = len(outputs), prompt_width + response_width
    input_ids = torch.full((samples, width), pad_id, dtype=torch.int64)
    attention_mask = torch.zeros((samples, width), dtype=torch.int64)
    for b, out in enumerate(outputs):
        p, r = len(out.prompt_ids), len(out.token_ids)
        input_ids[b, prompt_width - p : prompt_width] = torch.tensor(out.prompt_ids)
        input_ids[b, prompt_width : prompt_width + r] = torch.tensor(out.token_ids, dtype=torch.int64)
        attention_mask[b, prompt_width - p : prompt_width + r] = 1
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    source_row = torch.arange(samples)
    predict_index = torch.arange(response_width).expand(samples, response_width).clone()
    return input_ids, attention_mask, position_ids, source_row, predict_index


def _packed(outputs: Sequence[RolloutOutput], n: int, prompt_width: int, response_width: int, pad_id: int,
            mask_dtype: torch.dtype):
    groups, width = len(outputs) // n, prompt_width + n * response_width
    input_ids = torch.full((groups, width), pad_id, dtype=torch.int64)
    position_ids = torch.zeros((groups, width), dtype=torch.int64)
    valid = torch.zeros((groups, width), dtype=torch.bool)
    # segment 0: the prompt; segment i + 1: sample i's response
    segment = torch.zeros(width, dtype=torch.int64)
    for i in range(n):
        segment[prompt_width + i * response_width : prompt_width + (i + 1) * response_width] = i + 1
    for g in range(groups):
        prompt = outputs[g * n].prompt_ids
        p = len(prompt)
        input_ids[g, prompt_width - p : prompt_width] = torch.tensor(prompt)
        position_ids[g, prompt_width - p : prompt_width] = torch.arange(p)
        valid[g, prompt_width - p : prompt_width] = True
        for i in range(n):
            tokens = outputs[g * n + i].token_ids
            start = prompt_width + i * response_width
            input_ids[g, start : start + len(tokens)] = torch.tensor(tokens, dtype=torch.int64)
            position_ids[g, start : start + response_width] = p + torch.arange(response_width)
            valid[g, start : start + len(tokens)] = True
    column = torch.arange(width)
    causal = column[None, :] <= column[:, None]  # [W(query), W(key)]
    same_or_prompt = (segment[None, :] == 0) | (segment[None, :] == segment[:, None])
    allowed = causal & same_or_prompt & valid[:, None, :]  # [G, Wq, Wk]
    allowed |= torch.eye(width, dtype=torch.bool)  # padding queries see themselves: no empty softmax row
    attention_mask = torch.zeros((groups, 1, width, width), dtype=mask_dtype)
    attention_mask.masked_fill_(~allowed[:, None], torch.finfo(mask_dtype).min)
    source_row = torch.arange(groups).repeat_interleave(n)
    # column j (counted from P - 1) predicts: j = 0 -> every sample's first token; for
    # sample i, token t >= 1 is predicted by its own token t - 1, at j = i * R + t.
    t = torch.arange(response_width)
    per_sample = torch.stack([torch.where(t == 0, 0, i * response_width + t) for i in range(n)])  # [n, R]
    predict_index = per_sample.repeat(groups, 1)
    return input_ids, attention_mask, position_ids, source_row, predict_index
