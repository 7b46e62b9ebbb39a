"""Orphan protection: a tiny watchdog that outlives the agent by a few milliseconds.

``PR_SET_PDEATHSIG`` kills the agent's direct children when it dies, but not what they
started (data loader workers, a shell's children).  The reaper runs in its own session
(a Ctrl-C or ``kill -TERM -<pgid>`` of the agent's group does not reach it) and reads a
pipe from the agent.  The agent writes ``+<pid>`` for every process it starts (each leads
its own process group) and ``-<pid>`` once it has reaped it.  When the pipe closes --
the agent exited, cleanly or by SIGKILL -- the reaper kills every process group still
registered, with all descendants, unlinks ``/dev/shm/ckptrun-<token>-*`` and exits.

Run as ``python -m ckptrun.agent.reaper <job_token>``; it must not import torch (start-up time).
"""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
from typing import Optional, Set

SHM_GLOB = "/dev/shm/ckptrun-{token}-*"


def _kill_all(pids: Set[int]) -> None:
    if not pids:  # a clean exit: the agent reaped everything (and is waiting for us)
        return
    import psutil

    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
            procs += psutil.Process(pid).children(recursive=True)
        except psutil.Error:
            pass
    for pid in pids:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=2)


def unlink_shm(token: str) -> None:
    """Remove every shared-memory file of the job with this token."""
    for path in glob.glob(SHM_GLOB.format(token=token)):
        try:
            os.unlink(path)
        except OSError:
            pass


def main(argv: Optional[list] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    token = argv[0]
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # only the pipe decides when we act
    pids: Set[int] = set()
    buf = b""
    while True:
        chunk = os.read(0, 4096)
        if not chunk:
            break
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for line in lines:
            if line.startswith(b"+"):
                pids.add(int(line[1:]))
            elif line.startswith(b"-"):
                pids.discard(int(line[1:]))
    _kill_all(pids)
    unlink_shm(token)
    return 0


class Reaper:
    """Agent side: starts the watchdog and keeps it informed."""

    def __init__(self, job_token: str):
        from ckptrun.protocol.job_secret import without_secret

        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ckptrun.agent.reaper", job_token],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, start_new_session=True,
            close_fds=True, env=without_secret(os.environ),
        )
        self._fd = self.proc.stdin.fileno()

    def _send(self, line: str) -> None:
        try:
            os.write(self._fd, line.encode())
        except OSError:
            pass  # reaper gone: PDEATHSIG still covers direct children

    def watch(self, pid: int) -> None:
        self._send(f"+{pid}\n")

    def forget(self, pid: int) -> None:
        self._send(f"-{pid}\n")

    def close(self) -> None:
        """Clean exit: the reaper does its final sweep (harmless by now) and exits."""
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()


if __name__ == "__main__":
    sys.exit(main())
