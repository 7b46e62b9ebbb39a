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
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Dict, Iterable, List, Optional

from ckptrun.protocol.control import Fatal
from ckptrun.protocol.untrusted import MAX_JSON_DEPTH, depth, read_regular
from ckptrun.protocol.untrusted import read_json as read_checked_json

EVENTS_FILE = "events.jsonl"
STATUS_FILE = "status.json"
# what a reader takes of the run directory's files: the newest 64 MiB of events (a long job's
# log may be larger; readers want its end), a status file of at most 16 MiB
EVENTS_READ_BYTES = 64 << 20
JSON_FILE_MAX_BYTES = 16 << 20


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

    def __init__(self, run_dir: str, echo: Optional[Callable[[str], None]] = None,
                 forward_to: str = "null") -> None:
        self.run_dir = ensure_run_dir(run_dir)
        self.echo = echo  # gets :func:`describe`'s line for the events a person should see
        # --event-log-handler: every event also goes to that torch.distributed.elastic.events
        # handler, as torchrun's own agent events do ("null": nowhere)
        self.forward_to = forward_to
        self.path = os.path.join(self.run_dir, EVENTS_FILE)
        self._lock = threading.Lock()  # one write at a time from this process's threads
        # called with every record written (e.g. the agent's metrics); an error in one is
        # logged, never raised into the code that emitted the event
        self.listeners: List[Callable[[Dict[str, Any]], None]] = []
        self._fd: Optional[int] = os.open(
            self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o600
        )

    def emit(self, event: str, *, say: bool = True, **fields: Any) -> Dict[str, Any]:
        """Append one event and return the record written.

        ``time`` and ``event`` come first; ``fields`` may not override them. Values that
        JSON cannot encode are written with ``str()`` so that logging never raises.
        ``say=False``: not echoed (the caller says one line for a group of events).
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
        text = describe(record) if self.echo is not None and say else None
        if text:
            self.echo(text)
        if self.forward_to != "null":
            _forward(record, self.forward_to)
        for listener in self.listeners:
            try:
                listener(record)
            except Exception as exc:  # noqa: BLE001
                print(f"ckptrun: warning: event listener failed: {exc}", file=sys.stderr)
        return record

    def say(self, text: str) -> None:
        """Echo one line to the person watching (as for an event), if this log echoes."""
        if self.echo is not None:
            self.echo(text)

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


def describe(e: Dict[str, Any]) -> Optional[str]:
    """One line for a person (the agent's stderr, ``ckptrun status``) about a failure or a
    recovery; None for routine events (a step persisted or replicated, the start, a job
    that succeeded), which the status table shows instead."""
    kind, rank = e.get("event"), e.get("rank")
    attempt = f" (attempt {e['attempt']})" if e.get("attempt") is not None else ""
    if kind == "worker_failed":
        if e.get("fatal"):
            why = Fatal.TEXT.get(e["fatal"], f"a fatal error (code {e['fatal']})")
            return f"rank {rank}: {why}: no restart{attempt}"
        how = (f"was killed by {e['signal']}" if e.get("signal") is not None
               else f"exited with code {e.get('exit_code')}")
        return f"rank {rank} {how}{attempt}"
    if kind == "hang_detected":
        how = {"stopped": "stopped (no sign of life)",
               "deadlock": "waiting, as every other rank (a deadlock or a stuck collective)",
               "child_stopped": f"waiting on process {e.get('child_pid')} ({e.get('child')}), "
                                "which it started and which is stopped",
               }.get(e.get("why"), "hung")
        return (f"rank {rank} {how}: no rank advanced for "
                f"{_secs(e.get('seconds_silent'))}{attempt}")
    if kind == "unwind_timeout":
        where = f"; its stacks are in {e['stacks']}" if e.get("stacks") else ""
        return (f"rank {rank} did not unwind within {_secs(e.get('seconds'))} to recover in "
                f"place: it is restarted{where}{attempt}")
    if kind == "stacks_dumped":
        return f"stacks of the hung workers are in {e.get('path')}"
    if kind == "node_lost":
        at = f", its ranks at step {e['step']}" if e.get("step") is not None else ""
        return (f"machine {e.get('node')} lost: no heartbeat for "
                f"{_secs(e.get('seconds_silent'))}{at}{attempt}")
    if kind == "restart_loop":
        err = f": {e['error']}" if e.get("error") else ""
        return (f"rank(s) {', '.join(map(str, e.get('ranks') or []))} failed the same way "
                f"{e.get('failures')} times in a row ({e.get('how')}{err}) with no step "
                "committed in between: not restarting again (--max-restarts counts failures "
                "between which training advanced)")
    if kind == "restart":
        return (f"restarting the workers: attempt {e.get('attempt')}, "
                f"{e.get('restarts')} restart(s) of the budget used")
    if kind == "restored":
        return f"restored step {e.get('step')} from {e.get('tier')} in {_secs(e.get('seconds'))}"
    if kind == "recovered":
        ph = e.get("phases") or {}
        parts = ", ".join(f"{label} {ph[key]:.2f}" for key, label in (
            ("detect_s", "detect"), ("stop_s", "stop"), ("start_s", "start"),
            ("restore_s", "restore"), ("first_step_s", "script")) if key in ph)
        return f"recovered in {_secs(e.get('downtime_s'))}: {parts}"
    if kind == "progress_lost":
        return (f"WARNING: no step can be restored for every rank -- this machine's ranks had "
                f"reached step {e.get('step')}, and no memory, peer copy or durable checkpoint "
                f"holds one step of all of them: the workers start over from step 0{attempt}")
    if kind == "persist_failed":
        return f"persisting step {e.get('step')} failed: {e.get('error')}"
    if kind == "replication_refused":
        return f"refused a replication connection without the job's secret from {e.get('peer')}"
    if kind == "finished" and e.get("signal"):  # preempted: not a failure of the job
        return (f"stopped by {e['signal']} (exit code {e.get('exit_code')}): the same command "
                "run again resumes from the newest persisted step")
    if kind == "finished" and e.get("exit_code"):
        return f"the job failed (exit code {e['exit_code']})"
    return None


def rank_ranges(ranks: Iterable[int]) -> str:
    """``[0, 1, 2, 3, 5, 7, 6]`` -> ``"0-3, 5-7"``: ranks in a line a person reads."""
    runs: List[List[int]] = []
    for r in sorted(set(ranks)):
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    return ", ".join(f"{g[0]}-{g[-1]}" if len(g) > 1 else str(g[0]) for g in runs)


def _forward(record: Dict[str, Any], destination: str) -> None:
    """``record`` as a torch elastic ``Event`` named ``ckptrun.<event>`` (source AGENT)."""
    try:
        from torch.distributed.elastic.events import Event, EventSource
        from torch.distributed.elastic.events import record as send

        metadata = {k: v if isinstance(v, (str, int, float, bool)) or v is None
                    else json.dumps(v, default=str) for k, v in record.items() if k != "event"}
        send(Event(name=f"ckptrun.{record['event']}", source=EventSource.AGENT,
                   timestamp=int(record["time"]), metadata=metadata), destination=destination)
    except Exception:  # a handler's failure must not stop the agent
        pass


def to_stderr(text: str) -> None:
    """The agent's echo: ``ckptrun: <line>`` on stderr, beside its workers' output."""
    try:
        sys.stderr.write(f"ckptrun: {text}\n")
        sys.stderr.flush()
    except (OSError, ValueError):  # stderr closed or gone: the event log has it anyway
        pass


def _secs(value: Any) -> str:
    if not isinstance(value, (int, float)):
        return "? s"
    return f"{value * 1e3:.1f} ms" if value < 0.1 else f"{value:.2f} s"


def read_events(run_dir: str) -> List[Dict[str, Any]]:
    """The events of ``run_dir`` in file order (of a log over :data:`EVENTS_READ_BYTES`, the
    newest); ``[]`` if there is no log yet.  :class:`UntrustedFile` where the log is not a
    regular file (a symlink, a FIFO, a device).

    A line that is not a complete JSON object (a writer killed mid-line, or a line being
    appended right now) is skipped rather than failing the reader, and so is one nested
    deeper than ckptrun writes.
    """
    path = os.path.join(run_dir, EVENTS_FILE)
    try:
        data = read_regular(path, EVENTS_READ_BYTES, tail=True)
    except FileNotFoundError:
        return []
    lines = data.split(b"\n")
    if len(data) >= EVENTS_READ_BYTES:
        lines = lines[1:]  # the first is cut
    events: List[Dict[str, Any]] = []
    for raw in lines:
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except (ValueError, RecursionError):
            continue
        if isinstance(obj, dict) and isinstance(obj.get("event"), str) \
                and depth(obj) <= MAX_JSON_DEPTH:
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
    """Read a JSON file written by :func:`write_json_atomic`; ``None`` if missing.
    :class:`~ckptrun.protocol.untrusted.UntrustedFile` where it is not what ckptrun writes --
    such a file is replaced whole, never half written: a symlink, a FIFO, a device, over
    :data:`JSON_FILE_MAX_BYTES`, not JSON or nested deeper than ckptrun nests."""
    try:
        return read_checked_json(path, JSON_FILE_MAX_BYTES)
    except FileNotFoundError:
        return None
