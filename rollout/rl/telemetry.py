"""Where each step's metrics go: a local JSONL file (one JSON object per step) and a W&B run
(offline by default: no account, no network; `wandb sync` uploads it later).

A step's record is a flat dict: scalar metrics under verl-style names, plus two structured
entries that each sink renders its own way:
- "response_length/hist": {"edges": [...], "counts": [...]} (JSON as is; a wandb.Histogram);
- "samples": [{"prompt", "response", "reward"}, ...] on sample steps (a wandb.Table).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

HIST_KEY = "response_length/hist"
SAMPLES_KEY = "samples"
SAMPLE_COLUMNS = ("step", "prompt", "response", "reward")
WANDB_MODES = ("offline", "online", "disabled")


class Sink(Protocol):
    def log(self, step: int, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def histogram(values: Sequence[float], num_bins: int, upper: float) -> dict[str, list[float]]:
    """Counts of `values` in num_bins equal bins over [0, upper] (the top bin includes upper)."""
    if num_bins < 1 or not upper > 0:
        raise ValueError(f"histogram: num_bins={num_bins}, upper={upper}")
    width = upper / num_bins
    counts = [0] * num_bins
    for v in values:
        counts[min(max(int(v // width), 0), num_bins - 1)] += 1
    return {"edges": [i * width for i in range(num_bins + 1)], "counts": counts}


class JsonlSink:
    """One JSON object per step, flushed as written (a killed run keeps its finished steps)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("w")

    def log(self, step: int, record: dict[str, Any]) -> None:
        self._file.write(json.dumps({"step": step, **record}) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def resolve_wandb_mode(mode: str | None) -> str:
    """Explicit mode, else $WANDB_MODE, else offline. ("dryrun" is wandb's old word for offline.)"""
    mode = mode or os.environ.get("WANDB_MODE") or "offline"
    mode = "offline" if mode == "dryrun" else mode
    if mode not in WANDB_MODES:
        raise ValueError(f"wandb mode {mode!r}: expected one of {WANDB_MODES}")
    return mode


class WandbSink:
    """A W&B run: scalars as history, the length histogram as wandb.Histogram, samples as a
    wandb.Table. Offline unless told otherwise; the console stays ours (silent, no capture)."""

    def __init__(self, *, project: str = "rollout-grpo", mode: str | None = None, directory: str | Path = ".",
                 config: dict[str, Any] | None = None, name: str | None = None) -> None:
        import wandb

        self._wandb = wandb
        self.mode = resolve_wandb_mode(mode)
        Path(directory).mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=project, mode=self.mode, dir=str(directory), config=config or {}, name=name,
                              settings=wandb.Settings(silent=True, console="off"))

    @property
    def run_dir(self) -> str | None:
        """The run's own directory (offline-run-<time>-<id>), or None when disabled."""
        if self.mode == "disabled":
            return None
        return str(Path(self.run.dir).parent)

    def log(self, step: int, record: dict[str, Any]) -> None:
        wandb = self._wandb
        data: dict[str, Any] = {}
        for key, value in record.items():
            if key == HIST_KEY:
                data[key] = wandb.Histogram(np_histogram=(value["counts"], value["edges"]))
            elif key == SAMPLES_KEY:
                rows = [[step, s["prompt"], s["response"], s["reward"]] for s in value]
                data[key] = wandb.Table(columns=list(SAMPLE_COLUMNS), data=rows)
            elif isinstance(value, (int, float)):
                data[key] = value
        self.run.log(data, step=step)

    def close(self) -> None:
        self.run.finish()
