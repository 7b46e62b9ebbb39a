"""``--persist-every N`` persists the multiples of N (and the final step of a job that
succeeds): the durable steps a user expects to find, and ``--resume-from`` one of them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "examples", "train.py")

pytestmark = [pytest.mark.slow, pytest.mark.compat("--persist-every")]


def job(run_dir, *args: str, script_args=()):
    proc = subprocess.run([sys.executable, "-m", "ckptrun.cli", "--standalone",
                           "--nproc-per-node", "2", "--run-dir", str(run_dir), *args, TRAIN,
                           "--width", "64", *script_args],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(os.path.join(run_dir, "events.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def steps_of(evts, name):
    return [e["step"] for e in evts if e["event"] == name]


def test_the_multiples_of_n_and_the_final_step(tmp_path):
    evts = job(tmp_path / "a", "--persist-every", "5",
               script_args=["--steps", "23", "--step-time", "0.05"])
    assert steps_of(evts, "persisted") == [5, 10, 15, 20, 23], evts


def test_fast_steps_persist_only_multiples_and_resume_from_one(tmp_path):
    """Steps of a few ms: the persister may miss a multiple while it writes the last one,
    never persists a step that is not one; and a multiple resumes with --resume-from."""
    evts = job(tmp_path / "a", "--persist-every", "10", script_args=["--steps", "60"])
    persisted = steps_of(evts, "persisted")
    assert persisted and persisted[-1] == 60, evts
    assert all(s % 10 == 0 for s in persisted), persisted
    some = persisted[-2] if len(persisted) > 1 else 60  # still kept (--keep 3 prunes older)
    again = job(tmp_path / "b", "--resume-from",
                os.path.join(tmp_path, "a", "checkpoints", f"step-{some}"),
                script_args=["--steps", str(some + 3)])
    restored = [e for e in again if e["event"] == "restored"]
    assert restored and restored[0]["step"] == some and restored[0]["tier"] == "storage"
