"""Verifiable rewards: pure functions of a response's text (and the answer it should give).

No model, no tokenizer: each is a few lines a reader can check by eye, and each has unit
tests. A task (tasks.py) picks which one scores its problems.
"""

from __future__ import annotations

import re

_INTEGER = re.compile(r"-?\d+")
_BARE_INTEGER = re.compile(r"-?\d+\.?")


def last_integer(text: str) -> int | None:
    """The last integer written in `text` (how a model's final answer is usually read), or None."""
    found = _INTEGER.findall(text.replace(",", ""))
    return int(found[-1]) if found else None


def is_bare_integer(text: str) -> bool:
    """The whole response is one integer (surrounding whitespace and one trailing '.' allowed)."""
    return _BARE_INTEGER.fullmatch(text.strip()) is not None


def correct_answer(text: str, answer: int) -> float:
    """1.0 when the last integer in the response is the answer, else 0.0."""
    return 1.0 if last_integer(text) == answer else 0.0


def answer_only_format(text: str) -> float:
    """1.0 when the response is nothing but one integer (the format the prompt asks for)."""
    return 1.0 if is_bare_integer(text) else 0.0


def arithmetic_reward(text: str, answer: int, format_weight: float = 0.25) -> float:
    """(1 - format_weight) * correct_answer + format_weight * answer_only_format, the
    accuracy-plus-format sum of DeepSeek-R1's rule-based rewards. With the default weight:
    the bare correct number 1.0, the correct number inside other words ("7 + 5 = 12") 0.75,
    a bare wrong number 0.25, anything else 0.0."""
    if not 0.0 <= format_weight <= 1.0:
        raise ValueError(f"format_weight={format_weight}: must be in [0, 1]")
    return (1.0 - format_weight) * correct_answer(text, answer) + format_weight * answer_only_format(text)
