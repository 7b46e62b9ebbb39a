"""What the argument parser and the preflight checks share: the usage error (exit code 2,
one line) and how boolean and URL values are spelled."""

from __future__ import annotations

import re

FALSE = {"", "0", "false", "no", "off", "n", "f"}
TRUE = {"1", "true", "yes", "on", "y", "t"}
URL_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


class UsageError(Exception):
    """A bad command line; ``str(exc)`` is one line meant for ``ckptrun: error: ...``."""


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type name if it has none)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
