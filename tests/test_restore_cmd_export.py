"""``ckptrun restore``: --list, export (dcp/torch) from storage and from a live job's memory,
--rollback, and one-line errors with exit code 2."""

from __future__ import annotations

import json
import os
import random
import stat
import time

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from test_storage_format import snapshots

from ckptrun.cli.restore import restore_command
from ckptrun.protocol import create_shm_file
from ckptrun.snapshot import capture_rng, flatten, make_meta, write_slot
from ckptrun.tiers.durable import storage


def real_snapshot(rank: int, step: int, world: int):
    """A snapshot made by the memory tier's own flatten (nested state, numpy RNG, ...);
    a function of ``rank`` and ``step`` alone: every RNG it captures is seeded (code run in
    between -- a first import -- may draw from Python's or numpy's)."""
    torch.manual_seed(step * 10 + rank)
    random.seed(step * 10 + rank)
    np.random.seed(step * 10 + rank)
    state = {"model": {"w": torch.randn(4, 3), "b": torch.zeros(3)}, "step": step,
             "rng": capture_rng(), "np": np.arange(4, dtype=np.float32), "name": "run"}
    tree, items = flatten(state)
    meta = make_meta(step, rank, world, tree, items, [0] * len(items))
    return meta, [t.contiguous() for _, t in items]


def run(*args):
    res = CliRunner().invoke(restore_command, list(args), catch_exceptions=False)
    return res.exit_code, res.output


def make_run(tmp_path, state="running", steps=(4, 5), world=2, persisted=(3,)):
    """A run directory as the agent leaves it: status.json + slot files + durable steps."""
    run_dir = tmp_path / "ckptrun-runs" / "job1"
    run_dir.mkdir(parents=True)
    persist = str(run_dir / "checkpoints")
    for s in persisted:
        storage.write_step(persist, s, {r: real_snapshot(r, s, world) for r in range(world)}, world)
    slots = {}
    for r in range(world):
        slots[str(r)] = []
        for k, s in enumerate(steps):
            path = str(tmp_path / f"slot-r{r}-s{k}")
            meta, ts = real_snapshot(r, s, world)
            mm = create_shm_file(path, 1 << 20)
            write_slot(mm, meta, ts)
            mm.close()
            slots[str(r)].append(path)
    status = {"run_id": "job1", "state": state, "restarts": 0, "workers": [],
              "checkpoint": {}, "agent_pid": os.getpid(), "updated": time.time(),
              "persist_to": persist, "slots": slots}
    (run_dir / "status.json").write_text(json.dumps(status))
    return run_dir


def test_list_and_export_from_storage(tmp_path):
    url = str(tmp_path / "ck")
    for s in (2, 4):
        storage.write_step(url, s, snapshots(s), world_size=2)
    code, out = run("--list", "--from", url, "--json")
    assert code == 0
    listed = json.loads(out)
    assert [e["step"] for e in listed["steps"]] == [2, 4]
    assert listed["steps"][0]["tiers"] == ["storage"] and listed["steps"][0]["url"] == f"{url}/step-2"
    code, out = run("--list", "--from", url)
    assert code == 0 and "step-4" in out

    code, out = run("--from", url, "--step", "2", "--to", str(tmp_path / "exp"), "--json")
    assert code == 0, out
    assert json.loads(out)["step"] == 2
    import torch.distributed.checkpoint as dcp

    fresh = {"rank1/model/layer.weight": torch.zeros(8, 16)}
    dcp.load(fresh, checkpoint_id=str(tmp_path / "exp"))
    assert torch.equal(fresh["rank1/model/layer.weight"], snapshots(2)[1][1][0])
    # an export is itself a valid --from source
    code, out = run("--list", "--from", str(tmp_path / "exp"), "--json")
    assert [e["step"] for e in json.loads(out)["steps"]] == [2]


