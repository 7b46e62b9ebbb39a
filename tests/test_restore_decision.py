"""The restore decision across machines: every node restores the same step, and a tier
(peer memory, storage) is not given up while an older step all nodes can produce exists."""

from __future__ import annotations

import threading
from typing import Dict, List, Optional

from ckptrun.membership import decide_restore


class Coord:
    """Two nodes' JobCoordinators over one in-memory "store" (gathers meet at a barrier)."""

    def __init__(self, shared: dict, barrier: threading.Barrier, rank: int) -> None:
        self.shared, self.barrier, self.rank, self.nnodes = shared, barrier, rank, 2

    def _gather(self, key: str, value):
        self.shared.setdefault(key, {})[self.rank] = value
        self.barrier.wait(timeout=10)
        return [self.shared[key][r] for r in range(self.nnodes)]

    def agree_common_step(self, key: str, steps: List[int]) -> Optional[int]:
        common = set.intersection(*(set(s) for s in self._gather(key, steps)))
        return max(common) if common else None

    def agree_restore_step(self, key: str, local: Optional[int]) -> Optional[int]:
        vals = self._gather(key, local)
        return None if any(v is None for v in vals) else min(vals)


class Tier:
    """A tier that can materialise exactly ``steps`` (as peer copies do)."""

    def __init__(self, steps: List[int], tier: str = "peer") -> None:
        self.steps, self.tier = sorted(steps), tier
        self.materialised: List[int] = []

    def restore_step(self, ranks, attempt, max_step):
        ok = [s for s in self.steps if max_step is None or s <= max_step]
        if not ok:
            return None
        self.materialised.append(ok[-1])
        return ok[-1], self.tier


def decide_on_two_nodes(tiers_per_node: List[list], forced: Optional[int] = None) -> list:
    shared: Dict[str, dict] = {}
    barrier = threading.Barrier(2)
    out: list = [None, None]

    def node(rank: int) -> None:
        out[rank] = decide_restore(None, [rank], Coord(shared, barrier, rank), 3, forced,
                                   tiers_per_node[rank])

    threads = [threading.Thread(target=node, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return out


def test_a_step_one_node_cannot_produce_is_retried_older_not_given_up():
    """The survivor can produce steps 12, 11, 10 (its slots) and 7, 5 (its own copies of two
    rounds); the replacement only what the survivor holds of the lost machine: 9 and 7 (the
    lost machine's push of round 9 arrived, the survivor's own copy of round 9 did not).
    Step 9 fails on the survivor; both must then agree on 7 -- from peer memory, not fall
    through to storage (which holds step 4 here)."""
    storage = [Tier([4], "storage"), Tier([4], "storage")]
    survivor, newcomer = Tier([5, 7, 10, 11, 12]), Tier([7, 9])
    got = decide_on_two_nodes([[survivor, storage[0]], [newcomer, storage[1]]])
    assert got == [{"step": 7, "tier": "peer"}, {"step": 7, "tier": "peer"}]
    assert survivor.materialised[-1] == 7 and newcomer.materialised[-1] == 7
    assert storage[0].materialised == [] and storage[1].materialised == []


def test_no_common_step_falls_through_to_the_next_tier():
    storage = [Tier([4], "storage"), Tier([4], "storage")]
    got = decide_on_two_nodes([[Tier([10, 11]), storage[0]], [Tier([6, 8]), storage[1]]])
    assert got == [{"step": 4, "tier": "storage"}, {"step": 4, "tier": "storage"}]


def test_a_rollback_takes_exactly_its_step_or_nothing():
    got = decide_on_two_nodes([[Tier([5, 7, 9])], [Tier([7, 9])]], forced=9)
    assert got == [{"step": 9, "tier": "peer"}, {"step": 9, "tier": "peer"}]
    got = decide_on_two_nodes([[Tier([5, 7, 10])], [Tier([7, 9])]], forced=9)
    assert got == [{"step": 0}, {"step": 0}]
