"""Steady-state and fixed cost at realistic state sizes: ckptrun with a snapshot every step
next to torchrun with no checkpointing, in the same run.

``benchmarks/jobs/recovery_job.py`` (2 ranks, DDP over gloo, one OpenMP thread a rank) with
its MLP sized so that the model and AdamW's two moments are 64 MiB, 256 MiB or 1 GiB per
rank -- real training state, not padding -- in three cases, interleaved round by round:

* ``torchrun, no checkpointing`` -- the baseline;
* ``torchrun, torch.save at the end`` -- the same with one ``torch.save`` a rank of the
  final state, as a torchrun script keeps what it trained: the start-up and shutdown that a
  job which keeps its result costs (ckptrun's final persist is its counterpart);
* ``torchrun, copy+hash every step (the floor)`` -- the work a snapshot at every step
  cannot avoid and nothing else (``FloorCopy`` in the job: the state copied into a
  pre-faulted buffer and hashed, overlapping the next step): on a machine whose cores the
  ranks keep busy, no per-step snapshot can cost less;
* ``ckptrun, save() every step`` -- the default: a memory snapshot after every step;
* ``ckptrun, save() on/off in blocks`` -- one run alternating blocks of steps with and
  without ``save()``; adjacent blocks see the same machine load, the steadiest ratio.

Memory the machine has not used recently is warmed before every run (``warm_memory``): on
a virtual machine the host backs guest memory lazily and takes idle memory back, so a first
touch of it ran at 0.45-0.75 GB/s here (4 GiB: 5.45 s cold, 0.55 s warm), which charged
whichever case needed the most memory -- ckptrun's three slots a rank -- with the host's
work, not its own (at 1 GiB a rank: 45 s vs 31 s for the same job, cold vs warm).  The
seconds that warming took are in the rows' ``warm_s``; ``--steady-cold`` turns it off.

Per-step cost is a slope, not a whole job's time: the median interval between rank 0's
completed steps after a warm-up, so start-up, the first steps' page faults and shutdown do
not count.  The fixed cost is the rest: the launch's wall time less steps × that step time
(start-up, rendezvous, the final persist, shutdown).  Where a step's time goes comes from
the job's own log: ``optimizer.step()`` (it waits for the previous snapshot's background
copy before it changes the weights) and ``save()`` (what it blocks the loop).
"""

from __future__ import annotations

import math
import shutil
import statistics
import tempfile
import time
from typing import Dict, List

import psutil
import torch

from benchmarks import Context, Row, section
from benchmarks.jobrun import Launch, Outcome, interleaved_rounds, launch
from benchmarks.overhead import block_slowdowns

SIZES = {"64M": 64 << 20, "256M": 256 << 20, "1G": 1 << 30}
LAYERS = 4
SKIP = 4  # warm-up steps (first-touch page faults of the slots, DDP's bucket rebuild)
ALTERNATE = 4
GOAL = 1.05  # issue: <= 1.05x torchrun's step with a snapshot every step

COLUMNS = [("size", "state/rank", "str"), ("case", "case", "str"),
           ("step_s", "step s (slope)", "float"), ("ratio", "vs torchrun", "ratio"),
           ("met", "≤ 1.05x", "str"), ("vs_floor", "vs the floor", "ratio"),
           ("fixed_s", "fixed cost s", "float"),
           ("over_s", "fixed cost over torchrun s", "float"),
           ("over_saved_s", "over torchrun + torch.save s", "float"),
           ("first_s", "launch → 1st step s", "float"),
           ("warmup_s", "warm-up steps' extra s", "float"),
           ("end_s", "last step → exit s", "float"),
           ("persist_s", "final persist s", "float"),
           ("warm_s", "memory warmed before, s", "float"),
           ("opt_ms", "optimizer.step() ms", "float"), ("save_ms", "save() ms", "float"),
           ("reps", "reps", "int"), ("note", "note", "str")]


def hidden_for(nbytes: int, layers: int = LAYERS) -> int:
    """The MLP width whose parameters and AdamW's two moments take ``nbytes`` (float32):
    12 bytes a parameter, ``layers`` square layers of the width dominating."""
    return max(64, int(math.sqrt(nbytes / 12 / layers)))


