"""Where a restore comes from: the newest step every rank of the job can have, nearest tier
first, agreed by every machine.

One function, :func:`decide_restore`, over the agent's ordered list of tiers (memory, then
peer memory, then durable storage).  For each tier in turn:

1. every machine lists the steps the tier :meth:`~ckptrun.tiers.interface.Tier.offers` for
   its ranks (cheap: headers, inventories, listings);
2. the machines agree on the newest step they all offer;
3. each machine :meth:`~ckptrun.tiers.interface.Tier.materialise` s that step (verifying it:
   a checksum is one pass over the state, so only the agreed candidate is hashed or copied);
4. the machines agree that all of them succeeded.  If one could not (a copy failed its
   checksum, a holder went away), that machine drops the step from its offers and the round
   repeats with the newest step still common -- a tier is not given up while an older step
   all machines can produce exists, which would restore everyone from storage, or nothing.

A tier that has no common step passes to the next.  Nothing found anywhere: a fresh start
(``{"step": 0}``).  A rollback (``ckptrun restore --rollback N``) takes exactly step N.
"""

from __future__ import annotations

import logging
from typing import Dict, List, Optional, Protocol, Sequence

from ckptrun.tiers.interface import Tier

log = logging.getLogger(__name__)

MAX_ROUNDS = 8  # agreement rounds one tier gets before the next tier is asked


class Agreement(Protocol):
    """What the decision needs from the job's coordinator (``agent.rendezvous.JobCoordinator``):
    two kinds of job-wide agreement, each round under its own key."""

    def agree_common_step(self, key: str, steps: List[int]) -> Optional[int]:
        """The newest step every machine has in ``steps``; None if there is none."""

    def agree_restore_step(self, key: str, local_step: Optional[int]) -> Optional[int]:
        """``local_step`` if every machine posts the same, else the smallest; None if any
        machine posts None."""


def decide_restore(tiers: Sequence[Tier], ranks: List[int], agreement: Agreement,
                   attempt: int, forced_step: Optional[int] = None) -> Dict[str, object]:
    """The ``CKPTRUN_RESTORE`` value for ``attempt``: ``{"step": N, "tier": T}`` with the
    slots of ``ranks`` holding step N (``"verified": true`` when it is the memory copy this
    machine just hashed with every worker stopped, so the workers need not hash it again),
    or ``{"step": 0}``.  ``forced_step``: a rollback to exactly that step."""
    for tier in tiers:
        found = _agree_in_tier(tier, ranks, agreement, attempt, forced_step)
        if found is not None:
            step, served = found
            for t in tiers:
                t.settle(ranks, step)
            return {"step": step, "tier": served,
                    **({"verified": True} if served == "memory" else {})}
    return {"step": 0}


def _agree_in_tier(tier: Tier, ranks: List[int], agreement: Agreement, attempt: int,
                   forced_step: Optional[int]):
    """(step, tier that served it) agreed by every machine from ``tier``, or None."""
    offered = {s for s in tier.offers(ranks, attempt, forced_step)
               if s > 0 and forced_step in (None, s)}
    for rnd in range(MAX_ROUNDS):
        key = f"{attempt}/{tier.name}/{rnd}"
        step = agreement.agree_common_step(key, sorted(offered))
        log.info("restore %s: offered %s, agreed %s", key, sorted(offered), step)
        if step is None:
            return None
        served = tier.materialise(ranks, attempt, step)
        if served is None:
            log.info("restore %s: cannot materialise step %s here", key, step)
        if agreement.agree_restore_step(key + "/ok", step if served else None) == step:
            return step, served
        offered.discard(step)  # failed here or elsewhere: no machine restores it
    return None
