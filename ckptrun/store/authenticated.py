"""The rendezvous store, authenticated: every value MAC'd with the job key.

torch's ``TCPStore`` answers anyone who can reach its port, and torch's dynamic rendezvous
keeps its state there as a pickle, which it unpickles on every sync: a value written by
someone else ran code in every agent.  Here nothing read from the store is used, parsed or
unpickled before its MAC is verified:

* :class:`AuthenticatedStore` wraps the store the agents (and torch's handler, for its own
  keys) use: a value is ``MAGIC | HMAC-SHA256(key, name | value)[:16] | value``, bound to its
  key's name, so a value cannot be forged, moved to another key, or replayed from another
  job (whose key differs: :func:`ckptrun.protocol.job_secret.job_key`);
* :class:`AuthenticatedBackend` wraps torch's rendezvous *backend* (c10d or etcd), whose state
  is the pickle: it seals the state before it is stored and checks it before torch sees it.

A value that fails its MAC is reported (``on_forged``, at most once per key every
:data:`REPORT_S` seconds) and never returned.  The genuine value it replaced is put back when
this agent has seen one (most keys are written once: an address, a round's result), else the
forgery is removed and the reader waits for a real value; the operation is then redone.  So
forged writes, even a stream of them, never stop training -- they can slow it: the store has
no access control, so someone who can reach it can always deny service.

Counters (``add``) are the store server's own integers and cannot be MAC'd: what ckptrun
counts with them (liveness beats, the exit barrier) is a hint an attacker can inflate, never
data it parses.
"""

from __future__ import annotations

import hashlib
import hmac
import threading
import time
from datetime import timedelta
from typing import Callable, List, Optional, Sequence, Tuple

import torch.distributed as dist

from ckptrun.store.kvstore import as_bytes

MAGIC = b"ckS1"
TAG = 16
REPORT_S = 10.0


class _Sealer:
    """MAC'ing and checking, shared by the store and the backend wrappers."""

    def __init__(self, key: bytes, on_forged: Optional[Callable[[str], None]]) -> None:
        self.key = key
        self.on_forged = on_forged or (lambda name: None)
        self._lock = threading.Lock()
        self._reported: dict = {}  # key -> when its last forgery was reported
        self.last: dict = {}  # key -> the newest genuine value seen (put back over forgeries)

    def seal(self, name: str, value: bytes) -> bytes:
        return MAGIC + self._tag(name, value) + value

    def open(self, name: str, raw: bytes) -> Optional[bytes]:
        """The value inside ``raw``, or None when it is not this job's (reported)."""
        raw = bytes(raw)
        if raw[:len(MAGIC)] == MAGIC and len(raw) >= len(MAGIC) + TAG:
            tag, value = raw[len(MAGIC):len(MAGIC) + TAG], raw[len(MAGIC) + TAG:]
            if hmac.compare_digest(tag, self._tag(name, value)):
                return value
        now = time.monotonic()
        with self._lock:
            due = now - self._reported.get(name, -REPORT_S) >= REPORT_S
            if due:
                self._reported[name] = now
        if due:
            self.on_forged(name)
        return None

    def _tag(self, name: str, value: bytes) -> bytes:
        return hmac.new(self.key, name.encode() + b"\0" + value, hashlib.sha256).digest()[:TAG]


class AuthenticatedStore(dist.Store):
    """A torch ``Store`` whose values carry this job's MAC (module docstring).  It can go
    under a ``PrefixStore`` and be handed to torch's rendezvous handler."""

    def __init__(self, inner, key: bytes, on_forged: Optional[Callable[[str], None]] = None,
                 _sealer: Optional[_Sealer] = None) -> None:
        super().__init__()
        self._inner = inner
        self._sealer = _sealer or _Sealer(key, on_forged)
        # torch keeps only the C++ half of a Python store a clone() returns: the Python
        # object must outlive it, or the clone's methods are "not implemented"
        self._clones: List[AuthenticatedStore] = []

    # -- values: sealed on the way in, checked on the way out ----------------------------
    def set(self, key: str, value) -> None:
        value = as_bytes(value)
        self._inner.set(key, self._sealer.seal(key, value))
        self._sealer.last[key] = value

    def get(self, key: str) -> bytes:
        while True:
            raw = bytes(self._inner.get(key))
            value = self._sealer.open(key, raw)
            if value is not None:
                self._sealer.last[key] = value
                return value
            self._replace_forgery(key, raw)

    def multi_get(self, keys: Sequence[str]) -> List[bytes]:
        return [self.get(k) for k in keys]

    def multi_set(self, keys: Sequence[str], values: Sequence) -> None:
        for k, v in zip(keys, values):
            self.set(k, v)

    def compare_set(self, key: str, expected_value, desired_value) -> bytes:
        expected, desired = as_bytes(expected_value), as_bytes(desired_value)
        sealed_desired = self._sealer.seal(key, desired)
        while True:
            # a MAC is a function of (name, value): the sealed form of ``expected`` is the
            # exact bytes the store holds when it matches; an empty one means "absent"
            sealed_expected = self._sealer.seal(key, expected) if expected else b""
            raw = bytes(self._inner.compare_set(key, sealed_expected, sealed_desired))
            if raw == sealed_desired:
                self._sealer.last[key] = desired
                return desired
            if not expected and raw == b"":
                return raw
            value = self._sealer.open(key, raw)
            if value is not None:
                self._sealer.last[key] = value
                return value
            self._replace_forgery(key, raw)

    def _replace_forgery(self, key: str, raw: bytes) -> None:
        """Put the last genuine value back over the forgery ``raw`` (or remove it when none
        was seen here), only if ``raw`` is still what the key holds."""
        try:
            genuine = self._sealer.last.get(key)
            if genuine is not None:
                self._inner.compare_set(key, raw, self._sealer.seal(key, genuine))
                return
            marker = self._sealer.seal(key, b"\0forged")  # swap, then delete: an honest
            if bytes(self._inner.compare_set(key, raw, marker)) == marker:  # write stays
                self._inner.delete_key(key)
        except Exception:  # noqa: BLE001 -- a store without delete: the next read retries
            pass

    # -- everything else: names and counters only ---------------------------------------
    def add(self, key: str, value: int) -> int:
        return self._inner.add(key, value)

    def check(self, keys: List[str]) -> bool:
        return self._inner.check(keys)

    def wait(self, keys: List[str], timeout: Optional[timedelta] = None) -> None:
        if timeout is None:
            self._inner.wait(keys)
        else:
            self._inner.wait(keys, timeout)

    def delete_key(self, key: str) -> bool:
        return self._inner.delete_key(key)

    def num_keys(self) -> int:
        return self._inner.num_keys()

    def set_timeout(self, timeout: timedelta) -> None:
        self._inner.set_timeout(timeout)

    @property
    def timeout(self) -> timedelta:
        return self._inner.timeout

    def clone(self) -> AuthenticatedStore:
        c = AuthenticatedStore(self._inner.clone(), self._sealer.key, _sealer=self._sealer)
        self._clones.append(c)
        return c


