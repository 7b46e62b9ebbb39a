"""The run directory's append-only event log and atomically replaced JSON files.

``<run-dir>/events.jsonl`` holds one JSON object per line (DESIGN §3), each with ``time``
(unix seconds, float) and ``event``.  Several processes (agents, the ``restore`` command)
may append to the same file: every record is written with a single ``write()`` on an
``O_APPEND`` descriptor, which POSIX keeps whole for regular files, so lines never interleave.

This module is imported by the agent and by ``ckptrun status``; it must stay free of torch.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from typing import Any, Dict, List, Optional

EVENTS_FILE = "events.jsonl"
STATUS_FILE = "status.json"


def ensure_run_dir(run_dir: str) -> str:
    """Create ``run_dir`` (and parents) owner-only if missing; return its absolute path."""
    path = os.path.abspath(run_dir)
    # makedirs' mode is filtered by the umask; the chmod below is what makes it 0700.
    os.makedirs(path, mode=0o700, exist_ok=True)
    try:
        os.chmod(path, 0o700)
    except PermissionError:
        pass  # someone else's directory we can still write to: keep its mode
    return path


class EventLog:
    """Appends DESIGN §3 events to ``<run_dir>/events.jsonl``.

    The descriptor is opened once with ``O_APPEND`` and every event is one ``os.write``
    (no Python buffering), so a crash never leaves half an event buffered in memory and
    concurrent writers never interleave within a line.
    """

    def __init__(self, run_dir: str) -> None:
        self.run_dir = ensure_run_dir(run_dir)
        self.path = os.path.join(self.run_dir, EVENTS_FILE)
        self._lock = threading.Lock()  # one write at a time from this process's threads
        self._fd: Optional[int] = os.open(
            self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o600
        )

    def emit(self, event: str, **fields: Any) -> Dict[str, Any]:
        """Append one event and return the record written.

        ``time`` and ``event`` come first; ``fields`` may not override them. Values that
        JSON cannot encode are written with ``str()`` so that logging never raises.
        """
        record: Dict[str, Any] = {"time": time.time(), "event": event}
        for key, value in fields.items():
            if key not in record:
                record[key] = value
        line = (json.dumps(record, default=str, separators=(",", ":")) + "\n").encode()
        with self._lock:
            if self._fd is None:
                raise ValueError(f"event log {self.path} is closed")
            written = os.write(self._fd, line)
            # A regular file only writes short on a full disk; finish the line so the
            # next record does not glue onto a torn one.
            while written < len(line):
                written += os.write(self._fd, line[written:])
        return record

    def close(self) -> None:
        """Close the descriptor; further ``emit`` calls raise ``ValueError``."""
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def __enter__(self) -> EventLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def read_events(run_dir: str) -> List[Dict[str, Any]]:
    """All events of ``run_dir`` in file order; ``[]`` if there is no log yet.

    A line that is not a complete JSON object (a writer killed mid-line, or a line being
    appended right now) is skipped rather than failing the reader.
    """
    path = os.path.join(run_dir, EVENTS_FILE)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return []
    events: List[Dict[str, Any]] = []
    for raw in data.split(b"\n"):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except ValueError:
            continue
        if isinstance(obj, dict):
            events.append(obj)
    return events


def write_json_atomic(path: str, obj: Any) -> None:
    """Write ``obj`` as JSON to ``path`` so readers see the old or the new file, never half.

    The temporary file lives in the same directory (``os.replace`` is only atomic within
    one file system) and is created 0600 by ``mkstemp``.
    """
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, default=str, indent=1)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def read_json(path: str) -> Optional[Any]:
    """Read a JSON file written by :func:`write_json_atomic`; ``None`` if missing or invalid."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
