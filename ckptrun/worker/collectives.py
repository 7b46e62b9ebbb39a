"""Breaking a worker's blocked collectives from another thread (in-process recovery).

When a rank dies, only the ranks that talk to it directly see an error: gloo's ring leaves
the others waiting for a neighbour that is itself waiting -- for the process group's
timeout (30 minutes by default).  ``ProcessGroupGloo.abort()`` does not wake a waiting
operation.  What does is the connection: once a pair's socket is shut down, the operation
waiting on it raises at once, and so does the peer's at the other end -- so the error
reaches every rank in one hop, whatever each is waiting for.

So every process group created while a resilient function runs is watched: the sockets
that appear during its creation (:func:`ckptrun.torchcompat.process_groups.watch_group_creation`)
are gloo's pair connections to the other ranks.  To break
them, each connected one is ``shutdown()`` -- never a listening one: gloo's listener thread
aborts the process on an error.  NCCL communicators are aborted by torch
(:func:`ckptrun.torchcompat.process_groups.abort_nccl`).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import sys
import threading
from typing import Dict, List, Set

from ckptrun.torchcompat import process_groups


def _socket_fds() -> Dict[int, int]:
    """{socket inode: one fd of this process on it}."""
    out: Dict[int, int] = {}
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError, ValueError):
                link = os.readlink(f"/proc/self/fd/{name}")
                if link.startswith("socket:["):
                    out.setdefault(int(link[8:-1]), int(name))
    return out


class CollectiveBreaker:
    """Watches process-group creation; :meth:`break_all` makes every blocked collective of
    the watched groups raise."""

    def __init__(self) -> None:
        self._inodes: Set[int] = set()
        self._lock = threading.Lock()
        self._installed = False
        self._nccl = False

    def install(self) -> bool:
        """Watch torch's process-group creation (once per process); False when this torch
        offers no place to watch (collectives then break only where a peer's death reaches)."""
        if self._installed:
            return True

        def created(before: Set[int], backend: str) -> None:
            with self._lock:
                self._inodes |= set(_socket_fds()) - before
            self._nccl = self._nccl or "nccl" in backend

        self._installed = process_groups.watch_group_creation(lambda: set(_socket_fds()),
                                                              created)
        return self._installed

    def break_all(self) -> int:
        """Shut down the watched groups' connections (and abort NCCL's communicators);
        returns how many sockets were shut down."""
        if self._nccl or _default_uses_nccl():
            self._abort_nccl()
        _shorten_timeouts()
        n = 0
        with self._lock:
            inodes = set(self._inodes)
        for inode, fd in _socket_fds().items():
            if inode not in inodes:
                continue
            try:
                s = socket.socket(fileno=os.dup(fd))
            except OSError:
                continue
            try:
                if not s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                    s.shutdown(socket.SHUT_RDWR)
                    n += 1
            except OSError:
                pass  # already closed by the peer
            finally:
                s.close()  # the dup only; the socket is gloo's to close
        return n

    def forget(self) -> None:
        """The watched groups are destroyed: their sockets are not ours to touch again."""
        with self._lock:
            self._inodes.clear()
        self._nccl = False

    @staticmethod
    def _abort_nccl() -> None:
        try:
            process_groups.abort_nccl()
        except Exception as exc:  # torch without it, or nothing left to abort
            print(f"ckptrun: aborting the NCCL communicators failed: {exc!r}", file=sys.stderr)


BROKEN_TIMEOUT_S = 1.0


def _shorten_timeouts() -> None:
    """Operations issued to the broken groups from now on -- DDP queues each bucket's
    all-reduce as backward reaches it -- give up within :data:`BROKEN_TIMEOUT_S`, not the
    group's timeout: one whose connection gloo has already closed may never be woken by a
    shut-down socket.  (Operations issued before keep their timeout.)"""
    for pg in _groups():
        with contextlib.suppress(Exception):  # torch without it, an aborted NCCL group
            pg.set_timeout(datetime.timedelta(seconds=BROKEN_TIMEOUT_S))


def _groups() -> List[object]:
    """Every process group of this process ([] without one)."""
    return process_groups.all_groups()


def _default_uses_nccl() -> bool:
    """Whether the default group has an NCCL backend (``init_process_group()`` with no
    backend on a GPU machine picks ``cpu:gloo,cuda:nccl``)."""
    if "torch" not in sys.modules:
        return False
    try:
        import torch.distributed as dist

        return dist.is_initialized() and "nccl" in str(dist.get_backend()).lower()
    except Exception:
        return False


# the destroyed groups' last references, until release_retired() drops them on a thread
_retired: List[object] = []


def destroy_groups(timeout_s: float = 10.0) -> bool:
    """Take every process group out of ``torch.distributed`` once the connections are broken
    (``destroy_process_group()`` on a thread); False when that did not return within
    ``timeout_s``.

    The groups' C++ objects stay alive here until :func:`release_retired`: a gloo group's
    destructor joins its worker threads, and one of them can sit out the group's timeout
    (30 minutes) in an operation queued before the break on a connection gloo had already
    closed -- about 1 in 80 recoveries at 8 ranks did.  Held, ``destroy_process_group`` is
    only torch's bookkeeping and returns at once, and the next ``init_process_group`` does
    not depend on the old group's threads.
    """
    try:
        import torch.distributed as dist
    except ImportError:
        return True
    if not (dist.is_available() and dist.is_initialized()):
        return True
    _retired.extend(_groups())

    def run() -> None:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()

    t = threading.Thread(target=run, name="ckptrun-destroy-pg", daemon=True)
    t.start()
    t.join(timeout_s)
    return not t.is_alive()


def release_retired() -> None:
    """Drop the destroyed groups on a daemon thread, where a destructor that waits (see
    :func:`destroy_groups`) keeps nothing else waiting.  Called once nothing else of the
    failed attempt holds them (after its objects are collected): whoever drops a group's
    last reference runs its destructor, and that must not be this process's main thread."""
    if not _retired:
        return
    groups = list(_retired)
    _retired.clear()
    threading.Thread(target=groups.clear, name="ckptrun-retire-pg", daemon=True).start()


def forget_framework_groups() -> None:
    """Clear the process-wide state of frameworks that keep the destroyed group.

    🤗 Accelerate keeps its distributed set-up in singletons (``PartialState``,
    ``AcceleratorState``, ``GradientState``): an ``Accelerator()`` made in the next attempt
    would take the old set-up as done and train with no process group.  The HF ``Trainer``
    resets them itself when its ``TrainingArguments`` are made; a plain accelerate loop does
    not.  Lightning and DeepSpeed look at ``torch.distributed.is_initialized()``.  torch
    itself keeps the group as some functions' default argument: :func:`ckptrun.torchcompat.process_groups.unpin_default_groups`.
    """
    process_groups.unpin_default_groups()
    state = sys.modules.get("accelerate.state")
    if state is None:
        return
    with contextlib.suppress(Exception):
        state.AcceleratorState._reset_state(reset_partial_state=True)
    with contextlib.suppress(Exception):
        state.GradientState._reset_state()


def from_communication(exc: BaseException) -> bool:
    """Whether ``exc`` looks like a broken collective (gloo/NCCL, a closed connection)."""
    try:
        import torch.distributed as dist

        if isinstance(exc, getattr(dist, "DistError", ())):
            return True
    except ImportError:
        pass
    text = f"{type(exc).__name__} {exc}".lower()
    return any(w in text for w in ("gloo", "nccl", "connection", "socket", "peer",
                                   "process group", "processgroup", "timed out"))
