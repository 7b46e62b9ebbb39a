"""Replication overhead: training throughput of a 2-machine job with and without peer copies.

The same job as the overhead section (``benchmarks/jobs/recovery_job.py``: DDP MLP, width
512, 4 layers, + AdamW, ``save()`` every step) runs on two "machines" -- two ckptrun agents
on localhost, one rank each (``benchmarks/machines.py``) -- with

* ``--replicas 1``: every machine keeps its own snapshots only (no peer copies): the
  baseline;
* ``--replicas 2``: each agent also copies its newest snapshot to the other machine in
  rounds, paced by the default ``--replication-budget 5%``: the agents measure how much a
  round slows their workers (heartbeat rate during rounds vs between them) and space the
  rounds so that training loses at most 5% (``ckptrun/tiers/peer/pacing.py``);
* the same with ``--replication-budget 20%``, to show the knob;
* ``--replication-budget off``: rounds back to back, as fast as the machine allows;
* ``--replication-budget off --replication-rate 100``: back to back, with a bandwidth cap.

Runs are interleaved (one of each per round); the slowdown is the median over rounds of
``1 - steps/s ÷ steps/s of --replicas 1`` in the same round.  The table also says how
often a snapshot got across: rounds per second from the agents' ``status.json``
(``replication_rounds``), so "every N steps" is steps/s ÷ rounds/s, and the last round's
duration and lag (newest local step − replicated step when it ended).

Two agents and two ranks share the same two cores here, and every machine's worker runs
one OpenMP thread (``benchmarks/machines.py``: one core per "machine"), so every byte
replicated costs training CPU time (copy, checksum, loopback TCP on both ends); on GPU
machines the step waits on the GPU and replication uses cores and network bandwidth that
training leaves -- the pacer then measures no slowdown and lets rounds run back to back.
The table shows what the agents measured: the share of time rounds ran (``duty``) and how
much a round slowed training while it ran.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from typing import Dict, List, Optional

from benchmarks import Context, Row, section
from benchmarks.jobrun import Outcome, interleaved_rounds, read_logs, steps_per_s
from benchmarks.machines import start_job, teardown
from benchmarks.overhead import MODEL, SKIP, state_bytes

GOAL = 0.05  # DESIGN §6: replication slows training by at most 5%
PACED_MB_S = 100.0

COLUMNS = [("case", "case", "str"), ("state_bytes", "state/rank", "bytes"),
           ("steps_per_s", "steps/s (median)", "float"), ("min", "min", "float"),
           ("max", "max", "float"), ("slowdown", "slowdown vs --replicas 1", "pct"),
           ("slowdown_min", "slowdown min", "pct"), ("slowdown_max", "slowdown max", "pct"),
           ("rounds_per_s", "rounds/s", "float"), ("steps_per_round", "steps per round", "float"),
           ("round_ms", "last round ms", "float"), ("lag_steps", "lag (steps)", "float"),
           ("duty", "share of time in rounds", "pct"),
           ("round_cost", "slowdown while a round runs (measured)", "pct"),
           ("met", "≤ 5%", "str"), ("reps", "reps", "int"), ("note", "note", "str")]

BASE = "--replicas 1 (no peer copies)"
CASES: Dict[str, dict] = {
    BASE: dict(args=["--replicas", "1"]),
    "--replicas 2 (default: --replication-budget 5%)": dict(args=["--replicas", "2"]),
    "--replicas 2 --replication-budget 20%": dict(
        args=["--replicas", "2", "--replication-budget", "20%"]),
    "--replicas 2 --replication-budget off (unpaced)": dict(
        args=["--replicas", "2", "--replication-budget", "off"]),
    f"--replicas 2 --replication-budget off --replication-rate {PACED_MB_S:g}": dict(
        args=["--replicas", "2", "--replication-budget", "off", "--replication-rate",
              f"{PACED_MB_S:g}"]),
}


def one_run(case: dict, steps: int, root: str) -> Dict[str, object]:
    """One 2-machine launch of ``case``: throughput and the agents' replication figures."""
    work = tempfile.mkdtemp(prefix="replov-", dir=root)
    machines = []
    try:
        job = ["--ckpt", "ckptrun", "--steps", str(steps), *MODEL]
        env = {"CKPTRUN_WARM_SPARES": "0", **case.get("env", {})}
        machines = start_job(work, 2, ["--max-restarts", "0", *case["args"]], job, env,
                             private_shm=False)
        deadline = time.monotonic() + 240.0
        while any(m.alive() for m in machines) and time.monotonic() < deadline:
            time.sleep(0.1)
        timed_out = any(m.alive() for m in machines)
        for m in machines:
            m.stop()
        out = Outcome(max((m.proc.returncode or 0) for m in machines), 0.0,
                      read_logs(f"{work}/steps"), [], [], timed_out,
                      "\n".join(m.tail(300) for m in machines))
        rate = steps_per_s(out, 0, SKIP)
        finished = any(r["event"] == "done" for r in out.logs.get((0, 0), []))
        if rate is None or not finished or len(machines) < 2:
            return {"error": f"rc={out.rc} timed_out={timed_out}: {out.tail[-400:]}"}
        sample: Dict[str, object] = {"steps_per_s": rate, "shm_left": sum(
            len(m.shm_left()) for m in machines)}
        steps_log = [r for r in out.logs.get((0, 0), []) if r["event"] == "step"]
        wall = steps_log[-1]["time"] - steps_log[0]["time"] if len(steps_log) > 1 else 0.0
        stats = [m.status().get("checkpoint", {}) for m in machines]
        rounds = [s.get("replication_rounds") for s in stats if s.get("replication_rounds")]
        if rounds and wall > 0:
            sample["rounds_per_s"] = statistics.mean(rounds) / wall
            sample["round_ms"] = statistics.mean(
                float(s["replication_round_s"]) * 1e3 for s in stats
                if s.get("replication_round_s") is not None)
            for key, src in (("duty", "replication_duty"), ("round_cost", "replication_slowdown")):
                vals = [float(s[src]) for s in stats if s.get(src) is not None]
                if vals:
                    sample[key] = statistics.mean(vals)
            lags = [float(s["replication_lag_steps"]) for s in stats
                    if s.get("replication_lag_steps") is not None]
            if lags:
                sample["lag_steps"] = statistics.mean(lags)
        return sample
    finally:
        teardown(machines, work)


