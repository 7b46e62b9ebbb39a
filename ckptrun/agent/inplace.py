"""The agent's side of in-process recovery (``ckptrun.protocol.recovery``): which live
workers go on into the next attempt in their own process, and handing them over.

A worker is kept when it is alive, runs a ``@ckptrun.resilient`` function of the attempt
that failed, and is not one of the ranks a hang verdict named.  Each kept worker is asked
to unwind; the ones that do within :data:`UNWIND_TIMEOUT_S` go on, the others are killed
and replaced with the dead ranks -- so a survivor that cannot be interrupted (a long
computation that never reaches a collective or ``save()``) costs a restart of that rank
only, never a hang.
"""

from __future__ import annotations

import os
import time
from typing import Collection, Dict, List, Optional

from ckptrun.agent.events import write_json_atomic
from ckptrun.agent.workers import Worker
from ckptrun.protocol import ControlBlock
from ckptrun.protocol.recovery import RECOVER_DIR, message, message_path

UNWIND_TIMEOUT_S = 5.0
POLL_S = 0.002


def keepable(workers: List[Worker], control: ControlBlock, attempt: int,
             excluded: Collection[int]) -> List[Worker]:
    """The live workers of ``attempt`` that could recover in place (``excluded``: local
    ranks a hang verdict named)."""
    return [w for w in workers if w.status() is None and w.local_rank not in excluded
            and control.get(w.local_rank, "resilient") == attempt + 1
            and not control.get(w.local_rank, "raised")]


def ask(candidates: List[Worker], control: ControlBlock, target: int) -> None:
    """Ask ``candidates`` to unwind for attempt ``target`` (:func:`await_unwound` waits: a
    rank failure at once, a machine loss once the new membership is formed)."""
    for w in candidates:
        control.set(w.local_rank, "recover", target)


def await_unwound(candidates: List[Worker], control: ControlBlock, target: int,
                  deadline: float) -> Dict[int, Worker]:
    """{local rank: worker} of the asked ``candidates`` that unwound by ``deadline``
    (monotonic).  Looked at once at least: after a machine loss the deadline may have passed
    during a long rendezvous round, and the workers that unwound long before still count."""
    waiting = {w.local_rank: w for w in candidates}
    done: Dict[int, Worker] = {}
    while True:
        for lr, w in list(waiting.items()):
            if w.status() is not None:
                del waiting[lr]  # it left instead (its own failure): replaced
            elif control.get(lr, "unwound") >= target:
                done[lr] = waiting.pop(lr)
        if not waiting or time.monotonic() >= deadline:
            return done
        time.sleep(POLL_S)


def hand_over(run_dir: str, control: ControlBlock, local_rank: int, attempt: int,
              env: Dict[str, str], record: Optional[int] = None) -> None:
    """Start a kept worker on ``attempt``: its record cleared for the attempt, the message
    with ``env``'s changing variables written, then the go.  ``record``: a hot spare's own
    record, where it waits (it takes ``local_rank``'s, which is cleared for it)."""
    os.makedirs(os.path.join(run_dir, RECOVER_DIR), mode=0o700, exist_ok=True)
    if record is None:
        control.reset_attempt(local_rank)
    else:
        control.reset(local_rank)
    where = local_rank if record is None else record
    write_json_atomic(message_path(run_dir, attempt, where),
                      message(attempt, env, promote=record is not None))
    control.set(where, "recover_go", attempt)


def hot_spare_ready(control: ControlBlock, record: int) -> bool:
    """Whether the hot spare on ``record`` waits at its resilient function's entry."""
    return control.get(record, "resilient") == 1 and control.get(record, "recover_go") == 0
