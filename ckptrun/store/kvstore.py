"""The rendezvous store as the agents' threads use it: one client per thread, short waits.

A torch ``TCPStore`` client runs one operation at a time, and a ``wait`` holds it until the
keys appear or the wait times out.  Threads that share a client therefore queue behind each
other's waits: two threads waiting in 0.5 s slices kept a third one's ``add`` out for 2 s on an
idle machine, and for over 5 s on a busy one -- the liveness thread's heartbeat then stopped
and healthy machines were declared lost.  Every thread that talks to the store on its own gets
its own client (:func:`own_client`), and waits never hold a client: :func:`wait_keys` asks
the store again and again, so that a thread can be stopped, or notice a lost machine, while
it waits.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Optional, Sequence

WAIT_SLICE_S = 0.5  # the longest interval between two looks at the store
FIRST_POLL_S = 0.001


def as_bytes(value) -> bytes:
    """A store value as bytes: torch's stores take ``str`` and ``bytes`` alike."""
    return value if isinstance(value, (bytes, bytearray)) else str(value).encode()


def as_text(value) -> str:
    """A store value as text: torch's stores return ``bytes``, Python-written ones ``str``."""
    return value.decode() if isinstance(value, (bytes, bytearray)) else str(value)


def agreed_secret(store, key: str) -> bytes:
    """``--insecure`` jobs only: a random key that the first agent to ask puts in the store
    at ``key`` (anyone who reads the store then has it; a job with a secret never uses this)."""
    import secrets

    mine = secrets.token_hex(32)
    return bytes.fromhex(as_text(store.compare_set(key, "", mine)) or mine)


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
    """Wait until every key in ``keys`` is set, asking the store (``check``) at intervals
    that grow from 1 ms to ``slice_s`` seconds: a key that appears soon is seen within a few
    ms, and a long wait costs the store host a request per ``slice_s``.

    Not ``store.wait`` in slices: torch's TCPStore client writes two C++ warnings to stderr
    ("waitForInput ... likely a timeout") every time such a wait times out, and the agents'
    logs filled with them -- several a second in steady state, forty a second while a peer
    was gone.  ``check`` answers at once and logs nothing.

    True once the keys exist; False when ``stop`` is set while they do not; between polls
    ``check()`` may raise to abandon the wait (e.g. a machine of the round is lost).  After
    ``timeout_s``: TimeoutError."""
    keys = list(keys)
    deadline, nap = time.monotonic() + timeout_s, FIRST_POLL_S
    while not store.check(keys):
        if stop is not None and stop.is_set():
            return False
        if check is not None:
            check()
        if time.monotonic() > deadline:
            raise TimeoutError(f"store keys not set after {timeout_s:.0f} s: {keys[:4]}")
        if stop is not None:
            stop.wait(nap)
        else:
            time.sleep(nap)
        nap = min(slice_s, nap * 1.5)
    return True