class AuthenticatedBackend:
    """torch's ``RendezvousBackend`` (c10d or etcd) with its pickled state sealed: torch's
    handler unpickles only what this job wrote.  A forged state reads as no state, which
    the handler then writes over with its own."""

    def __init__(self, backend, key: bytes, on_forged: Optional[Callable[[str], None]] = None):
        self._backend = backend
        self._sealer = _Sealer(key, on_forged)
        self._name = f"rendezvous state {getattr(backend, 'name', '?')}"

    @property
    def name(self) -> str:
        return self._backend.name

    def get_state(self) -> Optional[Tuple[bytes, object]]:
        got = self._backend.get_state()
        if got is None:
            return None
        raw, token = got
        value = self._sealer.open(self._name, raw)
        if value is None:
            return None if token is None else (None, token)  # type: ignore[return-value]
        return value, token

    def set_state(self, state: bytes, token=None):
        got = self._backend.set_state(self._sealer.seal(self._name, bytes(state)), token)
        if got is None:
            return None
        raw, new_token, ok = got
        value = self._sealer.open(self._name, raw)
        if value is None:  # the store holds a forgery: not ours, write again over it
            return self.set_state(state, new_token)
        return value, new_token, ok


class SealedStoreBackend:
    """torch's c10d rendezvous backend, rewritten on an :class:`AuthenticatedStore`: the
    handler's state (a pickle) is stored sealed under one key and read back only when its
    MAC holds; a forged state reads as none, and the handler's next write replaces it.

    torch's own ``C10dRendezvousBackend`` base64-decodes what it reads *before* anything
    could check it, so garbage there stops the rendezvous; this one never decodes.  A state
    that vanished after one was seen (deleted by someone who can reach the store, or a
    forgery removed) is put back from the last one seen: torch never removes its state, and
    an empty one would read as "every node left"."""

    name = "c10d"
    _NONE = b"\0ckptrun: no rendezvous state"

    def __init__(self, store: AuthenticatedStore, run_id: str) -> None:
        self._store, self._key = store, f"ckptrun/rendezvous-state/{run_id}"
        self._last: Optional[bytes] = None  # the newest genuine state seen
        self._call("compare_set", self._key, "", self._NONE)

    def get_state(self) -> Optional[Tuple[bytes, bytes]]:
        raw = self._call("compare_set", self._key, "", self._NONE)  # creates "none" if absent
        if raw == self._NONE and self._last is not None:
            raw = self._call("compare_set", self._key, self._NONE, self._last)
        return None if raw == self._NONE else (self._seen(raw), raw)

    def set_state(self, state: bytes, token=None) -> Optional[Tuple[bytes, bytes, bool]]:
        expected = token if isinstance(token, bytes) and token else self._NONE
        raw = self._call("compare_set", self._key, expected, bytes(state))
        if raw == expected != bytes(state):
            # c10d answers a compare-and-set on a missing key with ``expected``: the key is
            # gone (deleted, or a forgery removed), so this write creates it
            raw = self._call("compare_set", self._key, "", bytes(state))
        if raw == self._NONE:
            return None
        return self._seen(raw), raw, raw == bytes(state)

    def _seen(self, raw: bytes) -> bytes:
        self._last = raw
        return raw

    def _call(self, op: str, *args) -> bytes:
        from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

        try:
            return bytes(getattr(self._store, op)(*args))
        except (ValueError, RuntimeError, TimeoutError) as e:  # as torch's backend does
            raise RendezvousConnectionError(f"the rendezvous store failed: {e}") from e
