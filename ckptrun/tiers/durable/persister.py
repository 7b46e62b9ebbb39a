"""The agent's background persistence: memory tier -> durable storage, off the training path.

A :class:`Persister` owns one daemon thread.  When a persist is due (every N steps, or every
D seconds since the last one) it asks the agent's ``reader`` for the newest step committed by
all local ranks, writes it with :func:`ckptrun.tiers.durable.storage.write_step`, prunes to ``keep`` and
emits ``persisted``.  A failure emits ``persist_failed`` and is retried with exponential
backoff (the retry takes whatever step is newest by then).  Nothing here ever raises into the
agent or waits on training: the reader is expected to copy or pin the slots it hands out
(``release(step)`` is called once the write is over either way).

Usage by the agent::

    p = Persister(url, every_steps=None, every_seconds=600, keep=3, world_size=W,
                  emit=events.emit, reader=lambda min_step: memory.read_common(min_step))
    p.start()
    p.notify(step)          # optional: wakes the thread when a new step is committed
    ...
    p.final(last_step)      # at a successful end: synchronous, returns True when persisted
    p.stop()

``reader(min_step)`` returns ``(step, {rank: (meta, tensors)})`` for the newest step every
local rank has committed if that step is ``>= min_step``, else ``None`` (cheaply: it is
polled).  With ``every_steps=N`` ``min_step`` is the next multiple of N, and the reader
returns that step (or, if the workers moved past it before it could be read, a later
multiple of N), so the durable steps are the multiples of N.  Limitation: the persister finalizes the step itself, so it needs all
``world_size`` ranks from its own node (single-node jobs); multi-node jobs need a
coordinator around :func:`storage.write_parts`/:func:`storage.finalize`.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, ContextManager, Dict, List, Optional, Tuple

Snapshot = Tuple[Dict[str, Any], List[Any]]
Reader = Callable[[int], Optional[Tuple[int, Dict[int, Snapshot]]]]
# holder(step): a context manager holding every local rank's snapshot of ``step`` still
# (``{rank: (meta, tensors)}``) for as long as the write takes; taken under the persister's
# lock, so that the lock is always taken before the slots' pins, as the reader takes them
Holder = Callable[[int], ContextManager[Dict[int, Snapshot]]]


class Persister:
    """Background persistence of the memory tier to ``url`` (see the module docstring)."""

    def __init__(
        self,
        url: str,
        *,
        reader: Reader,
        world_size: int,
        every_steps: Optional[int] = None,
        every_seconds: Optional[float] = 600.0,
        keep: int = 3,
        emit: Optional[Callable[..., Any]] = None,
        release: Optional[Callable[[int], None]] = None,
        start_step: int = 0,
        poll_s: float = 0.5,
        retry_base_s: float = 2.0,
        retry_max_s: float = 120.0,
        threads: int = 2,  # DCP writer threads: 2 files in flight (S3: ~1.7x faster)
        write: Optional[Callable[..., Dict[str, Any]]] = None,
    ) -> None:
        if (every_steps is None) == (every_seconds is None):
            raise ValueError("exactly one of every_steps / every_seconds must be set")
        if every_steps is not None and every_steps < 1:
            raise ValueError("every_steps must be >= 1")
        self.url = url
        self.every_steps = every_steps
        self.every_seconds = every_seconds
        self.keep = keep
        self.world_size = world_size
        self._reader = reader
        # write(url, step, snaps, world_size, threads=) -> {bytes, seconds, url}; the default
        # writes every rank itself; a multi-node job passes a coordinated writer
        self._write = write
        self._release = release
        self._emit = emit or (lambda event, **fields: None)
        self._poll_s = poll_s
        self._retry_base_s = retry_base_s
        self._retry_max_s = retry_max_s
        self._threads = threads
        self._base_step = start_step  # the step counting of every_steps starts from here
        self._last_time = time.monotonic()  # the first timed persist is one period after start
        self._persisted_step: Optional[int] = None
        self._persisted_url: Optional[str] = None
        self._last_error: Optional[str] = None
        self._failures = 0  # consecutive
        self._next_try = 0.0
        self._in_flight: Optional[int] = None
        self._io = threading.Lock()  # one write at a time: background or final()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: Optional[threading.Thread] = None

    # ------------------------------------------------------------------ agent-facing

    def start(self) -> None:
        """Start the background thread (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="ckptrun-persister",
                                            daemon=True)
            self._thread.start()

    def notify(self, step: int) -> None:
        """A new step was committed: check now instead of at the next poll."""
        self._wake.set()

    def final(self, step: int, attempts: int = 3, holder: Optional[Holder] = None,
              exact: bool = True) -> bool:
        """Persist ``step`` (the job's last) synchronously; True when it is durable.

        Waits for an in-flight background persist first.  Retries ``attempts`` times, then
        gives up with ``persist_failed`` -- never raises.  ``holder``: write what it holds
        instead of a copy from the reader (see :meth:`_persist_held`).  ``exact=False``: the
        reader may settle on an earlier step (several machines: the newest step they all
        hold, which is ``step`` or one before it after a preemption).
        """
        self._stopping.set()  # no new background persists from here on
        self._wake.set()
        with self._io:
            if self._durable(step):
                return True
            for attempt in range(attempts):
                done = self._persist_once(step, exact=exact, holder=holder)
                if done:
                    return True
                if done is None:
                    break  # no step every machine holds: nothing to retry for
                if _misconfigured(self._last_error):
                    break  # waiting cannot make the machines share storage: 6 s saved
                if attempt + 1 < attempts:
                    time.sleep(min(self._retry_base_s * 2 ** attempt, self._retry_max_s))
        return False

    def persist_now(self, step: int, holder: Optional[Holder] = None) -> bool:
        """Persist ``step`` now, once, on the caller's thread (the job's last step while its
        workers tear down); True when it is durable.  Unlike :meth:`final` the background
        persists go on: the job may still fail and train on."""
        with self._io:
            return self._durable(step) or bool(self._persist_once(step, holder=holder))

    def _durable(self, step: int) -> bool:
        """``step`` (or a later one) is persisted already: the job's end need not write it."""
        return self._persisted_step is not None and self._persisted_step >= step

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread; an in-flight write is left to finish in the daemon thread."""
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def status(self) -> Dict[str, Any]:
        """``persisted_step``, ``persisted_url``, ``last_error`` (+ ``persisting``, ``failures``)."""
        return {"persisted_step": self._persisted_step, "persisted_url": self._persisted_url,
                "last_error": self._last_error, "persisting": self._in_flight,
                "failures": self._failures}

    # ------------------------------------------------------------------ internals

    def _run(self) -> None:
        while not self._stopping.is_set():
            self._wake.wait(self._poll_s)
            self._wake.clear()
            if self._stopping.is_set():
                break
            try:
                self._tick()
            except Exception as e:  # noqa: BLE001 -- the thread must survive anything
                self._last_error = f"persister: {type(e).__name__}: {e}"

    def _tick(self) -> None:
        now = time.monotonic()
        if now < self._next_try:
            return
        if self._failures == 0 and self.every_seconds is not None \
                and now - self._last_time < self.every_seconds:
            return
        with self._io:
            if self._stopping.is_set():
                return
            if self.every_steps is not None:
                # the multiples of N (a reader that missed one gives a later multiple); the
                # count starts over from a step that is not one (a resumed final step)
                min_step = (self._base_step // self.every_steps + 1) * self.every_steps
            else:
                min_step = (self._persisted_step or 0) + 1
                if self._failures:  # retrying: any step newer than the last durable one
                    min_step = (self._persisted_step or 0) + 1
            ok = self._persist_once(min_step, exact=False)
            if ok is None:
                return  # nothing new to persist yet
            if ok:
                self._next_try = 0.0
            else:
                delay = min(self._retry_base_s * 2 ** (self._failures - 1), self._retry_max_s)
                self._next_try = time.monotonic() + delay

    def _persist_once(self, step: int, exact: bool = True,
                      holder: Optional[Holder] = None) -> Optional[bool]:
        """Read and write one step; True ok, False failed (event emitted), None nothing to do.
        ``holder``: the snapshots are held (not copied) by ``holder(step)`` while written."""
        if holder is not None:
            return self._persist_held(step, holder)
        try:
            got = self._reader(step)
        except Exception as e:  # noqa: BLE001
            return self._failed(step, f"reading the memory tier: {type(e).__name__}: {e}")
        if got is None:
            if exact:
                return self._failed(step, f"step {step} is not in the memory tier")
            return None
        s, snaps = got
        if exact and s != step:
            self._release_step(s)
            return self._failed(step, f"the memory tier holds step {s}, not {step}")
        try:
            res = self._write_step(s, snaps)
        except Exception as e:  # noqa: BLE001
            return self._failed(s, _one_line(e))
        finally:
            self._release_step(s)
            del snaps
        return self._succeeded(s, res)

    def _persist_held(self, step: int, holder: Holder) -> bool:
        """Write ``step`` from what ``holder(step)`` holds; a hold that cannot be had, or that
        reports on leaving that the memory changed under the write, fails the persist --
        nothing is recorded or announced before the hold is left intact."""
        try:
            with holder(step) as snaps:
                res = self._write_step(step, snaps)
        except Exception as e:  # noqa: BLE001
            return self._failed(step, _one_line(e))
        return self._succeeded(step, res)

    def _write_step(self, step: int, snaps: Dict[int, Snapshot]) -> Dict[str, Any]:
        from ckptrun.tiers.durable import storage

        self._in_flight = step
        try:
            write = self._write or storage.write_step
            return write(self.url, step, snaps, self.world_size, threads=self._threads)
        finally:
            self._in_flight = None

    def _succeeded(self, s: int, res: Dict[str, Any]) -> bool:
        from ckptrun.tiers.durable import storage

        self._persisted_step, self._persisted_url = s, res["url"]
        self._base_step = s
        self._last_time = time.monotonic()
        self._failures = 0
        self._last_error = None
        self._emit("persisted", step=s, url=res["url"], bytes=res["bytes"],
                   seconds=round(res["seconds"], 4))
        try:
            storage.prune(self.url, self.keep)
        except Exception as e:  # noqa: BLE001 -- a failed prune never undoes a good persist
            self._last_error = f"prune: {_one_line(e)}"
        return True

    def _failed(self, step: int, error: str) -> bool:
        self._failures += 1
        self._last_error = error
        try:
            self._emit("persist_failed", step=step, error=error)
        except Exception:  # noqa: BLE001, S110 -- the event log itself may be what is broken
            pass
        return False

    def _release_step(self, step: int) -> None:
        if self._release is not None:
            try:
                self._release(step)
            except Exception as e:  # noqa: BLE001
                self._last_error = f"release: {type(e).__name__}: {e}"


def _misconfigured(error: Optional[str]) -> bool:
    """Whether a persist failed because the machines do not share ``--persist-to`` (every
    node reads the leader's answer, so all of them stop retrying together)."""
    from ckptrun.tiers.durable.rounds import NOT_SHARED

    return bool(error) and NOT_SHARED in str(error)


def _one_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}".rstrip(": ")
