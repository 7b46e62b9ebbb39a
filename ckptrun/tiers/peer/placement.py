"""GEMINI's mixed placement of in-memory checkpoint replicas, and its failure analysis.

GEMINI (SOSP 2023, section 4) places ``m`` copies of every machine's checkpoint in CPU
memory of ``m`` machines, its own included:

* **group placement** -- machines ``0..n-1`` are cut into ``floor(n/m)`` groups of ``m``
  consecutive machines; every member of a group holds the checkpoints of all members.
  When ``m`` divides ``n`` this is optimal: a machine's state is lost only if its whole
  group fails.
* **ring placement** -- machine ``i`` holds its own state and that of its ``m-1``
  predecessors on a ring (equivalently, it sends its state to its ``m-1`` successors).
* **mixed placement** (what GEMINI uses): group placement, except that when ``m`` does not
  divide ``n`` the leftover ``n mod m`` machines join the last group, and that last group
  (``m + n mod m`` machines) uses ring placement.  Every machine then sends and receives
  exactly ``m-1`` copies, and the recovery probability is within ``(2m-3)/C(n,m)`` of the
  optimum.

Everything here is a pure function of ``(n, m)`` so every agent of a job computes the same
answer without talking to the others.  Machines are numbered ``0..n-1`` (the node rank).
``m`` larger than ``n`` is clamped to ``n`` (a single-node job keeps only its own copy).

``recovery_probability(n, m, k)`` is the probability that ``k`` simultaneous, uniformly
random machine failures leave every machine's state in some surviving machine's memory.
It is computed exactly by counting (a generating function over the disjoint groups, fast
for ``n`` in the tens of thousands), by brute-force enumeration for small ``n``, and the
paper's corollary bound is available for comparison.
"""

from __future__ import annotations

import itertools
from fractions import Fraction
from functools import lru_cache
from math import comb
from typing import List, Sequence

STRATEGIES = ("mixed", "group", "ring")


def effective_replicas(n: int, m: int) -> int:
    """Copies actually kept: ``m`` clamped to the number of machines (at least 1)."""
    _check(n, m)
    return min(m, n)


def groups(n: int, m: int) -> List[List[int]]:
    """GEMINI's placement groups for ``n`` machines and ``m`` replicas.

    ``floor(n/m)`` groups of consecutive machines; the last one also takes the ``n mod m``
    leftover machines (it is the ring group when it is larger than ``m``).  With ``m >= n``
    there is one group of everything.
    """
    m = effective_replicas(n, m)
    g = n // m
    out = [list(range(i * m, (i + 1) * m)) for i in range(g)]
    out[-1].extend(range(g * m, n))
    return out


def placement(n: int, m: int, strategy: str = "mixed") -> List[List[int]]:
    """For each machine, the sorted machines holding its replicas (itself included).

    ``strategy``: ``"mixed"`` (GEMINI, the default), ``"group"`` (only valid when ``m``
    divides ``n``) or ``"ring"`` (one ring over all machines); the latter two exist to
    compare against.  Every list has exactly ``min(m, n)`` entries.
    """
    m = effective_replicas(n, m)
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown placement strategy {strategy!r}; use one of {STRATEGIES}")
    if strategy == "ring":
        members_list = [list(range(n))]
    else:
        if strategy == "group" and n % m:
            raise ValueError(f"group placement needs m | n (n={n}, m={m}); use 'mixed'")
        members_list = groups(n, m)
    holders: List[List[int]] = [[] for _ in range(n)]
    for members in members_list:
        size = len(members)
        for pos, machine in enumerate(members):
            # Ring within the group: holders are the machine and its m-1 successors.  For a
            # group of exactly m this is the whole group, i.e. group placement.
            holders[machine] = sorted(members[(pos + j) % size] for j in range(m))
    return holders


def holders_of(machine: int, n: int, m: int) -> List[int]:
    """Machines whose memory holds ``machine``'s snapshot, itself included (mixed placement)."""
    _check_machine(machine, n)
    return placement(n, m)[machine]


def peers_of(machine: int, n: int, m: int) -> List[int]:
    """Machines ``machine`` must send its snapshot to: its holders other than itself."""
    return [h for h in holders_of(machine, n, m) if h != machine]


def sources_of(machine: int, n: int, m: int) -> List[int]:
    """Machines whose snapshots ``machine`` keeps for them (it receives from these)."""
    _check_machine(machine, n)
    return [src for src, hs in enumerate(placement(n, m)) if machine in hs and src != machine]


# --------------------------------------------------------------------------- recovery odds


def recoverable(holders: Sequence[Sequence[int]], failed: Sequence[int]) -> bool:
    """True when every machine has at least one holder outside ``failed``."""
    dead = set(failed)
    return all(any(h not in dead for h in hs) for hs in holders)


def recovery_probability_enumerated(n: int, m: int, k: int, strategy: str = "mixed") -> Fraction:
    """Exact probability by trying all ``C(n, k)`` failure sets (use for small ``n``)."""
    _check_k(n, k)
    holders = placement(n, m, strategy)
    total = good = 0
    for failed in itertools.combinations(range(n), k):
        total += 1
        good += recoverable(holders, failed)
    return Fraction(good, total)


