"""Launch ``benchmarks/jobs/recovery_job.py`` under ``ckptrun`` or ``torchrun`` and read
back what happened: the per-rank, per-attempt step logs the job writes and (for ckptrun)
``events.jsonl``.  Shared by the recovery and overhead sections.

Every launch runs in its own session with a hard timeout; on timeout the whole process
group *we* started is killed.  After a ckptrun run the job's ``/dev/shm/ckptrun-<token>*``
files are checked: leftovers are reported in the sample (and then removed, so a bench run
never leaves shared memory behind).
"""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

from ckptrun.protocol import SHM_DIR, SHM_PREFIX

HERE = os.path.dirname(os.path.abspath(__file__))
JOB = os.path.join(HERE, "jobs", "recovery_job.py")
ROOT = os.path.dirname(HERE)


@dataclass
class Launch:
    """One job launch: which launcher, the job's arguments, extra launcher options/env."""

    launcher: str  # "ckptrun" | "torchrun"
    job_args: List[str]
    launcher_args: List[str] = field(default_factory=list)
    env: Dict[str, str] = field(default_factory=dict)
    nproc: int = 2
    max_restarts: int = 1


@dataclass
class Outcome:
    """What a launch left behind: return code, step logs, events, wall time, problems."""

    rc: Optional[int]
    wall_s: float
    logs: Dict[tuple, List[dict]]  # (rank, attempt) -> log records
    events: List[dict]
    shm_left: List[str]
    timed_out: bool
    tail: str
    started_at: float = 0.0  # time.time() at the launch (the step logs' clock)

    def records(self, event: str, attempt: Optional[int] = None) -> List[dict]:
        out = []
        for (rank, att), recs in sorted(self.logs.items()):
            if attempt is None or att == attempt:
                out += [dict(r, rank=rank, attempt=att) for r in recs if r["event"] == event]
        return out


def torchrun_path() -> str:
    """The venv's ``torchrun`` next to this interpreter (never a different torch)."""
    cand = os.path.join(os.path.dirname(sys.executable), "torchrun")
    return cand if os.path.exists(cand) else "torchrun"


def command(spec: Launch, run_dir: str) -> List[str]:
    common = ["--standalone", "--nproc-per-node", str(spec.nproc),
              "--max-restarts", str(spec.max_restarts)]
    if spec.launcher == "ckptrun":
        return [sys.executable, "-m", "ckptrun.cli", *common, "--run-dir", run_dir,
                *spec.launcher_args, JOB, *spec.job_args]
    if spec.launcher == "torchrun":
        return [torchrun_path(), *common, *spec.launcher_args, JOB, *spec.job_args]
    raise ValueError(spec.launcher)


def read_logs(log_dir: str) -> Dict[tuple, List[dict]]:
    out: Dict[tuple, List[dict]] = {}
    for path in glob.glob(os.path.join(log_dir, "rank*-attempt*.jsonl")):
        name = os.path.basename(path)[len("rank"):-len(".jsonl")]
        rank, attempt = name.split("-attempt")
        with open(path) as f:
            out[(int(rank), int(attempt))] = [json.loads(x) for x in f if x.strip().endswith("}")]
    return out


def read_events(run_dir: str) -> List[dict]:
    path = os.path.join(run_dir, "events.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(x) for x in f if x.strip()]


def shm_leftovers(events: List[dict]) -> List[str]:
    tokens = {e.get("job_token") for e in events if e.get("event") == "start"} - {None}
    left: List[str] = []
    for tok in tokens:
        left += glob.glob(os.path.join(SHM_DIR, f"{SHM_PREFIX}{tok}*"))
    return left


def kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL, the process group of a launch we started ourselves.

    The SIGKILL goes to the group even when the launcher itself exited on the SIGTERM: a
    launcher that orphans its workers (torchrun does) leaves a SIGSTOPped worker behind,
    which never acts on a SIGTERM.  torch's launcher starts each worker in a session of its
    own, outside the group: the launch's descendants are collected first and SIGKILLed too."""
    import psutil

    try:
        family = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        family = []
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(10.0)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for p in family:
        try:
            p.kill()
        except psutil.Error:
            pass
    try:
        proc.wait(5.0)
    except subprocess.TimeoutExpired:
        pass


def launch(spec: Launch, work: str, timeout_s: float,
           stop_when: Optional[Callable[[str], bool]] = None) -> Outcome:
    """Run ``spec`` with logs under ``work``; ``stop_when(log_dir)`` may end it early."""
    run_dir, log_dir = os.path.join(work, "run"), os.path.join(work, "steps")
    os.makedirs(log_dir, exist_ok=True)
    cmd = command(spec, run_dir)
    cmd[cmd.index(JOB) + 1:cmd.index(JOB) + 1] = ["--log-dir", log_dir]
    env = dict(os.environ, PYTHONPATH=ROOT, **spec.env)
    out_path = os.path.join(work, "launcher.log")
    t0, started_at = time.monotonic(), time.time()
    timed_out = False
    with open(out_path, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        while proc.poll() is None:
            if time.monotonic() - t0 > timeout_s:
                timed_out = True
                break
            if stop_when is not None and stop_when(log_dir):
                break
            time.sleep(0.1)
        if proc.poll() is None:
            kill_group(proc)
    wall = time.monotonic() - t0
    events = read_events(run_dir)
    left = shm_leftovers(events)
    for path in left:  # report, then clean: a benchmark must not leave shm behind
        try:
            os.unlink(path)
        except OSError:
            pass
    with open(out_path, errors="replace") as f:
        tail = f.read()[-2000:]
    return Outcome(proc.returncode, wall, read_logs(log_dir), events,
                   [os.path.basename(p) for p in left], timed_out, tail, started_at)


def steps_per_s(outcome: Outcome, attempt: int, skip: int) -> Optional[float]:
    """Training throughput from rank 0's step times, after ``skip`` warm-up steps."""
    steps = [r for r in outcome.logs.get((0, attempt), []) if r["event"] == "step"]
    if len(steps) < skip + 2:
        return None
    a, b = steps[skip], steps[-1]
    return (b["step"] - a["step"]) / (b["time"] - a["time"])


def interleaved_rounds(names: List[str], reps: int, budget_s: float,
                       run_one: Callable[[int, str], dict]) -> Dict[str, List[dict]]:
    """``reps`` rounds of one sample per case (``run_one(round, name)``), round-robin so the
    machine's load of the moment hits every case alike.  No new round starts once
    ``budget_s`` has passed: fewer rounds rather than a blown budget (rows say how many)."""
    samples: Dict[str, List[dict]] = {n: [] for n in names}
    started = time.monotonic()
    for rnd in range(reps):
        if rnd and time.monotonic() - started > budget_s:
            break
        for name in names:
            samples[name].append(run_one(rnd, name))
    return samples