def _step_s(out: Outcome) -> float:
    """Median interval between rank 0's completed steps after the warm-up."""
    recs = [r for r in out.logs.get((0, 0), []) if r["event"] == "step"][SKIP:]
    gaps = [b["time"] - a["time"] for a, b in zip(recs, recs[1:])]
    return statistics.median(gaps) if gaps else float("nan")


def _phases(out: Outcome, step: float) -> Dict[str, float]:
    """Where the fixed cost goes (≈ first_s − step + warmup_s + end_s): the launch to rank
    0's first completed step (launcher, rendezvous, the script's start-up, one step); what
    the warm-up steps took beyond the slope (first saves: slots faulted in, DDP's layout);
    the last step to the launcher's exit (the script's teardown, the final persist,
    shutdown); and the final persist itself (ckptrun's ``persisted`` event)."""
    recs = [r for r in out.logs.get((0, 0), []) if r["event"] == "step"]
    if not recs or not out.started_at:
        return {}
    got = {"first_s": recs[0]["time"] - out.started_at,
           "end_s": out.started_at + out.wall_s - recs[-1]["time"]}
    if len(recs) > SKIP:
        got["warmup_s"] = recs[SKIP]["time"] - recs[0]["time"] - SKIP * step
    persisted = [e for e in out.events if e.get("event") == "persisted"]
    if persisted:
        got["persist_s"] = float(persisted[-1].get("seconds") or 0.0)
    return got


def _median_ms(out: Outcome, key: str) -> float:
    recs = [float(r[key]) for r in out.logs.get((0, 0), [])[SKIP:]
            if r["event"] == "step" and key in r]
    return statistics.median(recs) * 1e3 if recs else float("nan")


BARE = "torchrun, no checkpointing"
SAVED = "torchrun, torch.save at the end"
CASES: Dict[str, dict] = {
    BARE: dict(launcher="torchrun", ckpt="none", job=[]),
    SAVED: dict(launcher="torchrun", ckpt="torchsave", job=[], final_save=True),
    "torchrun, copy+hash every step (the floor)": dict(launcher="torchrun", ckpt="floor",
                                                       job=[]),
    "ckptrun, save() every step": dict(launcher="ckptrun", ckpt="ckptrun", job=[]),
    "ckptrun, save() on/off in blocks": dict(launcher="ckptrun", ckpt="ckptrun",
                                             job=["--alternate", str(ALTERNATE)]),
}


#: what a run touches at most, in states a rank: ckptrun's three slots plus the job's own
#: model, gradients, AdamW's moments, DDP's buckets and torch (~2.5 states)
TOUCHED_STATES = 5.5
RANKS = 2


def warm_memory(nbytes: int) -> float:
    """Touch ``nbytes`` of fresh memory once and free it (capped to 70% of what is
    available); returns the seconds it took -- long where the host had taken it back."""
    avail = psutil.virtual_memory().available
    n = int(min(nbytes, 0.7 * avail))
    t0 = time.perf_counter()
    if n > 0:
        buf = torch.ones(n, dtype=torch.uint8)  # writes every page
        del buf
    return time.perf_counter() - t0


def one_run(case: dict, hidden: int, steps: int, root: str, warm_bytes: int = 0) -> dict:
    work = tempfile.mkdtemp(prefix="steady-", dir=root)
    try:
        warm_s = warm_memory(warm_bytes) if warm_bytes else None
        final = (["--ckpt-dir", f"{work}/saved", "--save-every", str(steps)]
                 if case.get("final_save") else [])
        spec = Launch(case["launcher"],
                      ["--ckpt", case["ckpt"], "--steps", str(steps), "--hidden", str(hidden),
                       "--layers", str(LAYERS), "--batch", "64", "--state-mb", "0",
                       *case["job"], *final],
                      env={"CKPTRUN_WARM_SPARES": "0", "OMP_NUM_THREADS": "1"},
                      max_restarts=0)
        out = launch(spec, work, timeout_s=1800.0)
        if out.rc != 0:
            return {"error": f"rc={out.rc} timed_out={out.timed_out}: {out.tail[-300:]}"}
        step = _step_s(out)
        return {"step_s": step, "wall_s": out.wall_s, "fixed_s": out.wall_s - steps * step,
                "pairs": block_slowdowns(out, skip=SKIP) if case["job"] else [],
                "opt_ms": _median_ms(out, "opt_s"), "save_ms": _median_ms(out, "save_s"),
                **({"warm_s": warm_s} if warm_s is not None else {}), **_phases(out, step)}
    finally:
        shutil.rmtree(work, ignore_errors=True)


