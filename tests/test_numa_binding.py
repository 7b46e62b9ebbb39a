"""``--numa-binding``: each worker runs on the CPUs torch assigns its GPU (as torchrun's
``numactl --physcpubind``), warm spares included; where it cannot apply, one usage line.

This machine has no GPU: torch's CPU-set choice is replaced by a fixed one where a test
needs a set, and the affinity the started process really has is read back."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ckptrun.agent import numa
from ckptrun.agent.logs import StreamRoute
from ckptrun.agent.workers import _spawn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHOW = "import os; print(sorted(os.sched_getaffinity(0)))"


def _run(cpus):
    """The CPUs a child started by the agent's own spawn sees itself on."""
    routes = {"stdout": StreamRoute(to_file=True, to_console=False),
              "stderr": StreamRoute(to_file=False, to_console=True)}
    child, reads = _spawn([sys.executable, "-c", SHOW], dict(os.environ), routes, cpus=cpus)
    with os.fdopen(reads["stdout"]) as f:
        out = f.read()
    child.wait(30)
    return json.loads(out)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to tell")
def test_a_worker_starts_on_the_cpus_it_is_given():
    allowed = sorted(os.sched_getaffinity(0))
    assert _run(frozenset({allowed[-1]})) == [allowed[-1]]
    assert _run(None) == allowed  # without --numa-binding: the agent's own set


def test_the_binder_asks_torch_once_per_local_rank(monkeypatch):
    asked = []

    def fake(mode, gpu):
        asked.append((mode, gpu))
        return {gpu}
    monkeypatch.setattr(numa, "torch_cpus", fake)
    binder = numa.Binder("node")
    assert binder.cpus(1) == frozenset({1}) and binder.cpus(1) == frozenset({1})
    assert binder.cpus(0) == frozenset({0})
    assert asked == [("node", 1), ("node", 0)]
    assert numa.Binder(None).cpus(0) is None


def test_without_a_gpu_it_is_refused_in_one_line(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "ckptrun.cli", "--standalone", "--nproc-per-node", "1",
         "--run-dir", str(tmp_path / "run"), "--numa-binding", "node",
         os.path.join(ROOT, "examples", "train.py")],
        capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "ckptrun: error: --numa-binding node binds each worker to the CPUs near its GPU "
        "(GPU index = local rank); this machine has no CUDA GPU"], proc.stderr
    assert not (tmp_path / "run").exists()
