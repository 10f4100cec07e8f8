"""Tasks the GRPO example generates itself: problems with a checkable answer, the prompt
token ids the engine gets, and the reward of a finished sample.

A task knows its problems and how to score a response; it knows nothing about the
engine, the trainer or the batch. Problems are a pure function of (seed, step, index), so
every data-parallel rank draws the same global batch without talking to the others.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import Any, Protocol

from rollout.request import RolloutOutput
from rollout.rl.rewards import arithmetic_reward


@dataclass(frozen=True)
class Problem:
    prompt: str  # what a person reads (the samples table shows it)
    answer: int | None = None
    prompt_ids: tuple[int, ...] | None = None  # set by token-level tasks (no tokenizer needed)


class Task(Protocol):
    name: str

    def problems(self, step: int, count: int) -> list[Problem]: ...

    def prompt_ids(self, problem: Problem, tokenizer: Any) -> list[int]: ...

    def reward(self, problem: Problem, output: RolloutOutput) -> float: ...


def problem_rng(seed: int, step: int, index: int) -> random.Random:
    """A generator private to one problem: the same on every rank, independent of batch size."""
    digest = hashlib.blake2b(f"{seed}:{step}:{index}".encode(), digest_size=8).digest()
    return random.Random(int.from_bytes(digest, "little"))


@dataclass(frozen=True)
class ArithmeticTask:
    """"What is a + b? Answer with only the number." with 1 <= a, b <= max_operand.

    Reward (rewards.arithmetic_reward): accuracy (the last number in the response is the
    sum) plus a format bonus (the response is just a number).
    """

    max_operand: int = 9
    format_weight: float = 0.25
    seed: int = 0
    # None: the chat template's own default system turn. A short one keeps prompts (and
    # so training) short on CPU.
    system_prompt: str | None = None
    name: str = "arithmetic"

    def __post_init__(self) -> None:
        if self.max_operand < 1:
            raise ValueError(f"max_operand={self.max_operand}: must be >= 1")
        if not 0.0 <= self.format_weight <= 1.0:
            raise ValueError(f"format_weight={self.format_weight}: must be in [0, 1]")

    def problems(self, step: int, count: int) -> list[Problem]:
        out = []
        for index in range(count):
            rng = problem_rng(self.seed, step, index)
            a, b = rng.randint(1, self.max_operand), rng.randint(1, self.max_operand)
            out.append(Problem(f"What is {a} + {b}? Answer with only the number.", a + b))
        return out

    def prompt_ids(self, problem: Problem, tokenizer: Any) -> list[int]:
        if tokenizer is None:
            raise ValueError("ArithmeticTask needs a tokenizer in the checkpoint directory")
        messages = [{"role": "user", "content": problem.prompt}]
        if self.system_prompt is not None:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tokenizer.encode(text, add_special_tokens=False)

    def reward(self, problem: Problem, output: RolloutOutput) -> float:
        assert problem.answer is not None
        return arithmetic_reward(output.text or "", problem.answer, self.format_weight)


@dataclass(frozen=True)
class EvenTokenTask:
    """Token-level task for checkpoints without a tokenizer (the tests' tiny random models):
    random prompt ids; the reward is the fraction of response tokens with an even id.
    Rewards differ between samples of one prompt, so advantages are never all zero."""

    vocab_size: int
    prompt_len: int = 8
    seed: int = 0
    name: str = "even-tokens"

    def problems(self, step: int, count: int) -> list[Problem]:
        out = []
        for index in range(count):
            rng = problem_rng(self.seed, step, index)
            ids = tuple(rng.randrange(self.vocab_size) for _ in range(self.prompt_len))
            out.append(Problem(" ".join(map(str, ids)), prompt_ids=ids))
        return out

    def prompt_ids(self, problem: Problem, tokenizer: Any) -> list[int]:
        assert problem.prompt_ids is not None
        return list(problem.prompt_ids)

    def reward(self, problem: Problem, output: RolloutOutput) -> float:
        ids = output.token_ids
        return sum(1 for t in ids if t % 2 == 0) / len(ids) if ids else 0.0


@dataclass(frozen=True)
class Epochs:
    """A fixed dataset of `size` problems of `task`, walked in order and again once used up:
    step s takes problems s*count .. s*count+count-1 (mod size). RL recipes train several
    epochs over one dataset, so the same prompts come back under a newer policy (what the
    suffix drafter's rollout history feeds on: speculative/suffix.py)."""

    task: Any  # a Task
    size: int

    def __post_init__(self) -> None:
        if not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"Epochs.size={self.size!r}: must be an int >= 1")

    @property
    def name(self) -> str:
        return f"{self.task.name} (a dataset of {self.size})"

    def problems(self, step: int, count: int) -> list[Problem]:
        pool = self.task.problems(0, self.size)
        return [pool[(step * count + i) % self.size] for i in range(count)]

    def prompt_ids(self, problem: Problem, tokenizer: Any) -> list[int]:
        return self.task.prompt_ids(problem, tokenizer)

    def reward(self, problem: Problem, output: RolloutOutput) -> float:
        return self.task.reward(problem, output)
