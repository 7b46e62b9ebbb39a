"""Helpers of the adapter tests: run a job under ckptrun or torchrun, compare weights."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Dict, List, Sequence

import torch
from conftest import file_tail, run_events, run_status

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "examples")  # the adapter examples double as test jobs


def run(cmd: List[str], timeout: float = 240, env=None) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env=None if env is None else {**os.environ, **env})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


def ckptrun_job(run_dir: str, script: str, *args: str, nproc: int = 2,
                launcher: Sequence[str] = ()) -> List[dict]:
    """Run ``script`` under ``ckptrun --standalone`` (and ``launcher``'s options); returns the
    run's events."""
    # a job without an injected failure has no use for warm spares
    failing = any(a.startswith("--crash") for a in args)
    try:
        run([sys.executable, "-m", "ckptrun.cli", "--standalone", "--nproc-per-node", str(nproc),
             "--run-dir", run_dir, *launcher, os.path.join(SCRIPTS, script), *args],
            env=None if failing else {"CKPTRUN_WARM_SPARES": "0"})
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the job ran past its time; {_what_it_did(run_dir)}") from None
    evts = run_events(run_dir)
    assert evts, f"the job wrote no events into {run_dir}"
    return evts


def _what_it_did(run_dir: str) -> str:
    """A timed-out job's events, workers' status and the last lines each rank and each
    stack dump wrote (a hang in CI must say where it stood)."""
    out = [f"events: {run_events(run_dir)}", f"workers: {run_status(run_dir).get('workers')}"]
    for sub in ("logs", "stacks"):
        for root, _, files in sorted(os.walk(os.path.join(run_dir, sub))):
            for name in sorted(files):
                tail = file_tail(os.path.join(root, name), 1500)
                if tail.strip():
                    out.append(f"--- {os.path.relpath(os.path.join(root, name), run_dir)}:\n"
                               f"{tail}")
    return "\n".join(out)


def torchrun_job(script: str, *args: str, nproc: int = 2) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", str(nproc), os.path.join(SCRIPTS, script), *args])


def of(events: List[dict], name: str) -> List[dict]:
    return [e for e in events if e["event"] == name]


def assert_bitwise(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], dict):
            assert_bitwise(a[k], b[k])
        else:
            assert torch.equal(a[k], b[k]), f"{k} differs"
