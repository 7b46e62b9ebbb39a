"""Where peer copies live: agent-owned slot files, their kept mappings, verified copies.

* :class:`PeerStore` -- an agent's copies of other machines' ranks (two slot files per
  rank: the newest committed copy and the one being received), in the slot layout of
  ``ckptrun.protocol.slot_file`` so that every reader works on them;
* :class:`MapCache` -- mappings of slot files kept open from one transfer to the next;
* :func:`copy_slot_file` -- a verified local copy of a committed slot (the agent's own
  copy of its workers' snapshot for a replication round, or a copy materialised for a
  restore).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
import time
from typing import Dict, List, Optional, Sequence, Tuple

from ckptrun import protocol as P

CHUNK = 4 << 20  # local copies: copy granularity (each chunk hashed while cache-hot)


class MapCache:
    """Mappings of slot files kept open between transfers, by path.

    Mapping a 256 MiB file and populating its page tables costs tens of milliseconds --
    a third of sending it over loopback.  A receiver (and the agent's own copies) reuse
    the same few files round after round, so their mappings are kept; an entry is used
    again only while the path still names the same file (inode) of the same size, else it
    is dropped.  ``close()`` unmaps everything (unlinked files' memory is freed then).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._maps: Dict[str, Tuple[int, bool, mmap.mmap]] = {}
        self._lent: Dict[int, bool] = {}  # id(mapping) -> writable, while taken
        self._closed = False

    def take(self, path: str, min_size: int, write: bool) -> Optional[mmap.mmap]:
        """The cached mapping of ``path`` (removed from the cache until :meth:`give`), if it
        still maps that file, is at least ``min_size`` bytes and ``write``-able if asked."""
        with self._lock:
            entry = self._maps.pop(path, None)
        if entry is None:
            return None
        ino, writable, mm = entry
        try:
            st = os.stat(path)
            same = st.st_ino == ino and st.st_size == len(mm)
        except OSError:
            same = False
        if same and len(mm) >= min_size and (writable or not write):
            with self._lock:
                self._lent[id(mm)] = writable
            return mm
        _close_map(mm)
        return None

    def give(self, path: str, mm: mmap.mmap, write: bool) -> None:
        """Keep ``mm`` (a mapping of the whole file at ``path``) for the next transfer."""
        with self._lock:
            write = self._lent.pop(id(mm), False) or write  # a writable one stays writable
        try:
            ino = os.stat(path).st_ino
        except OSError:
            _close_map(mm)
            return
        with self._lock:
            old = self._maps.pop(path, None)
            if self._closed:  # a transfer that outlived close(): nothing is kept any more
                old, mm = (0, write, mm), None
            else:
                self._maps[path] = (ino, write, mm)
        if old is not None:
            _close_map(old[2])

    def open(self, path: str, write: bool = False) -> mmap.mmap:
        """A mapping of existing file ``path``: cached, else mapped and populated."""
        mm = self.take(path, 0, write)
        return mm if mm is not None else P.open_shm_file(path, populate=True, write=write)

    def forget(self, path: str) -> None:
        with self._lock:
            entry = self._maps.pop(path, None)
        if entry is not None:
            _close_map(entry[2])

    def close(self) -> None:
        with self._lock:
            entries, self._maps = list(self._maps.values()), {}
            self._closed = True
        for _, _, mm in entries:
            _close_map(mm)


def _close_map(mm: mmap.mmap) -> None:
    try:
        mm.close()
    except BufferError:
        pass  # a failed transfer's traceback still holds a slice; unmapped when collected


def prepare_slot_file(path: str, meta_len: int, data_len: int,
                      maps: Optional[MapCache] = None) -> mmap.mmap:
    """(Re)create ``path`` as a slot file big enough for the announced sizes, state WRITING.

    With ``maps``, a cached mapping of the file is reused (the caller gives it back)."""
    data_offset = P.data_offset_for(max(meta_len, P.PAGE))
    size = data_offset + data_len
    mm = maps.take(path, size, write=True) if maps is not None else None
    if mm is None:
        if os.path.exists(path) and os.path.getsize(path) >= size:
            mm = P.open_shm_file(path, populate=True)  # reuse: map every page now, not per fault
        else:
            if os.path.exists(path):
                os.unlink(path)
            mm = P.create_shm_file(path, size)
    h = P.SlotHeader.unpack_from(mm)
    h.state, h.step, h.seq = P.SlotState.WRITING, -1, h.seq + 1
    h.meta_len, h.data_len, h.data_offset, h.capacity = meta_len, data_len, data_offset, len(mm)
    h.pack_into(mm)
    return mm


def done_with_map(path: str, mm: mmap.mmap, maps: Optional[MapCache], write: bool) -> None:
    """Give ``mm`` back to ``maps`` (kept for the next transfer), or unmap it."""
    if maps is not None:
        maps.give(path, mm, write)
    else:
        _close_map(mm)


def copy_slot_file(src_path: str, dst_path: str,
                   maps: Optional[MapCache] = None) -> Optional[int]:
    """Copy a committed slot file, verifying the copy against the writer's checksum.

    Returns the step, or None if the source was not committed, changed during the copy, or
    does not match its checksum (a corrupted copy is never committed).  With ``maps``, the
    mappings of both files are kept for the next copy.
    """
    src = maps.open(src_path) if maps is not None else P.open_shm_file(
        src_path, populate=True, write=False)
    regions: list = []
    try:
        h, regions = _slot_regions(src)
        if h.state != P.SlotState.COMMITTED or h.data_offset + h.data_len > len(src):
            return None
        dst = prepare_slot_file(dst_path, h.meta_len, h.data_len, maps)
        try:
            dh = P.SlotHeader.unpack_from(dst)
            digest = P.new_checksum()
            for region, off in zip(regions, (P.SLOT_HEADER_SIZE, dh.data_offset)):
                for pos in range(0, len(region), CHUNK):  # hash while the chunk is hot
                    piece = region[pos : pos + CHUNK]
                    dst[off + pos : off + pos + len(piece)] = piece
                    digest.update(dst[off + pos : off + pos + len(piece)])
                    piece.release()
            now = P.SlotHeader.unpack_from(src)
            if (now.state, now.step, now.seq) != (h.state, h.step, h.seq) \
                    or digest.intdigest() != h.checksum:
                return None
            dh.checksum, dh.commit_time, dh.rank, dh.world_size = (
                h.checksum, time.time(), h.rank, h.world_size)
            dh.pack_into(dst)
            P.set_slot_state(dst, P.SlotState.COMMITTED, h.step)
            return h.step
        finally:
            done_with_map(dst_path, dst, maps, True)
    finally:
        for r in regions:
            r.release()
        done_with_map(src_path, src, maps, False)


class PeerStore:
    """Agent-owned copies of other machines' ranks: two slot files per rank (newest + incoming)."""

    def __init__(self, job_token: str, pin_ranks: Sequence[int] = ()):
        self.job_token = job_token
        self._lock = threading.Lock()
        self._busy: set = set()
        self.maps = MapCache()  # mappings of the copies, kept from one transfer to the next
        # the ranks a restore needs together (this node's own and its sources'): the newest
        # step held for all of them is never overwritten, see :meth:`incoming_path`
        self.pin_ranks = list(pin_ranks)

    def close(self) -> None:
        """Unmap the cached mappings (the files stay)."""
        self.maps.close()

    def path(self, rank: int, k: int) -> str:
        return os.path.join(P.SHM_DIR, f"{P.SHM_PREFIX}{self.job_token}-peer-r{rank}-s{k}")

    def latest(self, rank: int) -> Optional[Tuple[int, str]]:
        """(step, path) of the newest committed copy of ``rank``, if any."""
        best = None
        for k in (0, 1):
            h = _read_header(self.path(rank, k))
            if h and h.state == P.SlotState.COMMITTED and (best is None or h.step > best[0]):
                best = (h.step, self.path(rank, k))
        return best

    def copies(self, rank: int) -> Dict[int, str]:
        """{step: path} of every committed copy of ``rank`` held here (at most two)."""
        out: Dict[int, str] = {}
        for k in (0, 1):
            h = _read_header(self.path(rank, k))
            if h and h.state == P.SlotState.COMMITTED:
                out[h.step] = self.path(rank, k)
        return out

    def inventory(self) -> Dict[int, list]:
        """{rank: [steps]} of every committed copy held here."""
        return {r: sorted(self.copies(r)) for r in self.holdings()}

    def holdings(self) -> Dict[int, int]:
        """{rank: newest committed step} of every rank this agent holds a copy of."""
        out: Dict[int, int] = {}
        for rank in self._file_ranks():
            got = self.latest(rank)
            if got:
                out[rank] = got[0]
        return out

    def _file_ranks(self) -> List[int]:
        """The ranks with a copy file here, committed or not."""
        prefix = f"{P.SHM_PREFIX}{self.job_token}-peer-r"
        ranks = {name[len(prefix):].split("-")[0] for name in os.listdir(P.SHM_DIR)
                 if name.startswith(prefix)}
        return sorted(int(r) for r in ranks if r.isdigit())  # another user's file: not ours

    def pinned_step(self) -> Optional[int]:
        """The newest step held (committed) for every rank of ``pin_ranks``, if any."""
        common: Optional[set] = None
        for r in self.pin_ranks:
            steps = set(self.copies(r))
            common = steps if common is None else common & steps
        return max(common) if common else None

    def drop_others(self) -> List[int]:
        """Delete the copies of every rank but ``pin_ranks`` (a standby's copies of the whole
        job, an earlier membership's sources); the ranks dropped.  Only once this
        membership's rounds replaced every copy a restore could use: a step older than
        those is no longer anywhere for this node's own ranks, so nobody can agree on it."""
        keep, dropped = set(self.pin_ranks), []
        for r in sorted(set(self._file_ranks()) - keep):
            for k in (0, 1):
                self.maps.forget(self.path(r, k))
                with contextlib.suppress(OSError):
                    os.unlink(self.path(r, k))
            dropped.append(r)
        return dropped

    def incoming_path(self, rank: int) -> Optional[str]:
        """The slot to receive into; None if a transfer of ``rank`` is in flight.

        Never the copy of the step every rank of ``pin_ranks`` is held at: the copies of
        different ranks arrive independently (a push can fail while this node's own copy of
        the round succeeded), and overwriting the only step they share would leave nothing
        that one restore could use for all of them.  Otherwise never the newest copy."""
        with self._lock:
            if rank in self._busy:
                return None
            self._busy.add(rank)
        held = self.copies(rank)
        keep = self.pinned_step() if rank in self.pin_ranks else None
        if keep is None or keep not in held:
            got = self.latest(rank)
            keep_path = got[1] if got else None
        else:
            keep_path = held[keep]
        return self.path(rank, 1 if keep_path == self.path(rank, 0) else 0)

    def done(self, rank: int) -> None:
        with self._lock:
            self._busy.discard(rank)


def _read_header(path: str) -> Optional[P.SlotHeader]:
    """The header of a copy file; None if it is missing, or shorter than a header -- a
    receive creates the file before it sizes it, and a thread serving a peer must not die of
    looking at it meanwhile (the standby's did: it received nothing more, and with both
    holders of a copy lost the job restarted from scratch)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(P.SLOT_HEADER_SIZE)
    except OSError:
        return None
    return P.SlotHeader.unpack_from(raw) if len(raw) == P.SLOT_HEADER_SIZE else None


def _slot_regions(mm) -> Tuple[P.SlotHeader, list]:
    """Header and the (meta, data) memory regions of a committed slot, as memoryviews."""
    h = P.SlotHeader.unpack_from(mm)
    view = memoryview(mm)
    return h, [view[P.SLOT_HEADER_SIZE : P.SLOT_HEADER_SIZE + h.meta_len],
               view[h.data_offset : h.data_offset + h.data_len]]
