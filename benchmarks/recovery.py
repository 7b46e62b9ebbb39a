"""Recovery: failure -> first completed training step after restore, and steps lost.

Measured from the training script itself (``benchmarks/jobs/recovery_job.py``, 2 ranks,
gloo): every rank logs ``time.time()`` after each step and just before an injected failure.
Per run the harness takes

* ``failure -> first step``: from the failure (SIGKILL of rank 1, or SIGSTOP for a hang)
  to the moment *every* rank has completed its first step after restore;
* ``steps lost``: last step completed before the failure minus the step restored;
* ``time lost``: the above plus the lost steps redone at the step time measured before
  the failure -- what the failure cost the job in all.

Cases, run round-robin (one of each per round):

* ckptrun, ``Checkpointer.save`` every step (memory tier, warm spares);
* torchrun ``--max-restarts 1`` + ``torch.save`` every 10 steps (newest file read at start);
* torchrun ``--max-restarts 1`` + DCP ``save`` every 10 steps;
* ckptrun with ``--hang-timeout 2`` and a rank stopped with SIGSTOP.

The harness chooses the moment of the failure (``FailTrigger``): after ``--fail-after-s``
(default 2 s) of training and, under ckptrun, once its warm spares are up -- as they are in
any job that ran for more than a minute (niced, they import torch while training
saturates the CPU: 10-25 s here; ``CKPTRUN_SPARE_DELAY=0`` starts them with the workers
rather than 3 s later, to shorten that wait).  The failure then lands at
the middle of the baselines' 10-step interval (``K = 5 mod 10``).  torchrun runs
with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: without it a restart intermittently fails in
torch 2.13 (DESIGN §5), which would make the baseline look worse than it is.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
import time
from typing import Dict, List, Optional

from benchmarks import Context, Row, section
from benchmarks.jobrun import Launch, Outcome, interleaved_rounds, launch

HANG_TIMEOUT_S = 2.0
KILL_AT = 25  # the first failure step considered; later ones keep K = 5 (mod 10)
SAVE_EVERY = 10

COLUMNS = [("case", "case", "str"), ("failure", "failure", "str"), ("bytes", "state/rank", "bytes"),
           ("median_s", "failure → first step (median)", "s"), ("min_s", "min", "s"),
           ("max_s", "max", "s"), ("steps_lost", "steps lost (median)", "float"),
           ("steps_lost_range", "steps lost min–max", "str"),
           ("lost_s", "time lost incl. redone steps", "s"),
           ("vs_ckptrun", "time lost / ckptrun's", "ratio"),
           ("restart_s", "failure → restart event", "s"),
           ("start_s", "failure → scripts started", "s"),
           ("beyond_timeout_s", "restart − hang timeout", "s"),
           ("target", "target (DESIGN §6)", "str"), ("met", "met", "str"),
           ("reps", "reps", "int"), ("note", "note", "str")]


def state_mb(ctx: Context) -> int:
    """State per rank: ``--recovery-state`` or 64 MiB quick / 256 MiB full."""
    opt = ctx.options.get("recovery_state_bytes")
    if opt:
        return max(1, int(opt) >> 20)  # type: ignore[arg-type]
    return 64 if ctx.quick else 256


CASES: Dict[str, dict] = {
    "ckptrun": dict(launcher="ckptrun", ckpt="ckptrun", failure="SIGKILL rank 1",
                    target="≤ 1 s, 0 steps lost"),
    "torchrun + torch.save/10": dict(launcher="torchrun", ckpt="torchsave",
                                     failure="SIGKILL rank 1", target=""),
    "torchrun + DCP/10": dict(launcher="torchrun", ckpt="dcp", failure="SIGKILL rank 1",
                              target=""),
    "ckptrun --hang-timeout 2": dict(launcher="ckptrun", ckpt="ckptrun",
                                     failure="hang (SIGSTOP rank 1)",
                                     target="restart ≤ 1 s after the timeout"),
}


def make_launch(case: dict, mb: int, work: str) -> Launch:
    hang = case["failure"].startswith("hang")
    job = ["--ckpt", case["ckpt"], "--state-mb", str(mb), "--save-every", str(SAVE_EVERY),
           "--ckpt-dir", os.path.join(work, "ckpt"), "--fail-file", os.path.join(work, "fail"),
           "--hang-at" if hang else "--kill-at", str(KILL_AT)]
    if case["launcher"] == "torchrun":
        return Launch("torchrun", job, env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    extra = ["--hang-timeout", str(HANG_TIMEOUT_S)] if hang else []
    # Spares start with the workers instead of 3 s later: the harness waits for them anyway
    # (FailTrigger), and this makes that wait shorter; it changes nothing after they are up.
    return Launch("ckptrun", job, launcher_args=extra, env={"CKPTRUN_SPARE_DELAY": "0"})


def spares_warm(run_dir: str, nproc: int) -> bool:
    """Whether ckptrun's warm spares are up: listed in ``status.json`` and each asleep
    waiting for its "go" message (in a pipe read or a select: what a spare does once torch
    is imported and warmed up)."""
    try:
        with open(os.path.join(run_dir, "status.json")) as f:
            pids = json.load(f).get("spare_pids") or []
        if len(pids) < nproc:
            return False
        for pid in pids:
            with open(f"/proc/{int(pid)}/wchan") as f:
                wchan = f.read()
            if not any(w in wchan for w in ("pipe", "select", "poll")):
                return False
        return True
    except (OSError, ValueError):
        return False


class FailTrigger:
    """``stop_when`` callback of a launch that never stops it: it creates the job's
    ``--fail-file`` once the job trained ``min_train_s`` and, under ckptrun, its warm spares
    are up (at most ``max_wait_s`` later: then the sample is marked)."""

    def __init__(self, work: str, launcher: str, min_train_s: float, max_wait_s: float) -> None:
        self.work, self.launcher = work, launcher
        self.min_train_s, self.max_wait_s = min_train_s, max_wait_s
        self.training_since: Optional[float] = None
        self.fired_at: Optional[float] = None
        self.warm: Optional[bool] = None

    def __call__(self, log_dir: str) -> bool:
        if self.fired_at is not None:
            return False
        now = time.monotonic()
        if self.training_since is None:
            if os.path.exists(os.path.join(log_dir, "rank0-attempt0.jsonl")):
                self.training_since = now
            return False
        waited = now - self.training_since
        if waited < self.min_train_s:
            return False
        dirs = {"ckptrun": [("run", 2)], "two-agents": [("node0", 1), ("node1", 1)]}
        if self.launcher in dirs:
            self.warm = all(spares_warm(os.path.join(self.work, d), n)
                            for d, n in dirs[self.launcher])
            if not self.warm and waited < self.max_wait_s:
                return False
        open(os.path.join(self.work, "fail"), "w").close()
        self.fired_at = now
        return False


def _step_time(out: Outcome) -> Optional[float]:
    """Median step time of rank 0 over the last 50 steps before the failure."""
    times = [r["time"] for r in out.logs.get((0, 0), []) if r["event"] == "step"][-51:]
    gaps = [b - a for a, b in zip(times, times[1:])]
    return statistics.median(gaps) if gaps else None


def measure(out: Outcome, hang: bool) -> Dict[str, object]:
    """One sample from one launch; ``error`` says why there is none."""
    fail = out.records("hang" if hang else "kill", attempt=0)
    if not fail:
        return {"error": f"no failure was injected (rc={out.rc}): {out.tail[-300:]}"}
    t_fail = float(fail[0]["time"])
    # Work done before the failure: the last step *every* rank completed in attempt 0 (after
    # a hang that is later than the hang step: the agent's stack dump sends SIGCONT).
    last: Dict[int, int] = {}
    for r in out.records("step", attempt=0):
        last[int(r["rank"])] = max(last.get(int(r["rank"]), 0), int(r["step"]))
    fail_step = min(last.values()) if last else int(fail[0]["step"])
    restored = out.records("restored", attempt=1)
    firsts: Dict[int, float] = {}
    for r in out.records("step", attempt=1):
        firsts.setdefault(int(r["rank"]), float(r["time"]))
    if not restored or len(firsts) < 2:
        why = "timed out" if out.timed_out else f"rc={out.rc}"
        return {"error": f"no completed step after the restart ({why}): {out.tail[-300:]}"}
    step_s = _step_time(out) or 0.0
    restored_step = min(int(r["step"]) for r in restored)
    sample: Dict[str, object] = {
        "recovery_s": max(firsts.values()) - t_fail, "steps_lost": fail_step - restored_step,
        "step_s": step_s, "fail_step": fail_step, "restored_step": restored_step,
    }
    sample["lost_s"] = float(sample["recovery_s"]) + (fail_step - restored_step) * step_s
    sample["start_s"] = max(float(r["time"]) for r in out.records("start", attempt=1)) - t_fail
    restarts = [e for e in out.events if e.get("event") == "restart"]
    if restarts:
        sample["restart_s"] = float(restarts[0]["time"]) - t_fail
    tiers = [e.get("tier") for e in out.events if e.get("event") == "restored"]
    if tiers:
        sample["tier"] = tiers[0]
    if out.shm_left:
        sample["shm_left"] = out.shm_left
    return sample


def _summary(name: str, case: dict, mb: int, samples: List[Dict[str, object]]) -> Row:
    good = [s for s in samples if "error" not in s]
    row: Row = {"case": name, "failure": case["failure"], "bytes": mb << 20,
                "target": case["target"], "reps": len(good)}
    errors = [str(s["error"]) for s in samples if "error" in s]
    notes = []
    if errors:
        notes.append(f"{len(errors)} run(s) failed: {errors[0][:200]}")
    if good:
        rec = [float(s["recovery_s"]) for s in good]
        lost = [int(s["steps_lost"]) for s in good]  # type: ignore[call-overload]
        row.update(median_s=statistics.median(rec), min_s=min(rec), max_s=max(rec),
                   steps_lost=statistics.median(lost), steps_lost_range=f"{min(lost)}–{max(lost)}",
                   lost_s=statistics.median(float(s["lost_s"]) for s in good),
                   step_s=statistics.median(float(s["step_s"]) for s in good),
                   samples=good)
        for key in ("restart_s", "start_s"):
            vals = [float(s[key]) for s in good if key in s]  # type: ignore[arg-type]
            if vals:
                row[key] = statistics.median(vals)
        tiers = sorted({str(s["tier"]) for s in good if "tier" in s})
        if tiers:
            notes.append("restored from " + "/".join(tiers))
        cold = sum(1 for s in good if s.get("spares_warm") is False)
        if cold:
            notes.append(f"{cold} run(s) failed before the warm spares were up")
        if any("shm_left" in s for s in good):
            notes.append("ckptrun left /dev/shm files behind (removed by the harness)")
    row["note"] = "; ".join(notes)
    return row


def _judge(row: Row, hang: bool) -> None:
    """Compare with the DESIGN §6 target (medians)."""
    if "median_s" not in row or not row.get("target"):
        return
    if hang:
        beyond = float(row["restart_s"]) - HANG_TIMEOUT_S if "restart_s" in row else None
        row["beyond_timeout_s"] = beyond
        row["met"] = "yes" if beyond is not None and beyond <= 1.0 else "no"
    else:
        ok = float(row["median_s"]) <= 1.0 and float(row["steps_lost"]) == 0
        row["met"] = "yes" if ok else "no"


def torchrun_hang_row(mb: int, root: str, observe_s: float) -> Row:
    """One torchrun run with a SIGSTOPped rank, watched ``observe_s`` for any restart."""
    work = tempfile.mkdtemp(prefix="hang-torchrun-", dir=root)
    case = dict(launcher="torchrun", ckpt="torchsave", failure="hang (SIGSTOP rank 1)")
    spec = make_launch(case, mb, work)
    seen: Dict[str, float] = {}
    trigger = FailTrigger(work, "torchrun", 1.0, 0.0)

    def stop(log_dir: str) -> bool:  # observe_s after the hang, or at a restart
        trigger(log_dir)
        if os.path.exists(os.path.join(log_dir, "rank0-attempt1.jsonl")):
            return True
        if "hang" not in seen and os.path.exists(os.path.join(log_dir, "rank1-attempt0.jsonl")):
            with open(os.path.join(log_dir, "rank1-attempt0.jsonl")) as f:
                if '"hang"' in f.read():
                    seen["hang"] = time.monotonic()
        return "hang" in seen and time.monotonic() - seen["hang"] > observe_s

    out = launch(spec, work, timeout_s=observe_s + 90.0, stop_when=stop)
    restarted = bool(out.records("start", attempt=1))
    note = ("torchrun cannot detect hangs: " + (
        "it restarted (unexpected)" if restarted else
        f"no restart within {observe_s:.0f} s of the hang (observed, then killed); the other "
        "rank waits in a gloo collective until the process-group timeout (30 min default)"))
    if "hang" not in seen:
        note = f"run failed before the hang: {out.tail[-200:]}"
    return {"case": "torchrun + torch.save/10", "failure": "hang (SIGSTOP rank 1)",
            "bytes": mb << 20, "target": "", "note": note, "reps": 1}


@section("recovery", "Recovery: failure → first completed step after restore", COLUMNS,
         note="medians over rounds (min/max); time lost = failure → first step + lost steps × "
              "step time; ratio = time lost / ckptrun's (SIGKILL)")
def recovery(ctx: Context) -> List[Row]:
    mb = state_mb(ctx)
    min_train = float(ctx.options.get("fail_after_s") or 2.0)
    max_wait = 60.0  # for warm spares; a sample that had to give up says so
    reps = int(ctx.options.get("launch_reps") or (1 if ctx.quick else ctx.reps))
    root = tempfile.mkdtemp(prefix="ckptrun-bench-recovery-", dir=ctx.tmpdir)

    def one(rnd: int, name: str) -> Dict[str, object]:
        case = CASES[name]
        work = tempfile.mkdtemp(prefix=f"r{rnd}-", dir=root)
        trigger = FailTrigger(work, case["launcher"], min_train, max_wait)
        out = launch(make_launch(case, mb, work), work, timeout_s=max_wait + 90.0,
                     stop_when=trigger)
        sample = measure(out, case["failure"].startswith("hang"))
        if trigger.fired_at is not None and trigger.training_since is not None:
            sample["trained_s"] = trigger.fired_at - trigger.training_since
        if trigger.warm is not None:
            sample["spares_warm"] = trigger.warm
        shutil.rmtree(work, ignore_errors=True)
        return sample

    try:
        samples = interleaved_rounds(list(CASES), reps, ctx.time_budget_s, one)
        rows = [_summary(name, case, mb, samples[name]) for name, case in CASES.items()]
        for row, case in zip(rows, CASES.values()):
            _judge(row, case["failure"].startswith("hang"))
        base = rows[0].get("lost_s")
        for row in rows:
            if base and row.get("lost_s") and not str(row["failure"]).startswith("hang"):
                row["vs_ckptrun"] = float(row["lost_s"]) / float(base)
        observe = float(ctx.options.get("hang_observe_s") or (3.0 if ctx.quick else 30.0))
        rows.insert(3, torchrun_hang_row(mb, root, observe))
        return rows
    finally:
        shutil.rmtree(root, ignore_errors=True)
