"""Pinning a slot's host memory for CUDA (``cudaHostRegister``), without side effects on the
training script.

Device -> host copies into registered memory run at the link's speed and asynchronously on
a side stream; into pageable memory they are staged and synchronous.  Registration is an
optimisation: where it fails the slot stays pageable and copies still work.

Two things make the raw runtime calls risky inside somebody else's process:

* a failed runtime call leaves its error as the calling thread's "last error", and torch's
  next kernel-launch check (``cudaGetLastError``) reports it as the *script's* error --
  seen on an H200: "CUDA error: resource already mapped" out of a ``backward()``; so a
  failure is cleared at once (and reported once, on stderr);
* a thread's current device starts as GPU 0: a call from ckptrun's allocation thread would
  create a CUDA context there (hundreds of MiB of GPU 0 for every rank of the machine), so
  the rank's own device is made current around each call.
"""

from __future__ import annotations

import ctypes
import sys
from typing import Any, Optional

PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context of the process

_cudart: Any = None  # the process's loaded libcudart (ctypes), False where none is found
_warned = False


def register(view: Any, device: Optional[int]) -> bool:
    """Register the uint8 tensor ``view`` (a slot's whole map); True if it is now pinned."""
    import torch

    with torch.cuda.device(device if device is not None else -1):
        err = int(torch.cuda.cudart().cudaHostRegister(view.data_ptr(), view.numel(), PORTABLE))
        if err != 0:
            _clear_last_error()
    if err != 0:
        _warn(f"registering {view.numel() >> 20} MiB of slot memory at {view.data_ptr():#x} "
              f"failed (cudaError {err}): device->host copies into it run at pageable speed")
    return err == 0


def unregister(view: Any, device: Optional[int]) -> None:
    """Undo :func:`register` (before the memory is unmapped or handed on).  Never raises:
    it runs in ``close()`` and in a recovery, where CUDA may already be broken (a device
    assert) and the script's own exception is the one to see."""
    try:
        import torch

        with torch.cuda.device(device if device is not None else -1):
            err = int(torch.cuda.cudart().cudaHostUnregister(view.data_ptr()))
            if err != 0:
                _clear_last_error()
    except Exception as exc:  # noqa: BLE001
        _warn(f"unregistering slot memory failed: {exc!r}")
        return
    if err != 0:
        _warn(f"unregistering slot memory at {view.data_ptr():#x} failed (cudaError {err})")


def _clear_last_error() -> None:
    """``cudaGetLastError()`` on the calling thread: torch exposes no binding for it, so
    through the libcudart that torch loaded (the same library: the same per-thread error)."""
    global _cudart
    if _cudart is None:
        _cudart = _load_cudart() or False
    if _cudart:
        _cudart.cudaGetLastError()


def _load_cudart() -> Any:
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libcudart" in line and "/" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            return ctypes.CDLL(path)  # already loaded: the same handle, not a second copy
        except OSError:
            continue
    return None


def _warn(text: str) -> None:
    global _warned
    if not _warned:
        _warned = True
        print(f"ckptrun: {text}", file=sys.stderr, flush=True)
