"""A worker's own slots: allocation (pre-faulted, sized with headroom, /dev/shm checked up
front), the writer's slot-choice rule, and CUDA pinning of the slot memory.

Under the agent the slots are the rank's shared-memory files ``<CKPTRUN_SLOT_PREFIX><k>``,
which outlive the worker; under plain ``python``/``torchrun`` they are anonymous private
maps of the process (the in-process snapshot), with exactly the same layout and code path.
"""

from __future__ import annotations

import mmap
import os
import sys
import threading
import weakref
from typing import Any, Dict, List, Optional

from ckptrun.protocol import (
    PAGE,
    SHM_DIR,
    ShmMaps,
    SlotHeader,
    SlotState,
    create_shm_file,
    data_offset_for,
    fill_zeros,
    open_private,
    open_shm_file,
    slot_path,
)
from ckptrun.worker import pinning

MiB = 1 << 20
ENV_AHEAD = "CKPTRUN_SLOTS_AHEAD"  # "0": each slot is allocated by the save that first needs it

# Slot files a warm spare mapped while it waited (``premap_slots``): a restarted worker's
# SlotSet adopts them instead of paying MAP_POPULATE for every slot on the restart path.
_premapped = ShmMaps(write=True)


class ShmTooSmall(RuntimeError):
    """/dev/shm (or the configured budget) cannot hold this rank's slots."""


def _round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def size_with_headroom(meta_len: int, data_len: int) -> int:
    """Slot size for a state: 10% + 1 MiB headroom for data, generous room for the JSON."""
    return _round_up(data_offset_for(2 * meta_len + 64 * 1024) + data_len + data_len // 10 + MiB,
                     PAGE)


