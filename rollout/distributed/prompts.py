"""The prompt list of a multi-process run, the same on every rank: token ids from a JSON
file, or random ids from a seed. Knows nothing of the ranks themselves."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch


def load_prompts(path: str | Path | None, *, vocab_size: int, num_prompts: int, prompt_len: int, seed: int,
                 tokenizer: Any = None) -> list[list[int]]:
    """From `path`: a JSON list (or JSONL, one item a line) of token-id lists or strings;
    strings need `tokenizer` (anything with .encode(str) -> list[int]). Without a path:
    `num_prompts` random prompts of `prompt_len` ids below `vocab_size`, drawn from `seed`
    (a negative seed, the engine-drawn sampling mode, counts as 0)."""
    if path:
        items = _read_json_or_jsonl(Path(path).read_text())
        if any(isinstance(x, str) for x in items) and tokenizer is None:
            raise ValueError(f"{path}: text prompts need a tokenizer in the checkpoint dir")
        return [tokenizer.encode(x) if isinstance(x, str) else [int(t) for t in x] for x in items]
    g = torch.Generator().manual_seed(max(seed, 0))
    return [torch.randint(0, vocab_size, (prompt_len,), generator=g).tolist() for _ in range(num_prompts)]


def _read_json_or_jsonl(text: str) -> list[Any]:
    """One JSON list, or else one JSON value per non-blank line (JSONL)."""
    try:
        items = json.loads(text)
    except json.JSONDecodeError:  # several lines of JSON: JSONL
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    return items if isinstance(items, list) else [items]
