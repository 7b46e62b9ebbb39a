"""The gate in front of every listener: connections that have not proven the key are bounded.

Anyone who can reach a port can open connections to it, and a connection that sends a byte
now and then keeps a per-read timeout from ever firing: 2,000 of them once held 2,000 agent
threads and descriptors, and at a low file limit the replication thread died of ``EMFILE``
and took the job with it.  A :class:`Gate` holds at most ``max_pending`` connections that
are still in their handshake -- a new one past that drops the *oldest* (a real peer's
handshake takes a round trip or two, so a flood that fills the gate cannot keep it out the
way turning newcomers away would), gives each a deadline for the *whole* handshake (a
watchdog shuts its socket down when it passes, which wakes the thread reading it), and
reports refusals at most once every ``report_every_s`` per listener.
A connection leaves the gate when it has proven the key (:meth:`Gate.proven`) or is done
(:meth:`Gate.leave`); only then may it take its time.

:func:`accept_or_back_off` is the accept loop's side: running out of descriptors, memory or
threads is a degradation to report once and wait out, never the end of the listener.
"""

from __future__ import annotations

import errno
import logging
import socket
import threading
import time
from typing import Callable, Dict, Optional, Tuple

log = logging.getLogger(__name__)

MAX_PENDING = 64  # connections in their handshake at once, per listener
HANDSHAKE_DEADLINE_S = 10.0  # for the whole handshake, however slowly its bytes trickle in
REPORT_EVERY_S = 10.0  # at most one refusal line (and event) per listener per this long
# accept() failures that mean "out of a resource for now" (descriptors, memory, buffers)
_EXHAUSTED = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}
# ... and the ones that mean the listening socket itself is gone
_CLOSED = {errno.EBADF, errno.EINVAL, errno.ENOTSOCK}


class Gate:
    """Admission and handshake deadlines for one listener (see the module docstring);
    ``name`` says what it admits in its lines ("replica connection": "refused replica
    connection from ...")."""

    def __init__(self, name: str, max_pending: Optional[int] = None,
                 deadline_s: Optional[float] = None, report_every_s: Optional[float] = None,
                 on_refused: Optional[Callable[[str], None]] = None) -> None:
        # (the module's values, read now: a test may set them for every listener it starts)
        self.name = name
        self.max_pending = MAX_PENDING if max_pending is None else max_pending
        self.deadline_s = HANDSHAKE_DEADLINE_S if deadline_s is None else deadline_s
        self.report_every_s = REPORT_EVERY_S if report_every_s is None else report_every_s
        self._on_refused = on_refused
        self._lock = threading.Lock()
        self._pending: Dict[int, Tuple[socket.socket, float, str]] = {}
        self._last_report = -self.report_every_s
        self._quiet = 0
        self.refused = 0  # connections dropped to make room (over the cap)
        self.expired = 0  # connections whose handshake ran past its deadline
        self._closed = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, daemon=True,
                                          name=f"ckptrun-gate-{name.replace(' ', '-')}")
        self._watchdog.start()

    @property
    def pending(self) -> int:
        """Connections now in their handshake."""
        with self._lock:
            return len(self._pending)

    def admit(self, conn: socket.socket, peer: str) -> None:
        """Let ``conn`` start its handshake; where ``max_pending`` are already in theirs, the
        oldest of them is dropped (its socket shut down: its thread ends)."""
        with self._lock:
            dropped = None
            if len(self._pending) >= self.max_pending:
                key = min(self._pending, key=lambda k: self._pending[k][1])
                dropped = self._pending.pop(key)
                self.refused += 1
                # shut down under the lock: a handshake done meanwhile (proven() waits for
                # the lock) is never cut after it counted as proven
                with _quiet_os():
                    dropped[0].shutdown(socket.SHUT_RDWR)
            self._pending[id(conn)] = (conn, time.monotonic() + self.deadline_s, peer)
        if dropped is not None:
            self.report(dropped[2], f"{self.max_pending} connections were in their handshake: "
                                    "the oldest, this one, was dropped")

    def proven(self, conn: socket.socket) -> None:
        """``conn`` proved the key: no deadline, no place in the cap any more."""
        with self._lock:
            self._pending.pop(id(conn), None)

    leave = proven  # a connection that failed or ended: out of the gate all the same

    def report(self, peer: str, why: str) -> None:
        """Say a refusal -- the first at once, then one line per ``report_every_s`` with how
        many more there were."""
        with self._lock:
            now = time.monotonic()
            if now - self._last_report < self.report_every_s:
                self._quiet += 1
                return
            more, self._quiet, self._last_report = self._quiet, 0, now
        log.warning("refused %s from %s: %s%s", self.name, peer, why,
                    f" (and {more} more since the last report)" if more else "")
        if self._on_refused is not None:
            self._on_refused(peer)

    def close(self) -> None:
        """Stop the watchdog (the listener is closed)."""
        self._closed.set()

    def _watch(self) -> None:
        while not self._closed.wait(min(0.5, self.deadline_s / 4)):
            now = time.monotonic()
            with self._lock:  # (shut down under it: see admit)
                late = [k for k, (_, until, _) in self._pending.items() if until <= now]
                for k in late:
                    conn = self._pending.pop(k)[0]
                    self.expired += 1
                    with _quiet_os():  # wakes the thread blocked reading it
                        conn.shutdown(socket.SHUT_RDWR)


class _quiet_os:
    """``with _quiet_os():`` -- an OSError of a socket already gone is no news."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, value, tb) -> bool:
        return kind is not None and issubclass(kind, OSError)


def accept_or_back_off(sock: socket.socket, name: str, stopped: threading.Event
                       ) -> Optional[Tuple[socket.socket, tuple]]:
    """``sock.accept()``; where the process is out of descriptors or memory, say so once and
    retry after a pause (the connections that hold them time out meanwhile).  None once the
    listener is closed or ``stopped`` is set."""
    pause, saying = 0.05, False
    while not stopped.is_set():
        try:
            got = sock.accept()
        except OSError as e:
            if e.errno is None or e.errno in _CLOSED or stopped.is_set():
                return None  # the listener was closed
            if e.errno not in _EXHAUSTED:  # one connection's trouble (ECONNABORTED, EPROTO)
                continue
            if not saying:
                log.warning("%s: cannot accept connections for now (%s); retrying", name,
                            e.strerror)
                saying = True
            stopped.wait(pause)
            pause = min(1.0, pause * 2)
            continue
        if saying:
            log.warning("%s: accepting connections again", name)
        return got
    return None


def start_thread(target: Callable[..., None], args: tuple, name: str,
                 conn: socket.socket) -> bool:
    """Start a daemon thread for ``conn``; where no thread can be started now, close
    ``conn`` (its peer retries) and return False instead of ending the accept loop."""
    try:
        threading.Thread(target=target, args=args, daemon=True, name=name).start()
        return True
    except RuntimeError:  # "can't start new thread"
        with _quiet_os():
            conn.close()
        return False
