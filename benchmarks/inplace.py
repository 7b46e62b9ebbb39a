"""In-process recovery vs a restart: downtime and where it goes, side by side.

The recovery job (``benchmarks/jobs/recovery_job.py``, 2 ranks, gloo) in three forms:

* ``plain``: no start-up of its own (the recovery section's job);
* ``set-up 5 s``: 5 s of per-process start-up outside the training function -- what a GPT
  script spends on its tokenizer, dataset index and data-loader workers before the loop
  (simulated with a sleep: the cost a restarted process pays again, whatever it is made of);
* ``torch.compile``: the DDP model compiled at its first step (real compilation), built
  inside the training function -- a survivor re-entering it builds a new model;
* ``torch.compile, model kept``: the model built and compiled once per process, outside the
  training function (``--compile-kept``), the DDP wrapper built around it in each attempt
  -- what a survivor keeps, its compiled code included.

For the compiled forms the job logs how many frames torch.compile compiled in the attempt
after the restore by its first step, per rank (``torch._dynamo``'s own counter): the
survivor's (rank 0) count is the recompilation the goal asks to avoid.

Each is run four ways: ckptrun with ``@ckptrun.resilient`` (``--in-place``: the rank that
did not fail keeps its process) with ``--hot-spares`` (the replacement ran the script's
start-up already) and without (a warm spare), ckptrun restarting both ranks, and torchrun +
``torch.save`` every 10 steps.  Rank 1 is SIGKILLed inside a step; the time is failure
-> every rank completed its first step after the restore (measured from the script's own
logs, as in the recovery section), plus the phases of ckptrun's ``recovered`` event.
Goal (issue 16): survivors add nothing -- downtime ≈ detection + the replacement's
restore and first step -- and no recompilation on a survivor.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
import time
from typing import Dict, List

from benchmarks import Context, Row, section
from benchmarks.jobrun import Launch, interleaved_rounds, launch
from benchmarks.recovery import SAVE_EVERY, FailTrigger, measure, state_mb

KILL_AT = 25
SETUP_S = 5.0

FORMS = {"plain": [], f"set-up {SETUP_S:.0f} s": ["--setup-s", str(SETUP_S)],
         "torch.compile": ["--compile"], "torch.compile, model kept": ["--compile-kept"]}
MODES = {"ckptrun in-place + hot spares": ("ckptrun", ["--in-place"]),
         "ckptrun in-place": ("ckptrun", ["--in-place"]), "ckptrun restart": ("ckptrun", []),
         "torchrun + torch.save/10": ("torchrun", [])}
HOT = "ckptrun in-place + hot spares"
FORM_IDS = dict(zip(("plain", "setup", "compile", "compile-kept"), FORMS))  # --inplace-forms

COLUMNS = [("form", "job", "str"), ("mode", "recovery", "str"), ("bytes", "state/rank", "bytes"),
           ("median_s", "failure → first step (median)", "s"), ("min_s", "min", "s"),
           ("max_s", "max", "s"), ("vs_restart", "÷ ckptrun restart", "ratio"),
           ("detect_s", "detect", "s"), ("stop_s", "stop / unwind", "s"),
           ("start_s", "start", "s"), ("restore_s", "restore", "s"),
           ("first_step_s", "script → first step", "s"), ("steps_lost", "steps lost", "float"),
           ("compiled", "frames compiled after the restore (rank 0 survivor / rank 1)", "str"),
           ("reps", "reps", "int"), ("note", "note", "str")]


def _launch(form: List[str], mode: str, mb: int, work: str) -> Launch:
    launcher, extra = MODES[mode]
    ckpt = "ckptrun" if launcher == "ckptrun" else "torchsave"
    job = ["--ckpt", ckpt, "--state-mb", str(mb), "--save-every", str(SAVE_EVERY),
           "--ckpt-dir", os.path.join(work, "ckpt"), "--fail-file", os.path.join(work, "fail"),
           "--kill-at", str(KILL_AT), *form, *extra]
    if launcher == "torchrun":
        return Launch("torchrun", job, env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    return Launch("ckptrun", job, launcher_args=["--hot-spares"] if mode == HOT else [],
                  env={"CKPTRUN_SPARE_DELAY": "0"})


class HotTrigger(FailTrigger):
    """Fails the job once its hot spares wait ready (``status.json``), as they do in any
    job that ran for more than a minute."""

    def __call__(self, log_dir: str) -> bool:
        if self.fired_at is not None or self.training_since is None:
            return super().__call__(log_dir)  # not training yet, or done
        if time.monotonic() - self.training_since >= self.min_train_s:
            try:
                with open(os.path.join(self.work, "run", "status.json")) as f:
                    hot = json.load(f).get("hot_spares") or []
            except (OSError, ValueError):
                hot = []
            waited = time.monotonic() - self.training_since
            if not (len(hot) >= 2 and all(h["ready"] for h in hot)) and waited < self.max_wait_s:
                return False
            self.warm = bool(hot) and all(h["ready"] for h in hot)
            open(os.path.join(self.work, "fail"), "w").close()
            self.fired_at = time.monotonic()
        return False


def _phases(events: List[dict]) -> Dict[str, float]:
    rec = [e for e in events if e.get("event") == "recovered"]
    return {k: float(v) for k, v in (rec[0].get("phases") or {}).items()} if rec else {}


@section("inplace", "In-process recovery (@ckptrun.resilient) vs restart", COLUMNS,
         note="2 ranks, SIGKILL of rank 1 inside a step; medians over rounds; phases from "
              "ckptrun's recovered event (script → first step: the processes' own time "
              "until every rank's first step after the restore)")
def inplace(ctx: Context) -> List[Row]:
    mb = state_mb(ctx)
    reps = int(ctx.options.get("launch_reps") or (1 if ctx.quick else ctx.reps))
    root = tempfile.mkdtemp(prefix="ckptrun-bench-inplace-", dir=ctx.tmpdir)
    wanted = ctx.options.get("inplace_forms")
    ids = [f.strip() for f in str(wanted).split(",")] if wanted else list(FORM_IDS)
    unknown = [f for f in ids if f not in FORM_IDS]
    if unknown:
        raise ValueError(f"--inplace-forms: unknown {unknown}; known: {list(FORM_IDS)}")
    forms = [FORM_IDS[f] for f in ids]
    cases = [(f, m) for f in forms for m in MODES]
    names = [f"{f} | {m}" for f, m in cases]

    def one(rnd: int, name: str) -> Dict[str, object]:
        form, mode = name.split(" | ")
        work = tempfile.mkdtemp(prefix=f"r{rnd}-", dir=root)
        trigger = (HotTrigger if mode == HOT else FailTrigger)(work, MODES[mode][0], 2.0, 60.0)
        out = launch(_launch(FORMS[form], mode, mb, work), work, timeout_s=240.0,
                     stop_when=trigger)
        sample = measure(out, hang=False)
        sample.pop("start_s", None)  # "start" here is the phase of ckptrun's recovered event
        sample.update(_phases(out.events))
        in_place = [e.get("in_place") for e in out.events if e.get("event") == "restart"]
        sample["kept"] = in_place[0] if in_place else None
        frames = {int(r["rank"]): int(r["compiled"]) for r in out.records("step", attempt=1)
                  if "compiled" in r}
        if frames:
            sample["compiled"] = [frames.get(0), frames.get(1)]
        if trigger.warm is not None:
            sample["spares_ready"] = trigger.warm
        shutil.rmtree(work, ignore_errors=True)
        return sample

    try:
        samples = interleaved_rounds(names, reps, ctx.time_budget_s, one)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rows: List[Row] = []
    for (form, mode), name in zip(cases, names):
        good = [s for s in samples[name] if "error" not in s]
        row: Row = {"form": form, "mode": mode, "bytes": mb << 20, "reps": len(good)}
        bad = [str(s["error"]) for s in samples[name] if "error" in s]
        notes = [f"{len(bad)} run(s) failed: {bad[0][:160]}"] if bad else []
        if good:
            rec = [float(s["recovery_s"]) for s in good]
            row.update(median_s=statistics.median(rec), min_s=min(rec), max_s=max(rec),
                       steps_lost=statistics.median(int(s["steps_lost"]) for s in good),
                       samples=good)
            for key in ("detect_s", "stop_s", "start_s", "restore_s", "first_step_s"):
                vals = [float(s[key]) for s in good if key in s]
                if vals:
                    row[key] = statistics.median(vals)
            if mode.startswith("ckptrun in-place") and not all(s.get("kept") == [0]
                                                                for s in good):
                notes.append("rank 0 was not always kept: " + str([s.get("kept") for s in good]))
            if any("compiled" in s for s in good):
                row["compiled"] = ", ".join(
                    f"{s['compiled'][0]} / {s['compiled'][1]}" for s in good if "compiled" in s)
            cold = sum(1 for s in good if s.get("spares_ready") is False)
            if cold:
                notes.append(f"{cold} run(s) failed before the spares were ready")
        row["note"] = "; ".join(notes)
        rows.append(row)
    for form in forms:
        base = next((r for r in rows if r["form"] == form and r["mode"] == "ckptrun restart"
                     and r.get("median_s")), None)
        for r in rows:
            if base and r["form"] == form and r.get("median_s"):
                r["vs_restart"] = float(r["median_s"]) / float(base["median_s"])
    return rows
