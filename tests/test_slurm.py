"""ckptrun under a real Slurm (``tests/slurm_cluster.py``): an ``sbatch --requeue`` job of 2
emulated nodes runs ``srun ckptrun`` with no rendezvous flags at all; a worker crash restarts
in place; ``scontrol requeue`` (TERM, as a preemption) keeps the newest step, and the requeued
job resumes it and ends bitwise equal to an uninterrupted run; ``ckptrun status`` reads the
job from the batch host's submit directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch
from machines import status as _status
from slurm_cluster import start_cluster

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "examples", "train.py")
BIN = os.path.dirname(sys.executable)
STEPS = 70
ARGS = ["--width", "32", "--steps", str(STEPS)]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = start_cluster(str(tmp_path_factory.mktemp("slurm")), ["n1", "n2"])
    yield c
    c.stop()


def events(run_dir: str) -> list:
    try:
        with open(os.path.join(run_dir, "events.jsonl")) as f:
            return [json.loads(line) for line in f if line.strip()]
    except OSError:
        return []


def wait_for(pred, timeout: float, what: str, cluster, job: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}; job state "
                         f"{cluster.job_field(job, 'JobState')}")


def test_srun_ckptrun_needs_no_rendezvous_flags_and_survives_a_requeue(cluster, tmp_path):
    ref = tmp_path / "ref"
    done = subprocess.run([os.path.join(BIN, "ckptrun"), "--standalone", "--nproc-per-node",
                           "2", "--run-dir", str(ref), TRAIN, *ARGS, "--out",
                           str(tmp_path / "ref.pt")],
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, CKPTRUN_WARM_SPARES="0"))
    assert done.returncode == 0, done.stderr[-3000:]

    work = tmp_path / "submit"
    work.mkdir()
    script = work / "job.sh"
    # the crash is injected in the first attempt of the first run only (train.py reads
    # TORCHELASTIC_RESTART_COUNT); the requeued run starts past it anyway
    script.write_text(
        "#!/bin/bash\n"
        f"srun --ntasks-per-node=1 {BIN}/ckptrun --nproc-per-node 1 --persist-every 1000 "
        f"{TRAIN} {' '.join(ARGS)} --step-time 0.15 --crash-at 8 --out {work}/final.pt\n")
    out = cluster.run("sbatch", "--parsable", "--requeue", "-N", "2", "--ntasks-per-node=1",
                      "--open-mode=append", "-o", str(work / "job.out"), str(script),
                      cwd=str(work))
    job = out.strip().split(";")[0]
    runs = work / "ckptrun-runs" / f"slurm-{job}"
    node0 = str(runs / "node-0")

    # a worker crash: restarted in place, restored from memory
    wait_for(lambda: any(e["event"] == "restored" for e in events(node0)), 180,
             "the restore after the crash", cluster, job)
    # preempted well before the end, with a newest step past any --persist-every multiple
    wait_for(lambda: max((w.get("step", 0) for w in _status(node0).get("workers", [])),
                         default=0) >= 25, 120, "step 25", cluster, job)
    cluster.run("scontrol", "requeue", job)
    wait_for(lambda: any(e["event"] == "persisted" for e in events(node0)), 60,
             "the persist at the preemption", cluster, job)
    stopped = [e for e in events(node0) if e["event"] == "persisted"][0]["step"]
    assert 25 <= stopped < STEPS - 10, stopped
    # run the requeued job now rather than after the credential lifetime
    wait_for(lambda: cluster.job_field(job, "JobState") in ("PENDING", "REQUEUED",
                                                              "RUNNING", "COMPLETED"),
             60, "the requeue", cluster, job)
    cluster.run("scontrol", "update", f"jobid={job}", "StartTime=now", check=False)
    wait_for(lambda: cluster.job_field(job, "JobState") == "COMPLETED", 240,
             "the requeued job to complete", cluster, job)

    log = (work / "job.out").read_text()
    assert f"ckptrun: resuming from step {stopped} (storage)" in log, log[-4000:]
    # the stop at the requeue is quiet: no thread of the agent died (the replication thread
    # once did, OverflowError); the survivor's gloo error after the crash is the script's own
    assert "OverflowError" not in log and "Exception in thread" not in log, log[-4000:]
    assert cluster.job_field(job, "Restarts") == "1"
    got = torch.load(str(work / "final.pt"), weights_only=True)
    want = torch.load(str(tmp_path / "ref.pt"), weights_only=True)
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), f"{k} differs from the uninterrupted run"
    for node in ("node-0", "node-1"):  # one run dir per machine, checkpoints shared
        assert (runs / node / "events.jsonl").exists(), node
    assert any((runs / "checkpoints").glob("step-*"))

    status = subprocess.run([os.path.join(BIN, "ckptrun"), "status", "--json"], cwd=str(work),
                            capture_output=True, text=True, timeout=60)
    assert status.returncode == 0, status.stderr
    st = json.loads(status.stdout)
    assert st["run_id"] == f"slurm-{job}" and st["state"] == "succeeded", st
    assert st["nnodes"] == 2 and st["checkpoint"]["persisted_step"] == STEPS, st