@section("steady_state", "Steady-state and fixed cost at realistic state sizes "
         "(2 ranks, a snapshot every step, vs torchrun)", COLUMNS,
         note="step = the slope (median interval between completed steps after the warm-up); "
              "fixed cost = wall time − steps × step; model + AdamW state, no padding")
def steady_state(ctx: Context) -> List[Row]:
    names = str(ctx.options.get("steady_sizes") or ("64M" if ctx.quick else ",".join(SIZES)))
    names = [n.strip() for n in names.split(",") if n.strip() in SIZES]
    steps = int(ctx.options.get("steady_steps") or (12 if ctx.quick else 24))
    reps = int(ctx.options.get("launch_reps") or (1 if ctx.quick else 2))
    cold = bool(ctx.options.get("steady_cold"))
    rows: List[Row] = []
    root = tempfile.mkdtemp(prefix="ckptrun-bench-steady-", dir=ctx.tmpdir)
    try:
        for size in names:
            hidden = hidden_for(SIZES[size])
            warm = 0 if cold else int(TOUCHED_STATES * RANKS * SIZES[size])
            samples = interleaved_rounds(
                list(CASES), reps, ctx.time_budget_s,
                lambda _r, n, h=hidden, w=warm: one_run(CASES[n], h, steps, root, w))
            rows += _rows(size, hidden, steps, samples)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return rows


def _rows(size: str, hidden: int, steps: int, samples: Dict[str, List[dict]]) -> List[Row]:
    out: List[Row] = []
    base = None
    for name, got in samples.items():
        good = [s for s in got if "error" not in s]
        row: Row = {"size": size, "case": name, "reps": len(good)}
        notes = [f"width {hidden}, {steps} steps"]
        bad = [s["error"] for s in got if "error" in s]
        if bad:
            notes.append(f"{len(bad)} run(s) failed: {str(bad[0])[:200]}")
        if good:
            step = statistics.median(s["step_s"] for s in good)
            row.update(step_s=step, fixed_s=statistics.median(s["fixed_s"] for s in good),
                       opt_ms=statistics.median(s["opt_ms"] for s in good),
                       save_ms=statistics.median(s["save_ms"] for s in good))
            for key in ("first_s", "warmup_s", "end_s", "persist_s", "warm_s"):
                vals = [s[key] for s in good if key in s]
                if vals:
                    row[key] = statistics.median(vals)
            if base is None:
                base = step
                row["ratio"] = 1.0
            pairs = [x for s in good for x in s["pairs"]]
            if pairs:
                slow = statistics.median(pairs)
                row["ratio"] = 1.0 / (1.0 - slow) if slow < 1 else float("inf")
                notes.append(f"ratio from {len(pairs)} adjacent off/on blocks of {ALTERNATE} "
                             f"steps (slowdown {min(pairs) * 100:.1f}–{max(pairs) * 100:.1f}%)")
            elif base:
                row["ratio"] = step / base
            if name.startswith("ckptrun") and "ratio" in row:
                row["met"] = "yes" if float(row["ratio"]) <= GOAL else "no"
        row["note"] = "; ".join(notes)
        out.append(row)
    floor = next((r for r in out if "floor" in str(r["case"]) and "step_s" in r), None)
    for row in out:  # the every-step case against the least a snapshot every step costs
        if floor and row["case"] == "ckptrun, save() every step" and "step_s" in row:
            row["vs_floor"] = float(row["step_s"]) / float(floor["step_s"])
    # The start-up goal: ckptrun's fixed cost within torchrun's + 1 s -- against the
    # bare job and against one that keeps its result (torch.save at the end).
    fixed = {r["case"]: float(r["fixed_s"]) for r in out if "fixed_s" in r}
    for row in out:
        if "fixed_s" in row and str(row["case"]).startswith("ckptrun"):
            for key, base_case in (("over_s", BARE), ("over_saved_s", SAVED)):
                if base_case in fixed:
                    row[key] = float(row["fixed_s"]) - fixed[base_case]
    return out
