"""The memory tier as the agent's restore sees it: the node's own worker slots.

The snapshots are already where the workers read them, so materialising a step is only
verifying it: every local rank's copy is hashed (in parallel, from maps kept populated by
:meth:`tick`) against the checksum its writer recorded.  A copy that fails is never used
(Megatron-LM #5281): the decision moves on to an older step or the next tier.
"""

from __future__ import annotations

from typing import Dict, List, Optional

from ckptrun.tiers.interface import Tier, TierContext


class MemoryTier(Tier):
    """This machine's slots (see the module docstring)."""

    name = "memory"

    def __init__(self, ctx: TierContext) -> None:
        self.ctx = ctx
        self.memory = ctx.memory

    def offers(self, ranks: List[int], attempt: int, max_step: Optional[int]) -> List[int]:
        """Every step all of ``ranks`` committed (headers only): not only the newest, since
        a node one step ahead may no longer hold the others' newest step."""
        if not ranks:
            return []
        common = set.intersection(*(set(self.memory.steps(r)) for r in ranks))
        return sorted(s for s in common if max_step is None or s <= max_step)

    def materialise(self, ranks: List[int], attempt: int, step: int) -> Optional[str]:
        return "memory" if self.memory.verify_all(ranks, step) else None

    def settle(self, ranks: List[int], step: int) -> None:
        """No slot of an abandoned, newer timeline is ever restored later."""
        self.memory.discard_newer(ranks, step)

    def tick(self) -> None:
        self.memory.warm(self.ctx.ranks)

    def status(self) -> Dict[str, object]:
        """``memory_step``: the newest step every local worker has committed."""
        committed = [self.ctx.control.get(lr, "committed_step")
                     for lr in range(len(self.ctx.ranks))]
        return {"memory_step": min(committed) if committed and min(committed) >= 0 else None}
