"""Worker-side liveness: ``ckptrun.heartbeat()`` and the link to the agent's control block.

Under the ckptrun agent the worker's environment names the node's control block
(``CKPTRUN_CONTROL``); a heartbeat is a couple of struct writes into shared memory.
Outside ckptrun (plain ``python`` or ``torchrun``) every function here is a cheap no-op.
"""

from __future__ import annotations

import os
from typing import Optional, Tuple

from ckptrun.protocol import ENV_CONTROL, ENV_LOCAL_RANK, ControlBlock, Phase
from ckptrun.protocol.env import ENV_HOT_SPARE
from ckptrun.worker.progress import sample_progress

_link: Optional[Tuple[ControlBlock, int]] = None
_looked = False


def worker_link() -> Optional[Tuple[ControlBlock, int]]:
    """The (control block, local rank) of this worker, or None when not under ckptrun."""
    global _link, _looked
    if _looked and (_link is None or (_link[0].path == os.environ.get(ENV_CONTROL)
                                      and str(_link[1]) == _local_rank_env())):
        return _link
    _looked = True
    path = os.environ.get(ENV_CONTROL)
    if not path:
        _link = None
        return None
    local_rank = int(_local_rank_env())
    block = _link[0] if _link is not None and _link[0].path == path else ControlBlock(path)
    block.set(local_rank, "pid", os.getpid())
    sample_progress(block, local_rank)  # the agent tells waiting from hung by it
    _link = (block, local_rank)
    return _link


def _local_rank_env() -> str:
    """This worker's record: a hot spare's own until it takes a rank, then the rank's."""
    return (os.environ.get(ENV_HOT_SPARE) or os.environ.get(ENV_LOCAL_RANK)
            or os.environ.get("LOCAL_RANK", "0"))


class RecoveryRequested(Exception):
    """Raised out of ``save()``/``heartbeat()`` inside a ``@ckptrun.resilient`` function when
    the agent asks this rank to recover in place: a rank elsewhere failed.  The decorator
    catches it; a loop that catches every ``Exception`` should let this one through."""

    def __init__(self, attempt: int):
        super().__init__(f"ckptrun: a rank elsewhere failed; recovering in place into "
                         f"attempt {attempt}")
        self.attempt = attempt


def recovery_target(block: ControlBlock, local_rank: int) -> Optional[int]:
    """The attempt the agent asks this worker to recover into, or None (none asked, or the
    worker runs no resilient function)."""
    running = block.get(local_rank, "resilient")  # attempt + 1
    target = block.get(local_rank, "recover")
    return target if running and target >= running else None


def raise_if_recovering(link: Tuple[ControlBlock, int]) -> None:
    target = recovery_target(*link)
    if target is not None:
        raise RecoveryRequested(target)


def heartbeat(step: Optional[int] = None, phase: Optional[int] = None) -> None:
    """Tell the agent this worker is alive (call it during long phases with no ``save()``).

    ``step`` optionally reports progress; ``phase`` is one of :class:`ckptrun.protocol.Phase`.
    """
    link = worker_link()
    if link is None:
        return
    raise_if_recovering(link)
    block, local_rank = link
    block.beat(local_rank, step=step, phase=Phase.RUNNING if phase is None else phase)
