"""The one contract shared by the agent (``ckptrun`` process) and the worker-side API.

Nothing in here imports agent or worker internals; both sides import this module only.
It defines:

* the environment variables the agent hands to every worker,
* the *control block*: one small shared-memory file per node with a fixed-size record per
  local rank (heartbeat, step, phase, commit pointer, the agent's pin) -- plain struct
  writes, so a heartbeat costs no system call,
* the *slot file* layout: one shared-memory file per (rank, slot) holding a 4 KiB binary
  header, a JSON description of the state and the raw tensor bytes.  No pickle anywhere.

Slot life cycle (the worker is the only writer of its slots, the agent only reads them,
except when it materialises a peer or storage copy *before* the workers start)::

    EMPTY/COMMITTED --begin_write--> WRITING --commit--> COMMITTED(step, checksum)

``seq`` is bumped by ``begin_write``; a reader that copies a slot checks that
``state``/``step``/``seq`` are unchanged afterwards (optimistic, seqlock style), so a slot
overwritten under its feet is never used.  A worker never overwrites its two newest
commits, so after a crash every rank still has the step the slowest rank committed.
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from dataclasses import dataclass
from typing import Dict, Iterator, Optional, Tuple

# --------------------------------------------------------------------------- environment

ENV_CONTROL = "CKPTRUN_CONTROL"  # path of the node's control block file
ENV_SLOT_PREFIX = "CKPTRUN_SLOT_PREFIX"  # path prefix of this rank's slot files (+ "<k>")
ENV_NUM_SLOTS = "CKPTRUN_NUM_SLOTS"  # slots per rank
ENV_RESTORE = "CKPTRUN_RESTORE"  # JSON {"step": N, "tier": "memory|peer|storage"}; step 0 = none
# (+ "verified": true when the agent has just checked the slot's checksum itself)
ENV_RUN_DIR = "CKPTRUN_RUN_DIR"
ENV_STACKS_FILE = "CKPTRUN_STACKS_FILE"  # faulthandler target for SIGUSR1 stack dumps
ENV_PERSIST_TO = "CKPTRUN_PERSIST_TO"  # also read by Checkpointer outside ckptrun
ENV_MAX_STATE_BYTES = "CKPTRUN_MAX_STATE_BYTES"  # shm budget for one rank's slots (0 = no limit)

SHM_DIR = "/dev/shm"
SHM_PREFIX = "ckptrun-"  # every shared-memory file ckptrun creates starts with this
DEFAULT_NUM_SLOTS = 3

# --------------------------------------------------------------------------- control block

CONTROL_MAGIC = b"CKPTCTL1"
CONTROL_HEADER_SIZE = 64  # magic(8) nranks(u32) reserved
RECORD_SIZE = 128


class Phase:
    """What a worker is doing; the hang detector never fires in SAVING/RESTORING."""

    INIT = 0
    RUNNING = 1
    SAVING = 2
    RESTORING = 3
    DONE = 4
    NAMES = {0: "init", 1: "running", 2: "saving", 3: "restoring", 4: "done"}


# Field name -> (offset in record, struct format).  Workers write the first group,
# the agent writes ``pin``.
_FIELDS = {
    "pid": (0, "q"),
    "heartbeat": (8, "d"),  # time.monotonic() of the last heartbeat (system-wide clock)
    "step": (16, "q"),  # last step passed to save()/heartbeat()
    "phase": (24, "i"),
    "beats": (32, "q"),  # heartbeat count; lets the agent learn the step interval
    "committed_step": (40, "q"),  # newest step fully copied into a slot (-1 none)
    "committed_slot": (48, "i"),
    "pin": (52, "i"),  # slot the agent is reading (-1 none); written by the agent only
    "save_block_s": (56, "d"),  # time save() blocked the training loop, last save
    "save_copy_s": (64, "d"),  # time the copy into the slot took, last save
    "saves": (72, "q"),
    "skipped_saves": (80, "q"),  # saves dropped because every free slot was pinned
    "restored_step": (88, "q"),  # step restore() returned (-1 before restore())
    "restore_s": (96, "d"),
    "state_bytes": (104, "q"),
    # Non-zero: the worker hit a configuration error (e.g. /dev/shm too small) that a
    # restart cannot fix; the agent stops the job with exit code 2 instead of restarting.
    "fatal": (112, "i"),
    # Checkpointer(every=N|"auto"): the snapshot interval in steps (0: every step, the
    # default) and, under "auto", the measured share of training time it costs.
    "snapshot_every": (116, "i"),
    "snapshot_overhead": (120, "d"),
}


class ControlBlock:
    """A node's control block: a header and ``nranks`` records, mapped from a shm file."""

    def __init__(self, path: str, nranks: Optional[int] = None, create: bool = False):
        self.path = path
        if create:
            if nranks is None:
                raise ValueError("nranks is required to create a control block")
            size = CONTROL_HEADER_SIZE + RECORD_SIZE * nranks
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.ftruncate(fd, size)
                self._mm = mmap.mmap(fd, size)
            finally:
                os.close(fd)
            self._mm[0:8] = CONTROL_MAGIC
            struct.pack_into("I", self._mm, 8, nranks)
            self.nranks = nranks  # reset() range-checks against it
            for r in range(nranks):
                self.reset(r)
        else:
            fd = os.open(path, os.O_RDWR)
            try:
                self._mm = mmap.mmap(fd, 0)
            finally:
                os.close(fd)
            if bytes(self._mm[0:8]) != CONTROL_MAGIC:
                raise ValueError(f"{path} is not a ckptrun control block")
        self.nranks = struct.unpack_from("I", self._mm, 8)[0]

    def get(self, local_rank: int, field: str):
        off, fmt = _FIELDS[field]
        return struct.unpack_from(fmt, self._mm, self._base(local_rank) + off)[0]

    def set(self, local_rank: int, field: str, value) -> None:
        off, fmt = _FIELDS[field]
        struct.pack_into(fmt, self._mm, self._base(local_rank) + off, value)

    def record(self, local_rank: int) -> dict:
        """A snapshot of one rank's record as a dict (for status and tests)."""
        return {name: self.get(local_rank, name) for name in _FIELDS}

    def reset(self, local_rank: int) -> None:
        """Clear a record before (re)starting its worker."""
        base = self._base(local_rank)
        self._mm[base : base + RECORD_SIZE] = bytes(RECORD_SIZE)
        for name in ("committed_step", "committed_slot", "pin", "restored_step", "step"):
            self.set(local_rank, name, -1)

    def beat(self, local_rank: int, step: Optional[int] = None, phase: Optional[int] = None) -> None:
        """Worker side: record liveness (a few struct writes, no system call)."""
        if step is not None:
            self.set(local_rank, "step", step)
        if phase is not None:
            self.set(local_rank, "phase", phase)
        self.set(local_rank, "beats", self.get(local_rank, "beats") + 1)
        self.set(local_rank, "heartbeat", time.monotonic())

    def close(self) -> None:
        try:
            self._mm.close()
        except (BufferError, ValueError):
            pass  # a view is still exported; the mapping goes with the process

    def _base(self, local_rank: int) -> int:
        if not 0 <= local_rank < self.nranks:
            raise IndexError(f"local rank {local_rank} out of range 0..{self.nranks - 1}")
        return CONTROL_HEADER_SIZE + RECORD_SIZE * local_rank


