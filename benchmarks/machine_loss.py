"""Machine loss: a whole machine dies and a replacement running the same command takes over.

Two machines (``benchmarks/machines.py``: two ckptrun agents on localhost, one rank each,
``--replicas 2``; with root, each in its own mount namespace with a private ``/dev/shm``)
run ``benchmarks/jobs/recovery_job.py`` with ``--step-time`` padding every step (a GPU-bound
step: the CPU waits, the snapshot copy and replication overlap it), or unpadded (a CPU-bound
step: replication takes its CPU from training, and ``--replication-budget`` decides how
often a round may run).  Once both have trained 10 s (3 s with ``--quick``), have replicated
and the survivor's warm spares are up, the harness powers machine 1 off: SIGKILL
to every process of it at once (agent, workers, spares, reaper), so every byte of memory it
held is gone.  It then starts a replacement machine with the same command line (its own run
directory: a new machine has its own disk), which joins the rendezvous and pulls the lost
rank's snapshot from the survivor's memory -- or, in the ``standby`` cases, a third machine
started with ``--standby`` before the job trains (warm, waiting without ranks) takes the place and
no machine is started after it.

Per run: ``failure → first step`` until *every* rank completed a step after the restore;
``steps lost`` = last step every rank completed before the failure − step restored; which
tier served each rank (the agents' ``restored`` events); the replication lag when the
machine died (its newest step − the newest step of it the survivor held) and the last
round's duration, next to the step time -- a round longer than a step means snapshots get
across only every few steps, which is what steps lost then shows.  The loss is detected
when the survivor stops seeing the lost agent's heartbeat in the store
(``CKPTRUN_NODE_TIMEOUT``, default 5 s) or, sooner, when the survivor's link to the lost
agent breaks (``ckptrun.agent.links``): "detection" is part of the recovery time.
"""

from __future__ import annotations

import os
import random
import shutil
import statistics
import tempfile
import time
from typing import Dict, List, Optional, Tuple

from benchmarks import Context, Row, section
from benchmarks.jobrun import read_logs
from benchmarks.machines import Machine, namespace_problem, replacement, start_job, teardown
from ckptrun.tiers.peer.tier import COLD_ROUNDS

TARGET = "restored from peer memory, 0 steps lost"
COLUMNS = [("case", "case", "str"), ("failure", "failure", "str"),
           ("bytes", "state/rank", "bytes"),
           ("step_s", "step time", "s"), ("round_s", "replication round", "s"),
           ("lag_steps", "lag at failure (steps)", "float"),
           ("median_s", "failure → first step (median)", "s"), ("min_s", "min", "s"),
           ("max_s", "max", "s"), ("detect_s", "failure → loss detected", "s"),
           ("steps_lost", "steps lost (median)", "float"),
           ("steps_lost_range", "steps lost min–max", "str"), ("tiers", "tier per rank", "str"),
           ("target", "target (DESIGN §6)", "str"), ("met", "met", "str"),
           ("reps", "reps", "int"), ("note", "note", "str")]

# (state MiB per rank, padded step time s): replicating a step must fit in a step time
# (state MiB, padded step s, --replication-budget): the default budget, and for the
# CPU-bound case also "off" -- the two sides of the trade where rounds cost training
# (state MiB, padded step s, --replication-budget, who takes the place): "" a replacement
# started after the loss; "standby" a --standby machine holding every round's copies;
# "standby-pull" one holding none (CKPTRUN_STANDBY_COPIES=0) that pulls the lost rank's
# copy from the survivor at the takeover -- rounds as cheap as without a standby;
# "...inplace" the same with the job under @ckptrun.resilient: the survivor is not restarted
QUICK_CASES = [(64, 0.15, "5%", ""), (64, 0.15, "5%", "standby")]
FULL_CASES = [(64, 0.15, "5%", ""), (64, 0.15, "5%", "standby"),
              (64, 0.15, "5%", "standby-inplace"), (256, 0.5, "5%", ""),
              (256, 0.5, "5%", "standby"), (256, 0.5, "5%", "standby-pull"),
              (256, 0.5, "5%", "standby-inplace"), (256, 0.5, "5%", "inplace"),
              (64, 0.0, "5%", ""), (64, 0.0, "off", "")]
STANDBY_KINDS = ("", "standby", "standby-pull", "inplace", "standby-inplace")
_RESILIENT = ", @ckptrun.resilient (the survivor recovers in its process)"
STANDBY_LABELS = {"": "", "standby": ", a --standby machine takes the place",
                  "standby-pull": ", a --standby machine without copies "
                                  "(CKPTRUN_STANDBY_COPIES=0) takes the place",
                  "inplace": _RESILIENT,
                  "standby-inplace": ", a --standby machine takes the place" + _RESILIENT}


