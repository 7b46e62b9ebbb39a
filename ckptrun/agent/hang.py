"""Hang detection by progress, and stack dumps of hung workers.

A job is hung when **no rank of it advances** for the timeout -- a deadlock, a stopped
process, a collective that never completes -- not when one rank waits for another that is
busy (rank 0 evaluating alone while rank 1 sits in the next all-reduce).  A rank whose
process is stopped (state T) for the timeout is hung even while the others advance: workers
without collectives never wait on it.  Each worker's
sampler (``ckptrun.worker.progress``) writes into the control block when its main thread
last advanced and when it last sampled at all; other nodes' progress arrives through
:class:`ckptrun.agent.membership.Liveness`.  A verdict names the ranks whose sampler went
silent (stopped processes), not the ones waiting; when every rank is alive and none moves
it names the ranks that started a process which is stopped (a data-loader worker stopped by a
signal or a debugger: its rank waits for a batch, the others in the next collective), or, when
there is none (a deadlock), them all.

Only a worker that has heartbeat at least once is watched (a ``save()``, a ``heartbeat()``, or a
``restore()`` -- the loop starts there): a plain torchrun script that never imports ckptrun
has no heartbeat and must never be killed as hung.  The timeout is
either fixed (``--hang-timeout N``) or learned (``auto``) from the step times (intervals
between heartbeats): a generous window until the second beat (start-up, first compile,
first collective), then ``max(floor, factor * median interval between beats)``.  A worker
that declares itself SAVING or RESTORING counts as advancing (DESIGN lesson); one that is
DONE is not watched.
"""

from __future__ import annotations

import os
import shutil
import signal
import statistics
import subprocess
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Deque, Dict, List, Optional, Tuple

import psutil

from ckptrun.agent.stopping import stat_fields
from ckptrun.protocol import Phase
from ckptrun.protocol.job_secret import without_secret

AUTO_FIRST_WINDOW_S = 120.0
AUTO_FLOOR_S = 30.0
AUTO_FACTOR = 10.0
STOPPED_S = 1.0  # a sampler silent this long: the process is not running at all
REMOTE_GRACE_S = 2.0  # a node with no stopped rank waits this much more for the others'


class _RankState:
    def __init__(self) -> None:
        self.last_beats = 0
        self.last_time = 0.0
        self.intervals: Deque[float] = deque(maxlen=64)
        self.sampled = 0.0  # the sampler's last sample (0: no sampler yet)
        self.advanced = 0.0  # its last sample that found the main thread advancing
        self.phase = Phase.INIT


@dataclass
class Hang:
    """A verdict: the job made no progress for ``silent_s``; ``ranks`` (local ranks) are the
    stopped ones, or every watched one when ``deadlock``."""

    silent_s: float
    ranks: List[int]
    deadlock: bool


