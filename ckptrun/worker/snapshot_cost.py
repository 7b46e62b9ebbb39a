"""What snapshots cost the training loop, from the time it spends blocked by them.

A snapshot at every step (the default) is cheap where its copy and checksum fit beside a
step, and ruinous where they do not: on an H200 a 256 MiB state with 3 ms steps ran 17x
slower (the host checksum takes 42 ms), with nothing said.  The loop is blocked by a snapshot
in two places only -- ``save()`` itself (which waits for the previous snapshot first) and
``optimizer.step()``'s hook (which waits until the state is no longer read) -- so the
blocked time is measured there, and the rest of the time between two snapshots is
training.  ``share()`` is blocked / training over the last ``WINDOW`` snapshots: 0.03 is
3% slower, 1.0 twice as slow.
"""

from __future__ import annotations

from collections import deque
from typing import Deque, Optional

WINDOW = 32
TOO_COSTLY = 1.0  # a fixed interval whose snapshots double the step time is said once


class SnapshotCost:
    """Blocked time against training time over the last :data:`WINDOW` snapshots."""

    def __init__(self) -> None:
        self._blocked: Deque[float] = deque(maxlen=WINDOW)
        self._gaps: Deque[float] = deque(maxlen=WINDOW)
        self._since = 0.0  # blocked since the last snapshot
        self._last: Optional[float] = None
        self._measured = 0  # gaps measured since the start

    def blocked(self, seconds: float) -> None:
        """The loop waited ``seconds`` for a snapshot (a hook's wait, a save() call)."""
        self._since += seconds

    def snapshot_done(self, now: float) -> None:
        """A ``save()`` that took a snapshot returns at ``now`` (monotonic seconds)."""
        if self._last is not None:
            self._gaps.append(now - self._last)
            self._blocked.append(self._since)
            self._measured += 1
        self._since = 0.0
        self._last = now

    def restart(self) -> None:
        """After a restore: the gap to the next snapshot is not a training interval."""
        self._last = None
        self._since = 0.0

    def window_ends(self) -> bool:
        """The last snapshot completed a window of fresh measurements (every WINDOW-th)."""
        return self._measured >= WINDOW and self._measured % WINDOW == 0

    def share(self) -> Optional[float]:
        """Blocked / training time over a full window; None before one was seen."""
        if len(self._gaps) < WINDOW:
            return None
        blocked = sum(self._blocked)
        training = sum(self._gaps) - blocked
        return blocked / training if training > 0 else float("inf")

    def mean_ms(self) -> tuple:
        """(blocked, training) per snapshot, in ms, over the window."""
        n = max(1, len(self._gaps))
        blocked = sum(self._blocked)
        return blocked / n * 1e3, (sum(self._gaps) - blocked) / n * 1e3
