"""The restore decision across machines (``ckptrun.tiers.restore_decision``): every node
restores the same step, nearest tier first, and a tier is not given up while an older step
all nodes can produce exists."""

from __future__ import annotations

import threading
from typing import Dict, Iterable, List, Optional

from ckptrun.tiers.interface import Tier
from ckptrun.tiers.restore_decision import decide_restore


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


class FakeTier(Tier):
    """Offers ``steps``; materialising one of ``broken`` fails (a copy fails its checksum)."""

    def __init__(self, steps: Iterable[int], name: str = "peer", served: Optional[str] = None,
                 broken: Iterable[int] = ()) -> None:
        self.steps, self.name, self.served = sorted(steps), name, served or name
        self.broken = set(broken)
        self.materialised: List[int] = []
        self.settled: List[int] = []

    def offers(self, ranks, attempt, max_step):
        return [s for s in self.steps if max_step is None or s <= max_step]

    def materialise(self, ranks, attempt, step):
        self.materialised.append(step)
        return None if step in self.broken else self.served

    def settle(self, ranks, step):
        self.settled.append(step)


def decide_on_two_nodes(tiers_per_node: List[list], forced: Optional[int] = None) -> list:
    shared: Dict[str, dict] = {}
    barrier = threading.Barrier(2)
    out: list = [None, None]

    def node(rank: int) -> None:
        out[rank] = decide_restore(tiers_per_node[rank], [rank], Coord(shared, barrier, rank),
                                   3, forced)

    threads = [threading.Thread(target=node, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return out


def test_the_newest_step_every_node_offers_wins_and_nearer_tiers_come_first():
    """The survivor's memory holds 12, 11, 10, the replacement's nothing: memory passes.
    In peer memory the survivor can produce 12, 11, 10, 7, 5, the replacement (from what the
    survivor holds of the lost machine) 9 and 7: both take 7, and storage (step 4) is never
    read."""
    storage = [FakeTier([4], "storage"), FakeTier([4], "storage")]
    memory = [FakeTier([10, 11, 12], "memory"), FakeTier([], "memory")]
    survivor, newcomer = FakeTier([5, 7, 10, 11, 12]), FakeTier([7, 9])
    got = decide_on_two_nodes([[memory[0], survivor, storage[0]],
                               [memory[1], newcomer, storage[1]]])
    assert got == [{"step": 7, "tier": "peer"}, {"step": 7, "tier": "peer"}]
    assert survivor.materialised == [7] and newcomer.materialised == [7]
    assert memory[0].materialised == [] and storage[0].materialised == []
    assert memory[0].settled == [7] and storage[1].settled == [7]  # every tier hears of it


def test_a_step_one_node_cannot_materialise_is_retried_older_not_given_up():
    """Both offer 9 and 7; the replacement's copy of 9 fails its checksum: both agree on 7
    in the same tier instead of falling through to storage."""
    storage = [FakeTier([4], "storage"), FakeTier([4], "storage")]
    survivor, newcomer = FakeTier([7, 9]), FakeTier([7, 9], broken=[9])
    got = decide_on_two_nodes([[survivor, storage[0]], [newcomer, storage[1]]])
    assert got == [{"step": 7, "tier": "peer"}, {"step": 7, "tier": "peer"}]
    assert survivor.materialised == [9, 7] and newcomer.materialised == [9, 7]
    assert storage[0].materialised == []


def test_no_common_step_falls_through_to_the_next_tier():
    storage = [FakeTier([4], "storage"), FakeTier([4], "storage")]
    got = decide_on_two_nodes([[FakeTier([10, 11]), storage[0]], [FakeTier([6, 8]), storage[1]]])
    assert got == [{"step": 4, "tier": "storage"}, {"step": 4, "tier": "storage"}]


def test_a_memory_step_is_marked_verified_and_served_tier_is_reported():
    """The memory tier hashed its copies with every worker stopped ("verified"); a peer
    tier whose copies were all on this machine reports "memory" as well."""
    got = decide_on_two_nodes([[FakeTier([5], "memory")], [FakeTier([5], "memory")]])
    assert got == [{"step": 5, "tier": "memory", "verified": True}] * 2
    got = decide_on_two_nodes([[FakeTier([5], "peer", served="memory")],
                               [FakeTier([5], "peer", served="peer")]])
    assert got == [{"step": 5, "tier": "memory", "verified": True}, {"step": 5, "tier": "peer"}]


def test_a_rollback_takes_exactly_its_step_or_nothing():
    got = decide_on_two_nodes([[FakeTier([5, 7, 9])], [FakeTier([7, 9])]], forced=9)
    assert got == [{"step": 9, "tier": "peer"}, {"step": 9, "tier": "peer"}]
    got = decide_on_two_nodes([[FakeTier([5, 7, 10])], [FakeTier([7, 9])]], forced=9)
    assert got == [{"step": 0}, {"step": 0}]


def test_nothing_anywhere_is_a_fresh_start():
    assert decide_on_two_nodes([[FakeTier([])], [FakeTier([3])]]) == [{"step": 0}] * 2
