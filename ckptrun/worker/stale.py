"""Noticing state that may have gone stale: a plain number registered in the Checkpointer's
dict is the value it had then -- a loop that rebinds the name (``best_val_loss = loss``,
``iter_num += 1``) leaves the Checkpointer holding the first value, and a restore brings that
back, silently.  Objects (models, optimizers) and tensors are live references and cannot go
stale this way; numbers can.  The fix is to give such values at save time
(``ckpt.save(step, best_val_loss=best_val_loss)``); this says so once per entry."""

from __future__ import annotations

import sys
from typing import Any, Dict, Set

SAVES_BEFORE_WARNING = 3  # saves at different steps with the number unchanged


class StaleNumbers:
    """Watches the plain-number entries of a state dict across saves."""

    def __init__(self, state: Dict[str, Any]) -> None:
        self.state = state
        self._first = {k: v for k, v in state.items() if _is_number(v)}
        self._steps: Set[int] = set()
        self._warned: Set[str] = set()

    def saved(self, step: int) -> None:
        """Called by every ``save()`` that snapshots; warns once per entry."""
        if not self._first or len(self._steps) > SAVES_BEFORE_WARNING:
            return
        self._steps.add(step)
        if len(self._steps) <= SAVES_BEFORE_WARNING:
            return
        for k, first in self._first.items():
            now = self.state.get(k)
            if k not in self._warned and now is first:
                self._warned.add(k)
                print(f"ckptrun: warning: state entry {k!r} is a plain number ({now!r}) that "
                      f"has not changed in {SAVES_BEFORE_WARNING} saves; the Checkpointer keeps "
                      f"the value it was given, so if your loop rebinds it, pass it at save "
                      f"time instead: ckpt.save(step, {k}={k})", file=sys.stderr)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)
