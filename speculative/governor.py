"""SpeedGovernor: speculation only where it pays. Per-request draft lengths follow acceptance
(base.py), but whether verifying drafts beats plain decoding also depends on the batch and
the device: at batch 1 on a GPU a verify step costs about a decode step, so any accepted
draft is a win; on a compute-bound CPU, or at a large batch, the extra positions cost real
time. The governor measures both and keeps the faster.

It probes in pairs: drafting alternates on and off step by step until each mode has `probe`
decode steps timed, so both are timed on the same batch (a batch shrinks as requests finish
and grows as they join: windows of one mode after the other compared different batches).
A step with prefill work says nothing about drafting and is not counted; a drafting step in
which no request had a draft is a plain step (early in a request, before anything repeats,
that is most of them, and they need no forced plain steps). Then the faster mode holds:
drafting for HOLD_ON steps before the next probe, plain decoding for a stretch that doubles
while it keeps winning (up to MAX_OFF). A poor case is switched off after `probe` verify
steps; a good one loses at most the probe's plain steps.

Where the engine overlaps plain steps (CUDA: plain decoding with overlap scheduling is what
speculation must beat, not plain decoding without it), the probe runs in blocks instead:
`probe` plain steps in a row, so overlap works as it does in a long stretch, then `probe`
drafting steps, every one counted as drafting (overlap is off for all of them, drafts or
not). The first drafting step reads back the last plain step's tokens before it drafts; that
wait is plain decoding's (`observe_drain`), and it lands before the decision.

A probe whose drafting is clearly losing ends early: once each mode has EARLY_STEPS steps,
drafting at under LOSING of plain's rate is switched off without the rest of the probe. Each
poor drafting step costs a verify step's price (more than a decode step on a GPU, several
times one on a CPU: BENCHMARKS.md, speculative decoding), and a poor case now pays 2 of them
a probe, not 4. One that is hopeless (under HOPELESS of plain's rate, as a large batch's
verify of only wrong drafts is on a GPU: BENCHMARKS.md, speculative decoding, "H200,
2026-12-02: the verify step's host time; ...") ends after one drafting step once plain
decoding has its EARLY_STEPS, holds plain decoding twice as long, and its next hold grows
4x, not 2x.

A probe whose drafting block verified nothing at all (blocks only: no request had a draft)
says nothing about drafts, only that there were none; plain decoding then holds FIRST_OFF
steps and the hold does not grow (an "idle" verdict). And a verdict holds only for the mix it
measured: drafts may spread at any step (a prompt's first samples finish, and their rollouts
enter the history its other samples draft from). So during every plain hold the drafter looks,
every CHECK_EVERY steps, at a few running requests in turn (Drafter.look: would each get a
draft on the tokens the host knows?); once the looks have covered LOOK_WINDOW requests (or all
that run), drafts found for clearly more of them than the probe's drafting steps had (twice
that share, and a quarter of the requests more: 4 of 16 after an idle verdict) start a probe
at once (`looked`). Wrong drafts everywhere (the share the probe lost with) never re-probe
early, nor does one request of 64 whose context happens to repeat. Before this, a run whose
drafts appeared late sat out a doubled hold and verified none of them (BENCHMARKS.md,
speculative decoding, "H200, 2026-12-02: the governor when drafts appear late").
"""

from __future__ import annotations

PROBE = 4  # decode steps of each mode per probe
HOLD_ON = 64  # steps drafting holds after winning a probe
FIRST_OFF = 16  # steps plain decoding holds after winning a probe (doubling while it wins)
MAX_OFF = 512
EARLY_STEPS = 2  # steps of each mode after which a clearly losing probe ends
LOSING = 0.75  # ... clearly: at under this fraction of plain decoding's rate
HOPELESS = 0.5  # a verdict at under this fraction holds plain decoding longer
CHECK_EVERY = 4  # steps between a plain hold's looks for drafts
LOOK_WINDOW = 16  # requests the looks cover before their share is compared with the probe's
MORE_SHARE = 0.25  # ... which it must pass by this much (and by 2x) to end the hold


