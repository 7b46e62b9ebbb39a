"""Process niceness: a warm spare waits at a low priority, and both the agent (promoting
the spare) and the spare itself (once it is told to go) set it back for every thread."""

from __future__ import annotations

import os


def renice(pid: int, nice: int) -> None:
    """Set the nice value of every thread of ``pid`` (Linux nice values are per thread: the
    threads torch started during warm-up count too); lowering it needs privilege."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        tids = [pid]
    for tid in tids:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        except OSError:
            pass
