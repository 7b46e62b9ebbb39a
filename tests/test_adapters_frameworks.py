"""The framework examples: a plain 🤗 Accelerate loop under ckptrun -- rank 1 is SIGKILLed
mid-run (in the second epoch, mid-epoch), the job restores from memory, and the final weights
are bitwise equal to the failure-free run, with rank 0 restarted or recovering in its own
process under ``@ckptrun.resilient`` (``--in-place``); and every example (Lightning, the HF
Trainer, Accelerate) under plain python (in-process snapshots).

Lightning's and the HF Trainer's callbacks are recovered the same two ways at 3 ranks by
tests/test_framework_gpt_scripts.py, in scripts written the way users write them (loader
workers, evaluation, accumulation); the examples' own runs of that here went to keep CI
under 30 minutes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from adapter_util import SCRIPTS, assert_bitwise, ckptrun_job, of
from conftest import shared_weights

pytestmark = pytest.mark.slow

JOBS = {"lightning": ("lightning_train.py", "lightning"),
        "transformers": ("hf_train.py", "transformers"),
        "accelerate": ("accelerate_train.py", "accelerate")}
RECOVERED = ["accelerate"]  # the others: tests/test_framework_gpt_scripts.py


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """name -> the failure-free run's final weights (one run per framework)."""
    def make(name: str, tmp) -> str:
        path = str(tmp / "ref.pt")
        evts = ckptrun_job(str(tmp / "run"), JOBS[name][0], "--out", path)
        assert not of(evts, "restart"), evts
        return path

    return lambda name: shared_weights(tmp_path_factory, f"frameworks-{name}",
                                       lambda tmp: make(name, tmp))


@pytest.mark.parametrize("in_place", [False, True], ids=["restart", "in-place"])
@pytest.mark.parametrize("name", RECOVERED)
def test_sigkill_restores_from_memory_bitwise(tmp_path, references, name, in_place):
    script, module = JOBS[name]
    pytest.importorskip(module)
    out = str(tmp_path / "out.pt")
    evts = ckptrun_job(str(tmp_path / "run"), script, "--out", out, "--crash-at", "9",
                       *(["--in-place"] if in_place else []))
    assert of(evts, "worker_failed")
    restarts = of(evts, "restart")
    # in place: the survivor kept its process, and it took no second restart (a framework
    # that kept the destroyed group -- accelerate's singletons -- failed the new attempt)
    assert [r.get("in_place") for r in restarts] == [[0] if in_place else None], restarts
    restored = of(evts, "restored")
    assert restored and restored[0]["tier"] == "memory" and restored[0]["step"] >= 7, evts
    assert_bitwise(references(name), torch.load(out, weights_only=True))


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