def _cases(ctx: Context) -> List[Tuple[int, float, str, str]]:
    opt = ctx.options.get("machine_loss_cases")
    if opt:  # "64@0.15,256@0.5,64@0@off,64@0.15@5%@standby,256@0.5@5%@standby-pull"
        cases = [(int(p[0]), float(p[1]), p[2] if len(p) > 2 else "5%",
                  p[3] if len(p) > 3 else "")
                 for p in (c.split("@") for c in str(opt).split(","))]
        for case in cases:
            if case[3] not in STANDBY_KINDS:
                raise ValueError(f"machine-loss case {case}: the fourth field is one of "
                                 f"{STANDBY_KINDS[1:]}")
        return cases
    return QUICK_CASES if ctx.quick else FULL_CASES


def _node_steps(m: Machine) -> Tuple[int, Optional[int]]:
    """(newest step of the machine's worker, newest step of it replicated) from status."""
    st = m.status()
    steps = [w.get("step") or 0 for w in st.get("workers", [])]
    return (min(steps) if steps else 0), st.get("checkpoint", {}).get("peer_step")


def _ready(machines: List[Machine], since: Optional[float], min_train_s: float,
           max_wait_s: float, standby: Optional[Machine] = None) -> bool:
    """Both machines trained ``min_train_s``, finished their cold replication rounds (the
    first ones fill new copy files page by page and take seconds: a loss then measures the
    job's first seconds, not its steady state), and the survivor's warm spares (and the
    standby's) are up (or ``max_wait_s`` passed: the sample says so)."""
    from benchmarks.recovery import spares_warm

    if since is None or time.monotonic() - since < min_train_s:
        return False
    if standby is not None and not (standby.status().get("standby")
                                    and standby.status().get("spare_pids")):
        return time.monotonic() - since > max_wait_s
    if any((m.status().get("checkpoint", {}).get("replication_rounds") or 0) <= COLD_ROUNDS
           for m in machines):
        return time.monotonic() - since > max_wait_s
    return spares_warm(machines[0].run_dir, 1) or time.monotonic() - since > max_wait_s


def run_once(mb: int, step_s: float, root: str, private_shm: bool,
             min_train_s: float = 3.0, max_wait_s: float = 60.0,
             budget: str = "5%", standby: str = "") -> Dict[str, object]:
    """One machine loss; a sample dict (``error`` says why there is none)."""
    work = tempfile.mkdtemp(prefix="machine-", dir=root)
    job = ["--ckpt", "ckptrun", "--state-mb", str(mb), "--steps", "1000000",
           "--step-time", str(step_s), *(["--in-place"] if "inplace" in standby else [])]
    has_standby = standby.startswith("standby")
    env = {"CKPTRUN_SPARE_DELAY": "0"}
    machines: List[Machine] = []
    try:
        # a standby starts before the job trains, warm before the second machine starts
        # (benchmarks.machines.start_job says why)
        machines = start_job(work, 2, ["--max-restarts", "3", "--replicas", "2",
                                       "--replication-budget", budget], job, env,
                             private_shm, names=["survivor", "lost"], standby_env={
                                 "CKPTRUN_STANDBY_COPIES":
                                     "0" if standby == "standby-pull" else "1"}
                             if has_standby else None)
        if len(machines) < 2:
            return {"error": f"the store host did not start: {machines[0].tail(400)}"}
        survivor, lost = machines[:2]
        spare = machines[2] if has_standby else None
        since, deadline = None, time.monotonic() + 240.0
        rounds: List[float] = []
        while not _ready([survivor, lost], since, min_train_s, max_wait_s, spare):
            if time.monotonic() > deadline or not all(m.alive() for m in machines):
                return {"error": "the job did not get going: " + lost.tail(400)}
            if since is None and os.path.exists(os.path.join(work, "steps",
                                                             "rank0-attempt0.jsonl")):
                since = time.monotonic()
            cp = lost.status().get("checkpoint", {})
            r = cp.get("replication_round_s")  # the warm rounds: what the lag is made of
            if r is not None and (cp.get("replication_rounds") or 0) > COLD_ROUNDS \
                    and (not rounds or rounds[-1] != r):
                rounds.append(float(r))
            time.sleep(0.1)
        # at a random phase of a round: the readiness above is seen just after a round ends,
        # where the peer's copy is as new as it gets
        last = lost.status().get("checkpoint", {}).get("replication_round_s")
        time.sleep(random.uniform(0.0, float(last or 0.0)))
        newest, held = _node_steps(lost)
        lost_node = lost.status().get("node")
        t_fail = lost.power_off()
        fresh = spare or replacement(lost, "replacement", work, job, env)
        if spare is None:
            machines.append(fresh)
        deadline = time.monotonic() + 180.0
        while (survivor.alive() or fresh.alive()) and time.monotonic() < deadline:
            time.sleep(0.1)
        logs = read_logs(os.path.join(work, "steps"))
        sample = _measure(logs, t_fail)
        if "error" in sample:
            sample["error"] = f"{sample['error']}: {fresh.tail(300)}"
            return sample
        tiers: Dict[int, str] = {}
        for m in (survivor, fresh):
            evs = m.events()
            node = next((e.get("node") for e in reversed(evs) if e["event"] == "start"), None)
            restored = [e for e in evs if e["event"] == "restored"]
            if restored and node is not None:
                tiers[int(node)] = str(restored[-1].get("tier"))
            lost_evs = [e for e in evs if e["event"] == "node_lost"]
            if lost_evs and m is survivor:
                sample["detect_s"] = float(lost_evs[0]["time"]) - t_fail
            if m is survivor:  # the ranks that went on in their own processes
                sample["in_place"] = next((e.get("in_place", []) for e in reversed(evs)
                                           if e["event"] == "restart"), [])
        if lost_node is not None:
            sample["phases"] = _lost_rank_phases(logs, int(lost_node), t_fail, fresh.events())
        sample.update(tiers=tiers, lost_node=lost_node, lag_steps=(
            newest - held if held is not None else None), round_s=(
            statistics.median(rounds) if rounds else None), bytes=mb << 20,
            private_shm=private_shm)
        return sample
    finally:
        teardown(machines, work)


