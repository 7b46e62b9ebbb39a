"""Reading a Slurm job step (``ckptrun.cli.slurm``): the defaults ``srun ckptrun`` gets, what
wins over them, and the mistakes refused in one line -- without a cluster (the real one:
``tests/test_slurm.py``)."""

from __future__ import annotations

import os

import pytest

from ckptrun.cli import slurm
from ckptrun.cli.args import parse
from ckptrun.cli.usage import UsageError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "examples", "train.py")


@pytest.fixture
def step(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    for k in list(os.environ):
        if k.startswith("SLURM_") or k in ("MASTER_ADDR", "MASTER_PORT") or k.startswith("PET_"):
            monkeypatch.delenv(k)
    env = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_NODES": "3",
           "SLURM_STEP_NUM_TASKS": "3", "SLURM_NODEID": "2",
           "SLURM_STEP_NODELIST": "gpu[07-09]", "MASTER_ADDR": "127.0.0.1"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return monkeypatch


def test_nodelists_expand_as_scontrol_prints_them():
    assert slurm.expand_nodelist("a,n[01-03,7]x,b[9]") == ["a", "n01x", "n02x", "n03x", "n7x",
                                                           "b9"]
    with pytest.raises(slurm.SlurmError, match="cannot read the Slurm node list"):
        slurm.expand_nodelist("n[1-2][3-4]")


def test_a_step_gives_the_rendezvous_run_dir_and_shared_checkpoints(step, tmp_path):
    cfg = parse(["--nproc-per-node", "2", TRAIN])
    assert (cfg.min_nodes, cfg.max_nodes, cfg.rdzv_backend) == (3, 3, "c10d")
    assert cfg.rdzv_endpoint == f"127.0.0.1:{20000 + 4242}" and cfg.rdzv_id == "slurm-4242"
    base = os.path.join(str(tmp_path), "ckptrun-runs", "slurm-4242")
    assert cfg.run_dir == os.path.join(base, "node-2")
    assert cfg.persist_to == os.path.join(base, "checkpoints")


def test_flags_and_pet_variables_win_over_the_step(step):
    cfg = parse(["--nnodes", "1", "--rdzv-endpoint", "127.0.0.1:1234", "--rdzv-id", "mine",
                 TRAIN])
    assert (cfg.max_nodes, cfg.rdzv_endpoint, cfg.rdzv_id) == (1, "127.0.0.1:1234", "mine")
    assert cfg.run_dir.endswith(os.path.join("ckptrun-runs", "mine"))
    step.setenv("PET_NNODES", "1:3")
    assert parse([TRAIN]).min_nodes == 1
    step.delenv("PET_NNODES")
    cfg = parse(["--standalone", TRAIN])  # this machine alone: its own store, no warning
    assert cfg.standalone and cfg.max_nodes == 1


def test_several_tasks_per_node_are_refused(step):
    step.setenv("SLURM_STEP_NUM_TASKS", "6")
    with pytest.raises(UsageError, match="run one per node"):
        parse([TRAIN])


def test_outside_a_step_nothing_changes(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")  # the batch script itself: no step
    monkeypatch.delenv("SLURM_STEP_ID", raising=False)
    assert slurm.current_step() is None
