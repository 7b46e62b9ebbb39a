"""Which ``save()`` calls take a snapshot: every step (the default, DESIGN §1), every N
steps, or ``"auto"`` -- every step while that costs the training loop at most a budget
(3% by default), else every k-th step with the smallest k (a power of two) that fits it.

This is GEMINI's answer for checkpoint traffic that does not fit into the idle time of an
iteration: keep checkpointing at iteration granularity, but every k iterations.  The
trade-off is explicit: a failure then loses up to k - 1 completed steps (replayed after the
restore) instead of none; in exchange saves cost at most the budget.

How "auto" measures, without a clock that training noise would fool for long:

* the time between consecutive ``save()`` calls, per step: after a call that took a
  snapshot it holds the snapshot's whole cost (the blocking part, and the background copy
  competing with the next forward/backward for CPU, GIL and memory bandwidth); after a call
  that did not, it holds a plain step (the copy is always over before ``optimizer.step()``);
* the snapshot cost is the difference of the medians of the two kinds (windows of the last
  32 of each; the gap after the call that agreed on the interval, see below, is left out:
  it holds the wait for the slowest rank).  With k = 1 there are no plain steps, so one call in ``PROBE`` (then in
  ``PROBE_LATER``, once enough plain steps were seen) skips its snapshot to measure one.

Every rank must take snapshots at the same steps (a restore needs a step that all ranks
have), so every decision is a function of the steps given to ``save()`` only, and the
interval is agreed on -- the largest any rank wants -- with one small ``all_reduce`` every
``AGREE`` steps when ``torch.distributed`` is initialised.  A job of several ranks without
``torch.distributed`` keeps snapshotting every step.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections import deque
from typing import Any, Optional, Tuple

from ckptrun.config import parse_share
from ckptrun.protocol import ENV_EVERY

ENV_BUDGET = "CKPTRUN_SNAPSHOT_OVERHEAD"
DEFAULT_BUDGET = 0.03
MAX_EVERY = 1024
AGREE = 64  # steps between two agreements on the interval
PROBE = 16  # with k = 1: one call in PROBE skips its snapshot, to time a plain step ...
PROBE_LATER = 256  # ... one in PROBE_LATER once this many plain steps were timed:
ENOUGH = 8
WINDOW = 32


def parse_every(value: Any) -> Tuple[Optional[int], str]:
    """``1``/``"1"`` -> ``(1, "1")``; ``"auto"`` -> ``(None, "auto")``; else ValueError."""
    text = str(value).strip().lower()
    if text == "auto":
        return None, "auto"
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"ckptrun: snapshot interval must be a positive number of steps or "
                         f"'auto', got {value!r}")
    return n, str(n)


def parse_budget(value: Any) -> float:
    """``0.03``, ``"0.03"`` or ``"3%"`` -> 0.03 (a fraction of the training time)."""
    return parse_share(value, "snapshot overhead budget", "3%")


class SnapshotInterval:
    """The snapshot schedule of one ``Checkpointer`` (see the module docstring).

    ``due(step)`` is called once per ``save()``, first thing, and says whether this call
    snapshots; ``every`` is the current interval and ``overhead`` the estimated share of
    the training time that snapshots at that interval cost (None until measured).
    """

    def __init__(self, every: Any = None, budget: Any = None, world_size: int = 1) -> None:
        fixed, self.mode = parse_every(every if every is not None
                                       else os.environ.get(ENV_EVERY) or 1)
        self.budget = parse_budget(budget if budget is not None
                                   else os.environ.get(ENV_BUDGET) or DEFAULT_BUDGET)
        self.auto = fixed is None
        self.every = fixed or 1
        self.world_size = world_size
        self.overhead: Optional[float] = None
        self._prev: Optional[Tuple[int, float, bool]] = None  # (step, time, snapshotted)
        self._after_snap: deque = deque(maxlen=WINDOW)  # s per step after a snapshot
        self._after_plain: deque = deque(maxlen=WINDOW)  # ... after a call without one
        self._plain_seen = 0
        self._cost: Optional[Tuple[float, float]] = None  # (snapshot cost, plain step) in s
        self._agreed = False  # this call agreed on the interval: its gap is not a sample
        self._warned = False

    def restart(self) -> None:
        """After a restore: the next call snapshots (every rank restored the same step)."""
        self._prev = None
        self._agreed = False

    def due(self, step: int) -> bool:
        if not self.auto and self.every == 1:
            return True  # DESIGN: a snapshot at every step
        now = time.perf_counter()
        prev = self._prev
        if prev is None:  # the first call (of the job, or after a restore): take it
            self._prev = (step, now, True)
            return True
        pstep, ptime, psnap = prev
        if self.auto and step > pstep:
            gap = (now - ptime) / (step - pstep)
            if self._agreed:  # that gap holds the all_reduce (a wait for the slowest rank)
                self._agreed = False
            elif psnap:
                self._after_snap.append(gap)
            else:
                self._after_plain.append(gap)
                self._plain_seen += 1
            if step // AGREE > pstep // AGREE:
                self._agree(self._wanted())
                self._agreed = True
        take = step // self.every > pstep // self.every
        if take and self.auto and self.every == 1:
            probe = PROBE if self._plain_seen < ENOUGH else PROBE_LATER
            take = not step // probe > pstep // probe
        self._prev = (step, now, take)
        return take

    def _wanted(self) -> int:
        """The interval this rank would pick from its own measurements."""
        if len(self._after_snap) < 3 or len(self._after_plain) < 3:
            return self.every
        plain = statistics.median(self._after_plain)
        if plain <= 0:
            return self.every
        cost = max(0.0, statistics.median(self._after_snap) - plain)
        self._cost = (cost, plain)
        k = 1
        while k < MAX_EVERY and cost / (k * plain) > self.budget:
            k *= 2
        if k < self.every and cost / (k * plain) > 0.8 * self.budget:
            k = self.every  # hysteresis: shorten the interval only with room to spare
        return k

    def _agree(self, wanted: int) -> None:
        k = wanted
        if self.world_size > 1:
            k = _all_ranks_max(wanted)
            if k is None:
                if not self._warned:
                    self._warned = True
                    print("ckptrun: snapshot interval 'auto' needs torch.distributed to agree "
                          "on it across ranks; snapshotting every step", file=sys.stderr)
                return
        self.every = k
        if self._cost is not None:
            cost, plain = self._cost
            self.overhead = cost / (k * plain)


def _all_ranks_max(value: int) -> Optional[int]:
    """The largest ``value`` over all ranks (one ``all_reduce`` on the default group), or
    None when ``torch.distributed`` is not initialised."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    backend = str(dist.get_backend())
    cpu = "gloo" in backend or "mpi" in backend or not torch.cuda.is_available()
    t = torch.tensor([value], dtype=torch.int64,
                     device="cpu" if cpu else torch.device("cuda", torch.cuda.current_device()))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())
