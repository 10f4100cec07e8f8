"""The launchers refuse bad arguments before starting anything: argparse names the flag
(non-finite floats, out-of-range counts) and exits with code 2 before any process group."""

from __future__ import annotations

import importlib

import pytest


@pytest.mark.parametrize(
    ("script", "args", "message"),
    [
        ("launch_dp_rollout.py", ["--temperature", "nan"], "argument --temperature: must be finite, got nan"),
        ("launch_dp_rollout.py", ["--top-p", "0"], "argument --top-p: must be > 0.0"),
        ("launch_dp_rollout.py", ["--top-p", "1.5"], "argument --top-p: must be <= 1.0"),
        ("launch_dp_rollout.py", ["--samples", "0"], "argument --samples: must be >= 1, got 0"),
        ("launch_dp_rollout.py", ["--max-new-tokens", "2.5"], "argument --max-new-tokens: invalid int value"),
        ("launch_dp_rollout.py", ["--timeout-s", "inf"], "argument --timeout-s: must be finite"),
        ("launch_dp_rollout.py", ["--page-size", "0"], "argument --page-size: must be >= 1"),
        ("launch_disagg.py", ["--lr", "nan"], "argument --lr: must be finite"),
        ("launch_disagg.py", ["--steps", "0"], "argument --steps: must be >= 1"),
        ("launch_disagg.py", ["--trainer-ranks", "-1"], "argument --trainer-ranks: must be >= 1"),
        ("launch_disagg.py", ["--sync-port", "-5"], "argument --sync-port: must be >= 0"),
        ("grpo.py", ["--lr", "inf"], "argument --lr: must be finite"),
        ("grpo.py", ["--samples", "0"], "argument --samples: must be >= 1"),
        ("grpo.py", ["--kv-memory-fraction", "1.5"], "argument --kv-memory-fraction: must be <= 1.0"),
        ("grpo.py", ["--max-grad-norm", "0"], "argument --max-grad-norm: must be > 0.0"),
    ],
)
def test_bad_launcher_arguments_name_the_flag(script: str, args: list[str], message: str, capsys) -> None:
    launcher = importlib.import_module(f"scripts.{script.removesuffix('.py')}")
    with pytest.raises(SystemExit) as exit_info:
        launcher.parse_args(["--model", "unused", *args])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
