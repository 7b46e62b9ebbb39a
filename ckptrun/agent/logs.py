"""Where a worker's output goes: torchrun's ``--redirects/--tee/--local-ranks-filter`` (its
``Std`` spec, log layout and line headers), or ckptrun's default (log files plus console
lines prefixed ``[rank<N>]: ``), and the threads that copy the worker pipes there."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from dataclasses import dataclass
from string import Template
from typing import IO, Dict, List, Optional, Tuple

from ckptrun.config import AgentConfig

_console_lock = threading.Lock()
# Tracebacks already on the console, as labelled lines (so per rank): a failure that repeats after a
# restart (a crash at start-up, a bad config) shows its traceback once, not once per attempt
# (the log files keep every copy).  One agent per process, so one set.
_shown_tracebacks: set = set()
_TB_START = b"Traceback (most recent call last):"
_TB_LINKS = (b"During handling of the above exception", b"The above exception was the direct")


@dataclass
class StreamRoute:
    """Where one standard stream of one worker goes."""

    to_file: bool  # write into <attempt dir>/<local_rank>/<name>.log
    to_console: bool  # copy to the agent's console with ``prefix``
    prefix: str = ""
    # --duplicate-<name>-filters: console lines holding any of these also go to
    # <attempt dir>/filtered_<name>.log (all ranks in one file, as torchrun)
    filters: Tuple[str, ...] = ()

    @property
    def piped(self) -> bool:
        return self.to_file or (self.to_console and bool(self.prefix))

    @property
    def inherit(self) -> bool:
        """Passed straight through to the agent's own stream (torchrun's default)."""
        return self.to_console and not self.prefix and not self.to_file


def _parse_std(spec: str, nproc: int) -> Dict[int, int]:
    from torch.distributed.elastic.multiprocessing.api import Std, to_map
    return {k: int(v) for k, v in to_map(Std.from_str(spec), nproc).items()}


def stream_routes(cfg: AgentConfig, local_rank: int, global_rank: int) -> Dict[str, StreamRoute]:
    """torchrun's ``--redirects/--tee/--local-ranks-filter`` meaning, or ckptrun's default.

    ckptrun's default (no log option given): both streams go to the run dir's log files and
    to the console, each line prefixed ``[rank<N>]: ``.  With any torchrun log option the
    torchrun rules apply, including its ``[<role><local_rank>]:`` tee header.
    """
    shown = cfg.local_ranks_filter is None or local_rank in cfg.local_ranks_filter
    explicit = bool(cfg.log_dir) or cfg.redirects not in ("0", "") or cfg.tee not in ("0", "")
    template = os.environ.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE")

    def header(default: str) -> str:  # torchrun's template, with its three names
        if not template:
            return default
        return Template(template).safe_substitute(role_name=cfg.role, rank=global_rank,
                                                  local_rank=local_rank)

    filters = {"stdout": tuple(cfg.duplicate_stdout_filters),
               "stderr": tuple(cfg.duplicate_stderr_filters)}
    routes = {}
    if not explicit:
        for name in ("stdout", "stderr"):
            routes[name] = StreamRoute(True, shown, header(f"[rank{global_rank}]: "),
                                       filters[name] if shown else ())
        return routes
    redirects = _parse_std(cfg.redirects or "0", cfg.nproc_per_node)[local_rank]
    tee = _parse_std(cfg.tee or "0", cfg.nproc_per_node)[local_rank]
    for name, bit in (("stdout", 1), ("stderr", 2)):
        teed = bool(tee & bit)
        to_file = bool(redirects & bit) or teed
        to_console = shown and (teed or not to_file)
        prefix = header(f"[{cfg.role}{local_rank}]:") if teed else ""
        routes[name] = StreamRoute(to_file, to_console, prefix,
                                   filters[name] if teed and shown else ())
    return routes


class Pump(threading.Thread):
    """Copies a worker's pipe to its log file and/or the console, line by line."""

    def __init__(self, fd: int, log: Optional[IO[bytes]], console: Optional[IO[bytes]],
                 prefix: bytes, dup: Optional[IO[bytes]] = None,
                 filters: Tuple[bytes, ...] = ()):
        super().__init__(daemon=True, name="ckptrun-log")
        self.fd, self.log, self.console, self.prefix = fd, log, console, prefix
        self.dup, self.filters = dup, filters
        self._traceback: List[bytes] = []  # the lines of a traceback being received

    def run(self) -> None:
        pending = b""
        while True:
            try:
                chunk = os.read(self.fd, 65536)
            except OSError:
                chunk = b""
            if not chunk:
                break
            if self.log is not None:
                self.log.write(chunk)
                self.log.flush()
            if self.console is not None:
                lines = (pending + chunk).split(b"\n")
                pending = lines.pop()
                shown = self._once([self._label(ln) + b"\n" for ln in lines])
                if shown:
                    self._show(shown)
        if self.console is not None:
            tail = [self._label(pending) + b"\n"] if pending else []
            shown = self._once(tail)
            shown += b"".join(self._traceback)  # one left unfinished: as it came
            if shown:
                self._show(shown)
        os.close(self.fd)
        if self.log is not None:
            self.log.close()
        if self.dup is not None:
            self.dup.close()

    def _once(self, lines: List[bytes]) -> bytes:
        """``lines`` as the console shows them: a traceback is held until its last line,
        then shown, or -- when this rank showed the same one before -- replaced by one line
        (``_shown_tracebacks``)."""
        out: List[bytes] = []
        for line in lines:
            body = line[len(self.prefix):]  # labelled (``_label``): the prefix is there
            if not self._traceback:
                if body.startswith(_TB_START):
                    self._traceback = [line]
                else:
                    out.append(line)
                continue
            self._traceback.append(line)
            if body[:1] in (b" ", b"\t", b"\n") or body.startswith(_TB_START) \
                    or body.startswith(_TB_LINKS):
                continue  # a frame, a chained exception's heading, a blank line
            block, self._traceback = self._traceback, []  # its last line: the exception
            key = b"".join(block)  # labelled lines: the rank's prefix is part of it
            with _console_lock:
                seen = key in _shown_tracebacks
                _shown_tracebacks.add(key)
            out.extend([self.prefix + b"(the same traceback as before: " + body.rstrip(b"\n")
                        + b")\n"] if seen else block)
        return b"".join(out)

    def _label(self, line: bytes) -> bytes:
        # torch's own excepthook already starts a distributed worker's traceback lines
        # with "[rank<N>]: ": labelled twice, they read "[rank0]: [rank0]: Traceback"
        return line if line.startswith(self.prefix) else self.prefix + line

    def _show(self, data: bytes) -> None:
        if self.dup is not None:
            picked = [ln for ln in data.splitlines(keepends=True)
                      if any(f in ln for f in self.filters)]
            if picked:  # O_APPEND, one write: the ranks' lines do not interleave
                with contextlib.suppress(OSError, ValueError):
                    self.dup.write(b"".join(picked))
                    self.dup.flush()
        with _console_lock:
            try:
                self.console.write(data)
                self.console.flush()
            except (OSError, ValueError):
                pass  # console gone (agent output closed): keep writing the log file


