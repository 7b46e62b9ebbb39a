"""DeepSpeed ZeRO 0-3 under ckptrun (``ckptrun.adapters.deepspeed``): rank 1 SIGKILLed after
optimizer step 6 of 12, restored from memory, ends bitwise equal to the failure-free run --
with the engine registered and nothing else; a snapshot refuses another ZeRO stage."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install deepspeed)")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NO_SHM_OP = os.path.join(ROOT, "tests", "scripts", "deepspeed_no_shm_op.py")
EXAMPLE = os.path.join(ROOT, "examples", "deepspeed_train.py")


def _run(tmp_path, name: str, stage: int, *extra: str):
    run_dir, out = tmp_path / name, tmp_path / f"{name}.pt"
    proc = subprocess.run(
        [sys.executable, "-m", "ckptrun.cli", "--standalone", "--nproc-per-node", "2",
         "--run-dir", str(run_dir), NO_SHM_OP, EXAMPLE, "--zero-stage", str(stage),
         "--steps", "12",
         "--out", str(out), *extra],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(run_dir / "events.jsonl") as f:
        evts = [json.loads(line) for line in f if line.strip()]
    return torch.load(str(out), weights_only=True), evts


@pytest.mark.slow
# stage 1 (optimizer state partitioned) stands for stage 2 too, whose checkpointed state is
# laid out the same (it partitions the gradients, which are not saved); stage 0's state is
# plain DDP's (tests/test_ddp_exact.py); stage 3 keeps the parameters under 20,000 elements
# whole (all but the 256x256 one), so that one run has partitioned and whole parameters --
# stage 3 with every parameter partitioned adds nothing to it: CI's 30 minutes went to the
# other cases
@pytest.mark.parametrize("stage,extra", [
    (1, []), (3, ["--persistence-threshold", "20000"])], ids=["1", "3-small-whole"])
def test_zero_resumes_bitwise_after_a_sigkill(tmp_path, stage, extra):
    want, _ = _run(tmp_path, "reference", stage, *extra)
    got, evts = _run(tmp_path, "failed", stage, "--crash-at", "6", *extra)
    restored = [e for e in evts if e["event"] == "restored"]
    assert restored and restored[-1]["tier"] == "memory" and restored[-1]["step"] >= 5, restored
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), f"stage {stage}: {k} differs"


def test_a_snapshot_of_another_stage_or_world_size_is_refused():
    from ckptrun.adapters.deepspeed import EngineState

    class Engine:  # what the check reads of a DeepSpeedEngine
        def zero_optimization_stage(self):
            return 2

    with pytest.raises(ValueError, match="taken with ZeRO stage 3 on 1 ranks; this engine "
                                         "runs stage 2 on 1"):
        EngineState(Engine()).load_state_dict({"zero_stage": 3, "world_size": 1})


@pytest.mark.slow
def test_hf_trainer_with_a_deepspeed_config_resumes_bitwise(tmp_path):
    """examples/hf_train.py with ``--deepspeed-stage 2``: the callback finds the Trainer's
    DeepSpeed engine and snapshots it; rank 1 SIGKILLed at step 9 of 24 is restored from
    memory and the run ends bitwise equal to the failure-free one."""
    pytest.importorskip("transformers")
    hf = os.path.join(ROOT, "examples", "hf_train.py")
    runs = {}
    for name, extra in (("reference", []), ("failed", ["--crash-at", "9"])):
        run_dir, out = tmp_path / name, tmp_path / f"{name}.pt"
        proc = subprocess.run(
            [sys.executable, "-m", "ckptrun.cli", "--standalone", "--nproc-per-node", "2",
             "--run-dir", str(run_dir), NO_SHM_OP, hf, "--deepspeed-stage", "2",
             "--run-dir", str(tmp_path / f"hf-{name}"), "--out", str(out), *extra],
            capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]
        with open(run_dir / "events.jsonl") as f:
            runs[name] = ([json.loads(line) for line in f if line.strip()],
                          torch.load(str(out), weights_only=True))
    evts, got = runs["failed"]
    restored = [e for e in evts if e["event"] == "restored"]
    assert restored and restored[-1]["tier"] == "memory" and restored[-1]["step"] >= 7, evts
    want = runs["reference"][1]
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), f"{k} differs"
