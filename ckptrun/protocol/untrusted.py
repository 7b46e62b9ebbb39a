"""Reading a file that someone else may have planted: a regular file of a sane size, or nothing.

A run directory or a checkpoint directory may be one a user was pointed at, and anyone who
can write there can put a symlink to ``/dev/zero`` or to another user's file, a FIFO that
never answers, a file of gigabytes or JSON nested a million deep in place of what ckptrun
wrote.  Every such read goes through here: a symlink is followed only where it is the
user's own (checkpoints assembled from links -- a hub snapshot, ``cp -s`` -- are theirs; a
planted link is its planter's), the name is opened without blocking (``O_NONBLOCK``), what
was opened must be a regular file,
its size is checked against a bound before anything is read, and JSON is checked for depth
before anyone walks it.  Anything else raises :class:`UntrustedFile` with a one-line message
(the command line turns it into exit 2, a job into a fallback to the next tier).
"""

from __future__ import annotations

import errno
import json
import os
import stat
from typing import Any, Optional, Tuple

MAX_JSON_DEPTH = 64  # ckptrun's own files nest a handful of levels


class UntrustedFile(ValueError):
    """A file that is not what ckptrun writes there; the message is one line."""


class NotJSON(UntrustedFile):
    """A regular file of a sane size whose bytes are not JSON."""


def open_regular(path: str, max_bytes: Optional[int] = None) -> Tuple[int, int]:
    """``(fd, size)`` of the regular file at ``path`` (through a symlink only of the user's
    own, never blocking), refused past ``max_bytes``; ``FileNotFoundError`` where there is
    none.  The caller closes ``fd``."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        link = os.lstat(path)
        if stat.S_ISLNK(link.st_mode) and link.st_uid != os.geteuid():
            raise UntrustedFile(f"{path} is a symbolic link of another user")
        if not stat.S_ISLNK(link.st_mode):
            flags |= os.O_NOFOLLOW  # (no link now: none may be swapped in before the open)
        fd = os.open(path, flags)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UntrustedFile(f"{path} became a symbolic link while opened") from None
        if isinstance(e, FileNotFoundError):
            raise
        raise UntrustedFile(f"{path} cannot be opened ({e.strerror})") from None
    try:
        st = os.fstat(fd)  # of what was opened: the name may change meanwhile
        if not stat.S_ISREG(st.st_mode):
            raise UntrustedFile(f"{path} is not a regular file")
        if max_bytes is not None and st.st_size > max_bytes:
            raise UntrustedFile(f"{path} is {st.st_size} bytes, more than the {max_bytes} such "
                                "a file can be")
    except BaseException:
        os.close(fd)
        raise
    return fd, st.st_size


def read_regular(path: str, max_bytes: int, tail: bool = False) -> bytes:
    """The bytes of the regular file at ``path`` (at most ``max_bytes``: past that refused,
    or with ``tail`` its last ``max_bytes``)."""
    fd, size = open_regular(path, None if tail else max_bytes)
    try:
        if tail and size > max_bytes:
            os.lseek(fd, size - max_bytes, os.SEEK_SET)
        chunks, left = [], max_bytes + 1
        while left > 0:  # the file may grow while read: never past the bound
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    return data[-max_bytes:] if tail else data[:max_bytes]


def parse_json(raw: bytes, where: str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """``raw`` parsed as JSON, nested at most ``max_depth`` deep."""
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise NotJSON(f"{where} is not JSON ({first[:200]})") from None
    if depth(obj) > max_depth:
        raise UntrustedFile(f"{where} is nested more than {max_depth} deep")
    return obj


def read_json(path: str, max_bytes: int, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """The JSON value in the regular file at ``path`` (see :func:`read_regular`)."""
    return parse_json(read_regular(path, max_bytes), path, max_depth)


def depth(obj: Any) -> int:
    """How deep ``obj`` nests lists and dicts (iteratively: no recursion to exhaust)."""
    deepest, stack = 0, [(obj, 1)]
    while stack:
        x, d = stack.pop()
        if isinstance(x, dict):
            x = list(x.values())
        if isinstance(x, list):
            deepest = max(deepest, d)
            stack.extend((v, d + 1) for v in x if isinstance(v, (list, dict)))
    return deepest
