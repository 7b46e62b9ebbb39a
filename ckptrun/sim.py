"""Goodput model: how much of a cluster's time is useful training, with and without ckptrun.

GEMINI (SOSP 2023, section 2) charges every failure

    T_wasted = t_ckpt + 1/(2f) + t_rtvl            with 1/f >= max(t_ckpt, T_iter)

(the checkpoint being written when the failure hits is useless, half a checkpoint interval
of progress is lost on average because failures are uniform in time, and the checkpoint
must be read back).  We add the restart overhead ``restart_s`` (detect, stop, restart,
warm up), which the paper measures separately and which dominates once checkpoints live
in memory.

Two policies are compared on the same cluster:

* **ckptrun** -- a snapshot every iteration into local memory, replicated to ``m-1``
  peers (GEMINI placement).  A failure is served from CPU memory unless the failures that
  hit during the recovery window wipe out a whole placement group (probability from
  :mod:`ckptrun.tiers.peer.placement`); then every machine falls back to the last durable copy,
  written every ``persist_interval_s``.
* **storage-only** -- checkpoints go straight to storage as often as its bandwidth allows
  (the paper's "HighFreq"), or every ``storage_interval_s`` (e.g. 3 h, "Strawman").

The effective training time ratio is ``(1 - overhead) * (1 - failures/day * E[T_wasted] /
1 day)``, where ``overhead`` is the fraction of iteration time training is blocked by
checkpoint stalls.  All inputs are plain numbers -- feed them from measurements
(``python -m benchmarks``) or from the user; nothing here is a hidden constant except
the seconds in a day.
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass, field, replace
from typing import Dict, Iterable, List, Optional

from ckptrun.tiers.peer.placement import (
    effective_replicas,
    placement,
    recoverable,
    recovery_probability,
)

DAY_S = 86_400.0


@dataclass(frozen=True)
class ClusterInputs:
    """Everything the model needs, per machine unless stated otherwise (bytes, seconds)."""

    machines: int
    iteration_s: float
    state_bytes: float  # training state held by one machine
    snapshot_bytes_per_s: float  # copy into local CPU memory (memcpy into shm)
    network_bytes_per_s: float  # one machine's share of the network, for replicas/fetches
    storage_bytes_per_s: float  # durable storage write/read bandwidth
    storage_shared: bool = True  # True: the bandwidth above is shared by all machines
    failure_rate_per_day: float = 0.015  # probability a machine fails on a given day
    replicas: int = 2  # GEMINI's m, the machine's own copy included
    restart_s: float = 0.0  # detection + stop + restart + warm-up, per failure
    snapshot_stall_s: Optional[float] = None  # training blocked per save; None: whole copy
    storage_stall_s: Optional[float] = None  # training blocked per storage save; None: same
    persist_interval_s: float = 600.0  # ckptrun's durable fallback cadence (--persist-every)
    storage_interval_s: Optional[float] = None  # storage-only cadence; None: as fast as possible
    memory_ckpt_s: Optional[float] = None  # override: time to complete one memory checkpoint
    memory_retrieval_s: Optional[float] = None  # override: time to load it back

    def with_machines(self, n: int) -> ClusterInputs:
        return replace(self, machines=n)


@dataclass
class PolicyResult:
    """One policy's numbers; ratios are in 0..1, times in seconds."""

    name: str
    checkpoint_s: float
    interval_s: float
    retrieval_s: float
    wasted_per_failure_s: float
    overhead_fraction: float
    memory_recovery_probability: float
    failures_per_day: float
    effective_ratio: float


@dataclass
class GoodputResult:
    machines: int
    ckptrun: PolicyResult
    storage_only: PolicyResult
    extra: Dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


# --------------------------------------------------------------------------- pieces


def wasted_per_failure(checkpoint_s: float, interval_s: float, retrieval_s: float,
                       restart_s: float = 0.0) -> float:
    """GEMINI's ``t_ckpt + 1/(2f) + t_rtvl`` plus the restart overhead."""
    return checkpoint_s + interval_s / 2.0 + retrieval_s + restart_s


def storage_transfer_s(inp: ClusterInputs) -> float:
    """Seconds to write (or read) every machine's state to durable storage."""
    total = inp.state_bytes * (inp.machines if inp.storage_shared else 1)
    return total / inp.storage_bytes_per_s


def memory_checkpoint_s(inp: ClusterInputs) -> float:
    """Seconds from the start of a snapshot until its ``m-1`` peer copies are complete."""
    if inp.memory_ckpt_s is not None:
        return inp.memory_ckpt_s
    peers = effective_replicas(inp.machines, inp.replicas) - 1
    return inp.state_bytes / inp.snapshot_bytes_per_s + peers * inp.state_bytes / inp.network_bytes_per_s