def _median(samples: List[Dict[str, object]], key: str) -> Optional[float]:
    vals = [float(s[key]) for s in samples if s.get(key) is not None]  # type: ignore[arg-type]
    return statistics.median(vals) if vals else None


@section("replication_overhead",
         "Replication overhead: 2 machines × 1 rank, training throughput with peer copies vs "
         "without", COLUMNS,
         note="two agents on localhost sharing the machine's cores; slowdown = median over "
              "interleaved rounds of 1 − steps/s ÷ steps/s with --replicas 1 in the same "
              "round; goal (DESIGN §6) ≤ 5%")
def replication_overhead(ctx: Context) -> List[Row]:
    steps = int(ctx.options.get("overhead_steps") or (80 if ctx.quick else 400))
    reps = int(ctx.options.get("launch_reps") or (1 if ctx.quick else ctx.reps))
    cases = dict(CASES)
    if ctx.quick:  # the other budgets and the rate cap only in full runs
        cases = {k: v for i, (k, v) in enumerate(CASES.items()) if i < 2}
    root = tempfile.mkdtemp(prefix="ckptrun-bench-replov-", dir=ctx.tmpdir)
    try:
        samples = interleaved_rounds(list(cases), reps, ctx.time_budget_s,
                                     lambda _rnd, name: one_run(cases[name], steps, root))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rows: List[Row] = []
    for name in cases:
        good = [s for s in samples[name] if "error" not in s]
        bad = [str(s["error"]) for s in samples[name] if "error" in s]
        row: Row = {"case": name, "state_bytes": state_bytes(), "reps": len(good),
                    "steps": steps}
        notes = [f"{len(bad)} run(s) failed: {bad[0][:200]}"] if bad else []
        if good:
            rates = [float(s["steps_per_s"]) for s in good]  # type: ignore[arg-type]
            row.update(steps_per_s=statistics.median(rates), min=min(rates), max=max(rates))
            for key in ("rounds_per_s", "round_ms", "lag_steps", "duty", "round_cost"):
                value = _median(good, key)
                if value is not None:
                    row[key] = value
            if row.get("rounds_per_s"):
                row["steps_per_round"] = float(row["steps_per_s"]) / float(row["rounds_per_s"])
            if any(s.get("shm_left") for s in good):
                notes.append("ckptrun left /dev/shm files behind (removed by the harness)")
        elif name != BASE:
            notes.append("no run completed")
        row["note"] = "; ".join(notes)
        rows.append(row)
    base = samples[BASE]
    for row, name in zip(rows[1:], list(cases)[1:]):
        pairs = [1.0 - float(s["steps_per_s"]) / float(b["steps_per_s"])  # type: ignore[arg-type]
                 for s, b in zip(samples[name], base) if "error" not in s and "error" not in b]
        if pairs:
            row.update(slowdown=statistics.median(pairs), slowdown_min=min(pairs),
                       slowdown_max=max(pairs))
            row["met"] = "yes" if float(row["slowdown"]) <= GOAL else "no"
    return rows