class _TextConsole:
    """A text stream without a byte buffer (``io.StringIO``, a notebook's or a test
    harness's ``sys.stdout``, as torch's launcher tests run ``torchrun`` in-process) seen as
    the byte stream :class:`Pump` writes: bytes decoded, undecodable ones replaced."""

    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream

    def write(self, data: bytes) -> None:
        self.stream.write(data.decode("utf-8", errors="replace"))

    def flush(self) -> None:
        self.stream.flush()


def _binary(stream: IO[str]):  # -> a byte-writing object
    """``stream``'s byte buffer, or ``stream`` wrapped to take bytes where it has none."""
    buffer = getattr(stream, "buffer", None)
    return buffer if buffer is not None else _TextConsole(stream)


def _open_log(path: str) -> IO[bytes]:
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb")


def attach_pumps(reads: Dict[str, Optional[int]], routes: Dict[str, StreamRoute],
                  log_dir: str) -> List[Pump]:
    pumps = []
    for name, fd in reads.items():
        if fd is None:
            continue
        r = routes[name]
        log = _open_log(os.path.join(log_dir, f"{name}.log")) if r.to_file else None
        console = None
        if r.to_console:
            console = _binary(sys.stdout if name == "stdout" else sys.stderr)
        dup = None
        if console is not None and r.filters:
            dup = os.fdopen(os.open(os.path.join(os.path.dirname(log_dir), f"filtered_{name}.log"),
                                    os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "wb")
        pump = Pump(fd, log, console, r.prefix.encode(), dup,
                    tuple(f.encode() for f in r.filters))
        pump.start()
        pumps.append(pump)
    return pumps
