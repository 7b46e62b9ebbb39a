"""The worker's side of ``ckptrun check`` (``ckptrun.protocol.check``): a fingerprint of
every committed snapshot, the scheduled faults, and the stop after step K.

Only active when the check command set ``CKPTRUN_CHECK_LOG``; a normal job never builds one.
The fingerprint is taken from the slot after the commit -- what a restore would read -- so a
difference between two runs is a difference in what was saved.
"""

from __future__ import annotations

import json
import os
import signal
from typing import Any, Dict, List, Optional, Tuple

import torch

from ckptrun.protocol import new_checksum
from ckptrun.protocol.check import (
    ENV_CHECK_FAULTS,
    ENV_CHECK_LAUNCH,
    ENV_CHECK_LOG,
    ENV_CHECK_STEPS,
    OLD_VALUES_ENTRY,
    VALUES_ENTRY,
    Fault,
    claim,
    claims,
    log_path,
    read_schedule,
)


class InjectedFault(RuntimeError):
    """What a ``raise`` fault raises out of ``save()``."""


class CheckProbe:
    """Fingerprints snapshots into the check log; injects faults and stops when told."""

    def __init__(self, directory: str, rank: int, faults: Optional[str], steps: Optional[str]):
        self.rank = rank
        self.attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        self.launch = int(os.environ.get(ENV_CHECK_LAUNCH, "0") or 0)
        self._log = open(log_path(directory, rank), "a", buffering=1)  # noqa: SIM115
        self._faults_dir = faults
        self._schedule: List[Fault] = read_schedule(faults) if faults else []
        self.stop_step = int(steps) if steps else None

    @classmethod
    def from_env(cls, rank: int) -> Optional[CheckProbe]:
        directory = os.environ.get(ENV_CHECK_LOG)
        if not directory:
            return None
        return cls(directory, rank, os.environ.get(ENV_CHECK_FAULTS),
                   os.environ.get(ENV_CHECK_STEPS))

    def committed(self, step: int, meta: Dict[str, Any], views: List[Any]) -> None:
        """Log the fingerprint of ``step``; then this rank's next fault if it is due, or the
        stop (every rank after save(K))."""
        tensors = [_digest(v.reshape(-1).view(torch.uint8).numpy() if v.numel() else b"")
                   for v in views]
        paths = [d["path"] for d in meta["tensors"]]
        # an entry's own digest covers its skeleton (plain values, structure); its tensors
        # are compared path by path
        entries = {name: _digest(json.dumps(sub, sort_keys=True).encode())
                   for name, sub in _entries(meta["tree"])}
        done = claims(self._faults_dir) if self._schedule else {}
        self._log.write(json.dumps({"step": step, "rank": self.rank, "attempt": self.attempt,
                                    "launch": self.launch, "faults_before": len(done),
                                    "entries": entries,
                                    "tensors": dict(zip(paths, tensors))}) + "\n")
        fault = self._due(step, done)
        if fault is not None:
            self._inject(fault, step, views)
        if self.stop_step is not None and step >= self.stop_step:
            self._log.close()
            os._exit(0)  # every rank stops here: nothing after step K is compared

    def _due(self, step: int, done: Dict[int, Tuple[int, int, int]]) -> Optional[Fault]:
        """This rank's fault to inject now, claimed; None when the next one is not ours or
        not yet due.  ``done``: the faults injected so far (step, launch, attempt)."""
        if not self._schedule:
            return None
        pending = [f for f in self._schedule if f.index not in done]
        if not pending or pending[0].rank != self.rank:
            return None
        fault = pending[0]
        last = done[max(done)] if done else (0, -1, -1)
        if step < fault.step or step <= last[0]:  # training advances between two faults
            return None
        if (self.launch, self.attempt) <= last[1:]:
            return None  # the attempt the previous fault hit: it is being torn down
        if not claim(self._faults_dir, fault.index, step, self.launch, self.attempt):
            return None
        return fault

    def _inject(self, fault: Fault, step: int, views: List[Any]) -> None:
        kind = fault.kind
        if kind == "raise":
            raise InjectedFault(f"ckptrun check: fault {fault.index} injected after "
                                f"save({step}) on rank {self.rank}")
        self._log.close()  # flushed before the process may die
        me, agent = os.getpid(), os.getppid()
        if kind == "stop":
            os.kill(me, signal.SIGSTOP)
        elif kind == "term":
            os.kill(agent, signal.SIGTERM)  # preemption: the agent forwards it to us
        elif kind == "agent":
            os.kill(agent, signal.SIGKILL)
            os.kill(me, signal.SIGKILL)
        elif kind == "corrupt":
            _flip_one_byte(views)
            os.kill(me, signal.SIGKILL)
        else:  # "kill"
            os.kill(me, signal.SIGKILL)
        # a stopped rank that a stack dump resumed, or one waiting for the forwarded
        # SIGTERM, goes on logging: its peers move on with it, and what it saves until the
        # agent stops them may be what the next attempt restores (a restore at step K, the
        # last one, then saves nothing more)
        self._log = open(self._log.name, "a", buffering=1)  # noqa: SIM115


def _flip_one_byte(views: List[Any]) -> None:
    """Flip a byte in the middle of the largest tensor of the committed slot (the views
    alias it): the restore must notice the checksum and use another copy."""
    big = max((v for v in views if v.numel()), key=lambda v: v.numel() * v.element_size(),
              default=None)
    if big is not None:
        raw = big.reshape(-1).view(torch.uint8)
        raw[raw.numel() // 2] ^= 0x10


def _digest(data: Any) -> str:
    h = new_checksum()
    h.update(data)
    return h.hexdigest()


def _entries(tree: Any):
    """(name, skeleton) of each top-level entry; the save-time values one level deeper
    (``values.batch``), since each of them is a thing the script gave by name."""
    for key, sub in tree.get("d", []) if isinstance(tree, dict) else []:
        name = key if isinstance(key, str) else json.dumps(key)
        if name in (VALUES_ENTRY, OLD_VALUES_ENTRY) and isinstance(sub, dict) and "d" in sub:
            for k2, sub2 in sub["d"]:
                yield f"{VALUES_ENTRY}.{k2 if isinstance(k2, str) else json.dumps(k2)}", sub2
        else:
            yield name, sub
