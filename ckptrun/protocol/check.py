"""What ``ckptrun check`` tells a worker, and what the worker writes back.

The check command runs the job with these environment variables; the Checkpointer reads
them (``ckptrun.worker.check_probe``) and appends one JSON line per committed snapshot to
``<CKPTRUN_CHECK_LOG>/rank<R>.jsonl``: ``{"step", "rank", "attempt", "launch", "entries":
{name: hex}, "tensors": {path: hex}}`` -- the xxh3 of every state entry's skeleton (its plain
values and structure) and of every tensor of the snapshot, as the slot holds it.

Faults come from a schedule the check command writes before the run (``faults.json`` in
``CKPTRUN_CHECK_FAULTS``): an ordered list of ``{"index", "step", "rank", "kind"}``.  The
rank named by the first fault not yet injected injects it at its first ``save()`` at or
after the fault's step, after the step where the previous fault was injected (so training
always advances between two faults) and in a later attempt or launch than the previous one
(every fault ends the attempt it hits: the workers of a doomed attempt -- a stopped rank
that a stack dump's SIGCONT woke, its peers moving on with it until the agent kills them --
inject nothing).  Before injecting, it claims the fault by creating ``done-<index>``
exclusively, holding the step, launch and attempt: a restarted worker, or the same command
run again, never injects a fault twice.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Dict, List, Tuple

ENV_CHECK_LOG = "CKPTRUN_CHECK_LOG"  # directory of the per-rank check logs
ENV_CHECK_FAULTS = "CKPTRUN_CHECK_FAULTS"  # directory of faults.json and the done markers
ENV_CHECK_STEPS = "CKPTRUN_CHECK_STEPS"  # K: every rank exits (code 0) after save(K)
ENV_CHECK_LAUNCH = "CKPTRUN_CHECK_LAUNCH"  # which run of the command this is (0, 1, ...)

# what a fault does, in the worker that injects it, right after its save(step) committed
KINDS = {
    "kill": "the rank SIGKILLs itself",
    "stop": "the rank SIGSTOPs itself (a hang)",
    "raise": "save() raises an exception in the script's main thread",
    "agent": "the agent is SIGKILLed; the command is run again",
    "term": "the agent gets SIGTERM (preemption); the command is run again",
    "corrupt": "one byte of the rank's newest memory copy is flipped, then it SIGKILLs itself",
}
RERUN_KINDS = ("agent", "term")  # the command ends: the check runs it again
VALUES_ENTRY = "values"  # the entry holding save(step, **values); a name per value
OLD_VALUES_ENTRY = "__ckptrun_values__"
SCHEDULE_FILE = "faults.json"


@dataclass(frozen=True)
class Fault:
    """One scheduled fault: ``kind`` injected by ``rank`` at a save at or after ``step``."""

    index: int
    step: int
    rank: int
    kind: str


def log_path(directory: str, rank: int) -> str:
    return f"{directory}/rank{rank}.jsonl"


def write_schedule(directory: str, faults: List[Fault]) -> None:
    os.makedirs(directory, mode=0o700, exist_ok=True)
    with open(os.path.join(directory, SCHEDULE_FILE), "w") as f:
        json.dump([asdict(x) for x in faults], f)


def read_schedule(directory: str) -> List[Fault]:
    with open(os.path.join(directory, SCHEDULE_FILE)) as f:
        return [Fault(int(d["index"]), int(d["step"]), int(d["rank"]), str(d["kind"]))
                for d in json.load(f)]


def claim(directory: str, index: int, step: int, launch: int = 0, attempt: int = 0) -> bool:
    """Mark fault ``index`` injected at ``step`` by a worker of ``launch``/``attempt``;
    False if it already was (exclusive create)."""
    try:
        fd = os.open(os.path.join(directory, f"done-{index}"),
                     os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(f"{step} {launch} {attempt}")
    return True


def claims(directory: str) -> Dict[int, Tuple[int, int, int]]:
    """{fault index: (step, launch, attempt) it was injected at} of every claimed fault."""
    out: Dict[int, Tuple[int, int, int]] = {}
    for name in os.listdir(directory) if os.path.isdir(directory) else []:
        if name.startswith("done-"):
            try:
                with open(os.path.join(directory, name)) as f:
                    step, launch, attempt = (f.read().split() + ["0", "0", "0"])[:3]
                out[int(name[5:])] = (int(step), int(launch), int(attempt))
            except (OSError, ValueError):
                continue
    return out


def injected(directory: str) -> Dict[int, int]:
    """{fault index: the step it was injected at} of every claimed fault."""
    return {i: c[0] for i, c in claims(directory).items()}