def _lost_rank_phases(logs: Dict[tuple, List[dict]], rank: int, t_fail: float,
                      fresh_events: List[dict]) -> Dict[str, float]:
    """Where the lost rank's downtime went, on the machine that took it (the critical path
    when the survivors wait for it): the loss to the place taken (a standby's
    ``standby_joined``, a replacement's ``start``), to the training function's entry, to
    the process group and model built, the restore itself, and the first step."""
    recs = logs.get((rank, 1), [])
    first = {r["event"]: r for r in reversed(recs)}  # each event's first record
    taken = next((e["time"] for e in fresh_events
                  if e["event"] in ("standby_joined", "start")), None)
    steps = [r["time"] for r in recs if r["event"] == "step"]
    if taken is None or "start" not in first or "restored" not in first or not steps:
        return {}
    restored = first["restored"]
    built = restored["time"] - restored["seconds"]
    return {"taken_s": taken - t_fail, "to_function_s": first["start"]["time"] - taken,
            "group_and_model_s": built - first["start"]["time"],
            "restore_s": float(restored["seconds"]),
            "first_step_s": steps[0] - restored["time"]}


def _measure(logs: Dict[tuple, List[dict]], t_fail: float) -> Dict[str, object]:
    """Recovery time, steps lost and step time from the job's per-rank, per-attempt logs."""
    before: Dict[int, int] = {}
    times: List[float] = []
    for (rank, att), recs in logs.items():
        if att == 0:
            steps = [r for r in recs if r["event"] == "step" and r["time"] <= t_fail]
            if steps:
                before[rank] = max(int(r["step"]) for r in steps)
            if rank == 0:
                times = [float(r["time"]) for r in steps][-51:]
    restored = [int(r["step"]) for (rank, att), recs in logs.items() if att > 0
                for r in recs if r["event"] == "restored"]
    firsts: Dict[int, float] = {}
    for (rank, att), recs in sorted(logs.items()):
        for r in recs:
            if att > 0 and r["event"] == "step" and r["time"] > t_fail:
                firsts[rank] = min(firsts.get(rank, float("inf")), float(r["time"]))
    if len(before) < 2 or not restored or len(firsts) < 2:
        return {"error": f"no completed step on every rank after the restore "
                         f"(ranks stepped: {sorted(firsts)}, restored: {restored})"}
    gaps = [b - a for a, b in zip(times, times[1:])]
    fail_step, restored_step = min(before.values()), min(restored)
    return {"recovery_s": max(firsts.values()) - t_fail, "fail_step": fail_step,
            "restored_step": restored_step, "steps_lost": fail_step - restored_step,
            "step_s": statistics.median(gaps) if gaps else None}


