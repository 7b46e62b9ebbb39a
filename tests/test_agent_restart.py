"""Crash recovery: a failed worker restarts the group; the restart budget ends the job."""

from __future__ import annotations

import json
import os

from conftest import SCRIPTS, job_shm_files, run_events

TRAIN = os.path.join(SCRIPTS, "agent_train.py")


def of(evts, name):
    return [e for e in evts if e["event"] == name]


def test_sigkill_worker_is_restarted(tmp_path, ckptrun_run):
    run_dir = str(tmp_path / "run")
    p = ckptrun_run("--standalone", "--nproc-per-node", "2", "--run-dir", run_dir, TRAIN,
                    "--steps", "6", "--crash-at", "3")
    assert p.returncode == 0, p.stderr[-3000:]
    evts = run_events(run_dir)
    failed = of(evts, "worker_failed")
    # rank 0's all_reduce can fail on the dead peer's connection before the agent looks
    # again (CI once, under load): then both are reported, rank order, in the same poll
    assert (1, "SIGKILL") in [(e["rank"], e.get("signal")) for e in failed], evts
    assert all(e["rank"] == 1 or e.get("exit_code") for e in failed), evts
    assert "ckptrun: rank 1 was killed by SIGKILL (attempt 0)" in p.stderr.splitlines()
    assert [e["attempt"] for e in of(evts, "restart")] == [1]
    assert of(evts, "start")[0]["nnodes"] == 1 and of(evts, "start")[0]["nproc_per_node"] == 2
    assert of(evts, "finished")[-1]["exit_code"] == 0
    assert "rank 1 done attempt 1" in p.stdout
    status = json.load(open(os.path.join(run_dir, "status.json")))
    assert status["state"] == "succeeded" and status["restarts"] == 1
    assert oct(os.stat(os.path.join(run_dir, "status.json")).st_mode & 0o777) == "0o600"
    assert not job_shm_files(run_dir)


def test_crash_restart_kills_the_survivors_without_a_grace(tmp_path, ckptrun_run):
    """A restart SIGKILLs the surviving workers at once: their snapshots are in agent
    memory already, so a SIGTERM grace (here 600 s) would only delay the restart."""
    run_dir, marks = str(tmp_path / "run"), str(tmp_path / "marks.jsonl")
    p = ckptrun_run("--standalone", "--nproc-per-node", "2", "--shutdown-timeout", "600",
                    "--run-dir", run_dir, TRAIN, "--no-pg", "--steps", "100", "--crash-at", "3",
                    "--trap-sigterm", "--marks", marks)
    assert p.returncode == 0, p.stderr[-3000:]
    evts = run_events(run_dir)
    assert [(e["rank"], e["signal"]) for e in of(evts, "worker_failed")] == [(1, "SIGKILL")]
    assert [e["attempt"] for e in of(evts, "restart")] == [1]
    assert "rank 0 done attempt 0" not in p.stdout  # rank 0 was stopped, not finished
    recs = [json.loads(line) for line in open(marks)]
    assert [r for r in recs if r["what"] == "sigterm"] == []


def test_restart_lets_a_snapshot_copy_finish_before_the_kill(tmp_path, ckptrun_run):
    """Rank 1 crashes while rank 0 is copying a snapshot (phase SAVING, most of its step):
    the restart kills rank 0 only after that copy, never in the middle of one."""
    run_dir, marks = str(tmp_path / "run"), str(tmp_path / "marks.jsonl")
    p = ckptrun_run("--standalone", "--nproc-per-node", "2", "--run-dir", run_dir, TRAIN,
                    "--no-pg", "--steps", "4", "--step-time", "0.1", "--slow-save", "0.5",
                    "--crash-at", "2", "--marks", marks)
    assert p.returncode == 0, p.stderr[-3000:]
    recs = [json.loads(line) for line in open(marks)]
    steps = {what: [r["step"] for r in recs if r["what"] == what and r["rank"] == 0
                    and r["attempt"] == 0] for what in ("saving", "saved")}
    assert steps["saving"] and steps["saving"] == steps["saved"], steps


def test_exception_in_worker_is_restarted(tmp_path, ckptrun_run):
    run_dir = str(tmp_path / "run")
    p = ckptrun_run("--standalone", "--nproc-per-node", "1", "--run-dir", run_dir, TRAIN,
                    "--no-pg", "--fail-rank", "0", "--steps", "4", "--raise-at", "2")
    assert p.returncode == 0, p.stderr[-3000:]
    evts = run_events(run_dir)
    assert of(evts, "worker_failed")[0]["exit_code"] == 1
    assert [e["attempt"] for e in of(evts, "restart")] == [1]
    # the worker's traceback, as plain python prints it (no launcher frames)
    assert "RuntimeError: injected failure at step 2" in p.stderr
    assert "bootstrap.py" not in p.stderr
    log = open(os.path.join(run_dir, "logs", "attempt_0", "0", "stderr.log")).read()
    assert "injected failure" in log


def test_budget_spent_exits_1(tmp_path, ckptrun_run):
    run_dir = str(tmp_path / "run")
    p = ckptrun_run("--standalone", "--nproc-per-node", "1", "--max-restarts", "2",
                    "--run-dir", run_dir, TRAIN, "--no-pg", "--fail-rank", "0", "--steps", "3",
                    "--always-crash-at", "1")
    assert p.returncode == 1, p.stderr[-3000:]
    evts = run_events(run_dir)
    assert [e["attempt"] for e in of(evts, "restart")] == [1, 2]
    assert len(of(evts, "worker_failed")) == 3
    assert of(evts, "finished")[-1]["exit_code"] == 1
    assert json.load(open(os.path.join(run_dir, "status.json")))["state"] == "failed"
    assert not job_shm_files(run_dir)


def test_fatal_worker_error_stops_with_2(tmp_path, ckptrun_run):
    run_dir = str(tmp_path / "run")
    p = ckptrun_run("--standalone", "--nproc-per-node", "1", "--run-dir", run_dir, TRAIN,
                    "--no-pg", "--fail-rank", "0", "--steps", "3", "--fatal-at", "1")
    assert p.returncode == 2, p.stderr[-3000:]
    evts = run_events(run_dir)
    assert not of(evts, "restart")
    assert of(evts, "finished")[-1]["exit_code"] == 2
