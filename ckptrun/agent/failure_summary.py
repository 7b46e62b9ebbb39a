"""torchrun's failure summary at the end of a failed job: the same block, built by torch.

Users (and their log scrapers) know torchrun's "<script> FAILED ... Root Cause (first observed
failure)" block, with the traceback a ``@record``-decorated entry point wrote to its error
file.  ckptrun prints the same block, made by torch's own ``ChildFailedError`` from the
workers of the last attempt that exited with an error.
"""

from __future__ import annotations

import os
from typing import List, NamedTuple


class Exit(NamedTuple):
    """A worker that exited with an error: ``exitcode`` < 0 is the signal that killed it."""

    global_rank: int
    local_rank: int
    pid: int
    exitcode: int
    error_file: str


def failure_summary(script: str, exits: List[Exit]) -> str:
    """The block torchrun prints for ``exits`` (empty string when there are none)."""
    if not exits:
        return ""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    failures = {e.global_rank: ProcessFailure(local_rank=e.local_rank, pid=e.pid,
                                              exitcode=e.exitcode, error_file=e.error_file)
                for e in exits}
    return ChildFailedError(os.path.basename(script), failures).format_msg()
