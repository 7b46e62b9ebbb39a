"""Hang detection from control-block heartbeats, and stack dumps of hung workers.

Only a worker that has heartbeat at least once is watched: a plain torchrun script that
never imports ckptrun has no heartbeat and must never be killed as hung.  The timeout is
either fixed (``--hang-timeout N``) or learned (``auto``): a generous window until the
second beat (start-up, first compile, first collective), then
``max(floor, factor * median interval between beats)``.  A worker that declares itself
SAVING or RESTORING is never timed out (DESIGN lesson), nor one that is DONE.
"""

from __future__ import annotations

import os
import shutil
import signal
import statistics
import subprocess
import time
from collections import deque
from typing import Deque, Dict, List, Optional, Tuple

from ckptrun.protocol import Phase

AUTO_FIRST_WINDOW_S = 120.0
AUTO_FLOOR_S = 30.0
AUTO_FACTOR = 10.0


class _RankState:
    def __init__(self) -> None:
        self.last_beats = 0
        self.last_time = 0.0
        self.intervals: Deque[float] = deque(maxlen=64)


class HangDetector:
    """Tracks the heartbeats of one attempt's local workers; ``check`` says who is hung."""

    def __init__(self, timeout: Optional[float], first_window: float = AUTO_FIRST_WINDOW_S,
                 floor: float = AUTO_FLOOR_S, factor: float = AUTO_FACTOR):
        self.fixed = timeout
        self.first_window, self.floor, self.factor = first_window, floor, factor
        self._ranks: Dict[int, _RankState] = {}
        self._learned: List[float] = []  # intervals seen in earlier attempts

    def reset(self) -> None:
        """Forget everything (new attempt).  Learned step times are kept: same job."""
        kept = [i for st in self._ranks.values() for i in st.intervals]
        self._ranks = {}
        if kept:
            self._learned = kept[-64:]

    def timeout_for(self, local_rank: int) -> Optional[float]:
        """The silence (s) after which ``local_rank`` counts as hung; None = not watched."""
        st = self._ranks.get(local_rank)
        if st is None or st.last_beats == 0:
            return None
        if self.fixed is not None:
            return self.fixed
        samples = list(st.intervals) or self._learned
        if not samples:  # until the second beat: start-up, first compile, first collective
            return self.first_window
        return max(self.floor, self.factor * statistics.median(samples))

    def current_timeout(self) -> Optional[float]:
        """The largest timeout in force (for status.json); the fixed one if set."""
        if self.fixed is not None:
            return self.fixed
        values = [t for t in (self.timeout_for(r) for r in self._ranks) if t is not None]
        return max(values) if values else None

    def observe(self, local_rank: int, beats: int, heartbeat: float) -> None:
        """Feed one control-block reading (``beats`` counter, ``heartbeat`` monotonic time)."""
        st = self._ranks.setdefault(local_rank, _RankState())
        if beats > st.last_beats:
            if st.last_beats > 0 and heartbeat > st.last_time:
                # several beats may happen between two polls: the mean interval of them
                st.intervals.append((heartbeat - st.last_time) / (beats - st.last_beats))
            st.last_beats, st.last_time = beats, heartbeat

    def check(self, local_rank: int, phase: int, now: Optional[float] = None) -> Optional[float]:
        """Seconds of silence if ``local_rank`` is hung now, else None."""
        if phase in (Phase.SAVING, Phase.RESTORING, Phase.DONE):
            return None
        timeout = self.timeout_for(local_rank)
        if timeout is None:
            return None
        silent = (time.monotonic() if now is None else now) - self._ranks[local_rank].last_time
        return silent if silent > timeout else None


# ---------------------------------------------------------------------------- stacks


def stacks_path(run_dir: str, attempt: int, rank: int) -> str:
    """``<run-dir>/stacks/attempt_<k>-rank<r>.txt``: where a worker's stack dump goes."""
    return os.path.join(run_dir, "stacks", f"attempt_{attempt}-rank{rank}.txt")


def _py_spy(pid: int, timeout: float = 5.0) -> Optional[str]:
    exe = shutil.which("py-spy")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "dump", "--pid", str(pid)], capture_output=True,
                             text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    # on a SIGSTOPped process py-spy fails ("Failed to get stack traces"): fall back
    return out.stdout if out.returncode == 0 and out.stdout.strip() else None


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def dump_stacks(targets: List[Tuple[int, bool, str, str]], wait: float = 1.0) -> List[str]:
    """Dump the stacks of workers; returns the paths that received a non-empty dump.

    ``targets``: ``(pid, has_faulthandler, faulthandler_file, out_path)``.  py-spy is tried
    first when installed; otherwise (or when it fails) a bootstrapped worker gets SIGUSR1
    (its faulthandler writes all threads' stacks into ``faulthandler_file``) followed by
    SIGCONT, so a stopped process runs the handler too.  All signals go out before the
    wait, so dumping N workers costs one wait, not N.
    """
    done: List[str] = []
    pending: List[Tuple[str, str, int]] = []
    for pid, has_fh, fh_file, out in targets:
        text = _py_spy(pid)
        if text:
            _write(out, text)
            done.append(out)
            continue
        if not has_fh:
            continue
        before = _size(fh_file)
        try:
            os.kill(pid, signal.SIGUSR1)
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            continue
        pending.append((fh_file, out, before))
    deadline = time.monotonic() + wait
    while pending and time.monotonic() < deadline:
        if all(_size(f) > b for f, _, b in pending):
            time.sleep(0.05)  # the handler writes thread by thread: let it finish
            break
        time.sleep(0.02)
    for fh_file, out, before in pending:
        if _size(fh_file) > before:
            if os.path.abspath(fh_file) != os.path.abspath(out):
                with open(fh_file) as f:
                    _write(out, f.read())
            done.append(out)
    return done


def _write(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
