"""The control block: one small shared-memory file per node, one fixed-size record per local
rank (heartbeat, step, phase, commit pointer, the agent's pin).

Workers write their record with plain struct writes, so a heartbeat costs no system call; the
agent reads every record and writes only ``pin``.
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from typing import Optional

CONTROL_MAGIC = b"CKPTCTL1"
CONTROL_HEADER_SIZE = 64  # magic(8) nranks(u32) reserved
RECORD_SIZE = 192


class Phase:
    """What a worker is doing; the hang detector never fires in SAVING/RESTORING."""

    INIT = 0
    RUNNING = 1
    SAVING = 2
    RESTORING = 3
    DONE = 4
    NAMES = {0: "init", 1: "running", 2: "saving", 3: "restoring", 4: "done"}


class Fatal:
    """Values of the ``fatal`` field: why a restart cannot help (the agent stops the job)."""

    CONFIG = 1  # the state cannot be snapshotted, /dev/shm is too small
    RESTORE = 3  # a registered object refused its restored value (restore() says which)
    TEXT = {CONFIG: "a configuration error a restart cannot fix",
            RESTORE: "could not load its restored state; a restart would load the same"}


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
    # The worker's progress sampler (``ckptrun.worker.progress``): time.monotonic() of its
    # last sample -- it stops when the process is stopped -- and of the last sample that
    # found the main thread advancing (running, or at another bytecode than before).
    "sampled": (128, "d"),
    "advanced": (136, "d"),
    # time.monotonic() of this process's first save(): the end of a recovery's downtime
    "first_step_at": (144, "d"),
    # In-process recovery (``ckptrun.protocol.recovery``).  Worker-written: ``resilient`` is
    # attempt + 1 while a ``@ckptrun.resilient`` function runs (0: none), ``unwound`` the
    # attempt it has unwound for and waits to start.  Agent-written: ``recover`` the attempt
    # it asks the worker to recover into, ``recover_go`` the one whose message is written.
    "resilient": (152, "i"),
    "unwound": (156, "i"),
    "recover": (160, "i"),
    "recover_go": (164, "i"),
    # 1: the script raised an exception out of its top level and its traceback is printed;
    # the process is on its way out (its interpreter's teardown can take seconds, or hang
    # in gloo's while a peer waits): the agent counts the failure now.
    "raised": (168, "i"),
    # 1: the script is over and succeeded (it returned, or exited 0), its interpreter's
    # teardown under way: on one machine the agent starts the final persist now, not after
    # the exit (a teardown of seconds -- process groups, data loaders, CUDA -- overlaps it).
    "ended_ok": (172, "i"),
}

# What a kept worker's record starts a new attempt with: the fields of one attempt cleared;
# its process (pid, sampler), its committed slot and the agent's pin stay.
_PER_ATTEMPT = ("heartbeat", "step", "phase", "beats", "save_block_s", "save_copy_s",
                "restored_step", "restore_s", "fatal", "first_step_at", "unwound", "raised", "ended_ok")


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
            from ckptrun.protocol.shm import open_private

            fd = open_private(path, os.O_RDWR)
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

    def reset_attempt(self, local_rank: int) -> None:
        """Clear the per-attempt fields of a worker that goes on into the next attempt in
        the same process (in-process recovery)."""
        for name in _PER_ATTEMPT:
            self.set(local_rank, name, -1 if name in ("step", "restored_step") else 0)

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
