"""Stopping processes: SIGTERM/grace/SIGKILL of whole process trees, reaping, and
what ``/proc`` tells about a process that has begun to exit (a failure is known from its
exit status before the kernel has freed its memory)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from typing import List, Tuple

import psutil

PF_EXITING = 0x4  # task flag: the process has begun to exit
EXIT_POLL_S = 0.05  # how often a supervising agent looks for a failing worker


def _descendants(pid: int) -> List[psutil.Process]:
    with contextlib.suppress(psutil.Error):
        return psutil.Process(pid).children(recursive=True)
    return []


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)  # the worker leads its own process group


def stat_fields(raw: bytes) -> List[bytes]:
    """The fields of ``/proc/<pid>[/task/<tid>]/stat`` from field 3 (the state) on: the
    command name before them may hold spaces and parentheses."""
    return raw[raw.rindex(b")") + 2:].split()


def stat_flags(raw: bytes) -> Tuple[int, int]:
    """(flags, exit status) from the text of ``/proc/<pid>[/task/<tid>]/stat``."""
    fields = stat_fields(raw)
    return int(fields[6]), int(fields[49])  # stat fields 9 and 52


def threads_exiting(pid: int) -> bool:
    """No thread of ``pid`` can run user code any more: each has begun to exit or is gone."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return True  # reaped
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                if not stat_flags(f.read())[0] & PF_EXITING:
                    return False
        except (OSError, ValueError, IndexError):
            continue  # that thread is gone
    return True


def maps_a_device(pid: int) -> bool:
    """Whether ``pid`` mapped a device file (a GPU or other accelerator): its device
    memory is only released once the process is gone."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            return any(" /dev/" in line and " /dev/shm/" not in line and " /dev/zero" not in line
                       for line in f)
    except OSError:
        return False


def kill_trees(procs: List[subprocess.Popen], grace: float,
               sig: int = signal.SIGTERM, reap: bool = True) -> List[psutil.Process]:
    """Stop processes and everything they started: ``sig``, up to ``grace`` s, then SIGKILL.

    Descendants are listed *before* the first signal: once a worker is dead its children
    are re-parented and can no longer be found from it.  Returns as soon as all are gone
    (``reap`` False: right after the SIGKILL, with the descendants it was sent to).
    """
    tree: List[psutil.Process] = []
    for p in procs:
        tree += _descendants(p.pid)
    if grace > 0:
        for p in procs:
            if p.poll() is None:
                _signal_group(p, sig)
                _signal_group(p, signal.SIGCONT)  # a stopped (hung) worker must see it
        for d in tree:
            with contextlib.suppress(psutil.Error):
                d.send_signal(sig)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            time.sleep(0.01)
    for p in procs:
        tree += _descendants(p.pid)
        _signal_group(p, signal.SIGKILL)
    for d in tree:
        with contextlib.suppress(psutil.Error):
            d.kill()
    if reap:
        reap_all(procs, tree)
    return tree


def reap_all(procs: List[subprocess.Popen], tree: List[psutil.Process]) -> None:
    """Wait for killed processes and their descendants (an unkillable one is given up on)."""
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):  # unkillable (D state)
            p.wait(timeout=10)
    psutil.wait_procs(tree, timeout=1)