def memory_retrieval_s(inp: ClusterInputs) -> float:
    """Seconds to get a lost machine's state back from a peer's memory."""
    if inp.memory_retrieval_s is not None:
        return inp.memory_retrieval_s
    return inp.state_bytes / inp.network_bytes_per_s


def failures_per_day(inp: ClusterInputs) -> float:
    """Expected machine failures per day; each one stops the whole synchronous job."""
    return inp.machines * inp.failure_rate_per_day


def memory_recovery_odds(inp: ClusterInputs, window_s: float) -> float:
    """Probability a failure is served from CPU memory.

    The first failure is always covered (``m >= 2``); more failures arriving within
    ``window_s`` (until the replicas are re-established) are Poisson, and ``k`` failures
    together are survivable with :func:`ckptrun.tiers.peer.placement.recovery_probability`.
    """
    n, m = inp.machines, effective_replicas(inp.machines, inp.replicas)
    if m < 2:
        return 0.0
    lam = (n - 1) * inp.failure_rate_per_day * window_s / DAY_S
    total = 0.0
    weight = math.exp(-lam)
    for extra in range(0, n):
        k = extra + 1
        if k >= m:
            total += weight * float(recovery_probability(n, m, k))
        else:
            total += weight
        weight *= lam / (extra + 1)
        if weight < 1e-15:
            break
    return min(1.0, total)


# --------------------------------------------------------------------------- policies


def _ratio(overhead: float, fpd: float, wasted: float) -> float:
    return max(0.0, (1.0 - overhead) * (1.0 - fpd * wasted / DAY_S))


def storage_only(inp: ClusterInputs) -> PolicyResult:
    """Checkpoints straight to durable storage; bandwidth bounds the frequency."""
    t_ckpt = storage_transfer_s(inp)
    interval = max(t_ckpt, inp.iteration_s, inp.storage_interval_s or 0.0)
    t_rtvl = storage_transfer_s(inp)
    stall = inp.storage_stall_s
    if stall is None:
        stall = inp.snapshot_stall_s if inp.snapshot_stall_s is not None else (
            inp.state_bytes / inp.snapshot_bytes_per_s)
    overhead = min(1.0, stall / interval)
    wasted = wasted_per_failure(t_ckpt, interval, t_rtvl, inp.restart_s)
    fpd = failures_per_day(inp)
    return PolicyResult("storage-only", t_ckpt, interval, t_rtvl, wasted, overhead, 0.0, fpd,
                        _ratio(overhead, fpd, wasted))


def ckptrun_policy(inp: ClusterInputs) -> PolicyResult:
    """Per-iteration memory checkpoints with GEMINI placement and a durable fallback."""
    t_ckpt = memory_checkpoint_s(inp)
    interval = max(t_ckpt, inp.iteration_s)
    t_rtvl = memory_retrieval_s(inp)
    w_mem = wasted_per_failure(t_ckpt, interval, t_rtvl, inp.restart_s)
    t_store = storage_transfer_s(inp)
    w_store = wasted_per_failure(t_store, max(inp.persist_interval_s, t_store), t_store, inp.restart_s)
    p_mem = memory_recovery_odds(inp, window_s=inp.restart_s + t_rtvl + t_ckpt)
    wasted = p_mem * w_mem + (1.0 - p_mem) * w_store
    stall = inp.snapshot_stall_s
    if stall is None:
        stall = inp.state_bytes / inp.snapshot_bytes_per_s
    overhead = min(1.0, stall / inp.iteration_s)
    fpd = failures_per_day(inp)
    return PolicyResult("ckptrun", t_ckpt, interval, t_rtvl, wasted, overhead, p_mem, fpd,
                        _ratio(overhead, fpd, wasted))


def goodput(inp: ClusterInputs) -> GoodputResult:
    """Both policies for one cluster."""
    return GoodputResult(inp.machines, ckptrun_policy(inp), storage_only(inp))


def projection(inp: ClusterInputs, sizes: Iterable[int] = (16, 64, 256, 1000, 4096, 10_000)) -> List[GoodputResult]:
    """:func:`goodput` for each cluster size, all else equal."""
    return [goodput(inp.with_machines(n)) for n in sizes]