def summarize(mb: int, step_s: float, samples: List[Dict[str, object]],
              private_shm: bool, budget: str = "5%", standby: str = "") -> Row:
    label = f"{step_s:g} s" if step_s else "unpadded"
    row: Row = {"case": f"ckptrun 2 machines × 1 rank, --replicas 2, step {label}, "
                        f"--replication-budget {budget}"
                        f"{STANDBY_LABELS[standby]}",
                "failure": "machine loss (all its processes killed)", "bytes": mb << 20,
                "target": TARGET, "reps": 0}
    good = [s for s in samples if "error" not in s]
    notes = []
    bad = [str(s["error"]) for s in samples if "error" in s]
    if bad:
        notes.append(f"{len(bad)} run(s) failed: {bad[0][:240]}")
    if good:
        rec = [float(s["recovery_s"]) for s in good]  # type: ignore[arg-type]
        lost = [int(s["steps_lost"]) for s in good]  # type: ignore[call-overload]
        row.update(reps=len(good), median_s=statistics.median(rec), min_s=min(rec),
                   max_s=max(rec), steps_lost=statistics.median(lost),
                   steps_lost_range=f"{min(lost)}–{max(lost)}", samples=good)
        for key in ("step_s", "round_s", "lag_steps", "detect_s"):
            vals = [float(s[key]) for s in good if s.get(key) is not None]  # type: ignore[arg-type]
            if vals:
                row[key] = statistics.median(vals)
        per_rank: Dict[int, set] = {}
        for s in good:
            for rank, tier in dict(s["tiers"]).items():  # type: ignore[call-overload]
                per_rank.setdefault(int(rank), set()).add(tier)
        lost_nodes = {s.get("lost_node") for s in good}
        row["tiers"] = ", ".join(
            f"rank {r}{' (lost)' if r in lost_nodes else ''}: {'/'.join(sorted(t))}"
            for r, t in sorted(per_rank.items()))
        row["met"] = "yes" if all(from_copies(s) for s in good) \
            and statistics.median(lost) == 0 else "no"
    phases = [s["phases"] for s in good if s.get("phases")]
    if phases:
        med = {k: statistics.median(float(p[k]) for p in phases) for k in phases[0]}
        notes.append("the lost rank, medians: place taken {taken_s:.2f} s after the loss, "
                     "its function entered {to_function_s:.2f} s later, process group and "
                     "model {group_and_model_s:.2f} s, restore {restore_s:.2f} s, first step "
                     "{first_step_s:.2f} s".format(**med))
    if "inplace" in standby and good:
        kept = sum(1 for s in good if s.get("in_place"))
        notes.append(f"the survivor recovered in its own process in {kept} of {len(good)} runs")
    notes.append("each machine in its own mount namespace with a private /dev/shm; the lost "
                 "one powered off (SIGKILL to all its processes)" if private_shm else
                 "machines share the host's /dev/shm (no root/unshare here); the lost one's "
                 "files go with its processes (SIGKILL to all, its reaper unlinks them)")
    row["note"] = "; ".join(notes)
    return row


def from_copies(sample: Dict) -> bool:
    """Whether the lost machine's rank restored a copy replicated from its machine: fetched
    from a peer, or (a standby's) held in the memory it took over -- not storage, not none."""
    tiers = {int(rank): tier for rank, tier in dict(sample["tiers"]).items()}  # JSON: str keys
    return tiers.get(sample.get("lost_node")) in ("peer", "memory")


@section("machine_loss", "Machine loss → a replacement machine restores from a peer's copy",
         COLUMNS, note="two agents on localhost, one rank each, --replicas 2; the lost machine "
                       "is killed whole and a replacement started with the same command (or a "
                       "--standby machine, started before, takes its place); "
                       "lag = the lost machine's newest step − the newest step of it its peer "
                       "held, when it died; medians over rounds (min/max)")
def machine_loss(ctx: Context) -> List[Row]:
    reps = int(ctx.options.get("launch_reps") or (1 if ctx.quick else ctx.reps))
    private_shm = namespace_problem() is None
    root = tempfile.mkdtemp(prefix="ckptrun-bench-machine-", dir=ctx.tmpdir)
    started = time.monotonic()
    try:
        rows = []
        for mb, step_s, budget, standby in _cases(ctx):
            samples = []
            for rnd in range(reps):
                if rnd and time.monotonic() - started > ctx.time_budget_s:
                    break
                # full runs kill a machine that has trained 10 s: the steady state
                # (the pacer has measured what rounds cost, the copies' pages are mapped),
                # which is where a machine of a long job dies; quick runs after 3 s
                samples.append(run_once(mb, step_s, root, private_shm,  # quick: < 1 min
                                        min_train_s=3.0 if ctx.quick else 10.0,
                                        max_wait_s=10.0 if ctx.quick else 60.0,
                                        budget=budget, standby=standby))
            rows.append(summarize(mb, step_s, samples, private_shm, budget, standby))
        return rows
    finally:
        shutil.rmtree(root, ignore_errors=True)
