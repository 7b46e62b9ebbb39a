"""What ckptrun prints on the running torch is what torchrun prints: no warning of its own making.

Run in the compatibility part of ``make test`` on every torch release of the range: a
deprecation of something ckptrun imports (torch 2.15 deprecates DCP's private
``_fsspec_filesystem``) shows here first.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from conftest import ROOT, ckptrun_cmd

pytestmark = pytest.mark.compat("nothing printed that torchrun does not print (warnings)")

TRAIN = os.path.join(ROOT, "examples", "train.py")
_WARNING = re.compile(r"(\w*Warning): (.*)")


def warnings_in(text: str) -> set:
    """The ``Category: message`` warnings in ``text``, numbers and paths left out (pids,
    timestamps, temporary directories differ between two runs of the same job)."""
    out = set()
    for line in text.splitlines():
        m = _WARNING.search(line)
        if m:
            msg = re.sub(r"/\S+", "<path>", m.group(2))
            out.add(f"{m.group(1)}: {re.sub(r'[0-9]+', 'N', msg)}")
    return out


@pytest.mark.slow
def test_a_job_with_a_failure_and_persists_prints_no_warning_torchrun_does_not(tmp_path):
    """The same 2-rank script under torchrun, and under ckptrun SIGKILLed once (restored from
    memory) and persisting to storage every 5 steps.  (torchrun restarting the same kill
    failed its second attempt's gloo connect now and then, a torch matter.)"""
    args = [TRAIN, "--steps", "20", "--width", "64"]
    env = dict(os.environ, PYTHONWARNINGS="default")  # every warning shown, each once
    torchrun = subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--standalone",
         "--nproc-per-node", "2", *args,
         "--out", str(tmp_path / "t.pt")],
        capture_output=True, text=True, timeout=300, env=env, cwd=str(tmp_path))
    assert torchrun.returncode == 0, torchrun.stderr[-3000:]
    ours = subprocess.run(
        ckptrun_cmd("--standalone", "--nproc-per-node", "2", "--run-dir", str(tmp_path / "run"),
                    "--persist-to", str(tmp_path / "ckpt"), "--persist-every", "5", *args,
                    "--crash-at", "8",
                    "--out", str(tmp_path / "c.pt")),
        capture_output=True, text=True, timeout=300, env=env, cwd=str(tmp_path))
    assert ours.returncode == 0, ours.stderr[-3000:]
    printed = ours.stdout + ours.stderr
    assert "ckptrun: warning" not in printed, printed[-3000:]
    extra = warnings_in(printed) - warnings_in(torchrun.stdout + torchrun.stderr)
    assert not extra, f"ckptrun printed warnings torchrun did not: {sorted(extra)}"


def test_persisting_to_an_fsspec_url_warns_nothing(tmp_path):
    """A step written to a non-local fsspec URL (DCP's ``FsspecWriter``) and to a local
    directory, twice, and read back, in a fresh process with every warning an error (torch
    warns of some things once per process: another test must not have used that up)."""
    code = f"""
import os, sys
sys.path.insert(0, {os.path.join(ROOT, "tests")!r})
from test_storage_format import assert_same, snapshots
from ckptrun.tiers.durable import storage
for url in ("memory://compat-ckpt", {str(tmp_path / "local")!r}):
    snaps = snapshots(3)
    storage.write_step(url, 3, snaps, world_size=2)
    storage.write_step(url, 3, snaps, world_size=2)  # a resumed job persisting it again
    assert [s["step"] for s in storage.list_steps(url)] == [3]
    assert_same(storage.read_rank(url, 3, 1), snaps[1])
print("ok")
"""
    proc = subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True,
                          text=True, timeout=120, cwd=str(tmp_path))
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