def paper_reference_inputs() -> ClusterInputs:
    """GEMINI's scalability point: 1,000 instances, 1.5% failure rate per instance per day.

    The paper's simulation reuses its measured GPT-2 100B recovery on p4d.24xlarge; the
    inputs below are that breakdown (loading from CPU memory < 3 s, serialising with
    ``torch.save`` 162 s, restart warm-up "over 4 minutes", taken as 4.5 min) plus what
    the hardware gives (400 Gbps EFA, 20 Gbps FSx shared, 1.2 TB of Adam state over 16
    machines).  The iteration time of ~30 s is our assumption, not a number from the
    paper: the result moves by about +-0.01 for 10..60 s.  GEMINI spreads each
    iteration's checkpoint traffic over the idle gaps of the next iteration, so a memory
    checkpoint completes one iteration after it starts (``memory_ckpt_s = iteration_s``).
    """
    gbps = 1e9 / 8
    iteration_s = 30.0
    return ClusterInputs(
        machines=1000,
        iteration_s=iteration_s,
        state_bytes=100e9 * 12 / 16,
        snapshot_bytes_per_s=400 * gbps,  # GPU -> CPU not the bottleneck in their setup
        network_bytes_per_s=400 * gbps,
        storage_bytes_per_s=20 * gbps,
        storage_shared=True,
        failure_rate_per_day=0.015,
        replicas=2,
        restart_s=4.5 * 60,
        snapshot_stall_s=0.0,  # GEMINI interleaves checkpoint traffic with training
        storage_stall_s=0.0,
        persist_interval_s=3 * 3600,  # durable copies every 3 h, as their Strawman
        memory_ckpt_s=iteration_s,
        memory_retrieval_s=3.0 + 162.0,
    )


# --------------------------------------------------------------------------- restart costs


@dataclass(frozen=True)
class RestartCosts:
    """What a recovery costs besides the state itself, in seconds per failure.

    Measured on this project's machine (no GPU): ``detect_s`` (the ``recovered`` event's
    detection of a dead rank, ~0.02-0.05 s), ``process_s`` (a cold ``import torch`` and the
    interpreter, 2-3 s on 2 cores).  The others are public figures, there to be overridden
    with a cluster's own numbers (``benchmarks/goodput.py`` takes them as options):

    * ``cuda_context_s`` -- a CUDA context per process, 1-4 s (the figure issue 16 quotes);
      measured on an H200 (torch 2.11, CUDA 13): 0.16 s for the context and a first kernel
      (``benchmarks/results/cuda-h200.json``) -- a real model's first step adds its
      libraries' handles; 2 s stays the default, for a cluster to override;
    * ``comm_init_s`` -- an NCCL communicator: tens of seconds on one node, and ~265 s cold
      at 96k GPUs (Si et al., "Collective Communication for 100k+ GPUs", Meta,
      arXiv:2510.20171, 2025), whose init phases grow super-linearly with the job;
    * ``compile_s`` -- ``torch.compile`` in a new process with a warm cache: 30-40 s for
      gpt-fast (pytorch-labs/gpt-fast issue 43, a compiler maintainer's figure), 5-20 s with
      a persisted artifact cache (Baseten's torch-compile-cache documentation);
    * ``setup_s`` -- the script's own start-up (tokenizer, dataset index, data-loader
      workers); ``node_start_s`` -- a replacement machine (node or pod start, scheduling);
    * ``partition_detect_s`` -- a machine that vanishes without closing its connections
      (power, kernel panic, partition) is seen by the heartbeat timeout
      (``CKPTRUN_NODE_TIMEOUT``, 5 s); an agent process that dies (OOM killer, crash, the
      machine rebooted cleanly) is seen at once from its broken links, as ``detect_s``;
    * ``transfer_s`` -- state a standby machine does not hold yet (it holds every machine's
      newest round copy by default: ``ckptrun.tiers.peer.standby_copies``).

    For scale: standby machines bring a machine loss to ~20 s at 1,024 GPUs in TrainMover
    (Lao et al., OSDI '26, arXiv:2412.12636); the GEMINI paper measured restart warm-up above
    4 minutes; Meta reports a mean time to failure of 7.9 h at 1,024 GPUs ("Revisiting
    Reliability in Large-Scale ML Research Clusters").
    """

    detect_s: float = 0.05
    process_s: float = 2.5
    cuda_context_s: float = 2.0
    comm_init_s: float = 10.0
    compile_s: float = 20.0
    setup_s: float = 10.0
    node_start_s: float = 300.0
    partition_detect_s: float = 5.0
    transfer_s: float = 0.0


RECOVERY_MODES = ("restart (cold)", "restart + warm spares", "in-process",
                  "in-process + hot spares", "standby machine")