class SlotSet:
    """The slots of one rank, as seen by the worker that writes them.

    ``prefix`` None selects in-process mode (anonymous maps).  ``keep`` is how many of the
    newest commits a write must never touch: 2 under the agent (ranks may be one step apart
    at a crash, so every rank must still hold the slowest rank's step), 1 in-process.
    """

    def __init__(self, prefix: Optional[str], num_slots: int, keep: int,
                 max_bytes: int = 0, rank: int = 0) -> None:
        if num_slots <= keep:
            raise ValueError(f"ckptrun: {num_slots} slots cannot keep {keep} commits and write")
        self.prefix = prefix
        self.num_slots = num_slots
        self.keep = keep
        self.max_bytes = max_bytes
        self.rank = rank
        self.mms: List[Optional[mmap.mmap]] = [None] * num_slots
        self._pinned: List[Optional[Any]] = [None] * num_slots  # uint8 views registered with CUDA
        self._graveyard: List[mmap.mmap] = []  # maps still exported to views; dropped with them
        self._ahead: Optional[threading.Thread] = None  # allocates the other slots (ensure)
        self._ready: Dict[int, threading.Event] = {}
        self._closing = False
        self._device_cell: List[Optional[int]] = [None]  # the rank's GPU, once CUDA is used
        # A registered map that is unmapped without cudaHostUnregister stays registered in
        # the driver: the next map at that address fails to register, and CUDA copies into
        # it fail -- as the script's error, at its next kernel (seen on an H200 after a
        # Checkpointer was dropped and another made).  So a SlotSet collected with pinned
        # slots unregisters them first.
        self._finalizer = weakref.finalize(self, _unpin_views, self._pinned, self._device_cell)
        self._finalizer.atexit = False  # the process ends: CUDA goes with its maps
        if prefix is not None:
            for k in range(num_slots):
                if os.path.exists(slot_path(prefix, k)):  # a restart: earlier commits stay usable
                    try:
                        self.mms[k] = (_premapped.take(slot_path(prefix, k))
                                       or open_shm_file(slot_path(prefix, k), populate=True))
                    except ValueError:  # an empty file: ensure() grows it in place
                        continue
                    self._pin(k)

    # ------------------------------------------------------------------ reading

    def header(self, k: int) -> SlotHeader:
        mm = self.mms[k]
        return SlotHeader.unpack_from(mm) if mm is not None else SlotHeader()

    def find(self, step: int) -> Optional[int]:
        """The slot holding a COMMITTED ``step`` (newest commit if several), or None."""
        best = None
        for k in range(self.num_slots):
            h = self.header(k)
            if h.state == SlotState.COMMITTED and h.step == step:
                if best is None or h.commit_time > self.header(best).commit_time:
                    best = k
        return best

    def newest(self) -> Optional[int]:
        order = self._committed_order()
        return order[-1] if order else None

    def _committed_order(self) -> List[int]:
        hs = [self.header(k) for k in range(self.num_slots)]
        done = [k for k in range(self.num_slots) if hs[k].state == SlotState.COMMITTED]
        return sorted(done, key=lambda k: (hs[k].step, hs[k].commit_time))

    # ------------------------------------------------------------------ the writer's rule

    def choose(self, pin: int = -1) -> Optional[int]:
        """A slot to write next, or None (then the save is skipped, never blocked).

        Never one of the ``keep`` newest commits, never the slot the agent pinned.  Empty or
        torn slots go first, then the oldest commit.
        """
        order = self._committed_order()
        protected = set(order[-self.keep:]) if order else set()
        free = [k for k in range(self.num_slots) if k not in protected and k != pin]
        if not free:
            return None
        rank_of = {k: i for i, k in enumerate(order)}
        return min(free, key=lambda k: rank_of.get(k, -1))

    # ------------------------------------------------------------------ allocation

    def ensure(self, k: int, need: int, meta_len: int, data_len: int) -> mmap.mmap:
        """Slot ``k`` mapped with at least ``need`` bytes (allocating or growing it).

        The first allocation also starts allocating the other slots, at the same size, on a
        background thread (:meth:`_allocate_ahead`): faulting in a new slot costs 0.7 s
        per GiB here, 1-2 s with two ranks allocating at once, and the first saves paid one
        such allocation each, blocking the loop (+5 s at 1 GiB a rank before this).  On a
        machine whose cores wait for the GPU, or for a collective, the others are ready
        before the saves that need them."""
        self._await_ahead(k)
        self._note_device()
        mm = self.mms[k]
        if mm is not None and len(mm) >= need:
            return mm
        size = max(need, size_with_headroom(meta_len, data_len))
        self._check_space(size)
        self._allocate(k, size)
        self._allocate_ahead(size)
        return self.mms[k]

    def _allocate(self, k: int, size: int) -> None:
        mm = self.mms[k]
        self._unpin(k)
        if mm is not None:
            self._release(mm)
            self.mms[k] = None
        if self.prefix is None:
            flags = mmap.MAP_PRIVATE | getattr(mmap, "MAP_POPULATE", 0)
            self.mms[k] = mmap.mmap(-1, size, flags=flags)
        else:
            path = slot_path(self.prefix, k)
            if os.path.exists(path):
                # Grow in place (same inode): a reader holding the old map stays valid.
                fd = open_private(path, os.O_RDWR)
                try:
                    old = os.fstat(fd).st_size
                    os.ftruncate(fd, size)
                    if old:  # any hole before the old end (a no-op where it is all there)
                        os.posix_fallocate(fd, 0, old)
                    fill_zeros(fd, old, size)  # the new part: allocated by the writes
                finally:
                    os.close(fd)
                self.mms[k] = open_shm_file(path, populate=True)
            else:
                self.mms[k] = create_shm_file(path, size)
        self._pin(k)

    def _allocate_ahead(self, size: int) -> None:
        """Allocate the slots that do not exist yet on a thread, one after the other (each
        marked ready on its own: a save that needs the first waits for that one only)."""
        missing = [j for j in range(self.num_slots) if self.mms[j] is None]
        if not missing or self._ahead is not None or os.environ.get(ENV_AHEAD, "1") == "0":
            return
        self._ready = {j: threading.Event() for j in missing}

        def run() -> None:
            for j in missing:
                try:
                    if not self._closing and self.mms[j] is None:
                        self._check_space(size)
                        self._allocate(j, size)
                except Exception:  # noqa: BLE001, S110 -- the save that needs it allocates it
                    pass  # itself, and reports what went wrong
                finally:
                    self._ready[j].set()

        self._ahead = threading.Thread(target=run, name="ckptrun-slot-alloc", daemon=True)
        self._ahead.start()

    def _await_ahead(self, k: int) -> None:
        ready = self._ready.get(k)
        if ready is not None:
            ready.wait()

    def _check_space(self, size: int) -> None:
        """Fail fast with one clear line instead of a SIGBUS when tmpfs runs out mid-copy."""
        total = size * self.num_slots
        if self.max_bytes and total > self.max_bytes:
            raise ShmTooSmall(
                f"ckptrun: the snapshot of rank {self.rank} needs {total / MiB:.0f} MiB "
                f"({self.num_slots} slots x {size / MiB:.0f} MiB) but CKPTRUN_MAX_STATE_BYTES "
                f"allows {self.max_bytes / MiB:.0f} MiB; raise the limit or shrink the state")
        if self.prefix is None:
            return
        have = sum(len(m) for m in self.mms if m is not None)
        extra = max(0, total - have)
        st = os.statvfs(os.path.dirname(self.prefix) or SHM_DIR)
        free = st.f_bavail * st.f_frsize
        if extra > free:
            where = os.path.dirname(self.prefix) or SHM_DIR
            raise ShmTooSmall(
                f"ckptrun: {where} has {free / MiB:.0f} MiB free but the snapshot needs "
                f"{extra / MiB:.0f} MiB more (rank {self.rank}: {self.num_slots} slots x "
                f"{size / MiB:.0f} MiB); enlarge it, e.g. docker --shm-size")

    # ------------------------------------------------------------------ CUDA pinning

    @property
    def _device(self) -> Optional[int]:
        return self._device_cell[0]

    def use_device(self, index: Optional[int]) -> None:
        """The GPU the state lives on (a script may use ``cuda:N`` without making it
        current): the slots are registered through it."""
        if index is not None:
            self._device_cell[0] = index

    def complete(self) -> bool:
        """Every slot allocated (the allocation thread is done with them)."""
        return all(mm is not None for mm in self.mms)

    def _note_device(self) -> None:
        """Remember the rank's GPU (on the thread that trains: CUDA's current device is per
        thread) for the slots the allocation thread pins (a fresh thread's is GPU 0)."""
        if self._device is None and "torch" in sys.modules:
            import torch

            if torch.cuda.is_available() and torch.cuda.is_initialized():
                self._device_cell[0] = torch.cuda.current_device()

    def _pin(self, k: int) -> None:
        """Register the slot as pinned host memory (:mod:`ckptrun.worker.pinning`) so
        device->host copies run at full speed; only once the process uses CUDA."""
        try:
            import torch

            if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
                return
            self._note_device()
            view = torch.frombuffer(self.mms[k], dtype=torch.uint8)
            self._pinned[k] = view if pinning.register(view, self._device) else None
        except Exception:  # pinning is an optimisation; pageable copies still work
            self._pinned[k] = None

    def _unpin(self, k: int) -> None:
        view = self._pinned[k]
        self._pinned[k] = None
        if view is not None:
            pinning.unregister(view, self._device)

    def unpin(self) -> None:
        """Unregister every pinned slot (the maps stay, readable): when the writer is done."""
        for k in range(self.num_slots):
            self._unpin(k)

    def _release(self, mm: mmap.mmap) -> None:
        try:
            mm.close()
        except BufferError:
            self._graveyard.append(mm)  # tensor views still point into it; freed with them

    def stop_allocating(self) -> None:
        """End a background allocation (after the slot it is on): before the maps are
        handed on or closed, and when the Checkpointer closes (no thread outlives it)."""
        self._closing = True
        if self._ahead is not None:
            self._ahead.join()

    def hand_back(self) -> None:
        """Leave the maps to the next SlotSet of this process for the same slots (an
        in-process recovery: mapping and faulting 256 MiB again costs ~0.1 s)."""
        self.stop_allocating()
        if self.prefix is None:
            return self.close()
        for k in range(self.num_slots):
            self._unpin(k)
            if self.mms[k] is not None:
                _premapped.put(slot_path(self.prefix, k), self.mms[k])
                self.mms[k] = None

    def close(self) -> None:
        """Unmap (the shared files stay: the agent owns their lifetime)."""
        self.stop_allocating()
        for k in range(self.num_slots):
            self._unpin(k)
            if self.mms[k] is not None:
                self._release(self.mms[k])
                self.mms[k] = None


def _unpin_views(pinned: List[Optional[Any]], device_cell: List[Optional[int]]) -> None:
    for k, view in enumerate(pinned):
        if view is not None:
            pinned[k] = None
            pinning.unregister(view, device_cell[0])


# ---------------------------------------------------------------------- warm spares


def premap_slots(prefix: str, num_slots: int) -> None:
    """Map and pre-fault the slot files ``<prefix><k>`` that exist now (again if one was
    replaced or grew since).  Called by a warm spare while it waits, so that the worker it
    becomes finds its slots ready."""
    for k in range(num_slots):
        _premapped.get(slot_path(prefix, k))


def premapped_state_bytes() -> int:
    """Data bytes of the largest committed snapshot among the spare's maps (0: none)."""
    sizes = [h.data_len for h in (SlotHeader.unpack_from(mm) for _, mm in _premapped.items())
             if h.state == SlotState.COMMITTED]
    return max(sizes, default=0)


def drop_premapped(keep_prefix: Optional[str] = None) -> None:
    """Unmap the spare's maps, except those of the slots under ``keep_prefix``."""
    _premapped.drop(lambda p: keep_prefix is None or not p.startswith(keep_prefix))
