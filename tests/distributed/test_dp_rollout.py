"""rollout/distributed pieces that need no process group: the prompt split and the prompt
list. run_dp_rollout itself runs under torchrun in tests/scripts/test_launchers.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollout.distributed.dp_rollout import split_indices
from rollout.distributed.prompts import load_prompts


def test_split_covers_every_prompt_once() -> None:
    for mode in ("strided", "contiguous"):
        for n, world in [(7, 2), (2, 3), (0, 2), (16, 4)]:
            shares = [split_indices(n, r, world, mode) for r in range(world)]
            assert sorted(i for s in shares for i in s) == list(range(n)), (mode, n, world)


class _Tokenizer:
    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]


def test_prompts_from_json_or_jsonl(tmp_path: Path) -> None:
    as_json, as_jsonl = tmp_path / "p.json", tmp_path / "p.jsonl"
    as_json.write_text(json.dumps([[1, 2], "hi"]))
    as_jsonl.write_text('[1, 2]\n\n"hi"\n')
    for path in (as_json, as_jsonl):
        got = load_prompts(str(path), vocab_size=10, num_prompts=0, prompt_len=0, seed=0, tokenizer=_Tokenizer())
        assert got == [[1, 2], [104, 105]]
    with pytest.raises(ValueError, match="text prompts need a tokenizer"):
        load_prompts(str(as_json), vocab_size=10, num_prompts=0, prompt_len=0, seed=0)


def test_random_prompts_are_the_same_on_every_call() -> None:
    a = load_prompts(None, vocab_size=50, num_prompts=3, prompt_len=5, seed=4)
    assert a == load_prompts(None, vocab_size=50, num_prompts=3, prompt_len=5, seed=4)
    assert len(a) == 3 and all(len(p) == 5 and all(0 <= t < 50 for t in p) for p in a)
    assert load_prompts(None, vocab_size=50, num_prompts=3, prompt_len=5, seed=-1) == load_prompts(
        None, vocab_size=50, num_prompts=3, prompt_len=5, seed=0)
