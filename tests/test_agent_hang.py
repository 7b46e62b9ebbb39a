"""Hang detection: a SIGSTOPped worker is detected, its stack dumped, the group restarted."""

from __future__ import annotations

import json
import os
import time

import psutil
from conftest import SCRIPTS, job_shm_files, run_events

TRAIN = os.path.join(SCRIPTS, "agent_train.py")


def of(evts, name):
    return [e for e in evts if e["event"] == name]


def test_sigstop_hang_detected_dumped_restarted(tmp_path, ckptrun_run):
    run_dir = str(tmp_path / "run")
    p = ckptrun_run("--standalone", "--nproc-per-node", "2", "--hang-timeout", "2",
                    "--run-dir", run_dir, TRAIN, "--steps", "6", "--hang-at", "3")
    assert p.returncode == 0, p.stderr[-3000:]
    evts = run_events(run_dir)
    hangs = of(evts, "hang_detected")
    assert [e["rank"] for e in hangs] == [1], evts  # rank 0 only waits on rank 1
    assert all(e["seconds_silent"] >= 2 for e in hangs), evts
    dumps = {e["path"]: e["rank"] for e in of(evts, "stacks_dumped")}
    path = os.path.join(run_dir, "stacks", "attempt_0-rank1.txt")
    assert dumps.get(path) == 1, evts
    # both ranks' stacks are dumped (rank 0 waits in a collective), said in one line
    said = [line for line in p.stderr.splitlines() if "stacks of the hung" in line]
    assert said == [f"ckptrun: stacks of the hung workers (ranks 0-1) are in "
                    f"{os.path.join(run_dir, 'stacks', 'attempt_0-rank*.txt')}"], said
    text = open(path).read()
    assert "agent_train.py" in text and "in main" in text, text
    assert [e["attempt"] for e in of(evts, "restart")] == [1]
    assert of(evts, "finished")[-1]["exit_code"] == 0
    # the hang was reported before the restart, the dump between the two
    names = [e["event"] for e in evts]
    assert names.index("hang_detected") < names.index("stacks_dumped") < names.index("restart")
    assert not job_shm_files(run_dir)


def _gone(pid: int, within: float = 5.0) -> bool:
    """``pid`` exited (an orphan is reaped by whoever adopted it, a moment later)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def test_a_rank_waiting_on_its_stopped_child_is_the_one_named(tmp_path, ckptrun_run):
    """Rank 1 waits for a batch from a process it started (a data-loader worker) that is
    stopped; rank 0 waits for rank 1 in the next all-reduce.  Both samplers run: without
    looking at their children this is a deadlock of every rank."""
    run_dir, marks = str(tmp_path / "run"), str(tmp_path / "marks")
    p = ckptrun_run("--standalone", "--nproc-per-node", "2", "--hang-timeout", "2",
                    "--run-dir", run_dir, TRAIN, "--steps", "6", "--child-hang-at", "3",
                    "--marks", marks)
    assert p.returncode == 0, p.stderr[-3000:]
    evts = run_events(run_dir)
    child = [json.loads(line) for line in open(marks) if '"child"' in line][0]["pid"]
    hangs = of(evts, "hang_detected")
    assert [(e["rank"], e["why"], e["child_pid"]) for e in hangs] == \
        [(1, "child_stopped", child)], hangs
    what = hangs[0]["child"]
    assert what.startswith("python"), hangs  # neither torch's worker nor a fork of the rank
    assert f"rank 1 waiting on process {child} ({what}), which it started and which is " \
        "stopped" in p.stderr, p.stderr[-3000:]
    assert _gone(child)  # stopped, it was killed with its rank
    status = ckptrun_run("status", "--run-dir", run_dir)  # its recent failures say why too
    assert f"rank 1 waiting on process {child}" in " ".join(status.stdout.split()), status.stdout
    assert [e["attempt"] for e in of(evts, "restart")] == [1]
    assert of(evts, "finished")[-1]["exit_code"] == 0


def test_script_without_heartbeat_is_never_hung(tmp_path, ckptrun_run):
    run_dir = str(tmp_path / "run")
    p = ckptrun_run("--standalone", "--nproc-per-node", "1", "--hang-timeout", "1",
                    "--run-dir", run_dir, os.path.join(SCRIPTS, "agent_sleeper.py"), "3")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "slept" in p.stdout
    evts = run_events(run_dir)
    assert not of(evts, "hang_detected") and not of(evts, "restart")
