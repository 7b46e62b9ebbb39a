"""How often replication rounds may run: training may slow down by at most a budget.

GEMINI fits checkpoint traffic into the idle gaps of training; what a copy costs depends on
the machine.  On a GPU machine the step waits on the GPU and a round uses cores and network
bandwidth that training leaves idle, so rounds can run back to back (every step reaches a
peer).  On a machine whose cores training keeps busy -- this project's 2-core test machine,
or a CPU job -- every byte a round copies, checksums, sends or receives is taken from
training.  Neither a fixed bandwidth cap nor a fixed share of time is right for both.

:class:`Pacer` *measures* the cost instead, from the workers' heartbeats (the beat counter
every ``save()`` advances in the control block): the rate of beats while a round runs and
while none does.  If rounds slow training by a share ``s`` of the time they run, rounds may
run ``budget / s`` of the time and the job as a whole slows by at most ``budget`` (DESIGN
§6: 5%; the pacer aims a little lower, see ``AIM``).  Until both rates are known, rounds
run half of the time: both kinds of window fill quickly (a second or two of training), and
what that costs once is nothing next to a job's length -- while starting at ``budget``
left a machine lost in its first minute with a peer copy many steps old (the benchmarks'
machine-loss runs lost 12 steps).

The windows are cut at the workers' beats (``ckptrun/tiers/peer/beat_windows.py``), so they hold whole
steps.  Rounds must still start at a random phase of the step: one started by a fresh commit
always meets the same part of the step (the forward pass, say) and would measure only what
it costs there.  So every pause is moved by a random amount of up to half a beat interval
either way (a spread of one interval is every phase), centred so that it does not lengthen
the pause on average -- an added wait halved the share of time rounds ran at 0.5 s steps,
where it is a whole step.  A wider spread only made the pauses of the agents, which start
a round together once all of them are ready, wait on the longest one.

Evidence fades (see ``half_life_s``), and at a high duty the time without rounds is short:
with slow steps it holds fewer than ``MIN_BEATS`` beats.  The thresholds therefore only
gate the first estimate; after that the decayed rates are used as they are (falling back
to the initial duty there made a job with free rounds and 0.5 s steps swing between
0.95 and 0.5).
"""

from __future__ import annotations

import math
import random
from typing import Optional

from ckptrun.config import parse_share

DEFAULT_BUDGET = 0.05
OFF = ("off", "none", "0", "0%", "unpaced")


def parse_budget(raw: Optional[str]) -> Optional[float]:
    """``--replication-budget``: ``"5%"``, ``"0.05"`` -> 0.05; ``"off"``/``"0"`` -> None
    (rounds back to back); empty -> the default 5%.  Raises ValueError for anything else."""
    text = (raw or "").strip().lower()
    if not text:
        return DEFAULT_BUDGET
    if text in OFF:
        return None
    return parse_share(text, "replication budget", "5%")


class Pacer:
    """Pauses between replication rounds so that training slows by at most ``budget``.

    Feed it every window of time with the beats the local workers made in it
    (:meth:`observe`); ask :meth:`pause` after each round.  Old evidence fades with a
    half-life of ``half_life_s`` of observed time, so a change of phase (evaluation, a
    bigger model after a restart) is followed."""

    MAX_DUTY = 0.95  # always some time without a round: the baseline must stay measured
    # the longest pause between rounds: once the workers stop (a failure, the job's end) the
    # beat interval grows without bound, and an unbounded pause overflowed Event.wait
    MAX_PAUSE_S = 10.0
    INITIAL_DUTY = 0.5  # until the cost is measured
    # aim below the budget: the estimate is noisy, and what the agents spend outside the
    # rounds (agreeing on the next one, this loop) is not in it
    AIM = 0.8
    # expected beats in each kind of window before the rates are trusted
    MIN_BEATS = 10.0
    MIN_ACTIVE_BEATS = 10.0

    def __init__(self, budget: Optional[float], half_life_s: float = 20.0,
                 rng: Optional[random.Random] = None) -> None:
        self.budget = budget
        self.half_life_s = half_life_s
        self._rng = rng or random.Random()
        # decayed sums: [beats, seconds] while a round ran ("active") and while none did
        self._active = [0.0, 0.0]
        self._idle = [0.0, 0.0]
        self._primed = False  # both rates once rested on the minimum of beats

    def observe(self, active: bool, seconds: float, beats: float) -> None:
        """One window: ``seconds`` long, during which a round ran (``active``) or not, and
        the workers beat ``beats`` times (per worker)."""
        if seconds <= 0 or beats < 0:
            return
        keep = math.exp(-math.log(2) * seconds / self.half_life_s)
        for acc in (self._active, self._idle):
            acc[0] *= keep
            acc[1] *= keep
        acc = self._active if active else self._idle
        acc[0] += beats
        acc[1] += seconds

    def beat_interval(self) -> Optional[float]:
        """Seconds between beats when no round runs (None: not known yet)."""
        beats, seconds = self._idle
        return seconds / beats if beats > 0 else None

    def slowdown_while_active(self) -> Optional[float]:
        """Share of training progress lost while a round runs (0: none, 1: training
        stopped); None until both rates rest on enough beats."""
        idle_rate = self._idle[0] / self._idle[1] if self._idle[1] > 0 else 0.0
        if idle_rate <= 0 or self._active[1] <= 0:
            return None
        if not self._primed:
            if self._idle[0] < self.MIN_BEATS:
                return None
            if self._active[1] * idle_rate < self.MIN_ACTIVE_BEATS:  # too little round time
                return None
            self._primed = True
        active_rate = self._active[0] / self._active[1]
        return min(1.0, max(0.0, 1.0 - active_rate / idle_rate))

    def duty(self) -> float:
        """Share of the time rounds may run."""
        if self.budget is None:
            return 1.0
        lost = self.slowdown_while_active()
        if lost is None:
            return max(self.budget, self.INITIAL_DUTY)
        target = self.AIM * self.budget
        return self.MAX_DUTY if lost <= target / self.MAX_DUTY else target / lost

    def pause(self, round_s: float) -> float:
        """Seconds to wait after a round of ``round_s`` seconds (0 when unpaced)."""
        if self.budget is None:
            return 0.0
        f, half = self.duty(), 0.5 * min(self.beat_interval() or 0.0, self.MAX_PAUSE_S)
        if not f > 0.0:
            return self.MAX_PAUSE_S
        pause = max(0.0, round_s) * (1.0 / f - 1.0) + self._rng.uniform(-half, half)
        return min(self.MAX_PAUSE_S, max(0.0, pause))
