"""Run files, logs and a custom ``--persist-to`` are the user's alone, whatever the umask;
what the script itself writes keeps the user's umask, as under torchrun."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest
from conftest import ROOT

TRAIN = os.path.join(ROOT, "examples", "train.py")


def _open_to_others(top: str) -> list:
    bad = []
    for d, _dirs, files in os.walk(top):
        for p in [d] + [os.path.join(d, f) for f in files]:
            mode = os.lstat(p).st_mode
            if not stat.S_ISLNK(mode) and mode & 0o077:
                bad.append(f"{oct(mode & 0o777)} {p}")
    return bad


@pytest.mark.slow
def test_checkpoints_and_run_files_are_private_under_a_lax_umask(tmp_path):
    persist, run, out = tmp_path / "shared" / "ckpts", tmp_path / "run", tmp_path / "final.pt"
    proc = subprocess.run(
        ["sh", "-c", 'umask 000 && exec "$@"', "sh", sys.executable, "-m", "ckptrun.cli",
         "--standalone", "--nproc-per-node", "1", "--run-dir", str(run), "--persist-to",
         str(persist), "--persist-every", "2", TRAIN, "--width", "32", "--steps", "4",
         "--out", str(out)], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert os.listdir(persist), "nothing was persisted"
    assert _open_to_others(str(persist)) == []
    assert _open_to_others(str(run)) == []
    # the script's own output: its umask (000) applies, not the agent's
    assert os.stat(out).st_mode & 0o777 == 0o666
