"""Shared-memory files: their names under ``/dev/shm``, creating and mapping them, and a cache
of populated maps (reading a mapped, populated file costs no page fault)."""

from __future__ import annotations

import errno
import mmap
import os
import stat
from typing import Dict, Iterator, Optional, Tuple

SHM_DIR = "/dev/shm"
SHM_PREFIX = "ckptrun-"  # every shared-memory file ckptrun creates starts with this

def slot_path(prefix: str, slot: int) -> str:
    """Path of slot ``slot`` for the rank whose prefix is ``prefix``."""
    return f"{prefix}{slot}"


def rank_slot_prefix(job_token: str, rank: int) -> str:
    """``/dev/shm/ckptrun-<token>-r<rank>-s``: slot files of a global rank on this node."""
    return os.path.join(SHM_DIR, f"{SHM_PREFIX}{job_token}-r{rank}-s")


def control_path(job_token: str) -> str:
    return os.path.join(SHM_DIR, f"{SHM_PREFIX}{job_token}-control")


def create_shm_file(path: str, size: int, prefault: bool = True) -> mmap.mmap:
    """Create an owner-only shared-memory file of ``size`` bytes and map it.

    Pre-faulting pays the first-touch cost (~15x slower than copying into touched pages)
    once, at allocation, instead of on the first snapshot.  A file that does not fit fails
    here (``OSError``, ENOSPC) and is removed, instead of a SIGBUS mid-copy later.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
        if prefault:
            try:
                fill_zeros(fd, 0, size)
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


_ZERO_CHUNK = 8 << 20


def fill_zeros(fd: int, start: int, end: int) -> None:
    """Give the file's bytes ``[start, end)`` their memory by writing zeros into them.

    Why not ``posix_fallocate`` and a ``MAP_POPULATE``: tmpfs zeroes a page at its first
    fault, one 4 KiB fault at a time -- 0.45 s a GiB here, 0.65 s with the fallocate before
    it -- while ``pwrite`` allocates and fills the same pages in 0.23-0.4 s, after which a
    populated map only maps them (0.08-0.1 s a GiB): a quarter less for every new slot, on
    the cores the training uses (docs/performance.md).  Raises ``OSError`` (ENOSPC) where
    the file system cannot hold them, as ``posix_fallocate`` did.
    """
    zeros = memoryview(bytes(min(_ZERO_CHUNK, max(0, end - start))))
    off = start
    while off < end:
        n = os.pwrite(fd, zeros[:min(len(zeros), end - off)], off)
        if n <= 0:  # a write that makes no progress: the file system is full
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        off += n


def open_private(path: str, flags: int) -> int:
    """``os.open`` of an existing file that must be this user's own private regular file.

    Anyone on the machine can create files under ``/dev/shm`` with the names ckptrun uses:
    a symlink planted there must not make us write through it (``O_NOFOLLOW``), and another
    user's file -- or one others can read or write -- must not receive a snapshot or feed a
    restore.  Raises ``PermissionError`` naming the file otherwise."""
    fd = os.open(path, flags | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077 \
            or st.st_nlink != 1:
        os.close(fd)
        raise PermissionError(f"ckptrun: refusing {path}: not a private file of this user "
                              f"(owner {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}, "
                              f"links {st.st_nlink})")
    return fd


def open_shm_file(path: str, populate: bool = False, write: bool = True) -> mmap.mmap:
    """Map an existing shared-memory file (whole length); only this user's private file."""
    fd = open_private(path, os.O_RDWR if write else os.O_RDONLY)
    try:
        flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if write else 0)
        return mmap.mmap(fd, 0, flags=flags, prot=prot)
    finally:
        os.close(fd)


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
            fd = open_private(path, os.O_RDWR if self.write else os.O_RDONLY)
        except OSError:  # gone, or not ours to trust (PermissionError): no copy here
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

    def put(self, path: str, mm: mmap.mmap) -> None:
        """Keep ``mm``, a map of the file at ``path`` now, for a later :meth:`take`."""
        try:
            st = os.stat(path)
        except OSError:
            return
        self._maps[path] = ((st.st_ino, st.st_size), mm)

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
