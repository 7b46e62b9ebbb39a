"""Restart loops: a failure that repeats with no progress in between is not worth retrying.

A script that crashes the same way at start-up (a bad config, a missing file) would
otherwise be restarted ``--max-restarts`` times (10 by default), printing the same traceback
every time.  Progress is a snapshot committed since the attempt's restore: between failures
that make none, a third identical failure stops the job; ``--max-restarts`` still caps the
failures between which training advanced.
"""

from __future__ import annotations

import json
from typing import Iterable, Optional, Tuple

LIMIT = 3  # attempts failing the same way in a row, with no step committed between them

Signature = Tuple[Tuple[int, str, str], ...]  # ((rank, how it failed, error message), ...)


class RestartLoops:
    """Counts consecutive identical failures that made no progress (see module docstring)."""

    def __init__(self, limit: int = LIMIT) -> None:
        self.limit = limit
        self.count = 0
        self._last: Optional[Signature] = None

    def failed(self, signature: Signature, progressed: bool) -> bool:
        """Record an attempt's failure; True when the job should stop instead of restarting."""
        if progressed or signature != self._last:
            self.count = 0
        self._last = signature
        self.count += 1
        return self.count >= self.limit


def signature(failures: Iterable[Tuple[int, str, str]]) -> Signature:
    return tuple(sorted(failures))


def error_message(error_file: str) -> str:
    """The first line of the message a worker's ``@record`` wrote (torchelastic's error file),
    or "" when there is none."""
    try:
        with open(error_file) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return ""
    msg = data.get("message") if isinstance(data, dict) else None
    if isinstance(msg, dict):
        msg = msg.get("message")
    text = str(msg or "").strip()
    return text.splitlines()[0][:200] if text else ""


def describe_how(how: dict) -> str:
    return f"signal {how['signal']}" if "signal" in how else f"exit code {how['exit_code']}"


__all__ = ["LIMIT", "RestartLoops", "describe_how", "error_message", "signature"]
