"""The proof that nothing is lost: a deterministic DDP job (gloo, 2 workers, dropout, AdamW, LR
schedule) interrupted by failures ends with weights bitwise equal to the same job without them.

Only the user-facing contract is used: the ``ckptrun`` command line, ``events.jsonl`` and the
final weights the script writes.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import shared_weights

from ckptrun.cli.status import load_status

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "scripts", "e2e_train.py")
STEPS = 30

pytestmark = [pytest.mark.slow, pytest.mark.spares]


def run_job(run_dir: str, out: str, *script_args: str, ckptrun_args=(), timeout=240,
            env=None):
    cmd = [sys.executable, "-m", "ckptrun.cli", "--standalone", "--nproc-per-node", "2",
           "--run-dir", run_dir, *ckptrun_args, SCRIPT, "--steps", str(STEPS), "--out", out,
           *script_args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env=None if env is None else {**os.environ, **env})
    return proc


def events(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "events.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def of(evts: list[dict], name: str) -> list[dict]:
    return [e for e in evts if e["event"] == name]


def load(path: str) -> dict:
    return torch.load(path, weights_only=True)


def assert_bitwise_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs"


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    def make(d) -> str:
        # no failure, so no use for warm spares
        proc = run_job(str(d / "run"), str(d / "final.pt"), env={"CKPTRUN_WARM_SPARES": "0"})
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert not of(events(str(d / "run")), "restart")
        return str(d / "final.pt")
    return shared_weights(tmp_path_factory, "e2e", make)


def no_shm_left(run_dir: str) -> None:
    """None of the job's shared-memory files is left behind (the job token names them)."""
    with open(os.path.join(run_dir, "status.json")) as f:
        token = json.load(f)["job_token"]
    assert token
    left = glob.glob(f"/dev/shm/ckptrun-{token}*")
    assert not left, left