class HangDetector:
    """Tracks one attempt's local workers; :meth:`verdict` says whether the job is hung."""

    def __init__(self, timeout: Optional[float], first_window: float = AUTO_FIRST_WINDOW_S,
                 floor: float = AUTO_FLOOR_S, factor: float = AUTO_FACTOR):
        self.fixed = timeout
        self.first_window, self.floor, self.factor = first_window, floor, factor
        self._ranks: Dict[int, _RankState] = {}
        self._learned: List[float] = []  # intervals seen in earlier attempts
        self._started = time.monotonic()

    def reset(self, now: Optional[float] = None) -> None:
        """Forget everything (new attempt, starting ``now``).  Learned step times are kept:
        same job."""
        kept = [i for st in self._ranks.values() for i in st.intervals]
        self._ranks = {}
        self._started = time.monotonic() if now is None else now
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

    def observe(self, local_rank: int, beats: int, heartbeat: float,
                sampled: float = 0.0, advanced: float = 0.0,
                phase: int = Phase.RUNNING) -> None:
        """Feed one control-block reading of a live worker: its ``beats`` counter and
        ``heartbeat`` time, and its sampler's ``sampled``/``advanced`` times (monotonic)."""
        st = self._ranks.setdefault(local_rank, _RankState())
        if beats > st.last_beats:
            if st.last_beats > 0 and heartbeat > st.last_time:
                # several beats may happen between two polls: the mean interval of them
                st.intervals.append((heartbeat - st.last_time) / (beats - st.last_beats))
            st.last_beats, st.last_time = beats, heartbeat
        st.sampled, st.advanced, st.phase = sampled, advanced, phase

    def gone(self, local_rank: int) -> None:
        """``local_rank`` exited: it neither advances nor holds the job back."""
        self._ranks.pop(local_rank, None)

    def local_progress(self, now: Optional[float] = None) -> float:
        """Monotonic time at which some live local rank last advanced (a running rank
        saving or restoring, or one not yet sampling -- still starting -- advances now)."""
        now = time.monotonic() if now is None else now
        times = [self._started]
        for st in self._ranks.values():
            if st.phase == Phase.DONE:
                continue
            alive = st.sampled == 0.0 or now - st.sampled <= STOPPED_S
            if st.sampled == 0.0 or (alive and st.phase in (Phase.SAVING, Phase.RESTORING)):
                times.append(now)  # (a process stopped mid-snapshot is stopped all the same)
            else:
                times.append(max(st.advanced, st.last_time))
        return max(times)

    def verdict(self, now: Optional[float] = None,
                remote_age: Optional[float] = None,
                is_stopped: Optional[Callable[[int], bool]] = None) -> Optional[Hang]:
        """A :class:`Hang` when no rank of the job advanced for the timeout, or when a rank
        has been stopped for its timeout (``is_stopped(local_rank)``: its process is in state
        T) while others advance -- independent workers never wait on it, and a process that
        cannot run at all is hung whatever its peers do.  A rank computing alone is not:
        its sampler goes on.  ``remote_age``: seconds since another node last reported
        progress (None: one node)."""
        now = time.monotonic() if now is None else now
        watched = {r: st for r, st in self._ranks.items()
                   if st.phase != Phase.DONE and self.timeout_for(r) is not None}
        if not watched:
            return None
        if is_stopped is not None:
            long_stopped = sorted(r for r, st in watched.items()
                                  if st.sampled and now - st.sampled > self.timeout_for(r)
                                  and is_stopped(r))
            if long_stopped:
                silent = min(now - watched[r].sampled for r in long_stopped)
                return Hang(round(silent, 3), long_stopped, deadlock=False)
        timeout = max(self.timeout_for(r) for r in watched)
        silent = now - self.local_progress(now)
        if remote_age is not None:
            silent = min(silent, remote_age)
        if silent <= timeout:
            return None
        stopped = sorted(r for r, st in watched.items()
                         if st.sampled and now - st.sampled > STOPPED_S)
        if stopped:
            return Hang(round(silent, 3), stopped, deadlock=False)
        if remote_age is not None and silent <= timeout + REMOTE_GRACE_S:
            return None  # a stopped rank on another node: its own agent names it first
        return Hang(round(silent, 3), sorted(watched), deadlock=True)


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
                             env=without_secret(os.environ),
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
    SIGCONT, so a stopped process runs the handler too.  The signals of a group go out
    before its wait, so dumping N workers costs one or two waits, not N.

    A stopped worker must not train on once the SIGCONT wakes it: the verdict was made on
    a stopped rank, and the restart that follows must find it so (left running, it and its
    peers trained on while the agent stopped the group, and a short job even ended before
    the survivors were asked to recover in place).  So the running workers are dumped
    first; then they are frozen (SIGSTOP) while the stopped ones run their handlers, which
    are stopped again once their stacks are out; then the running ones go on.  A woken rank
    thus finds no peer to complete a collective with.
    """
    done: List[str] = []
    by_handler: List[Tuple[int, str, str]] = []
    for pid, has_fh, fh_file, out in targets:
        text = _py_spy(pid)
        if text:
            _write(out, text)
            done.append(out)
        elif has_fh:
            by_handler.append((pid, fh_file, out))
    stopped = [t for t in by_handler if _stopped(t[0])]
    running = [t for t in by_handler if t not in stopped]
    done += _dump(running, wait)
    if stopped:
        _signal([pid for pid, _, _ in running], signal.SIGSTOP)
        try:
            done += _dump(stopped, wait, stop_again=True)
        finally:
            _signal([pid for pid, _, _ in running], signal.SIGCONT)
    return done


def _dump(targets: List[Tuple[int, str, str]], wait: float, stop_again: bool = False
          ) -> List[str]:
    """SIGUSR1 + SIGCONT to each of ``targets``, wait until their handlers wrote (at most
    ``wait`` s), SIGSTOP them again if ``stop_again``; the paths that received a dump."""
    pending: List[Tuple[str, str, int]] = []
    for pid, fh_file, out in targets:
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
        time.sleep(0.005)
    if stop_again:
        _signal([pid for pid, _, _ in targets], signal.SIGSTOP)
    done = []
    for fh_file, out, before in pending:
        if _size(fh_file) > before:
            if os.path.abspath(fh_file) != os.path.abspath(out):
                with open(fh_file) as f:
                    _write(out, f.read())
            done.append(out)
    return done


def stopped_descendant(pid: int) -> Optional[Tuple[int, str]]:
    """(pid, what it is) of a process that ``pid`` started (at any depth) and that is
    stopped by a signal, or None.  A rank waiting on it looks like a deadlock (its own
    sampler runs), but it is the one to replace: its peers only wait for it."""
    try:
        rank = psutil.Process(pid)
        children = rank.children(recursive=True)
    except psutil.Error:
        return None
    for c in children:
        if _stopped(c.pid):
            try:
                return c.pid, _what(c, rank)
            except psutil.Error:
                return c.pid, "gone since"
    return None


def _what(child: psutil.Process, rank: psutil.Process) -> str:
    """torch's data-loader workers call themselves ``pt_data_worker``; torchdata's are forks
    of the rank that keep its command line."""
    name = child.name()
    if name == "pt_data_worker":
        return "pt_data_worker, a data-loader worker"
    if child.cmdline() == rank.cmdline():
        return "a fork of the rank: a data-loader worker, say"
    return name


def process_stopped(pid: int) -> bool:
    """Whether ``pid`` is stopped by a signal (state T in ``/proc/<pid>/stat``)."""
    return _stopped(pid)


def _stopped(pid: int) -> bool:
    """Whether ``pid`` is stopped by a signal (state T in ``/proc/<pid>/stat``)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return stat_fields(f.read())[0] == b"T"
    except (OSError, ValueError, IndexError):
        return False


def _signal(pids: List[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _write(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
