"""The same script under plain torchrun-style env (no agent): 2 gloo DDP ranks persist
collectively, one is SIGKILLed, a fresh pair resumes from durable storage bitwise-exactly."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest
from test_checkpointer_agent import free_port, run_workers, weights


def plain_env(rank: int, world: int, port: int) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTRUN_")}
    env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    return env


@pytest.mark.slow
def test_ddp_without_agent_resumes_from_storage(tmp_path):
    from ckptrun.tiers.durable import storage
    url = str(tmp_path / "ckpts")
    base = ["--steps", "14", "--ddp", "--optim", "adam"]
    port = free_port()
    codes, logs = run_workers([plain_env(r, 2, port) for r in (0, 1)], base, tmp_path, "ref")
    assert codes == [0, 0], logs

    port = free_port()
    args = base + ["--persist-to", url, "--persist-every", "4", "--kill-after", "6"]
    codes, logs = run_workers([plain_env(r, 2, port) for r in (0, 1)], args, tmp_path, "killed",
                              kill_rest=True)
    assert codes[0] == -signal.SIGKILL, logs
    assert storage.newest_step(url) == 4

    port = free_port()
    args = base + ["--persist-to", url, "--persist-every", "4"]
    codes, logs = run_workers([plain_env(r, 2, port) for r in (0, 1)], args, tmp_path, "resumed")
    assert codes == [0, 0], logs
    assert all("starts at step 4" in log for log in logs), logs
    assert storage.newest_step(url) == 14  # persisted at 8, 12 and at close()
    for r in (0, 1):
        assert np.array_equal(weights(tmp_path, "ref", r), weights(tmp_path, "resumed", r))
