"""A full garbage collection before interpreter shutdown, in every worker the agent starts
and every process that creates a :class:`~ckptrun.Checkpointer` (plain ``torchrun`` or
``python`` too).

DDP and FSDP modules sit in reference cycles with the process group they hold, so even after
``destroy_process_group()`` the group lives until the garbage collector runs -- by default
during interpreter shutdown, where gloo's threads releasing their tensors abort the process
now and then ("terminate called without an active exception", SIGABRT after the job's last
step: a needless restart under a launcher, a failed job under plain torchrun).  Collecting
in an ``atexit`` handler, while the interpreter is still whole, tears such objects down like
any other.
"""

from __future__ import annotations

import atexit
import gc
import threading

_lock = threading.Lock()
_registered = False


def collect_at_exit() -> None:
    """Register, once per process, a full garbage collection at interpreter exit."""
    global _registered
    with _lock:
        if not _registered:
            atexit.register(_collect)
            _registered = True


def _collect() -> None:
    gc.collect()
    # What is left lives until the process ends: interpreter shutdown would walk it all
    # again (torch's import alone, ~0.5 s here) for nothing; the workers' exit is the job's.
    gc.freeze()
