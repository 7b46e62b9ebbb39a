"""The rendezvous store as the agents' threads use it: one client per thread, short waits.

A torch ``TCPStore`` client runs one operation at a time, and a ``wait`` holds it until the
keys appear or the wait times out.  Threads that share a client therefore queue behind each
other's waits: two threads waiting in 0.5 s slices kept a third one's ``add`` out for 2 s on an
idle machine, and for over 5 s on a busy one -- the liveness thread's heartbeat then stopped
and healthy machines were declared lost.  Every thread that talks to the store on its own gets
its own client (:func:`own_client`), and waits go in short slices (:func:`wait_keys`) so that a
thread can be stopped, or notice a lost machine, while it waits.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Callable, Optional, Sequence

WAIT_SLICE_S = 0.5


def own_client(store):
    """A client of the same store (same prefix) that no other thread waits on.

    ``Store.clone()`` opens a new connection to the store host; a store that cannot be cloned
    (older torch, a store written in Python such as etcd's) is shared as it is."""
    try:
        return store.clone()
    except Exception:  # noqa: BLE001 -- AttributeError, RuntimeError "not implemented", ...
        return store


def wait_keys(store, keys: Sequence[str], timeout_s: float, *,
              stop: Optional[threading.Event] = None,
              check: Optional[Callable[[], None]] = None,
              slice_s: float = WAIT_SLICE_S) -> bool:
    """Wait until every key in ``keys`` is set, in slices of ``slice_s`` seconds (the store
    answers as soon as the keys appear; the slice only bounds how late a stop is noticed).

    True once the keys exist; False when ``stop`` is set while they do not; between slices
    ``check()`` may raise to abandon the wait (e.g. a machine of the round is lost).  After
    ``timeout_s`` the store's own timeout error propagates."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            store.wait(list(keys), timedelta(seconds=slice_s))
            return True
        except Exception:  # noqa: BLE001 -- torch raises its own timeout error types
            if stop is not None and stop.is_set():
                return False
            if check is not None:
                check()
            if time.monotonic() > deadline:
                raise
