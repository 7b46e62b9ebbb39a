"""Stopping a worker group: SIGTERM/grace/SIGKILL of whole process trees, reaping, and
what ``/proc`` tells about a process that has begun to exit (a failure is known from its
exit status before the kernel has freed its memory)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from typing import TYPE_CHECKING, List, Tuple

import psutil

if TYPE_CHECKING:
    from ckptrun.workers import Worker

PF_EXITING = 0x4  # task flag: the process has begun to exit
EXIT_POLL_S = 0.05  # how often a supervising agent looks for a failing worker


def _descendants(pid: int) -> List[psutil.Process]:
    with contextlib.suppress(psutil.Error):
        return psutil.Process(pid).children(recursive=True)
    return []


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)  # the worker leads its own process group


def stat_flags(raw: bytes) -> Tuple[int, int]:
    """(flags, exit status) from the text of ``/proc/<pid>[/task/<tid>]/stat``."""
    fields = raw[raw.rindex(b")") + 2:].split()
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
        _reap(procs, tree)
    return tree


def _reap(procs: List[subprocess.Popen], tree: List[psutil.Process]) -> None:
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):  # unkillable (D state)
            p.wait(timeout=10)
    psutil.wait_procs(tree, timeout=1)


def wait_for_exit(workers: List[Worker], timeout: float) -> None:
    """Sleep up to ``timeout`` s, but return within ``EXIT_POLL_S`` of one of the running
    ``workers`` exiting or starting to fail (:meth:`Worker.status`): a crash is acted on
    when it happens, not at the next monitor tick."""
    deadline = time.monotonic() + timeout
    while True:
        if any(w.proc.returncode is None and
               (w.failing() if w.stat_fd >= 0 else w.proc.poll()) is not None for w in workers):
            return
        left = deadline - time.monotonic()
        if left <= 0:
            return
        time.sleep(min(EXIT_POLL_S, left))


def stop_workers(workers: List[Worker], grace: float) -> None:
    """Stop a group (SIGTERM, ``grace``, SIGKILL; ``grace`` 0: SIGKILL at once) and wait
    until their logs are drained."""
    drain(workers, kill_trees([w.proc for w in workers], grace))


def drain(workers: List[Worker], tree: List[psutil.Process], block: bool = True) -> bool:
    """Reap a killed group (``block`` False: only if it is gone already) and drain its
    logs; False if it is not gone yet."""
    if block:
        _reap([w.proc for w in workers], tree)
    elif any(w.proc.poll() is None for w in workers):
        return False
    for w in workers:
        w.close()
        for pump in w.pumps:
            pump.join(timeout=2 if block else 0)
    return True

