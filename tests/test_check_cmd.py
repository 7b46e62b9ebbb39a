"""``ckptrun check``: a correct loop is reported exact; each mistake is named -- a batch
fetched ahead and not saved, numbers registered in the dict and rebound, a job that is not
deterministic at all; bad command lines are usage errors (exit 2) before anything runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOOPS = os.path.join(ROOT, "tests", "scripts", "check_loops.py")


def check(tmp_path, *args: str, timeout: int = 400, nproc: int = 2
          ) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckptrun.cli", "check", "--standalone",
                           "--nproc-per-node", str(nproc), "--run-dir", str(tmp_path / "check"),
                           *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("args,message", [
    (["--rank", "5", LOOPS], "--rank 5 is outside 0..1"),
    (["--steps", "4", "--fail-at", "4", LOOPS], "--fail-at 4 must be before --steps 4"),
    (["--faults", "20", "--steps", "10", LOOPS], "--faults 20 needs at least 21 steps"),
    (["--faults", "3", "--kinds", "kill,bogus", LOOPS], "--kinds takes a comma-separated"),
    (["--faults", "0", LOOPS], "--faults must be >= 1"),
    (["--faults", "3", "--fail-at", "2", LOOPS], "--fail-at/--rank name a single failure"),
    (["--fail-at", "0", LOOPS], "--fail-at must be >= 1"),
])
def test_bad_command_lines_are_refused_before_anything_runs(tmp_path, args, message):
    proc = check(tmp_path, *args, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("ckptrun: error: ") and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "check" / "reference").exists()


@pytest.mark.slow
@pytest.mark.compat("ckptrun check")
def test_a_correct_loop_is_exact(tmp_path):
    proc = check(tmp_path, LOOPS, "--mode", "correct")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert proc.stdout.strip() == "exact: steps 7..12 bitwise equal after a restore at 6"
    assert "reference run" in proc.stderr and "failure run" in proc.stderr  # progress shown
    assert "reference-2" not in proc.stderr  # exact: no third run needed


@pytest.mark.slow
@pytest.mark.parametrize("mode,deterministic,named", [
    ("prefetch", True, "a batch fetched before save()"),
    ("rebind", True, "state entry 'best' is a plain number"),
    ("nondeterministic", False, "the job is not deterministic"),
])
def test_each_mistake_is_named(tmp_path, mode, deterministic, named):
    proc = check(tmp_path, "--json", LOOPS, "--mode", mode, nproc=1)  # one rank shows it
    assert proc.returncode == 1, proc.stdout + proc.stderr[-3000:]
    got = json.loads(proc.stdout)
    assert got["exact"] is False and got["deterministic"] is deterministic, got
    assert got["first_divergent_step"] == got["restored_step"] + 1, got
    assert "model" in got["divergent_entries"], got
    assert named in got["hint"], got["hint"]
