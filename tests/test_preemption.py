"""Preemption (Slurm's or Kubernetes' SIGTERM, a Ctrl-C) keeps the newest step: the agent
forwards the signal to the workers as torchrun does, persists the newest step every rank
committed, exits 1; the same command run again -- no --run-dir, the default run dir is stable
for the same job -- resumes from it and ends bitwise equal to an uninterrupted run."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from conftest import shared_weights

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "examples", "train.py")
ARGS = ["--steps", "40", "--step-time", "0.05", "--width", "64", "--out", "final.pt"]

pytestmark = pytest.mark.slow


def ckptrun(*args: str) -> list:
    return [sys.executable, "-m", "ckptrun.cli", "--standalone", "--nproc-per-node", "2", *args]


def events(run_dir: str) -> list:
    with open(os.path.join(run_dir, "events.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def wait_for_step(cwd, step: int, timeout: float = 120.0) -> str:
    deadline = time.time() + timeout
    while time.time() < deadline:
        for status in glob.glob(os.path.join(cwd, "ckptrun-runs", "*", "status.json")):
            try:
                st = json.load(open(status))
            except ValueError:
                continue
            if (st["checkpoint"].get("memory_step") or 0) >= step:
                return os.path.dirname(status)
        time.sleep(0.1)
    raise AssertionError("the job never got there")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    def make(ref) -> str:
        subprocess.run(ckptrun(TRAIN, *ARGS), cwd=ref, check=True, capture_output=True,
                       timeout=240, env=dict(os.environ, CKPTRUN_WARM_SPARES="0"))  # no failure
        return str(ref / "final.pt")
    return shared_weights(tmp_path_factory, "preemption", make)


@pytest.mark.compat("SIGTERM preemption, resumed by the same command")
def test_preempted_job_resumes_from_its_newest_step(tmp_path, reference):
    # SIGTERM (Slurm, Kubernetes); a Ctrl-C's SIGINT takes the same path in the agent, and
    # its forwarding to the workers is tested below
    sig = signal.SIGTERM
    work = tmp_path / "work"
    work.mkdir()
    job = subprocess.Popen(ckptrun(TRAIN, *ARGS), cwd=work, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    run_dir = wait_for_step(work, 15)
    job.send_signal(sig)
    _, err = job.communicate(timeout=120)
    assert job.returncode == 1, err[-3000:]  # as torchrun
    evts = events(run_dir)
    persisted = [e for e in evts if e["event"] == "persisted"]
    assert persisted and persisted[-1]["step"] >= 15, evts
    newest = persisted[-1]["step"]
    # a preemption is said as what it is, not as a failed job
    assert [e.get("signal") for e in evts if e["event"] == "finished"] == [sig.name], evts
    assert f"ckptrun: stopped by {sig.name} (exit code 1)" in err and "job failed" not in err, \
        err[-3000:]

    again = subprocess.run(ckptrun(TRAIN, *ARGS), cwd=work, capture_output=True, text=True,
                           timeout=240)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resuming from step {newest} (storage)" in again.stderr, again.stderr[-3000:]
    assert glob.glob(os.path.join(work, "ckptrun-runs", "*")) == [run_dir]  # the same dir
    got = torch.load(work / "final.pt", weights_only=True)
    for k in reference:
        assert torch.equal(reference[k], got[k]), k


RECORDER = textwrap.dedent("""
    import os, signal, sys, time
    out = sys.argv[1] + "." + os.environ["RANK"]
    def got(signum, frame):
        open(out, "w").write(signal.Signals(signum).name)
        sys.exit(0)
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, got)
    open(sys.argv[1] + ".ready." + os.environ["RANK"], "w").close()
    while True:
        time.sleep(0.05)
""")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_the_workers_get_the_signal_the_agent_got(tmp_path, sig):
    script = tmp_path / "rec.py"
    script.write_text(RECORDER)
    mark = str(tmp_path / "sig")
    job = subprocess.Popen(ckptrun("--run-dir", str(tmp_path / "run"), str(script), mark),
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while time.time() < deadline and len(glob.glob(mark + ".ready.*")) < 2:
        time.sleep(0.05)
    job.send_signal(sig)
    _, err = job.communicate(timeout=60)
    assert job.returncode == 1, err[-2000:]
    for rank in (0, 1):
        assert open(f"{mark}.{rank}").read() == sig.name
