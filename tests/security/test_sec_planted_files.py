"""Files someone else planted where ckptrun reads: ``ckptrun status`` on a run directory and
``ckptrun restore`` on a checkpoint whose files are symlinks to devices or to other files,
FIFOs, huge, nested deep or of the wrong types.  Each read ends in one line (exit 2) or in a
bounded read, within seconds, never a traceback, never a hang, never gigabytes of memory.
(``ckptrun/protocol/untrusted.py``; before, a ``status.json`` linked to ``/dev/zero`` took
20 GB, a FIFO hung, deep JSON printed a ``RecursionError`` traceback.)"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time

import pytest
from test_storage_format import snapshots

from ckptrun.tiers.durable import storage

STEP = 7
BIG = 200 << 20  # sparse: takes no disk, reads as zeros


def _planted_link(target: str, path: str) -> None:
    """A symlink of another user's (planted): never followed.  (A link of the user's own is
    theirs to follow: see the last test.)"""
    os.symlink(target, path)
    if os.geteuid() == 0:
        os.lchown(path, 65534, 65534)


def _symlink_to_zero(path: str) -> None:
    _planted_link("/dev/zero", path)


def _symlink_to_a_file(path: str) -> None:
    _planted_link("/etc/hostname", path)  # a readable file that is not the user's data


def _own_symlink_to_zero(path: str) -> None:
    os.symlink("/dev/zero", path)  # the user's own link, to a device: not a regular file


def _fifo(path: str) -> None:
    os.mkfifo(path)


def _huge(path: str) -> None:
    with open(path, "wb") as f:
        f.truncate(BIG)


def _deep(path: str) -> None:
    with open(path, "w") as f:
        f.write("[" * 100_000 + "]" * 100_000)


def _wrong_types(path: str) -> None:
    with open(path, "w") as f:
        json.dump({"state": {"running": 1}, "workers": 5, "restarts": [],
                   "checkpoint": {"peers": 3}, "failures": "x", "updated": "soon"}, f)


PLANTS = {"a symlink to /dev/zero": _symlink_to_zero, "a symlink to another file":
          _symlink_to_a_file, "an own symlink to /dev/zero": _own_symlink_to_zero,
          "a FIFO": _fifo, "a 200 MB file": _huge,
          "JSON nested 100k deep": _deep, "JSON of the wrong types": _wrong_types}


def run(args, timeout: float = 60.0) -> subprocess.CompletedProcess:
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "ckptrun.cli", *args], capture_output=True,
                          text=True, timeout=timeout)
    assert time.monotonic() - t0 < timeout
    # the largest resident size of any child so far: bounded (a /dev/zero read took 20 GB)
    assert resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss < 1_500_000, "KiB"
    return proc


def one_line_or_fine(proc: subprocess.CompletedProcess) -> None:
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    if proc.returncode != 0:
        assert proc.returncode == 2, proc.stderr[-3000:]
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("ckptrun: error: "), proc.stderr


def run_dir(tmp_path) -> str:
    d = tmp_path / "run"
    d.mkdir()
    with open(d / "events.jsonl", "w") as f:
        f.write(json.dumps({"time": time.time(), "event": "start", "job_token": "x"}) + "\n")
    with open(d / "status.json", "w") as f:
        json.dump({"state": "running", "run_id": "run", "workers": []}, f)
    return str(d)


@pytest.mark.parametrize("plant", sorted(PLANTS))
def test_status_json_planted(tmp_path, plant):
    d = run_dir(tmp_path)
    os.unlink(os.path.join(d, "status.json"))
    PLANTS[plant](os.path.join(d, "status.json"))
    proc = run(["status", "--run-dir", d, "--json"])
    one_line_or_fine(proc)
    assert proc.returncode == 2, proc.stdout[-2000:]


@pytest.mark.parametrize("plant", sorted(PLANTS))
def test_events_log_planted(tmp_path, plant):
    d = run_dir(tmp_path)
    os.unlink(os.path.join(d, "events.jsonl"))
    PLANTS[plant](os.path.join(d, "events.jsonl"))
    proc = run(["status", "--run-dir", d])
    one_line_or_fine(proc)
    if plant in ("a symlink to /dev/zero", "a symlink to another file", "a FIFO",
                 "an own symlink to /dev/zero"):
        assert proc.returncode == 2


@pytest.mark.parametrize("target", ["ckptrun.json", "__0_0.distcp"])
@pytest.mark.parametrize("plant", ["a symlink to /dev/zero", "a symlink to another file",
                                   "an own symlink to /dev/zero", "a FIFO", "a 200 MB file",
                                   "JSON nested 100k deep"])
def test_a_checkpoint_file_planted(tmp_path, target, plant):
    url = str(tmp_path / "ck")
    storage.write_step(url, STEP, snapshots(STEP), world_size=2)
    path = os.path.join(url, f"step-{STEP}", target)
    os.unlink(path)
    PLANTS[plant](path)
    proc = run(["restore", "--from", os.path.join(url, f"step-{STEP}"),
                "--to", str(tmp_path / "out.pt"), "--format", "torch"])
    one_line_or_fine(proc)
    assert proc.returncode == 2 and not (tmp_path / "out.pt").exists(), proc.stderr


def test_a_checkpoint_made_of_the_users_own_links_is_read(tmp_path):
    """A step directory whose files are the user's own symlinks to the real ones (a hub
    snapshot, ``cp -s``) restores as the files themselves would."""
    url = str(tmp_path / "ck")
    storage.write_step(url, STEP, snapshots(STEP), world_size=2)
    real, linked = os.path.join(url, f"step-{STEP}"), tmp_path / "linked"
    linked.mkdir()
    for name in os.listdir(real):
        os.symlink(os.path.join(real, name), linked / name)
    proc = run(["restore", "--from", str(linked), "--to", str(tmp_path / "out.pt"),
                "--format", "torch"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "out.pt").exists()