@lru_cache(maxsize=256)
def _ring_good_counts(size: int, window: int) -> tuple:
    """``c[j]`` = number of ``j``-subsets of a cycle of ``size`` with no ``window``
    cyclically consecutive members, i.e. failure sets of a ring group that lose nothing.

    Transfer over positions, tracking the run of failed machines at the start (to close
    the cycle) and the current run at the end.  ``size`` is below ``2*window`` in mixed
    placement, so this is tiny.
    """
    counts = [0] * (size + 1)
    if window > size:  # cannot happen after clamping, kept for safety
        return tuple(comb(size, j) for j in range(size + 1))
    # state: (prefix_run, still_in_prefix, current_run, failures) -> ways
    states = {(0, True, 0, 0): 1}
    for _ in range(size):
        nxt: dict = {}
        for (pre, in_pre, run, f), ways in states.items():
            # machine survives
            key = (pre, False, 0, f)
            nxt[key] = nxt.get(key, 0) + ways
            # machine fails
            new_run = run + 1
            if new_run >= window:
                continue
            key = (pre + 1 if in_pre else pre, in_pre, new_run, f + 1)
            nxt[key] = nxt.get(key, 0) + ways
        states = nxt
    for (pre, in_pre, run, f), ways in states.items():
        if in_pre:  # every machine failed: only possible when size < window
            continue
        if pre + run >= window:  # run wrapping around the end of the cycle
            continue
        counts[f] += ways
    return tuple(counts)


def _group_good_counts(size: int, m: int, strategy: str) -> List[int]:
    if strategy != "ring" and size == m:
        return [comb(m, j) for j in range(m)] + [0]
    return list(_ring_good_counts(size, m))


def _poly_mul(a: List[int], b: List[int], limit: int) -> List[int]:
    out = [0] * min(len(a) + len(b) - 1, limit + 1)
    for i, x in enumerate(a):
        if not x or i > limit:
            continue
        for j, y in enumerate(b):
            if i + j > limit:
                break
            out[i + j] += x * y
    return out


def recovery_probability(n: int, m: int, k: int, strategy: str = "mixed") -> Fraction:
    """Exact probability that ``k`` simultaneous random failures lose no machine's state.

    Groups are disjoint, so the number of harmless ``k``-subsets is the ``x^k`` coefficient
    of the product of per-group polynomials; identical full groups (``(1+x)^m - x^m``) are
    raised to the ``g``-th power by inclusion-exclusion, which keeps this fast for
    ``n = 10_000``.
    """
    _check_k(n, k)
    m = effective_replicas(n, m)
    if strategy == "ring":
        members_sizes = [n]
    else:
        if strategy == "group" and n % m:
            raise ValueError(f"group placement needs m | n (n={n}, m={m})")
        members_sizes = [len(g) for g in groups(n, m)]
    full = sum(1 for s in members_sizes if s == m and strategy != "ring")
    # (1+x)^m - x^m to the power `full`, coefficients up to x^k:
    #   sum_j (-1)^j C(full, j) x^(j m) (1+x)^(m (full - j))
    poly = [0] * (k + 1)
    for j in range(0, min(full, k // m) + 1):
        base = m * (full - j)
        sign = -1 if j % 2 else 1
        for i in range(0, k - j * m + 1):
            poly[j * m + i] += sign * comb(full, j) * comb(base, i)
    for s in members_sizes:
        if s == m and strategy != "ring":
            continue
        poly = _poly_mul(poly, _group_good_counts(s, m, strategy), k)
    good = poly[k] if k < len(poly) else 0
    return Fraction(good, comb(n, k))


def corollary_bound(n: int, m: int, k: int) -> float:
    """GEMINI's corollary for ``m | n``: ``1`` if ``k < m``, else
    ``max(0, 1 - n*C(n-m, k-m) / (m*C(n, k)))``.

    A union bound over the ``n/m`` groups; it equals the exact value while at most one
    group can be wiped out (``k < 2m``) and is a lower bound beyond.
    """
    _check_k(n, k)
    m = effective_replicas(n, m)
    if n % m:
        raise ValueError("the corollary covers m | n only")
    if k < m:
        return 1.0
    return max(0.0, 1.0 - n * comb(n - m, k - m) / (m * comb(n, k)))


# --------------------------------------------------------------------------- validation


def _check(n: int, m: int) -> None:
    if n < 1:
        raise ValueError(f"need at least one machine (n={n})")
    if m < 1:
        raise ValueError(f"need at least one replica (m={m})")


def _check_machine(machine: int, n: int) -> None:
    if not 0 <= machine < n:
        raise ValueError(f"machine {machine} outside 0..{n - 1}")


def _check_k(n: int, k: int) -> None:
    if not 0 <= k <= n:
        raise ValueError(f"failures k={k} outside 0..{n}")
