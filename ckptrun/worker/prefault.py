"""Memory a restarted worker will allocate, faulted in by its warm spare ahead of time.

A restarted worker builds its model, optimizer and buffers again in fresh memory, and the
kernel zero-fills each 4 KiB page on first touch: ~0.3 s per 256 MiB on an idle 2-core
machine, 0.5-1 s under load -- the largest cost left between a crash and the first step
after restore.  A waiting spare knows how much state its rank restores (the size of the
rank's snapshot), so it pays that ahead: it grows glibc's main heap by about that much,
touches it and frees it with heap trimming off.  The worker's first big allocations are
then served from pages that are already there (glibc takes a request from the free top
of the heap before it considers ``mmap``).

:func:`release` -- called when ``Checkpointer.restore()`` finished (or at the first
``save()``) -- turns trimming back on: glibc returns the unused rest of the reservation at
its next ``free`` next to it, not on the restart path (``malloc_trim`` there cost 20-40 ms).
What stays different from a fresh interpreter: glibc's mmap threshold is fixed at 32 MiB
with a 64 MiB trim threshold (the values its own adaptive rule reaches, and which a
``mallopt`` call switches off).

glibc only, CPU state only (no reservation when CUDA is available: GPU state is restored
into device memory), never more than a quarter of the available memory;
``CKPTRUN_SPARE_PREFAULT=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import os
from typing import Optional

ENV_PREFAULT = "CKPTRUN_SPARE_PREFAULT"
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD = 32 << 20  # glibc's maximum; heap blocks must stay below it
_TRIM_AFTER = 64 << 20  # twice the mmap threshold, as glibc's adaptive rule sets it
_BLOCK = 16 << 20

_active = False  # mallopt changed by reserve(), not yet undone by release()


def _glibc() -> Optional[ctypes.CDLL]:
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018  (musl and others: no reservation)
        libc.mallopt  # noqa: B018
    except (OSError, AttributeError):
        return None
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    return libc


def _available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) << 10
    except (OSError, ValueError, IndexError):
        pass
    return 0


def reserve(state_bytes: int, stop=None) -> int:
    """Fault in heap memory for a worker that will restore ``state_bytes`` of state;
    returns the bytes reserved (0: nothing done).  Once per process.  ``stop``: a callable
    asked between blocks; True ends the reservation there (the worker is needed now)."""
    global _active
    if _active or state_bytes <= 0 or os.environ.get(ENV_PREFAULT, "1") == "0":
        return 0
    want = state_bytes + state_bytes // 8 + (32 << 20)  # the rest of start-up allocates too
    libc = _glibc()
    if libc is None or want > _available_bytes() // 4:
        return 0
    import torch

    if torch.cuda.is_available():
        return 0
    if not libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD):
        return 0
    libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)
    _active = True
    blocks = []
    while len(blocks) * _BLOCK < want:
        if stop is not None and stop():
            break
        p = libc.malloc(_BLOCK)
        if not p:
            break
        ctypes.memset(p, 0, _BLOCK)
        blocks.append(p)
    for p in blocks:  # adjacent: they merge into the free top of the heap, which stays
        libc.free(p)
    return len(blocks) * _BLOCK


def release() -> None:
    """Let glibc trim the heap again (the reservation's unused rest goes back to the system
    at the next ``free`` next to it)."""
    global _active
    if not _active:
        return
    _active = False
    libc = _glibc()
    if libc is not None:
        libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_AFTER)
