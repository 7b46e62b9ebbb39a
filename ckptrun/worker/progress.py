"""Is the script's main thread getting anywhere?  A sampler thread in every ckptrun worker.

Heartbeats come from ``save()``: a rank that evaluates for ten minutes on rank 0 only, and the
rank waiting for it in the next all-reduce, both stop beating, yet only a job where *no* rank
moves is hung.  So every few hundred milliseconds a daemon thread looks at the main thread
and writes two times into this rank's control record: ``sampled`` (the sampler ran: the
process is not stopped) and ``advanced`` (the main thread was running on a CPU, or stood at
another bytecode than at the last sample).  A main thread blocked in a collective, a lock or
a sleep stands still and sleeps in the kernel; one evaluating, loading data or compiling
does not.  The agent (``ckptrun.agent.hang``) declares a hang only when no rank of the job
advanced for the timeout, and names the ranks whose sampler went silent (stopped) rather
than the ones waiting.

No per-bytecode hook (``sys.settrace``) is installed: the cost is one ``sys._current_frames``
call and one small ``/proc`` read per sample.  Started once per process, only under the ckptrun
agent (with a control block), the first time the worker talks to it; it runs as long as the process (a script may
still compute after ``Checkpointer.close()``, and a silent sampler reads as a stopped
process) and ends at interpreter exit.
"""

from __future__ import annotations

import atexit
import sys
import threading
import time
from typing import Optional, Tuple

SAMPLE_S = 0.2


class ProgressSampler:
    """Samples the main thread every ``interval`` s into ``block``'s record of ``local_rank``."""

    def __init__(self, block, local_rank: int, interval: float = SAMPLE_S):
        self.block, self.local_rank, self.interval = block, local_rank, interval
        main = threading.main_thread()
        self._ident = main.ident
        self._stat = f"/proc/self/task/{main.native_id}/stat"
        self._last: Optional[Tuple[int, int, int]] = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="ckptrun-progress", daemon=True)

    def start(self) -> ProgressSampler:
        now = time.monotonic()
        self.block.set(self.local_rank, "sampled", now)
        self.block.set(self.local_rank, "advanced", now)
        self._thread.start()
        return self

    def retarget(self, block, local_rank: int) -> None:
        """Write into another control block from now on (the worker was handed a new one)."""
        self.block, self.local_rank = block, local_rank

    def sample(self) -> bool:
        """One sample: True when the main thread advanced since the last one."""
        frame = sys._current_frames().get(self._ident)
        where = None if frame is None else (id(frame), id(frame.f_code), frame.f_lasti)
        advanced = where != self._last or self._running()
        self._last = where
        now = time.monotonic()
        block, rank = self.block, self.local_rank
        try:
            block.set(rank, "sampled", now)
            if advanced:
                block.set(rank, "advanced", now)
        except (ValueError, IndexError):
            pass  # the block was closed under us (the worker is exiting)
        return advanced

    def _running(self) -> bool:
        """The main thread's scheduler state is R (on a CPU or runnable): computing in C."""
        try:
            with open(self._stat, "rb") as f:
                data = f.read()
        except OSError:
            return False
        # "pid (comm) S ...": comm may hold spaces and parentheses; the state follows the last ')'
        return data[data.rfind(b")") + 2:data.rfind(b")") + 3] == b"R"

    def stop(self) -> None:
        """End the thread (at interpreter exit: a daemon thread still running while the
        interpreter finalizes can abort the process)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self.interval + 1)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()


_sampler: Optional[ProgressSampler] = None


def sample_progress(block, local_rank: int) -> None:
    """Start this process's sampler (once), or point it at ``block``."""
    global _sampler
    if _sampler is None:
        _sampler = ProgressSampler(block, local_rank).start()
        atexit.register(_sampler.stop)
    else:
        _sampler.retarget(block, local_rank)


def sampler() -> Optional[ProgressSampler]:
    """This process's sampler, if it started one."""
    return _sampler