def test_export_torch_format_is_weights_only_loadable(tmp_path):
    run_dir = make_run(tmp_path, steps=(6, 7), persisted=(3,))
    out_file = tmp_path / "out" / "ckpt.pt"
    code, out = run("--run-dir", str(run_dir), "--to", str(out_file), "--format", "torch")
    assert code == 0, out
    got = torch.load(str(out_file), weights_only=True)
    assert got["step"] == 7 and got["world_size"] == 2  # newest: from memory
    want = real_snapshot(1, 7, 2)
    r1 = got["ranks"][1]
    assert torch.equal(r1["model"]["w"], want[1][0]) and r1["step"] == 7 and r1["name"] == "run"
    assert torch.equal(r1["np"], torch.arange(4, dtype=torch.float32))
    code, out = run("--run-dir", str(run_dir), "--step", "3", "--to", str(tmp_path / "s3.pt"),
                    "--format", "torch", "--json")
    assert code == 0 and json.loads(out)["tier"] == "storage"
    assert torch.load(str(tmp_path / "s3.pt"), weights_only=True)["step"] == 3


def test_list_live_run_memory_and_storage(tmp_path, monkeypatch):
    make_run(tmp_path, steps=(4, 5), persisted=(3, 5))
    monkeypatch.chdir(tmp_path)  # no --run-dir: the newest run under ./ckptrun-runs
    code, out = run("--list", "--json")
    assert code == 0, out
    steps = {e["step"]: e["tiers"] for e in json.loads(out)["steps"]}
    assert steps == {3: ["storage"], 4: ["memory"], 5: ["memory", "storage"]}
    code, out = run("--list")
    assert code == 0 and "2 ranks" in out


def test_export_from_memory_dcp(tmp_path):
    run_dir = make_run(tmp_path, steps=(8, 9), persisted=())
    code, out = run("--run-dir", str(run_dir), "--step", "8", "--to", str(tmp_path / "e"), "--json")
    assert code == 0, out
    assert json.loads(out)["tier"] == "memory"
    meta, ts = storage.read_rank(str(tmp_path / "e"), None, 0)
    want = real_snapshot(0, 8, 2)
    assert meta["step"] == 8 and all(torch.equal(a, b) for a, b in zip(ts, want[1]))


def test_rollback(tmp_path):
    run_dir = make_run(tmp_path, steps=(4, 5), persisted=(3,))
    code, out = run("--rollback", "4", "--run-dir", str(run_dir))
    assert code == 0, out
    path = run_dir / "rollback.json"
    assert json.loads(path.read_text())["step"] == 4
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    code, out = run("--rollback", "3", "--run-dir", str(run_dir))  # durable step: fine too
    assert code == 0 and json.loads(path.read_text())["step"] == 3
    code, out = run("--rollback", "17", "--run-dir", str(run_dir))
    assert code == 2 and "not restorable" in out and len(out.strip().splitlines()) == 1


def test_rollback_refused_when_not_live(tmp_path):
    run_dir = make_run(tmp_path, state="succeeded", persisted=(3,))
    code, out = run("--rollback", "3", "--run-dir", str(run_dir))
    assert code == 2 and "not live" in out and len(out.strip().splitlines()) == 1
    assert not (run_dir / "rollback.json").exists()


@pytest.mark.parametrize("args, msg", [
    (["--list", "--from", "/nonexistent/ck"], "no restorable step"),
    (["--from", "/nonexistent/ck", "--to", "/tmp/x"], "no restorable step"),
    (["--list", "--run-dir", "/nonexistent/run"], "does not exist"),
    (["--list", "--to", "/tmp/x"], "exactly one"),
    ([], "exactly one"),
    (["--rollback", "1", "--from", "/x"], "--rollback"),
])
def test_errors_are_one_line_exit_2(tmp_path, monkeypatch, args, msg):
    monkeypatch.chdir(tmp_path)
    code, out = run(*args)
    if args[:1] == ["--list"] and args[1:2] == ["--from"]:
        assert code == 0 and "no restorable steps" in out  # an empty list is not an error
        return
    assert code == 2 and msg in out and len(out.strip().splitlines()) == 1


def test_no_run_found(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out = run("--list")
    assert code == 2 and "no ckptrun run found" in out
