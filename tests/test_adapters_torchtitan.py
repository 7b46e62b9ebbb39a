"""torchtitan's own components registered with ckptrun (``examples/torchtitan_train.py``):
its ``ModelWrapper`` over an FSDP2 model (DTensor state), ``OptimizersContainer`` (flat,
FQN-keyed), ``LRSchedulersContainer`` and a ``train_state`` dataclass.  A rank SIGKILLed
mid-run is restored from memory and the job ends bitwise equal to the failure-free run --
restarted at 2 and 4 ranks, in place at 2 -- and ``ckptrun check`` reports the loop exact.

torchtitan's llama3 model needs triton and its data pipeline HF ``datasets``: the model here
is a small MLP and batches come from the step number (``make test`` installs torchtitan's
components alone, see the Makefile)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from adapter_util import SCRIPTS, assert_bitwise, ckptrun_job, of, torchrun_job

pytest.importorskip("torchtitan.components.optimizer",
                    reason="torchtitan is not installed (make test installs it)")

pytestmark = pytest.mark.slow
JOB = "torchtitan_train.py"


@pytest.mark.parametrize("nproc,in_place", [(2, False), (2, True), (4, False)],
                         ids=["2-restart", "2-in-place", "4-restart"])
def test_torchtitan_components_restore_bitwise_after_a_sigkill(tmp_path, nproc, in_place):
    ref, out = str(tmp_path / "ref.pt"), str(tmp_path / "out.pt")
    torchrun_job(JOB, "--steps", "6", "--out", ref, nproc=nproc)
    evts = ckptrun_job(str(tmp_path / "run"), JOB, "--steps", "6", "--crash-at", "3",
                       "--out", out, *(["--in-place"] if in_place else []), nproc=nproc)
    assert of(evts, "worker_failed") and of(evts, "restored")[0]["tier"] == "memory"
    assert len(of(evts, "restart")) == 1, evts  # restored at once, not a restart loop
    if in_place:
        assert of(evts, "restart")[0].get("in_place") == [r for r in range(nproc) if r != 1]
    got, want = torch.load(out, weights_only=True), torch.load(ref, weights_only=True)
    assert got["start"] >= 2
    assert_bitwise(want["model"], got["model"])
    assert_bitwise(want["optim"], got["optim"])
    assert got["lr"] == want["lr"] and got["ntokens_seen"] == want["ntokens_seen"]


def test_ckptrun_check_reports_the_torchtitan_loop_exact(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "ckptrun.cli", "check", "--standalone",
                           "--nproc-per-node", "2", "--run-dir", str(tmp_path / "check"),
                           os.path.join(SCRIPTS, JOB), "--steps", "10"],
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert proc.stdout.strip().startswith("exact: steps"), proc.stdout
