"""How long a recovery kept the job from training, and where the time went.

"restored step 99 from memory in 24 ms" says nothing about the seconds the job was down: most
of a recovery is detection, stopping, starting processes, and the script's own start-up.
:class:`RecoveryClock` follows one recovery on this node through its phases, all on the
system-wide monotonic clock that workers write into the control block:

- ``detect_s``: the failure (a dead rank's last sign of life, the last time any rank
  advanced before a hang, a lost machine's last heartbeat) until the agent acted on it;
- ``stop_s``: stopping the old workers;
- ``start_s``: the agent's own work up to the new workers' start (the restore decision, a
  rendezvous round when membership changed, spawning or handing over warm spares);
- ``restore_s``: the slowest rank's ``restore()``;
- ``first_step_s``: the rest -- the script's own time before ``restore()`` (imports, model
  set-up) and its first step after it, until every rank's first ``save()``.

``downtime_s`` is their sum: failure until every rank completed its first step again.
"""

from __future__ import annotations

import time
from typing import Dict, List, Optional


class RecoveryClock:
    """One node's view of the recovery under way (at most one at a time)."""

    def __init__(self) -> None:
        self._t: Dict[str, float] = {}

    def failed(self, at: Optional[float] = None, now: Optional[float] = None) -> None:
        """A failure was acted on ``now``; it happened at ``at`` (None: not known here,
        e.g. another node's, so it counts from now)."""
        now = time.monotonic() if now is None else now
        if "detected" in self._t:  # a second failure while recovering: one recovery
            return
        self._t = {"failed": min(at, now) if at else now, "detected": now}

    def stopped(self) -> None:
        if "detected" in self._t:
            self._t.setdefault("stopped", time.monotonic())

    def started(self) -> None:
        if "stopped" in self._t:
            self._t["started"] = time.monotonic()

    def finish(self, records: List[dict]) -> Optional[dict]:
        """Once every worker of the new attempt made its first step: the ``recovered``
        event's fields (and the clock is reset); else None.  ``records``: control-block
        records of the live workers."""
        if "started" not in self._t or not records:
            return None
        firsts = [r["first_step_at"] for r in records]
        if not all(firsts):
            return None
        t = self._t
        end = max(firsts)
        restore = max(r["restore_s"] for r in records if r["restored_step"] >= 0) \
            if any(r["restored_step"] >= 0 for r in records) else 0.0
        phases = {"detect_s": t["detected"] - t["failed"], "stop_s": t["stopped"] - t["detected"],
                  "start_s": t["started"] - t["stopped"], "restore_s": restore}
        phases["first_step_s"] = max(0.0, end - t["started"] - restore)
        self._t = {}
        return {"downtime_s": round(end - t["failed"], 3),
                "phases": {k: round(max(0.0, v), 3) for k, v in phases.items()}}

    @property
    def recovering(self) -> bool:
        return bool(self._t)
