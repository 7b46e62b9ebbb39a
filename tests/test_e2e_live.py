"""Failures that need a live job to aim at: a worker killed in the middle of a snapshot copy,
and ``ckptrun restore --rollback`` of a running job.  Both must end bitwise equal to the
failure-free run (the reference of ``test_e2e_recovery``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from test_e2e_recovery import (
    SCRIPT,
    assert_bitwise_equal,
    events,
    load,
    no_shm_left,
    of,
    reference,  # noqa: F401  (module fixture)
)

from ckptrun.protocol import ControlBlock, Phase

pytestmark = pytest.mark.slow


def start_job(run_dir: str, out: str, *script_args: str, ckptrun_args=()):
    cmd = [sys.executable, "-m", "ckptrun.cli", "--standalone", "--nproc-per-node", "2",
           "--run-dir", run_dir, *ckptrun_args, SCRIPT, "--steps", "30", "--out", out,
           *script_args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_status(run_dir: str, ok, timeout: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(os.path.join(run_dir, "status.json")) as f:
                st = json.load(f)
            if ok(st):
                return st
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    raise AssertionError(f"status never satisfied the condition in {run_dir}")


def test_worker_killed_mid_snapshot_copy(tmp_path, reference):  # noqa: F811
    """SIGKILL rank 1 while its control block says SAVING (a 64 MiB snapshot is being
    copied): the torn slot is never restored; the previous step is, from memory."""
    run_dir, out = str(tmp_path / "run"), str(tmp_path / "final.pt")
    proc = start_job(run_dir, out, "--ballast-mib", "64", "--step-time", "0.02")
    try:
        st = wait_status(run_dir, lambda s: s.get("job_token") and s["workers"]
                         and min(w["step"] or 0 for w in s["workers"]) >= 8)
        block = ControlBlock(f"/dev/shm/ckptrun-{st['job_token']}-control")
        deadline, killed = time.monotonic() + 60, None
        while time.monotonic() < deadline and killed is None:
            rec = block.record(1)
            if rec["phase"] == Phase.SAVING and rec["pid"] > 0:
                os.kill(rec["pid"], signal.SIGKILL)
                killed = (rec["step"], rec["committed_step"])
        block.close()
        assert killed, "never caught rank 1 inside a snapshot"
        _, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    saving_step, committed = killed
    restored = of(events(run_dir), "restored")
    assert restored and restored[0]["tier"] == "memory"
    assert restored[0]["step"] <= max(committed, saving_step - 1)  # never the torn step
    assert_bitwise_equal(load(out), reference)
    no_shm_left(run_dir)


def test_rollback_of_a_live_job(tmp_path, reference):  # noqa: F811
    """`ckptrun restore --rollback N` (N an older durable step) while the job runs: every
    worker restarts from step N, the restart is not counted as a failure, and replaying the
    steps after N gives the same weights."""
    run_dir, out, hurry = str(tmp_path / "run"), str(tmp_path / "final.pt"), tmp_path / "hurry"
    # slow steps: the two CLI calls below (each imports torch) must land well before the end;
    # once the rollback is asked for, the rest need not sleep
    proc = start_job(run_dir, out, "--step-time", "0.5", "--fast-after-file", str(hurry),
                     ckptrun_args=["--persist-every", "5", "--keep", "100"])
    try:
        wait_status(run_dir, lambda s: (s["checkpoint"].get("persisted_step") or 0) >= 8
                    and min(w["step"] or 0 for w in s["workers"]) >= 12)
        listed = subprocess.run([sys.executable, "-m", "ckptrun.cli", "restore", "--list",
                                 "--json", "--run-dir", run_dir],
                                capture_output=True, text=True, timeout=60)
        assert listed.returncode == 0, listed.stderr
        durable = [e["step"] for e in json.loads(listed.stdout)["steps"]
                   if "storage" in e["tiers"]]
        target = min(durable)  # the oldest: surely behind the workers by now
        rb = subprocess.run([sys.executable, "-m", "ckptrun.cli", "restore", "--rollback",
                             str(target), "--run-dir", run_dir],
                            capture_output=True, text=True, timeout=60)
        assert rb.returncode == 0, rb.stderr
        hurry.touch()
        _, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    evts = events(run_dir)
    restored = of(evts, "restored")
    assert restored and restored[0]["step"] == target, evts
    assert of(evts, "restart") and not of(evts, "worker_failed")
    assert json.load(open(os.path.join(run_dir, "status.json")))["restarts"] == 0
    assert_bitwise_equal(load(out), reference)
    no_shm_left(run_dir)