# --------------------------------------------------------------------------- slot files

SLOT_MAGIC = b"CKPTSLT1"
SLOT_HEADER_SIZE = 4096
PAGE = 4096


class SlotState:
    EMPTY = 0
    WRITING = 1
    COMMITTED = 2


# magic(8s) state(I) version(I) step(q) seq(Q) meta_len(Q) data_len(Q) data_offset(Q)
# checksum(Q) commit_time(d) capacity(Q) rank(i) world_size(i)
_SLOT_FMT = "8sIIqQQQQQdQii"
_SLOT_STRUCT = struct.Struct(_SLOT_FMT)
SLOT_VERSION = 1


@dataclass
class SlotHeader:
    """The fixed binary header at the start of every slot file."""

    state: int = SlotState.EMPTY
    step: int = -1
    seq: int = 0
    meta_len: int = 0
    data_len: int = 0
    data_offset: int = 0
    checksum: int = 0  # xxh3_64 of meta bytes then data bytes
    commit_time: float = 0.0
    capacity: int = 0
    rank: int = -1
    world_size: int = 0

    def pack_into(self, buf) -> None:
        _SLOT_STRUCT.pack_into(
            buf, 0, SLOT_MAGIC, self.state, SLOT_VERSION, self.step, self.seq, self.meta_len,
            self.data_len, self.data_offset, self.checksum, self.commit_time, self.capacity,
            self.rank, self.world_size,
        )

    @classmethod
    def unpack_from(cls, buf) -> SlotHeader:
        (magic, state, version, step, seq, meta_len, data_len, data_offset, checksum,
         commit_time, capacity, rank, world_size) = _SLOT_STRUCT.unpack_from(buf, 0)
        if magic != SLOT_MAGIC or version != SLOT_VERSION:
            return cls()  # never written (all zeros) or foreign: treat as empty
        return cls(state, step, seq, meta_len, data_len, data_offset, checksum, commit_time,
                   capacity, rank, world_size)


