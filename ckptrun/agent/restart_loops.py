"""Restart loops: a failure that repeats with no progress in between is not worth retrying.

A script that crashes the same way at start-up (a bad config, a missing file) would
otherwise be restarted ``--max-restarts`` times (10 by default), printing the same traceback
every time.  Progress is a snapshot committed since the attempt's restore: between failures
that make none, a third identical failure stops the job; ``--max-restarts`` still caps the
failures between which training advanced.

"Identical" is by what failed, not by which ranks reported it: when one rank fails, the
agent stops the others, and whether one of them failed the same way first is a race --
counted by the set of ranks, a load that every rank refused took six attempts to stop
instead of three.  So attempts fail "the same way" while some (how, message) pair -- rank
numbers in the message left out -- is among the failures of every one of them: a pair with a
message, or, where the workers left none (no ``@record``: every failure is "exit code 1"), one
that some same rank reported in each attempt -- rank 0 failing one way and then rank 1 some
other way are not the same failure.
"""

from __future__ import annotations

import re
from typing import FrozenSet, Iterable, Optional, Tuple

from ckptrun.protocol.untrusted import UntrustedFile, read_json

LIMIT = 3  # attempts failing the same way in a row, with no step committed between them

Signature = Tuple[Tuple[int, str, str], ...]  # ((rank, how it failed, error message), ...)


class RestartLoops:
    """Counts consecutive identical failures that made no progress (see module docstring)."""

    def __init__(self, limit: int = LIMIT) -> None:
        self.limit = limit
        self.count = 0
        self._common: Optional[FrozenSet[Tuple[str, str]]] = None
        self._ranks: FrozenSet[int] = frozenset()

    def failed(self, signature: Signature, progressed: bool) -> bool:
        """Record an attempt's failure; True when the job should stop instead of restarting."""
        kinds = frozenset((how, _without_numbers(msg)) for _, how, msg in signature)
        ranks = frozenset(r for r, _, _ in signature)
        common = None if progressed or self._common is None else self._common & kinds
        same = bool(common) and (any(msg for _, msg in common) or bool(ranks & self._ranks))
        if not same:
            self.count, common, self._ranks = 0, kinds, ranks
        else:
            self._ranks = self._ranks & ranks or ranks
        self._common = common
        self.count += 1
        return self.count >= self.limit


def _without_numbers(message: str) -> str:
    """``message`` with its numbers left out ("rank 1: ..." and "rank 0: ..." are alike)."""
    return re.sub(r"\d+", "N", message)


def signature(failures: Iterable[Tuple[int, str, str]]) -> Signature:
    return tuple(sorted(failures))


def error_message(error_file: str) -> str:
    """The first line of the message a worker's ``@record`` wrote (torchelastic's error file),
    or "" when there is none."""
    try:  # the worker writes it; what is there may be anything (untrusted)
        data = read_json(error_file, 1 << 20)
    except (OSError, UntrustedFile):
        return ""
    msg = data.get("message") if isinstance(data, dict) else None
    if isinstance(msg, dict):
        msg = msg.get("message")
    text = str(msg or "").strip()
    return text.splitlines()[0][:200] if text else ""


def describe_how(how: dict) -> str:
    return f"signal {how['signal']}" if "signal" in how else f"exit code {how['exit_code']}"


__all__ = ["LIMIT", "RestartLoops", "describe_how", "error_message", "signature"]
