"""Lightning (strategy="ddp") and the HF Trainer (use_cpu, gloo) under ckptrun: rank 1 is
SIGKILLed mid-run (in the second epoch, mid-epoch), the job restores from memory, and the
final weights are bitwise equal to the failure-free run.  Each also runs under plain python
(in-process snapshots)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from adapter_util import SCRIPTS, assert_bitwise, ckptrun_job, of

pytestmark = pytest.mark.slow

JOBS = {"lightning": ("lightning_train.py", "lightning"),
        "transformers": ("hf_train.py", "transformers")}


@pytest.mark.parametrize("name", sorted(JOBS))
def test_sigkill_restores_from_memory_bitwise(tmp_path, name):
    script, module = JOBS[name]
    pytest.importorskip(module)
    ref, out = str(tmp_path / "ref.pt"), str(tmp_path / "out.pt")
    evts = ckptrun_job(str(tmp_path / "ref"), script, "--out", ref)
    assert not of(evts, "restart"), evts
    evts = ckptrun_job(str(tmp_path / "run"), script, "--out", out, "--crash-at", "9")
    assert of(evts, "worker_failed")
    restored = of(evts, "restored")
    assert restored and restored[0]["tier"] == "memory" and restored[0]["step"] >= 7, evts
    assert_bitwise(torch.load(ref, weights_only=True), torch.load(out, weights_only=True))


@pytest.mark.parametrize("name", sorted(JOBS))
def test_plain_python_in_process(tmp_path, name):
    script, module = JOBS[name]
    pytest.importorskip(module)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CKPTRUN_", "RANK", "WORLD"))}
    proc = subprocess.run([sys.executable, os.path.join(SCRIPTS, script), "--epochs", "1",
                           "--out", str(tmp_path / "w.pt")], capture_output=True, text=True,
                          timeout=240, env=env, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert os.path.exists(tmp_path / "w.pt")


