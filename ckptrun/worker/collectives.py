"""Breaking a worker's blocked collectives from another thread (in-process recovery).

When a rank dies, only the ranks that talk to it directly see an error: gloo's ring leaves
the others waiting for a neighbour that is itself waiting -- for the process group's
timeout (30 minutes by default).  ``ProcessGroupGloo.abort()`` does not wake a waiting
operation.  What does is the connection: once a pair's socket is shut down, the operation
waiting on it raises at once, and so does the peer's at the other end -- so the error
reaches every rank in one hop, whatever each is waiting for.

So every process group created while a resilient function runs is watched: the sockets
that appear during its creation (``_new_process_group_helper``, which ``init_process_group``
and ``new_group`` both go through) are gloo's pair connections to the other ranks.  To break
them, each connected one is ``shutdown()`` -- never a listening one: gloo's listener thread
aborts the process on an error.  NCCL communicators are aborted with torch's
``_abort_process_group``, which is made for this.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import sys
import threading
from typing import Dict, List, Set


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
        """Wrap torch's process-group constructor (once per process); False when this torch
        has none to wrap (collectives then break only where a peer's death reaches)."""
        if self._installed:
            return True
        try:
            import torch.distributed.distributed_c10d as c10d
        except ImportError:
            return False
        inner = getattr(c10d, "_new_process_group_helper", None)
        if inner is None:
            return False

        def helper(*args, **kwargs):
            before = set(_socket_fds())
            try:
                return inner(*args, **kwargs)
            finally:
                with self._lock:
                    self._inodes |= set(_socket_fds()) - before
                backend = str(kwargs.get("backend", args[3] if len(args) > 3 else "")).lower()
                self._nccl = self._nccl or "nccl" in backend

        helper.__wrapped__ = inner  # type: ignore[attr-defined]
        c10d._new_process_group_helper = helper
        self._installed = True
        return True

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
            import torch.distributed.distributed_c10d as c10d

            c10d._abort_process_group()
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
    """Every process group of this process (torch's own table of them; [] without one)."""
    try:
        import torch.distributed.distributed_c10d as c10d

        return list(c10d._world.pg_map)
    except Exception:
        return []


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
    itself keeps the group as some functions' default argument: :func:`_unpin_default_groups`.
    """
    _unpin_default_groups()
    state = sys.modules.get("accelerate.state")
    if state is None:
        return
    with contextlib.suppress(Exception):
        state.AcceleratorState._reset_state(reset_partial_state=True)
    with contextlib.suppress(Exception):
        state.GradientState._reset_state()


# modules whose functions take ``group=group.WORLD`` as a default argument: evaluated once,
# at import -- and torch imports them with ``torch._dynamo`` (DDP's constructor, the first
# optimizer step) or the user's script does, often after the first attempt's
# ``init_process_group``.  (Found by grepping torch for ``= group.WORLD`` defaults.)
GROUP_DEFAULT_MODULES = ("torch.distributed.nn.functional",
                         "torch.distributed.fsdp.sharded_grad_scaler",
                         "torch.distributed.optim.zero_redundancy_optimizer")


def _unpin_default_groups() -> int:
    """Replace the destroyed groups that functions (and classes' methods) of
    :data:`GROUP_DEFAULT_MODULES` keep as default arguments with ``None`` -- which they take
    as "the default group", now the next attempt's; returns how many functions changed.

    Why: ``torch.distributed.nn.functional.all_gather(t)`` and the rest of torch's
    differentiable collectives, or a ``ShardedGradScaler()``, would otherwise keep using the
    first attempt's group after an in-place recovery -- the collectives raised "not
    initialized in the world group map" on every survivor -- and keep it alive: its
    connections, its store client and its threads (on a GPU, the aborted communicator) for
    the life of the process.
    """
    modules = [sys.modules[m] for m in GROUP_DEFAULT_MODULES if m in sys.modules]
    if not modules:  # none imported: nothing can hold a group (and no torch import here)
        return 0
    from torch.distributed import ProcessGroup

    def unpin(fn: object) -> int:
        changed = 0
        defaults = getattr(fn, "__defaults__", None)
        if defaults and any(isinstance(d, ProcessGroup) for d in defaults):
            fn.__defaults__ = tuple(None if isinstance(d, ProcessGroup) else d
                                    for d in defaults)
            changed = 1
        kw = getattr(fn, "__kwdefaults__", None)
        if kw and any(isinstance(d, ProcessGroup) for d in kw.values()):
            fn.__kwdefaults__ = {k: None if isinstance(d, ProcessGroup) else d
                                 for k, d in kw.items()}
            changed = 1
        return changed

    n = 0
    for module in modules:
        for obj in list(vars(module).values()):
            if isinstance(obj, type) and obj.__module__ == module.__name__:
                n += sum(unpin(m) for m in vars(obj).values())
            else:
                n += unpin(obj)
    return n
