"""A GPT loop written like the popular open-source trainers (examples/gpt_train.py: a batch
prefetched before the step ends, numbers the loop rebinds, gradient accumulation under
no_sync, a rank-0-only evaluation, GradScaler, an LR schedule from iter_num, plain DDP)
killed by SIGKILL at 3 ranks resumes bitwise: weights and best_val_loss as without the kill."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "gpt_train.py")

pytestmark = [pytest.mark.slow, pytest.mark.compat(
    "a users'-style GPT loop (prefetch, rank-0 eval, grad accumulation), 3 ranks, SIGKILL, bitwise")]


def _run(tmp_path, name: str, *args: str) -> dict:
    out = tmp_path / f"{name}.pt"
    proc = subprocess.run(
        [sys.executable, "-m", "ckptrun.cli", "--standalone", "--nproc-per-node", "3",
         "--run-dir", str(tmp_path / name), SCRIPT, "--iters", "30", "--out", str(out), *args],
        capture_output=True, text=True, timeout=300,
        # a run without a failure has no use for warm spares
        env=dict(os.environ, **({} if args else {"CKPTRUN_WARM_SPARES": "0"})))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"result": torch.load(out, weights_only=True), "stderr": proc.stderr}


def test_gpt_loop_resumes_bitwise_after_a_sigkill(tmp_path):
    want = _run(tmp_path, "reference")["result"]
    got = _run(tmp_path, "failed", "--crash-at", "15")
    assert "restored step" in got["stderr"] and "from memory" in got["stderr"]
    assert "warning" not in got["stderr"]
    for k, v in want["weights"].items():
        assert torch.equal(v, got["result"]["weights"][k]), k
    assert torch.equal(want["best_val_loss"], got["result"]["best_val_loss"])
