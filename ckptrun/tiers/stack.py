"""The agent's ordered list of tiers, nearest first: memory, peer memory, durable storage.

The order is the restore order (:mod:`ckptrun.tiers.restore_decision` asks them in turn).
Which tiers a job has follows from its configuration alone, so every machine of a job builds
the same list -- the agreement rounds of a restore depend on that.
"""

from __future__ import annotations

from typing import List

from ckptrun.tiers.durable.tier import DurableTier
from ckptrun.tiers.interface import Tier, TierContext
from ckptrun.tiers.memory.tier import MemoryTier
from ckptrun.tiers.peer.tier import ReplicaTier


def build_tiers(ctx: TierContext) -> List[Tier]:
    """The tiers for one membership of the job (rebuilt after a machine is replaced)."""
    tiers: List[Tier] = [MemoryTier(ctx)]
    if ctx.nnodes > 1 and ctx.cfg.replicas > 1:  # peers to replicate to
        tiers.append(ReplicaTier(ctx))
    if ctx.cfg.persist_to or ctx.cfg.resume_from:
        tiers.append(DurableTier(ctx))
    return tiers
