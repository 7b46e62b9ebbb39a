"""Overhead: training throughput with ckptrun's per-step snapshots vs no checkpointing.

The same job (``benchmarks/jobs/recovery_job.py``: a 4-layer MLP + AdamW under DDP, gloo,
2 ranks) runs under the ``ckptrun`` launcher in every case; only what it checkpoints
differs:

* ``no checkpointing`` -- ``--ckpt none`` (no ``Checkpointer`` at all);
* ``ckptrun save() every step`` -- ``Checkpointer.save`` after every step (memory tier);
* ``... + persist every N steps`` -- the same, and the agent persists every N steps
  (``--persist-every N``, DCP through fsspec to the run directory).

* ``--snapshot-every auto`` -- ``save()`` every step, the launcher's adaptive interval
  (``ckptrun.worker.interval``): every step while that costs <= 3%, else every k-th step;
* ``save() on/off in alternate blocks`` -- one run whose steps alternate in blocks of
  ``ALTERNATE``: without ``save()``, then with it; the slowdown is the median over
  adjacent (off, on) pairs -- both blocks of a pair see the same machine load, which on a
  shared machine makes this the steadiest of the ratios.

Throughput is rank 0's steps/s after ``SKIP`` warm-up steps.  Runs are interleaved
(one of each per round).  Warm spares are disabled here (``CKPTRUN_WARM_SPARES=0``): an
idle spare costs no CPU once it has imported torch, but its import would land inside the
measuring window of these short runs.  The table also shows where a step's time goes:
``optimizer.step()`` (which waits for the previous background copy) and ``save()``.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
from typing import Dict, List

from benchmarks import Context, Row, section
from benchmarks.jobrun import Launch, Outcome, interleaved_rounds, launch, steps_per_s

SKIP = 15
PERSIST_EVERY = 20
GOAL = 0.10  # DESIGN/issue: <= 10% slower (then <= 3%)

COLUMNS = [("case", "case", "str"), ("state_bytes", "state/rank", "bytes"),
           ("steps_per_s", "steps/s (median)", "float"), ("min", "min", "float"),
           ("max", "max", "float"), ("slowdown", "slowdown vs none", "pct"),
           ("slowdown_min", "slowdown min", "pct"), ("slowdown_max", "slowdown max", "pct"),
           ("opt_ms", "optimizer.step() ms", "float"), ("save_ms", "save() ms", "float"),
           ("met", "≤ 10%", "str"), ("reps", "reps", "int"), ("note", "note", "str")]

MODEL = ["--hidden", "512", "--layers", "4", "--batch", "64", "--state-mb", "0"]

ALTERNATE = 10
ALT_CASE = "ckptrun save() on/off in alternate blocks of one run"
AUTO_CASE = "ckptrun save() every step, --snapshot-every auto (3% budget)"

CASES: Dict[str, dict] = {
    "no checkpointing": dict(ckpt="none", args=[]),
    "ckptrun save() every step": dict(ckpt="ckptrun", args=[]),
    f"ckptrun save() every step + persist every {PERSIST_EVERY}":
        dict(ckpt="ckptrun", args=["--persist-every", str(PERSIST_EVERY)]),
    ALT_CASE: dict(ckpt="ckptrun", args=[], job=["--alternate", str(ALTERNATE)]),
    AUTO_CASE: dict(ckpt="ckptrun", args=["--snapshot-every", "auto"]),
}


def block_slowdowns(out: Outcome, skip: int = SKIP) -> List[float]:
    """1 - rate(on block) / rate(preceding off block), for each pair of blocks of rank 0.

    Adjacent blocks share whatever load the machine had at that moment, so their ratio
    is far steadier than one between runs minutes apart.
    """
    recs = [r for r in out.logs.get((0, 0), []) if r["event"] == "step" and "saving" in r]
    blocks: List[tuple] = []  # (saving, first time, last time, steps)
    for r in recs[skip:]:
        if blocks and blocks[-1][0] == r["saving"]:
            b = blocks[-1]
            blocks[-1] = (b[0], b[1], r["time"], b[3] + 1)
        else:
            blocks.append((r["saving"], r["time"], r["time"], 1))
    rate = [(b[0], (b[3] - 1) / (b[2] - b[1])) for b in blocks if b[3] > 2 and b[2] > b[1]]
    return [1.0 - on / off for (s0, off), (s1, on) in zip(rate, rate[1:]) if not s0 and s1]


def state_bytes() -> int:
    """Model + AdamW (2 moments) of the MLP above, in bytes (what every save copies)."""
    hidden, layers = 512, 4
    params = 32 * hidden + hidden + (layers - 1) * (hidden * hidden + hidden) + hidden + 1
    return 3 * params * 4


def _timing_ms(out: Outcome, key: str) -> float:
    recs = [r for r in out.logs.get((0, 0), []) if r["event"] == "step" and key in r][SKIP:]
    return statistics.median(float(r[key]) for r in recs) * 1e3 if recs else float("nan")


def one_run(case: dict, steps: int, root: str) -> Dict[str, float]:
    """One launch of ``case``: throughput, step-time split, block pairs, persist count."""
    work = tempfile.mkdtemp(prefix="overhead-", dir=root)
    try:
        spec = Launch("ckptrun", ["--ckpt", case["ckpt"], "--steps", str(steps), *MODEL,
                                  *case.get("job", [])],
                      launcher_args=list(case["args"]), env={"CKPTRUN_WARM_SPARES": "0"},
                      max_restarts=0)
        out = launch(spec, work, timeout_s=180.0)
        rate = steps_per_s(out, 0, SKIP)
        finished = any(r["event"] == "done" for r in out.logs.get((0, 0), []))
        if rate is None or not (out.rc == 0 or finished):
            return {"error": f"rc={out.rc} timed_out={out.timed_out}: {out.tail[-300:]}"}  # type: ignore[dict-item]
        persisted = sum(1 for e in out.events if e.get("event") == "persisted")
        every = [e["every"] for e in out.events if e.get("event") == "snapshot_interval"]
        pairs = block_slowdowns(out) if case.get("job") else []
        if out.rc != 0:  # all steps done, then the job failed on the way out: keep, say so
            print(f"overhead: job exited {out.rc} after its last step: {out.tail[-200:]}")
        return {"steps_per_s": rate, "pairs": pairs, "exit_rc": out.rc,  # type: ignore[dict-item]
                "opt_ms": _timing_ms(out, "opt_s"), "save_ms": _timing_ms(out, "save_s"), "persisted": persisted,
                "shm_left": len(out.shm_left), "every": every[-1] if every else None}
    finally:
        shutil.rmtree(work, ignore_errors=True)


@section("overhead", "Overhead: training throughput under ckptrun, per-step snapshots vs none",
         COLUMNS, note="same script and launcher; slowdown = 1 − steps/s ÷ steps/s without "
                       "checkpointing (medians over interleaved rounds)")
def overhead(ctx: Context) -> List[Row]:
    steps = int(ctx.options.get("overhead_steps") or (120 if ctx.quick else 400))
    reps = int(ctx.options.get("launch_reps") or (1 if ctx.quick else ctx.reps))
    root = tempfile.mkdtemp(prefix="ckptrun-bench-overhead-", dir=ctx.tmpdir)
    try:
        samples = interleaved_rounds(list(CASES), reps, ctx.time_budget_s,
                                     lambda _rnd, name: one_run(CASES[name], steps, root))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rows: List[Row] = []
    for name, case in CASES.items():
        good = [s for s in samples[name] if "error" not in s]
        row: Row = {"case": name, "state_bytes": 0 if case["ckpt"] == "none" else state_bytes(),
                    "reps": len(good), "steps": steps}
        bad = [s["error"] for s in samples[name] if "error" in s]
        notes = [f"{len(bad)} run(s) failed: {str(bad[0])[:200]}"] if bad else []
        if good:
            rates = [s["steps_per_s"] for s in good]
            row.update(steps_per_s=statistics.median(rates), min=min(rates), max=max(rates),
                       opt_ms=statistics.median(s["opt_ms"] for s in good),
                       save_ms=statistics.median(s["save_ms"] for s in good))
            pairs = [x for s in good for x in s["pairs"]]  # type: ignore[union-attr]
            if pairs:
                row.update(slowdown=statistics.median(pairs), slowdown_min=min(pairs),
                           slowdown_max=max(pairs), pairs=len(pairs))
                notes.append(f"slowdown = median over {len(pairs)} adjacent off/on block pairs "
                             f"of {ALTERNATE} steps (min {min(pairs) * 100:.1f}%, max "
                             f"{max(pairs) * 100:.1f}%); steps/s is the whole run's")
            if "--persist-every" in case["args"]:
                persisted = statistics.median(s["persisted"] for s in good)
                notes.append(f"{persisted:.0f} `persisted` events per run of {steps} steps")
                if not persisted:
                    row["persist_missing"] = True
                    notes.append("the agent persisted nothing: this row measures the same "
                                 "as the one above (see docs/performance.md)")
            chosen = [s["every"] for s in good if s.get("every")]
            if chosen:
                row["every"] = max(chosen)
                notes.append("snapshot interval chosen: every " + "/".join(map(str, chosen))
                             + " steps (one per run)")
            bad_exit = sum(1 for s in good if s.get("exit_rc"))
            if bad_exit:
                notes.append(f"{bad_exit} run(s) exited non-zero after their last step")
            if any(s["shm_left"] for s in good):
                notes.append("ckptrun left /dev/shm files behind (removed by the harness)")
        row["note"] = "; ".join(notes)
        rows.append(row)
    base = rows[0].get("steps_per_s")
    for row in rows[1:]:
        if row.get("pairs"):
            row["met"] = "yes" if float(row["slowdown"]) <= GOAL else "no"
        elif base and row.get("steps_per_s"):
            row["slowdown"] = 1.0 - float(row["steps_per_s"]) / float(base)
            row["met"] = "yes" if float(row["slowdown"]) <= GOAL else "no"
            if row.get("persist_missing"):
                row["met"] = "n/a"
    return rows
