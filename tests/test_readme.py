"""The README's quick start runs as written (one GRPO step of one prompt instead of twelve of eight), on the real
SmolLM2-135M-Instruct on the CPU: the engine serves the policy's weights after the step."""

from __future__ import annotations

import re
from pathlib import Path

import torch

README = Path(__file__).resolve().parents[1] / "README.md"
STEPS = "for step in range(1, 13):"
PROMPTS = "task.problems(step, 8)"  # one prompt's 8 samples are a whole GRPO group: enough to check the loop


def quick_start() -> str:
    text = README.read_text()
    section = text.split("## Quick start", 1)[1]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert blocks, "README: no python block after '## Quick start'"
    return blocks[0]


def test_readme_quick_start_runs_one_grpo_step(smollm2, capsys) -> None:
    code = quick_start()
    for expected in (STEPS, PROMPTS):
        assert expected in code, f"README's quick start no longer has {expected!r}; update this test"
    code = code.replace(STEPS, "for step in range(1, 2):").replace(PROMPTS, "task.problems(step, 1)")
    namespace: dict = {}
    exec(compile(code, str(README), "exec"), namespace)
    engine, policy, rewards = namespace["engine"], namespace["policy"], namespace["rewards"]
    assert engine.weight_version == 1
    assert rewards.shape == (8,) and torch.isfinite(rewards).all()
    # the update reached the engine: its weights are the trained policy's
    trained = dict(policy.named_parameters())["model.layers.0.self_attn.o_proj.weight"]
    served = engine.model.layers[0].self_attn.o_proj.weight
    assert torch.equal(served, trained.detach())
    printed = capsys.readouterr().out.split()
    assert printed[0] == "1" and abs(float(printed[1]) - float(rewards.mean())) < 1e-6
