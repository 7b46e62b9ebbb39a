"""The worker's side of ``ckptrun check`` (``ckptrun.protocol.check``): a fingerprint of
every committed snapshot, the injected kill, and the stop after step K.

Only active when the check command set ``CKPTRUN_CHECK_LOG``; a normal job never builds one.
The fingerprint is taken from the slot after the commit -- what a restore would read -- so a
difference between two runs is a difference in what was saved.
"""

from __future__ import annotations

import json
import os
import signal
from typing import Any, Dict, List, Optional

import torch

from ckptrun.protocol import new_checksum
from ckptrun.protocol.check import ENV_CHECK_KILL, ENV_CHECK_LOG, ENV_CHECK_STEPS, log_path


class CheckProbe:
    """Fingerprints snapshots into the check log; kills or stops the worker when told."""

    def __init__(self, directory: str, rank: int, kill: Optional[str], steps: Optional[str]):
        self.rank = rank
        self.attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        self._log = open(log_path(directory, rank), "a", buffering=1)  # noqa: SIM115
        self.kill_step: Optional[int] = None
        if kill and self.attempt == 0:
            step, _, who = kill.partition(":")
            if int(who) == rank:
                self.kill_step = int(step)
        self.stop_step = int(steps) if steps else None

    @classmethod
    def from_env(cls, rank: int) -> Optional[CheckProbe]:
        directory = os.environ.get(ENV_CHECK_LOG)
        if not directory:
            return None
        return cls(directory, rank, os.environ.get(ENV_CHECK_KILL),
                   os.environ.get(ENV_CHECK_STEPS))

    def committed(self, step: int, meta: Dict[str, Any], views: List[Any]) -> None:
        """Log the fingerprint of ``step``; then the kill (rank R after save(S), first
        attempt) or the stop (every rank after save(K))."""
        tensors = [_digest(v.reshape(-1).view(torch.uint8).numpy() if v.numel() else b"")
                   for v in views]
        paths = [d["path"] for d in meta["tensors"]]
        # an entry's own digest covers its skeleton (plain values, structure); its tensors
        # are compared path by path
        entries = {name: _digest(json.dumps(sub, sort_keys=True).encode())
                   for name, sub in _entries(meta["tree"])}
        self._log.write(json.dumps({"step": step, "rank": self.rank, "attempt": self.attempt,
                                    "entries": entries,
                                    "tensors": dict(zip(paths, tensors))}) + "\n")
        if step == self.kill_step:
            self._log.close()
            os.kill(os.getpid(), signal.SIGKILL)
        if self.stop_step is not None and step >= self.stop_step:
            self._log.close()
            os._exit(0)  # every rank stops here: nothing after step K is compared


def _digest(data: Any) -> str:
    h = new_checksum()
    h.update(data)
    return h.hexdigest()


def _entries(tree: Any):
    """(name, skeleton) of each top-level entry; the save-time values one level deeper
    (``values.batch``), since each of them is a thing the script gave by name."""
    for key, sub in tree.get("d", []) if isinstance(tree, dict) else []:
        name = key if isinstance(key, str) else json.dumps(key)
        if name in ("values", "__ckptrun_values__") and isinstance(sub, dict) and "d" in sub:
            for k2, sub2 in sub["d"]:
                yield f"values.{k2 if isinstance(k2, str) else json.dumps(k2)}", sub2
        else:
            yield name, sub
