"""Reward functions and tasks: units, by hand."""

from __future__ import annotations

import pytest

from rollout.request import RolloutOutput
from rollout.rl.rewards import answer_only_format, arithmetic_reward, correct_answer, is_bare_integer, last_integer
from rollout.rl.tasks import ArithmeticTask, Epochs, EvenTokenTask


def _output(text: str | None = None, token_ids: list[int] | None = None) -> RolloutOutput:
    tokens = token_ids or [5]
    return RolloutOutput("r", 0, 0, [1, 2], tokens, [-1.0] * len(tokens), "stop", text, 0, 0, [(0, 0, len(tokens))])


@pytest.mark.parametrize(("text", "want"), [
    ("12", 12), ("7 + 5 = 12", 12), ("The answer is 1,024.", 1024), ("-3", -3), ("no digits", None),
    ("", None), ("3 apples and 4 pears", 4),
])
def test_last_integer(text: str, want: int | None) -> None:
    assert last_integer(text) == want


@pytest.mark.parametrize(("text", "want"), [
    ("12", True), (" 12\n", True), ("12.", True), ("-7", True), ("12 apples", False), ("7 + 5 = 12", False),
    ("", False), ("1.5", False), ("twelve", False),
])
def test_is_bare_integer(text: str, want: bool) -> None:
    assert is_bare_integer(text) is want
    assert answer_only_format(text) == float(want)


@pytest.mark.parametrize(("text", "answer", "want"), [
    ("12", 12, 1.0),               # bare and correct
    ("7 + 5 = 12", 12, 0.75),      # correct, wrapped in words
    ("13", 12, 0.25),              # bare but wrong: the format alone
    ("7 + 5 = 13", 12, 0.0),       # wrong and wordy
    ("12 is 7 + 5", 12, 0.0),      # the LAST number is what counts
    ("", 12, 0.0),
])
def test_arithmetic_reward(text: str, answer: int, want: float) -> None:
    assert arithmetic_reward(text, answer) == pytest.approx(want)
    assert correct_answer(text, answer) == float(want >= 0.75)


def test_arithmetic_reward_weights() -> None:
    assert arithmetic_reward("7 + 5 = 12", 12, format_weight=0.0) == 1.0
    assert arithmetic_reward("13", 12, format_weight=1.0) == 1.0
    with pytest.raises(ValueError, match="format_weight"):
        arithmetic_reward("12", 12, format_weight=1.5)


def test_arithmetic_task_problems_are_deterministic_and_correct() -> None:
    task = ArithmeticTask(max_operand=20, seed=3)
    first, again = task.problems(step=4, count=6), task.problems(step=4, count=6)
    assert first == again
    assert task.problems(step=4, count=3) == first[:3], "a problem does not depend on the batch size"
    assert task.problems(step=5, count=6) != first
    for p in first:
        a, b = (int(x) for x in p.prompt.removeprefix("What is ").split("?")[0].split(" + "))
        assert 1 <= a <= 20 and 1 <= b <= 20 and p.answer == a + b
    assert task.reward(first[0], _output(str(first[0].answer))) == 1.0
    assert task.reward(first[0], _output(None)) == 0.0  # no text (no tokenizer): nothing to read


def test_arithmetic_task_prompt_uses_the_chat_template() -> None:
    class Tok:
        def apply_chat_template(self, messages, add_generation_prompt, tokenize):
            assert add_generation_prompt and not tokenize
            return "|".join(f"{m['role']}:{m['content']}" for m in messages)

        def encode(self, text, add_special_tokens):
            assert not add_special_tokens  # the template already holds the special tokens
            return [len(part) for part in text.split("|")]

    task = ArithmeticTask(system_prompt="Be brief.")
    problem = task.problems(0, 1)[0]
    assert task.prompt_ids(problem, Tok()) == [len("system:Be brief."), len(f"user:{problem.prompt}")]
    with pytest.raises(ValueError, match="tokenizer"):
        task.prompt_ids(problem, None)


def test_epochs_walk_one_dataset_in_order_and_wrap() -> None:
    task = EvenTokenTask(vocab_size=50, prompt_len=4, seed=1)
    pool = task.problems(0, 5)
    epochs = Epochs(task, 5)
    assert epochs.problems(0, 3) == pool[:3] and epochs.problems(1, 3) == [pool[3], pool[4], pool[0]]
    assert epochs.problems(5, 5) == pool  # step 5 of 5 per step: the sixth epoch, in the same order
    assert epochs.reward(pool[0], _output(token_ids=[2, 4])) == task.reward(pool[0], _output(token_ids=[2, 4]))
    assert "dataset of 5" in epochs.name
    with pytest.raises(ValueError, match="Epochs.size=0"):
        Epochs(task, 0)


def test_even_token_task() -> None:
    task = EvenTokenTask(vocab_size=50, prompt_len=4, seed=1)
    problems = task.problems(0, 3)
    assert all(len(p.prompt_ids) == 4 and all(0 <= t < 50 for t in p.prompt_ids) for p in problems)
    assert task.prompt_ids(problems[0], None) == list(problems[0].prompt_ids)
    assert task.reward(problems[0], _output(token_ids=[2, 3, 4, 7])) == 0.5
    assert task.reward(problems[0], _output(token_ids=[1])) == 0.0
