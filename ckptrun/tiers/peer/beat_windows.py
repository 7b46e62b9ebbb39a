"""The windows of time a :class:`~ckptrun.tiers.peer.pacing.Pacer` learns from, cut at the workers' beats.

A replication round costs training whatever the workers did not get done while it ran --
and some of that shows only in the step that was running when the round ended (it finishes
late).  Windows cut at arbitrary times had to guess how far each worker had got into its
current step; with rounds about a step long that guess was the larger part of the count,
and it leaned towards the workers having got further than they had.  The benchmarks' job
(20 ms steps, 20 ms rounds) slowed by 2-18% (about 10%) where the pacer allowed for 4%;
``tests/test_beat_windows.py`` models the same.  Cut at beats, a window holds whole beats only:

* a round's window starts at the last beat before the round and ends at the first beat
  after it, so every step the round touched is in it (and the pause that follows is
  sized from that longer window, which keeps the share of time right);
* the window between rounds runs from there to the last beat before the next round.

A worker's beat is the time it last called ``save()``/``heartbeat()`` (``time.monotonic()``,
one clock for every process on the machine) and its count of beats, both in the agent's
control block.
"""

from __future__ import annotations

import threading
import time
from typing import Optional, Tuple

from ckptrun import protocol as P
from ckptrun.tiers.peer.pacing import Pacer

Mark = Tuple[float, float]  # (mean time of the workers' last beats, mean beat count)
POLL_S = 0.002  # reading the control block costs microseconds
MAX_WAIT_S = 5.0  # for the first beat after a round: a worker that slow says nothing


class BeatWindows:
    """Cuts time into round / no-round windows at the local workers' beats and feeds them
    to ``pacer``.  ``control`` is the agent's control block (None: nothing is measured)."""

    def __init__(self, pacer: Pacer, control: Optional[P.ControlBlock], nranks: int) -> None:
        self.pacer, self.control, self.nranks = pacer, control, nranks
        self._mark: Optional[Mark] = None  # where the window now open started

    def read(self) -> Optional[Mark]:
        """The local workers' last beats, averaged; None unless all of them are training
        (windows in which one starts, restores or finishes say nothing about rounds)."""
        if self.control is None or self.nranks <= 0:
            return None
        t = beats = 0.0
        try:
            for lr in range(self.nranks):
                if self.control.get(lr, "phase") not in (P.Phase.RUNNING, P.Phase.SAVING):
                    return None
                for _ in range(3):  # a beat between the two reads: read again
                    hb = self.control.get(lr, "heartbeat")
                    count = self.control.get(lr, "beats")
                    if self.control.get(lr, "heartbeat") == hb:
                        break
                beats, t = beats + count, t + hb
        except (ValueError, IndexError):  # the block is closed: the agent is stopping
            return None
        return t / self.nranks, beats / self.nranks

    def round_starts(self) -> None:
        """Close the window without a round at the last beat, and open the round's."""
        self._close(False, self.read(), True)

    def round_ended(self, measure: bool = True,
                    stop: Optional[threading.Event] = None) -> Optional[float]:
        """Wait for every worker's next beat and close the round's window there (told to
        the pacer only if ``measure``).  Returns the window's length, or None when it could
        not be cut at beats (a worker stopped training, or beat too slowly)."""
        start, end = self._mark, self._next_beat(stop)
        self._close(True, end, measure)
        if start is None or end is None:
            return None
        return max(0.0, end[0] - start[0])

    def _next_beat(self, stop: Optional[threading.Event]) -> Optional[Mark]:
        if self.control is None or self.read() is None:  # not training: nothing to wait for
            return None
        counts = [self.control.get(lr, "beats") for lr in range(self.nranks)]
        interval = self.pacer.beat_interval()
        deadline = time.monotonic() + min(MAX_WAIT_S, 3.0 * interval if interval else 1.0)
        while time.monotonic() < deadline and not (stop is not None and stop.is_set()):
            try:
                if all(self.control.get(lr, "beats") > c for lr, c in enumerate(counts)):
                    return self.read()
            except (ValueError, IndexError):
                return None
            time.sleep(POLL_S)
        return None

    def _close(self, in_round: bool, mark: Optional[Mark], measure: bool) -> None:
        """Tell the pacer about the window from the open mark to ``mark``; open the next."""
        start, self._mark = self._mark, mark
        if start is None or mark is None or not measure:
            return
        seconds, beats = mark[0] - start[0], mark[1] - start[1]
        if beats >= 0:  # a restart resets the counts
            self.pacer.observe(in_round, seconds, beats)
