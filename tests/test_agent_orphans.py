"""No orphans: killing the agent (SIGKILL or SIGTERM) takes every worker, spare and
grandchild with it, and leaves no shared-memory file behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import psutil
import pytest
from conftest import SCRIPTS, ckptrun_cmd, job_shm_files, run_events

pytestmark = pytest.mark.spares  # the spares are among the processes that must not outlive the agent

TRAIN = os.path.join(SCRIPTS, "agent_train.py")


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def start_long_job(tmp_path, nproc: int = 2, agent_args=(), job_args=()):
    run_dir = str(tmp_path / "run")
    marks = str(tmp_path / "marks.jsonl")
    env = dict(os.environ, CKPTRUN_SPARE_DELAY="0.2")
    proc = subprocess.Popen(
        ckptrun_cmd("--standalone", "--nproc-per-node", str(nproc), "--run-dir", run_dir,
                    *agent_args, TRAIN, "--steps", "100000", "--step-time", "0.1",
                    "--grandchild", "--marks", marks, *job_args),
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    status_path = os.path.join(run_dir, "status.json")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # workers beating and spares started
        try:
            st = json.load(open(status_path))
        except (OSError, ValueError):
            st = None
        if (st and len(st["workers"]) == nproc and len(st["spare_pids"]) == nproc
                and all(w["step"] >= 1 for w in st["workers"])):
            break
        assert proc.poll() is None, "agent exited early"
        time.sleep(0.2)
    else:
        proc.kill()
        raise AssertionError(f"job did not come up: {st}")
    grandchildren = [json.loads(line)["pid"] for line in open(marks)
                     if json.loads(line)["what"] == "grandchild"]
    pids = [w["pid"] for w in st["workers"]] + st["spare_pids"] + grandchildren
    assert len(grandchildren) == nproc and all(alive(p) for p in pids)
    return proc, run_dir, pids


def wait_gone(pids, seconds: float) -> list:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def test_agent_sigkill_leaves_no_orphans(tmp_path):
    proc, run_dir, pids = start_long_job(tmp_path)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert wait_gone(pids, 2.0) == []
    deadline = time.monotonic() + 2
    while job_shm_files(run_dir) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not job_shm_files(run_dir)


def test_agent_sigterm_stops_workers_exits_nonzero(tmp_path):
    proc, run_dir, pids = start_long_job(tmp_path)
    os.kill(proc.pid, signal.SIGTERM)
    rc = proc.wait(timeout=30)
    assert rc == 1  # as torchrun: the signal is forwarded, the launcher exits 1
    assert wait_gone(pids, 2.0) == []
    evts = run_events(run_dir)
    assert evts[-1]["event"] == "finished" and evts[-1]["exit_code"] == rc
    assert json.load(open(os.path.join(run_dir, "status.json")))["state"] == "failed"
    assert not job_shm_files(run_dir)


def test_agent_sigterm_gives_workers_sigterm_and_the_grace(tmp_path):
    """The job's final stop (unlike a restart) sends SIGTERM first and waits
    --shutdown-timeout before SIGKILL: each worker's handler ran."""
    proc, run_dir, pids = start_long_job(tmp_path, agent_args=("--shutdown-timeout", "1"),
                                         job_args=("--trap-sigterm",))
    os.kill(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=30) == 1  # as torchrun
    assert wait_gone(pids, 2.0) == []
    recs = [json.loads(line) for line in open(tmp_path / "marks.jsonl")]
    assert sorted(r["rank"] for r in recs if r["what"] == "sigterm") == [0, 1]