def recovery_downtime(costs: RestartCosts, mode: str, machine_lost: bool = False
                      ) -> Dict[str, float]:
    """The downtime of one failure under ``mode`` (one of :data:`RECOVERY_MODES`), by part.

    Ranks restart in parallel, so a recovery costs what the slowest restarted process pays,
    and the group waits for its replacement whatever the survivors do: in-process recovery
    on its own saves the survivors' work, not the downtime -- the replacement still starts.
    What shortens it is a replacement that has paid its start-up already (a warm spare: the
    interpreter and torch; a hot spare: the script's start-up too, and a CUDA context if the
    start-up made one) and, for a lost machine, one that is already up (a standby machine).
    Every mode re-forms the communicator (``comm_init_s``) and the replacement compiles.
    """
    if mode not in RECOVERY_MODES:
        raise ValueError(f"unknown recovery mode {mode!r}; one of {', '.join(RECOVERY_MODES)}")
    c = costs
    parts: Dict[str, float] = {"detect": c.partition_detect_s if machine_lost else c.detect_s}
    if machine_lost and mode != "standby machine":
        parts["machine"] = c.node_start_s  # a new machine comes up first
    if mode == "restart (cold)" or (machine_lost and mode != "standby machine"):
        parts["process"] = c.process_s  # a new machine has no warm spares yet
    if mode in ("restart (cold)", "restart + warm spares", "in-process") or (
            machine_lost and mode != "standby machine"):
        parts["cuda"] = c.cuda_context_s
        parts["setup"] = c.setup_s
    if mode == "standby machine":
        parts["transfer"] = c.transfer_s
    parts["comm_init"] = c.comm_init_s
    parts["compile"] = c.compile_s
    return parts


def goodput_by_mode(inp: ClusterInputs, costs: RestartCosts,
                    machine_loss_share: float = 0.5) -> Dict[str, Dict[str, float]]:
    """For each recovery mode: the mean downtime per failure (``machine_loss_share`` of the
    failures lose their machine, the others one process) and ckptrun's effective training
    time ratio with it as the restart overhead."""
    out: Dict[str, Dict[str, float]] = {}
    for mode in RECOVERY_MODES:
        proc = sum(recovery_downtime(costs, mode, machine_lost=False).values())
        mach = sum(recovery_downtime(costs, mode, machine_lost=True).values())
        down = (1.0 - machine_loss_share) * proc + machine_loss_share * mach
        res = ckptrun_policy(replace(inp, restart_s=down))
        out[mode] = {"process_failure_s": proc, "machine_loss_s": mach, "downtime_s": down,
                     "effective_ratio": res.effective_ratio}
    return out


def storage_break_even(inp: ClusterInputs, hi_bytes_per_s: float = 1e12) -> Optional[float]:
    """The storage bandwidth *per machine* (a store that grows with the cluster) at which
    checkpointing only to storage, as often as it allows, reaches ckptrun's effective
    ratio; None when even ``hi_bytes_per_s`` does not."""
    target = ckptrun_policy(inp).effective_ratio

    def ratio(bw: float) -> float:
        return storage_only(replace(inp, storage_shared=False, storage_bytes_per_s=bw)
                            ).effective_ratio

    if ratio(hi_bytes_per_s) < target:
        return None
    lo, hi = 1e3, hi_bytes_per_s
    for _ in range(80):  # bisection on a log scale: monotone in the bandwidth
        mid = math.sqrt(lo * hi)
        if ratio(mid) >= target:
            hi = mid
        else:
            lo = mid
    return hi


# --------------------------------------------------------------------------- Monte Carlo


def monte_carlo_recovery(n: int, m: int, k: int, trials: int = 20_000, seed: int = 0) -> float:
    """Fraction of ``trials`` random ``k``-failure sets that lose no state (mixed placement)."""
    rng = random.Random(seed)
    holders = placement(n, m)
    good = sum(recoverable(holders, rng.sample(range(n), k)) for _ in range(trials))
    return good / trials


def monte_carlo_wasted(checkpoint_s: float, interval_s: float, retrieval_s: float,
                       restart_s: float = 0.0, trials: int = 20_000, seed: int = 0) -> float:
    """Average wasted time when a failure hits uniformly in time.

    Checkpoints start every ``interval_s`` and become usable ``checkpoint_s`` later; the
    failure loses everything since the start of the newest usable one.  Checks the
    closed form of :func:`wasted_per_failure` independently.
    """
    if interval_s < checkpoint_s:
        raise ValueError("a checkpoint cannot start before the previous one completes")
    rng = random.Random(seed)
    horizon = interval_s * 1000
    total = 0.0
    for _ in range(trials):
        t = rng.uniform(interval_s * 2, horizon)  # away from the start: a checkpoint exists
        newest_start = math.floor(t / interval_s) * interval_s
        if t - newest_start < checkpoint_s:  # still being written: use the previous one
            newest_start -= interval_s
        total += t - newest_start + retrieval_s + restart_s
    return total / trials