@pytest.mark.parametrize(
    "failure,args,expect",
    [
        pytest.param("sigkill", ["--crash-at", "12"], "worker_failed",
                     marks=pytest.mark.compat("SIGKILL: restore from memory, bitwise")),
        ("exception", ["--raise-at", "12"], "worker_failed"),
        ("hang", ["--hang-at", "12"], "hang_detected"),
    ],
)
def test_worker_failure_restores_from_memory_bitwise(tmp_path, reference, failure, args, expect):
    run_dir = str(tmp_path / "run")
    extra = ["--hang-timeout", "3"] if failure == "hang" else []
    proc = run_job(run_dir, str(tmp_path / "final.pt"), *args, ckptrun_args=extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
    evts = events(run_dir)
    assert of(evts, expect), evts
    restored = of(evts, "restored")
    assert restored, evts
    # every rank had step 11 or 12 committed when rank 1 failed after step 12
    assert restored[0]["tier"] == "memory"
    assert restored[0]["step"] >= 11
    assert_bitwise_equal(load(str(tmp_path / "final.pt")), reference)
    assert of(evts, "finished")[-1]["exit_code"] == 0
    no_shm_left(run_dir)
    # the agent tells the person watching the job what failed and how it recovered
    said = [line for line in proc.stderr.splitlines() if line.startswith("ckptrun: ")]
    # (in a hang rank 0 waits in the collective: only the stopped rank 1 is named)
    # (an exception exits 1 -- or SIGABRT, when gloo's teardown aborts while the peer is
    # still in its collective, as it does under torchrun too)
    want = {"sigkill": ["was killed by SIGKILL"],
            "exception": ["exited with code 1", "was killed by SIGABRT"],
            "hang": ["stopped (no sign of life): no rank advanced for"]}[failure]
    assert any(line.startswith("ckptrun: rank 1 ") and any(w in line for w in want)
               for line in said), said
    if failure == "hang":
        assert not any(line.startswith("ckptrun: rank 0 ") for line in said), said
    assert "ckptrun: restarting the workers: attempt 1, 1 restart(s) of the budget used" in said
    # the downtime, failure to every rank's first step after the restore, and its phases
    rec = of(evts, "recovered")
    assert len(rec) == 1 and rec[0]["step"] == restored[0]["step"], evts
    ph = rec[0]["phases"]
    assert set(ph) == {"detect_s", "stop_s", "start_s", "restore_s", "first_step_s"}, ph
    assert abs(sum(ph.values()) - rec[0]["downtime_s"]) < 0.01, rec
    if failure == "hang":
        assert ph["detect_s"] >= 3.0, ph  # the hang timeout is 3 s
    else:
        # a crash is seen once the process is gone: at once after a SIGKILL; after the
        # interpreter's teardown for an exception, which took 3.9 s once (the gloo group's
        # destructor waits for the peer still in its collective)
        assert ph["detect_s"] < (3.0 if failure == "sigkill" else 10.0), ph
    assert any(line.startswith("ckptrun: recovered in ") and ", script " in line
               for line in said), said
    st = load_status(run_dir)
    assert st["last_recovery"]["downtime_s"] == rec[0]["downtime_s"]
    tt = st["training_time"]
    assert tt["recoveries"] == 1 and tt["effective_s"] == round(tt["elapsed_s"]
                                                                - tt["downtime_s"], 3), tt
    assert f"restored step {restored[0]['step']} from memory in " in "\n".join(said)


def test_corrupted_memory_copy_is_never_loaded(tmp_path, reference):
    """Every memory copy of rank 1 is corrupted, then rank 1 dies: restore from storage."""
    run_dir = str(tmp_path / "run")
    # slow steps so that the background persister sees the early steps
    proc = run_job(run_dir, str(tmp_path / "final.pt"), "--corrupt-at", "12",
                   "--step-time", "0.2", ckptrun_args=["--persist-every", "5"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    evts = events(run_dir)
    restored = of(evts, "restored")
    assert restored and restored[0]["tier"] == "storage", evts
    # a durable step from before the corruption; the corrupted step 12 was never persisted
    assert 5 <= restored[0]["step"] < 12
    assert all(e["step"] != 12 for e in of(evts, "persisted"))
    assert_bitwise_equal(load(str(tmp_path / "final.pt")), reference)
    no_shm_left(run_dir)


def test_nothing_left_to_restore_is_said_loudly_not_a_silent_fresh_start(tmp_path, reference):
    """Every memory copy of rank 1 is corrupted and nothing was persisted: the workers can
    only start over -- and the agent says so (``progress_lost``, a WARNING on stderr) with the
    step that was lost.  The deterministic job still ends with the right weights."""
    run_dir = str(tmp_path / "run")
    proc = run_job(run_dir, str(tmp_path / "final.pt"), "--corrupt-at", "12")
    assert proc.returncode == 0, proc.stderr[-3000:]
    evts = events(run_dir)
    assert not of(evts, "restored"), evts
    lost = of(evts, "progress_lost")
    assert len(lost) == 1 and lost[0]["step"] >= 12 and lost[0]["attempt"] == 1, evts
    assert "WARNING: no step can be restored for every rank" in proc.stderr, proc.stderr[-3000:]
    assert f"reached step {lost[0]['step']}" in proc.stderr
    assert_bitwise_equal(load(str(tmp_path / "final.pt")), reference)
    no_shm_left(run_dir)


def test_agent_killed_then_rerun_resumes_from_storage(tmp_path, reference):
    """The agent dies (SIGKILL): no worker survives; the same command resumes from storage."""
    run_dir = str(tmp_path / "run")
    out = str(tmp_path / "final.pt")
    proc = run_job(run_dir, out, "--kill-agent-at", "17", "--step-time", "0.2",
                   ckptrun_args=["--persist-every", "5"])
    assert proc.returncode != 0
    assert not os.path.exists(out)
    no_shm_left(run_dir)
    proc = run_job(run_dir, out, ckptrun_args=["--persist-every", "5"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    restored = of(events(run_dir), "restored")
    assert restored and restored[-1]["tier"] == "storage"
    assert 5 <= restored[-1]["step"] <= 17
    assert_bitwise_equal(load(out), reference)
    no_shm_left(run_dir)


@pytest.mark.compat("--resume-from a persisted step, bitwise")
def test_resume_from_a_durable_checkpoint_in_a_new_run(tmp_path, reference):
    """A 15-step job persists its final step; a new job (own run dir) started with
    --resume-from continues it to 30 steps and ends bitwise equal to one 30-step run."""
    durable = str(tmp_path / "durable")
    cmd = [sys.executable, "-m", "ckptrun.cli", "--standalone", "--nproc-per-node", "2",
           "--run-dir", str(tmp_path / "first"), "--persist-to", durable, SCRIPT,
           "--steps", "15"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = str(tmp_path / "second")
    proc = run_job(run_dir, str(tmp_path / "final.pt"),
                   ckptrun_args=["--resume-from", durable + "/step-15"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    restored = of(events(run_dir), "restored")
    assert restored and restored[0] == {**restored[0], "tier": "storage", "step": 15}
    assert_bitwise_equal(load(str(tmp_path / "final.pt")), reference)
    no_shm_left(run_dir)


def test_snapshot_every_n_restores_the_last_snapshot_and_replays_bitwise(tmp_path, reference):
    """``--snapshot-every 4``: a failure after step 14 goes back to step 12, every rank's
    newest snapshot (ranks agree on the steps), and the replayed steps end bitwise equal."""
    run_dir = str(tmp_path / "run")
    proc = run_job(run_dir, str(tmp_path / "final.pt"), "--crash-at", "14",
                   ckptrun_args=["--snapshot-every", "4"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    evts = events(run_dir)
    intervals = of(evts, "snapshot_interval")
    assert intervals and {e["every"] for e in intervals} == {4}, evts
    with open(os.path.join(run_dir, "status.json")) as f:
        st = json.load(f)
    # (failed once in a full run, never alone: the whole status says which record lacked it)
    assert {w.get("snapshot_every") for w in st["workers"]} == {4}, (st, evts)
    restored = of(evts, "restored")
    assert [(r["tier"], r["step"]) for r in restored] == [("memory", 12)], evts
    assert_bitwise_equal(load(str(tmp_path / "final.pt")), reference)
    assert of(evts, "finished")[-1]["exit_code"] == 0
    no_shm_left(run_dir)
