"""``--resume-from`` a checkpoint that cannot be used: exit 2, never a fresh start.

Before, a flipped byte in a data file failed the checksum at restore and the job quietly
trained from step 0 under a command line that said it resumed."""

from __future__ import annotations

import glob
import os
import subprocess
import sys

import pytest
from conftest import ROOT, run_events
from test_sec_durable_reader import checkpoint, rewrite_index

from ckptrun.tiers.durable import storage

TRAIN = os.path.join(ROOT, "examples", "train.py")


def ckptrun(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckptrun.cli", "--standalone",
                           "--nproc-per-node", "1", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_a_malformed_index_is_refused_before_anything_starts(tmp_path):
    url = checkpoint(tmp_path)
    rewrite_index(url, lambda i: i.__setitem__("world_size", "two"))
    proc = ckptrun("--run-dir", str(tmp_path / "run"), "--resume-from", url, TRAIN)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "is not a ckptrun checkpoint" in proc.stderr and "world_size" in proc.stderr
    assert not os.path.exists(tmp_path / "run" / "events.jsonl")


@pytest.mark.slow
def test_a_corrupt_resume_from_exits_2_and_trains_nothing(tmp_path):
    first = ckptrun("--run-dir", str(tmp_path / "a"), "--persist-every", "5", TRAIN,
                    "--width", "64", "--steps", "10")
    assert first.returncode == 0, first.stderr[-3000:]
    step_dir = storage.step_url(str(tmp_path / "a" / "checkpoints"), 10)
    index = storage.read_index(step_dir, None)
    biggest = max(index["ranks"]["0"]["tensors"], key=lambda e: e["length"])
    path = os.path.join(step_dir, biggest["file"])
    with open(path, "r+b") as f:  # one byte in the middle of the largest tensor's bytes
        f.seek(biggest["offset"] + biggest["length"] // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x10]))
    run = tmp_path / "b"
    proc = ckptrun("--run-dir", str(run), "--resume-from", step_dir, TRAIN, "--width", "64",
                   "--steps", "20")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert "cannot be restored" in proc.stderr and "checksum" in proc.stderr, proc.stderr[-2000:]
    events = run_events(str(run))
    rejected = [e for e in events if e["event"] == "restore_rejected"]
    assert rejected and rejected[0]["tier"] == "storage" and rejected[0]["step"] == 10, events
    assert not any(e["event"] in ("restored", "worker_failed") for e in events), events
    assert any(e["event"] == "resume_refused" for e in events), events
    assert not glob.glob(str(run / "**" / "attempt_0"), recursive=True), "a worker was started"
