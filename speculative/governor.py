"""SpeedGovernor: speculation only where it pays. Per-request draft lengths follow acceptance
(base.py), but whether verifying drafts beats plain decoding also depends on the batch and
the device: at batch 1 on a GPU a verify step costs about a decode step, so any accepted
draft is a win; on a compute-bound CPU, or at a large batch, the extra positions cost real
time. The governor measures both: it alternates windows of steps with drafting on and off,
compares emitted tokens per second, and keeps drafting off (for a doubling number of
windows) while plain decoding is faster, so the engine with speculation is not slower than
without it, up to the probing windows.
"""

from __future__ import annotations

WINDOW = 16  # steps per measurement window
RECHECK = 8  # after this many winning speculative windows, measure plain decoding again
MAX_OFF = 32  # longest stretch of windows with drafting off before probing again


class SpeedGovernor:
    def __init__(self, window: int = WINDOW) -> None:
        self.window = window
        self.drafting = True  # the mode of the current window
        self._steps = 0
        self._seconds = 0.0
        self._tokens = 0
        self.rate = {True: 0.0, False: 0.0}  # emitted tokens/s of the last window of each mode
        self._off_windows = 0  # windows of plain decoding still to go before probing
        self._off_length = 1
        self._wins = 0

    def observe(self, seconds: float, tokens: int) -> None:
        """One step of the current mode: its wall time and the tokens it emitted."""
        self._steps += 1
        self._seconds += seconds
        self._tokens += tokens
        if self._steps >= self.window:
            self._end_window()

    def _end_window(self) -> None:
        rate = self._tokens / self._seconds if self._seconds > 0 else 0.0
        self.rate[self.drafting] = rate
        self._steps, self._seconds, self._tokens = 0, 0.0, 0
        if self.drafting:
            if not self.rate[False]:  # no baseline yet: measure plain decoding next
                self.drafting = False
                self._off_windows = 1
            elif rate < self.rate[False]:  # slower than plain: off, for longer each time
                self.drafting = False
                self._off_windows = self._off_length
                self._off_length = min(2 * self._off_length, MAX_OFF)
            else:
                self._wins += 1
                if self._wins >= RECHECK:  # conditions drift (batch size, lengths): re-measure
                    self._wins = 0
                    self.drafting, self._off_windows = False, 1
        else:
            self._off_windows -= 1
            if self._off_windows <= 0:
                self.drafting = True
                if self.rate[True] >= rate:
                    self._off_length = 1
