"""The slot file layout: a 4 KiB binary header, a JSON description of the state, then the
raw tensor bytes starting on a page boundary.  No pickle anywhere.

Slot life cycle (the worker is the only writer of its slots, the agent only reads them,
except when it materialises a peer or storage copy *before* the workers start)::

    EMPTY/COMMITTED --begin_write--> WRITING --commit--> COMMITTED(step, checksum)

``seq`` is bumped by ``begin_write``; a reader that copies a slot checks that
``state``/``step``/``seq`` are unchanged afterwards (optimistic, seqlock style), so a slot
overwritten under its feet is never used.  A worker never overwrites its two newest
commits, so after a crash every rank still has the step the slowest rank committed.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Optional

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


def data_offset_for(meta_capacity: int) -> int:
    """Tensor bytes start on a page boundary after the header and the JSON area."""
    return _round_up(SLOT_HEADER_SIZE + meta_capacity, PAGE)


def _round_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


def new_checksum():
    """The streaming checksum used for slots, replicas and durable copies (xxh3, 64 bit)."""
    import xxhash

    return xxhash.xxh3_64()