class SpeedGovernor:
    def __init__(self, probe: int = PROBE, hold_on: int = HOLD_ON, first_off: int = FIRST_OFF,
                 max_off: int = MAX_OFF, blocks: bool = False, early_stop: bool = True) -> None:
        self.probe, self.hold_on, self.first_off, self.max_off = probe, hold_on, first_off, max_off
        self.blocks = blocks  # probe plain steps in a row, then drafting ones (overlapped plain steps)
        self.early_stop = early_stop  # end clearly losing probes early, hold hopeless ones longer (benches: False)
        self.drafting = not blocks  # the mode of the next step
        self.probing = True
        self.rate = {True: 0.0, False: 0.0}  # emitted tokens/s of each mode in the last probe
        self._seconds = {True: 0.0, False: 0.0}
        self._tokens = {True: 0, False: 0}
        self._steps = {True: 0, False: 0}
        self._share = 0.0  # summed over the probe's drafting steps: the share of requests that had drafts
        self.probe_share = 0.0  # ... their mean, at the last verdict
        self._looks = [0, 0]  # this hold's looks since the last comparison: requests with drafts, looked at
        self._hold = 0  # steps left in the current mode (not probing)
        self._off_length = first_off
        self.idle = False  # the plain hold follows a probe with nothing to draft (may end early)

    def observe(self, seconds: float, tokens: int, decode_only: bool = True, verified: bool | None = None,
                share: float | None = None) -> None:
        """One step: its wall time, the tokens it emitted, whether it had no prefill work,
        whether it verified any draft (None: it did exactly when drafting was on) and the
        share of its requests that had drafts (None: all when it verified). A step with
        prefill work is not a measurement, and a drafting step that found nothing to draft
        measures plain decoding (with the drafter's host cost in it)."""
        if not self.probing:
            self._hold -= 1
            if self._hold <= 0:
                self._start_probe()
            return
        if not decode_only:
            return
        mode = self.drafting if verified is None or self.blocks else verified
        if mode:
            self._share += (0.0 if verified is False else 1.0) if share is None else share
        self._seconds[mode] += seconds
        self._tokens[mode] += tokens
        self._steps[mode] += 1
        if min(self._steps.values()) >= self.probe or self._losing():
            self._decide()
        elif self._steps[True] >= self.probe:
            self.drafting = False
        elif self._steps[False] >= self.probe:
            self.drafting = True
        elif not self.blocks:  # both modes short of samples: alternate, so they are timed on the same batch
            self.drafting = not mode

    def _losing(self) -> bool:
        """Both modes timed for EARLY_STEPS, and drafting far behind; or plain decoding timed
        for EARLY_STEPS and one drafting step hopeless."""
        if not self.early_stop or self._steps[False] < min(EARLY_STEPS, self.probe) or not self._steps[True]:
            return False
        ratio = self._rate(True) / max(self._rate(False), 1e-30)
        return ratio < HOPELESS or (self._steps[True] >= min(EARLY_STEPS, self.probe) and ratio < LOSING)

    def _rate(self, mode: bool) -> float:
        """Emitted tokens/s of a mode over this probe so far."""
        return self._tokens[mode] / self._seconds[mode] if self._seconds[mode] > 0 else 0.0

    def observe_drain(self, seconds: float, tokens: int) -> None:
        """A drafting step first read back the overlapped plain step before it: that wait and
        those tokens are plain decoding's (counted only while probing)."""
        if self.probing:
            self._seconds[False] += seconds
            self._tokens[False] += tokens

    def check_due(self) -> bool:
        """Should the drafter look for drafts before this step (a plain hold, every CHECK_EVERY)?"""
        return not self.probing and not self.drafting and self._hold % CHECK_EVERY == 0

    def looked(self, found: int, looked: int, running: int) -> None:
        """A look's result: `found` of `looked` requests would draft, of `running`. Once the
        looks cover LOOK_WINDOW requests (or all of them), drafts for clearly more of them
        than the last probe had (MORE_SHARE) start a probe now."""
        self._looks[0] += found
        self._looks[1] += looked
        hits, seen = self._looks
        if seen < min(LOOK_WINDOW, max(running, 1)):
            return
        self._looks = [0, 0]
        if hits / seen >= max(2 * self.probe_share, self.probe_share + MORE_SHARE):
            self._start_probe()

    def restart(self) -> None:
        """The policy changed (a weight update): the last verdict was about another model's
        acceptance. Probe at once, and an off verdict starts again from the short hold: an RL
        policy sharpens step by step, and a governor that switched drafting off on epoch 1's
        diffuse policy would otherwise sit out up to MAX_OFF steps of a sharper one."""
        self._off_length = self.first_off
        self._start_probe()

    def _start_probe(self) -> None:
        self.probing, self.drafting, self.idle, self._share = True, not self.blocks, False, 0.0
        for mode in (True, False):
            self._seconds[mode], self._tokens[mode], self._steps[mode] = 0.0, 0, 0

    def _decide(self) -> None:
        for mode in (True, False):
            self.rate[mode] = self._rate(mode)
        self.probing = False
        self.probe_share = self._share / max(self._steps[True], 1)
        self._looks = [0, 0]
        self.drafting = self.rate[True] >= self.rate[False]
        if self.drafting:
            self._hold, self._off_length = self.hold_on, self.first_off
        elif self._share == 0:  # nothing was drafted: no verdict on drafts, a short hold that may end early
            self._hold, self.idle = self.first_off, True
        else:
            hopeless = self.early_stop and self.rate[True] < HOPELESS * self.rate[False]
            self._hold = min(self._off_length * (2 if hopeless else 1), self.max_off)
            self._off_length = min((4 if hopeless else 2) * self._off_length, self.max_off)