def set_slot_state(buf, state: int, step: int, seq: Optional[int] = None) -> None:
    """Flip only state/step(/seq) of a header in place (the commit point)."""
    struct.pack_into("I", buf, 8, state)
    struct.pack_into("q", buf, 16, step)
    if seq is not None:
        struct.pack_into("Q", buf, 24, seq)


def slot_path(prefix: str, slot: int) -> str:
    """Path of slot ``slot`` for the rank whose prefix is ``prefix``."""
    return f"{prefix}{slot}"


def rank_slot_prefix(job_token: str, rank: int) -> str:
    """``/dev/shm/ckptrun-<token>-r<rank>-s``: slot files of a global rank on this node."""
    return os.path.join(SHM_DIR, f"{SHM_PREFIX}{job_token}-r{rank}-s")


def control_path(job_token: str) -> str:
    return os.path.join(SHM_DIR, f"{SHM_PREFIX}{job_token}-control")


def data_offset_for(meta_capacity: int) -> int:
    """Tensor bytes start on a page boundary after the header and the JSON area."""
    return _round_up(SLOT_HEADER_SIZE + meta_capacity, PAGE)


def _round_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


def create_shm_file(path: str, size: int, prefault: bool = True) -> mmap.mmap:
    """Create an owner-only shared-memory file of ``size`` bytes and map it.

    Pre-faulting pays the first-touch cost (~15x slower than copying into touched pages)
    once, at allocation, instead of on the first snapshot.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
        if prefault and hasattr(os, "posix_fallocate"):
            try:
                os.posix_fallocate(fd, 0, size)  # reserves tmpfs pages: ENOSPC now, not SIGBUS later
            except OSError:
                os.close(fd)
                fd = -1
                os.unlink(path)
                raise
        flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if prefault else 0)
        mm = mmap.mmap(fd, size, flags=flags)
    finally:
        if fd >= 0:
            os.close(fd)
    return mm


def open_shm_file(path: str, populate: bool = False, write: bool = True) -> mmap.mmap:
    """Map an existing shared-memory file (whole length)."""
    fd = os.open(path, os.O_RDWR if write else os.O_RDONLY)
    try:
        flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if write else 0)
        return mmap.mmap(fd, 0, flags=flags, prot=prot)
    finally:
        os.close(fd)


def new_checksum():
    """The streaming checksum used for slots, replicas and durable copies (xxh3, 64 bit)."""
    import xxhash

    return xxhash.xxh3_64()


class ShmMaps:
    """Shared-memory files kept mapped and pre-faulted (MAP_POPULATE), by path; a file that
    was replaced or resized since is mapped again (one ``stat`` tells).  Reading a mapped,
    populated slot costs no page fault, so verifying 256 MiB is a pure hash (~20 ms here).
    A map that is dropped is unmapped when its last user lets go of it (never under a
    thread still reading it)."""

    def __init__(self, write: bool = False) -> None:
        self.write = write
        self._maps: Dict[str, Tuple[Tuple[int, int], mmap.mmap]] = {}

    def get(self, path: str) -> Optional[mmap.mmap]:
        """The current map of ``path``, mapped now if new or changed; None: no file, or empty."""
        old = self._maps.get(path)
        if old is not None and self._current(path, old[0]):
            return old[1]
        self._maps.pop(path, None)
        try:
            fd = os.open(path, os.O_RDWR if self.write else os.O_RDONLY)
        except OSError:
            return None
        try:
            st = os.fstat(fd)
            if st.st_size == 0:
                return None
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if self.write else 0)
            mm = mmap.mmap(fd, 0, flags=flags, prot=prot)
        finally:
            os.close(fd)
        self._maps[path] = ((st.st_ino, st.st_size), mm)
        return mm

    def take(self, path: str) -> Optional[mmap.mmap]:
        """Hand over the map of ``path`` if it still maps the file there (the caller owns it)."""
        old = self._maps.pop(path, None)
        return old[1] if old is not None and self._current(path, old[0]) else None

    def items(self) -> Iterator[Tuple[str, mmap.mmap]]:
        return ((p, mm) for p, (_, mm) in list(self._maps.items()))

    def drop(self, which=lambda path: True) -> None:
        """Unmap the files whose path ``which`` accepts (default: all)."""
        for path in [p for p in list(self._maps) if which(p)]:
            self._maps.pop(path, None)

    @staticmethod
    def _current(path: str, key: Tuple[int, int]) -> bool:
        try:
            st = os.stat(path)
        except OSError:
            return False
        return (st.st_ino, st.st_size) == key
