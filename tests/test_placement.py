"""GEMINI mixed placement: structure, worked cases from the paper, exact vs enumerated odds."""

from __future__ import annotations

from fractions import Fraction

import pytest

from ckptrun.tiers.peer.placement import (
    corollary_bound,
    effective_replicas,
    groups,
    holders_of,
    peers_of,
    placement,
    recovery_probability,
    recovery_probability_enumerated,
    sources_of,
)


@pytest.mark.parametrize("n", range(1, 13))
@pytest.mark.parametrize("m", range(1, 5))
def test_every_machine_sends_and_receives_m_minus_1(n, m):
    mm = effective_replicas(n, m)
    holders = placement(n, m)
    assert len(holders) == n
    received = [0] * n
    for machine, hs in enumerate(holders):
        assert machine in hs
        assert len(hs) == len(set(hs)) == mm
        assert peers_of(machine, n, m) == [h for h in hs if h != machine]
        for h in hs:
            if h != machine:
                received[h] += 1
    assert received == [mm - 1] * n
    for machine in range(n):
        assert len(sources_of(machine, n, m)) == mm - 1


def test_groups_follow_the_paper_rule():
    assert groups(4, 2) == [[0, 1], [2, 3]]
    # m does not divide n: leftovers join the last group, which becomes a ring
    assert groups(5, 2) == [[0, 1], [2, 3, 4]]
    assert groups(7, 3) == [[0, 1, 2], [3, 4, 5, 6]]
    assert groups(3, 2) == [[0, 1, 2]]
    assert placement(5, 2) == [[0, 1], [0, 1], [2, 3], [3, 4], [2, 4]]
    assert holders_of(4, 5, 2) == [2, 4]
    assert peers_of(2, 5, 2) == [3]
    assert sources_of(2, 5, 2) == [4]


def test_single_node_and_clamping():
    assert placement(1, 2) == [[0]]
    assert peers_of(0, 1, 2) == []
    assert placement(2, 5) == [[0, 1], [0, 1]]
    with pytest.raises(ValueError):
        placement(0, 2)
    with pytest.raises(ValueError):
        holders_of(3, 3, 2)
    with pytest.raises(ValueError):
        placement(5, 2, strategy="group")


def test_paper_n4_m2_group_beats_ring():
    # Two simultaneous failures: group placement loses state only for {0,1} or {2,3}
    # (2 of 6 pairs), a ring for any adjacent pair (4 of 6).
    assert recovery_probability_enumerated(4, 2, 2, "group") == Fraction(2, 3)
    assert recovery_probability_enumerated(4, 2, 2, "ring") == Fraction(1, 3)
    assert recovery_probability(4, 2, 2, "group") == Fraction(2, 3)
    assert recovery_probability(4, 2, 2, "ring") == Fraction(1, 3)
    assert recovery_probability(4, 2, 2) == Fraction(2, 3)  # mixed == group when m | n


def test_paper_n16_m2_worked_numbers():
    p2 = recovery_probability_enumerated(16, 2, 2)
    p3 = recovery_probability_enumerated(16, 2, 3)
    assert float(p2) == pytest.approx(0.9333, abs=5e-4)
    assert float(p3) == pytest.approx(0.800, abs=5e-4)
    assert recovery_probability(16, 2, 2) == p2
    assert recovery_probability(16, 2, 3) == p3
    assert corollary_bound(16, 2, 2) == pytest.approx(float(p2))
    assert corollary_bound(16, 2, 3) == pytest.approx(float(p3))


@pytest.mark.parametrize("n", range(2, 14))
@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_counting_matches_enumeration(n, m):
    for k in range(0, n + 1):
        assert recovery_probability(n, m, k) == recovery_probability_enumerated(n, m, k), (n, m, k)
        assert recovery_probability(n, m, k, "ring") == recovery_probability_enumerated(n, m, k, "ring")


@pytest.mark.parametrize("n,m", [(8, 2), (12, 3), (12, 2), (16, 4), (18, 3)])
def test_corollary_is_exact_below_2m_and_a_lower_bound_beyond(n, m):
    for k in range(0, n + 1):
        exact = float(recovery_probability(n, m, k))
        bound = corollary_bound(n, m, k)
        if k < 2 * m:
            assert bound == pytest.approx(exact, abs=1e-12)
        assert bound <= exact + 1e-12


@pytest.mark.parametrize("n,m", [(5, 2), (7, 2), (7, 3), (11, 3), (10, 4), (13, 4)])
def test_mixed_is_within_the_papers_gap_and_beats_a_ring(n, m):
    # With k = m failures a placement loses state only when the failed set is some
    # machine's whole holder set; any placement has at least ceil(n/m) distinct holder
    # sets, so the optimum loses at least that many m-sets.  The paper bounds mixed
    # placement's gap to the optimum by (2m-3)/C(n,m).
    from math import ceil, comb

    total = comb(n, m)
    mixed_deadly = total - recovery_probability(n, m, m) * total
    assert mixed_deadly == len({tuple(h) for h in placement(n, m)})
    assert mixed_deadly - ceil(n / m) <= 2 * m - 3
    assert recovery_probability(n, m, m) >= recovery_probability(n, m, m, "ring")


def test_large_cluster_is_fast_and_sane():
    p = recovery_probability(10_000, 2, 2)
    assert float(p) == pytest.approx(1 - 5000 / comb2(10_000), rel=1e-12)
    assert 0.999 < float(recovery_probability(10_001, 3, 3)) <= 1.0
    assert recovery_probability(10_000, 2, 1) == 1


def comb2(n: int) -> int:
    return n * (n - 1) // 2
