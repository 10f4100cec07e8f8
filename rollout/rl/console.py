"""The terminal view of a GRPO run: one table row per step, and a progress line (the
phase of the step in flight) that the next row overwrites. The progress line is drawn
only on a terminal; piped output gets the rows alone."""

from __future__ import annotations

import sys
from typing import Any, TextIO

# (header, width, record key, format)
COLUMNS = (
    ("step", 5, "step", "{:d}"),
    ("reward", 13, None, None),  # mean +- std
    ("len", 5, "response_length/mean", "{:.1f}"),
    ("tok/s", 6, "rollout/tokens_per_s", "{:.0f}"),
    ("hit", 4, "rollout/prefix_cache_hit_rate", "{:.0%}"),
    ("acc/v", 5, "rollout/spec_accepted_per_verify", "{:.2f}"),  # speculation: drafts accepted per verify ("-": off)
    ("sync ms", 7, "weight_sync/ms", "{:.0f}"),
    ("|dlogp| max", 11, "training/rollout_logprobs_abs_diff_max", "{:.1e}"),
    ("k3 KL", 7, "rollout_corr/k3_kl", "{:.0e}"),
    ("lag", 3, "rollout/weight_version_lag_max", "{:.0f}"),
    ("step s", 6, "timing_s/step", "{:.1f}"),
    ("wall s", 6, "timing_s/elapsed", "{:.0f}"),
)


class ConsoleTable:
    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty()
        self._header_done = False
        self._progress_shown = False

    def header(self) -> str:
        return "  ".join(h.rjust(w) for h, w, _, _ in COLUMNS)

    def row(self, step: int, record: dict[str, Any]) -> str:
        cells = []
        for header, width, key, fmt in COLUMNS:
            if header == "reward":
                text = f"{record['critic/rewards/mean']:.3f}+-{record['critic/rewards/std']:.2f}"
            elif key == "step":
                text = f"{step}"
            else:
                value = record.get(key)
                text = fmt.format(value) if value is not None else "-"
            cells.append(text.rjust(width))
        return "  ".join(cells)

    def progress(self, text: str) -> None:
        if not self.tty:
            return
        self.stream.write("\r\033[K  " + text)
        self.stream.flush()
        self._progress_shown = True

    def log(self, step: int, record: dict[str, Any]) -> None:
        if self._progress_shown:
            self.stream.write("\r\033[K")
            self._progress_shown = False
        if not self._header_done:
            self.stream.write(self.header() + "\n")
            self._header_done = True
        self.stream.write(self.row(step, record) + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self._progress_shown:
            self.stream.write("\r\033[K")
            self.stream.flush()
