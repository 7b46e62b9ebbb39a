"""ckptrun.tiers.durable.storage: the durable DCP format, its JSON index and reading back without pickle."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from s3util import s3_bucket, s3_endpoint  # noqa: F401  (pytest fixtures)

from ckptrun.tiers.durable import storage
from ckptrun.tiers.durable.storage import StorageError


def make_snapshot(rank: int, step: int, world_size: int, scale: int = 1):
    """A hand-built snapshot in the agreed (meta, tensors) representation."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    items = [
        ("model/layer.weight", torch.randn(8 * scale, 16, generator=g)),
        ("model/layer.bias", torch.randn(16, generator=g).to(torch.bfloat16)),
        ("optim/state/0/exp_avg", torch.randn(8 * scale, 16, generator=g)),
        ("optim/state/0/step", torch.tensor(float(step))),  # 0-dim
        ("data/order", torch.randperm(10, generator=g)),  # int64
        ("mask", torch.rand(5, generator=g) > 0.5),  # bool
        ("empty", torch.empty(0, 3)),
    ]
    meta = {
        "format": 1, "step": step, "rank": rank, "world_size": world_size,
        "tree": {"d": [["model", {"T": 0}], ["lr", 0.1]]},
        "tensors": [{"path": p, "dtype": str(t.dtype).split(".")[1], "shape": list(t.shape),
                     "offset": 0, "nbytes": t.numel() * t.element_size()} for p, t in items],
    }
    return meta, [t for _, t in items]


def snapshots(step: int, world_size: int = 2, scale: int = 1):
    return {r: make_snapshot(r, step, world_size, scale) for r in range(world_size)}


def assert_same(a, b):
    meta_a, ts_a = a
    meta_b, ts_b = b
    assert meta_a == meta_b
    assert len(ts_a) == len(ts_b)
    for x, y in zip(ts_a, ts_b):
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)


@pytest.mark.parametrize("scheme", ["plain", "file", pytest.param(
    "memory", marks=pytest.mark.compat("persist to an fsspec URL (memory://)"))])
def test_roundtrip_and_listing(tmp_path, scheme):
    url = {"plain": str(tmp_path / "ck"), "file": f"file://{tmp_path}/ck",
           "memory": f"memory://ckpt-{os.getpid()}-{tmp_path.name}"}[scheme]
    snaps = snapshots(7)
    res = storage.write_step(url, 7, snaps, world_size=2)
    assert res["bytes"] > 0 and res["seconds"] >= 0 and res["url"].endswith("/step-7")
    for r in range(2):
        assert_same(storage.read_rank(url, 7, r), snaps[r])
    storage.write_step(url, 9, snapshots(9), world_size=2)
    listed = storage.list_steps(url)
    assert [s["step"] for s in listed] == [7, 9]
    assert listed[0]["world_size"] == 2 and listed[0]["bytes"] == res["bytes"]
    assert storage.newest_step(url) == 9
    index = storage.read_index(url, 9)
    assert index["world_size"] == 2 and set(index["ranks"]) == {"0", "1"}
    assert all(len(e["checksum"]) == 16 for e in index["ranks"]["0"]["tensors"])
    assert storage.is_checkpoint(url) and storage.is_checkpoint(url + "/step-7")
    assert storage.resolve(url + "/step-7") == (url + "/step-7", 7)
    assert storage.resolve(url) == (url + "/step-9", 9)
    assert_same(storage.read_rank(url + "/step-7", None, 0), snaps[0])


@pytest.mark.compat("a persisted step read by plain DCP")
def test_plain_dcp_reads_it_without_ckptrun(tmp_path):
    url = str(tmp_path / "ck")
    snaps = snapshots(3)
    storage.write_step(url, 3, snaps, world_size=2)
    script = textwrap.dedent(f"""
        import sys
        sys.modules["ckptrun"] = None  # prove that nothing of ckptrun is needed
        import torch, json
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
        d = {str(tmp_path / "ck" / "step-3")!r}
        dcp_to_torch_save(d, {str(tmp_path / "out.pt")!r})
        sd = torch.load({str(tmp_path / "out.pt")!r}, weights_only=True)
        fresh = {{"rank1/model/layer.weight": torch.zeros(8, 16),
                  "rank0/data/order": torch.zeros(10, dtype=torch.int64)}}
        dcp.load(fresh, checkpoint_id=d)
        meta = json.loads(bytes(sd["rank1/__ckptrun_meta__"].numpy()))
        assert meta["rank"] == 1
        torch.save({{"sd": sd, "fresh": fresh}}, {str(tmp_path / "check.pt")!r})
    """)
    subprocess.run([sys.executable, "-c", script], check=True, cwd=str(tmp_path))
    got = torch.load(str(tmp_path / "check.pt"), weights_only=True)
    for r, (meta, ts) in snaps.items():
        for d, t in zip(meta["tensors"], ts):
            assert torch.equal(got["sd"][f"rank{r}/{d['path']}"], t)
    assert torch.equal(got["fresh"]["rank1/model/layer.weight"], snaps[1][1][0])
    assert torch.equal(got["fresh"]["rank0/data/order"], snaps[0][1][4])


def test_read_back_never_touches_pickled_metadata(tmp_path):
    url = str(tmp_path)
    snaps = snapshots(4)
    storage.write_step(url, 4, snaps, world_size=2)
    os.remove(tmp_path / "step-4" / ".metadata")  # DCP's pickle: we must not need it
    assert_same(storage.read_rank(url, 4, 1), snaps[1])


def test_a_new_jobs_missing_directory_is_listed_without_fsspec(tmp_path):
    """Every start-up lists the job's durable steps; a local directory that does not exist
    yet holds none, and seeing so must not cost fsspec's import.  An existing one is
    listed through fsspec as before."""
    code = textwrap.dedent(f"""
        import sys
        from ckptrun.tiers.durable import storage
        assert storage.list_steps({str(tmp_path / "new")!r}) == []
        assert storage.newest_step({str(tmp_path / "new")!r}) is None
        assert not storage.is_checkpoint({str(tmp_path / "new")!r})  # preflight's resolve
        print("fsspec" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False", (out.stdout, out.stderr)
    assert storage.absent_locally(str(tmp_path / "new"))
    assert not storage.absent_locally(str(tmp_path))
    assert not storage.absent_locally("s3://bucket/new")
    assert storage.list_steps(str(tmp_path)) == []


def test_step_without_index_does_not_exist(tmp_path):
    url = str(tmp_path)
    storage.write_step(url, 1, snapshots(1), world_size=2)
    storage.write_parts(url, 2, snapshots(2), node=0)  # killed before finalize
    assert storage.newest_step(url) == 1
    assert [s["step"] for s in storage.list_steps(url)] == [1]
    with pytest.raises(StorageError, match="not a complete checkpoint"):
        storage.read_rank(url, 2, 0)
    assert not storage.is_checkpoint(url + "/step-2")
    with pytest.raises(StorageError, match="no complete ckptrun checkpoint"):
        storage.resolve(url + "/step-2")
    (tmp_path / "step-5").mkdir()
    (tmp_path / "step-5" / "ckptrun.json").write_text("{trunc")  # torn index
    assert storage.newest_step(url) == 1


@pytest.mark.compat("a corrupted persisted byte is refused")
def test_corruption_is_detected(tmp_path):
    url = str(tmp_path)
    snaps = snapshots(6)
    storage.write_step(url, 6, snaps, world_size=2)
    e = storage.read_index(url, 6)["ranks"]["1"]["tensors"][0]
    path = tmp_path / "step-6" / e["file"]
    data = bytearray(path.read_bytes())
    raw = snaps[1][1][0].numpy().tobytes()
    pos = data.find(raw, e["offset"], e["offset"] + e["length"])
    assert pos > 0
    data[pos + 100] ^= 0xFF  # one bit-flip inside the tensor's raw bytes
    path.write_bytes(bytes(data))
    with pytest.raises(StorageError, match="checksum mismatch"):
        storage.read_rank(url, 6, 1)
    assert_same(storage.read_rank(url, 6, 0), snaps[0])
    data[e["offset"] + e["length"] - 10] ^= 0xFF  # the zip trailer of the same blob
    path.write_bytes(bytes(data))
    with pytest.raises(StorageError, match="corrupt"):
        storage.read_rank(url, 6, 1)


def test_prune_keeps_newest_and_clears_debris(tmp_path):
    url = str(tmp_path)
    for s in (1, 2, 3, 4):
        storage.write_step(url, s, snapshots(s), world_size=2)
    storage.write_parts(url, 0, snapshots(0), node=0)  # debris of an old interrupted persist
    storage.write_parts(url, 9, snapshots(9), node=0)  # newer: may be in flight, stays
    assert storage.prune(url, keep=2) == [0, 1, 2]
    assert [s["step"] for s in storage.list_steps(url)] == [3, 4]
    assert sorted(os.listdir(tmp_path)) == ["step-3", "step-4", "step-9"]
    assert storage.prune(url, keep=0) == []


@pytest.mark.compat("a step written by several nodes into one directory")
def test_multi_node_parts_finalize(tmp_path):
    url = str(tmp_path)
    snaps = snapshots(5, world_size=4)
    part0 = storage.write_parts(url, 5, {0: snaps[0], 1: snaps[1]}, node=0)
    part1 = storage.write_parts(url, 5, {2: snaps[2], 3: snaps[3]}, node=1)
    json.dumps([part0, part1])  # parts travel between machines as JSON
    with pytest.raises(StorageError, match="no data for ranks"):
        storage.finalize(url, 5, [part0], world_size=4)
    with pytest.raises(StorageError, match="two nodes"):
        storage.finalize(url, 5, [part0, part0], world_size=4)
    storage.finalize(url, 5, [part0, part1], world_size=4)
    assert {f for f in os.listdir(tmp_path / "step-5") if f.endswith(".distcp")} == {
        "__0_0.distcp", "__1_0.distcp"}
    for r in range(4):
        assert_same(storage.read_rank(url, 5, r), snaps[r])
    import torch.distributed.checkpoint as dcp

    fresh = {"rank3/optim/state/0/exp_avg": torch.zeros(8, 16)}
    dcp.load(fresh, checkpoint_id=str(tmp_path / "step-5"))
    assert torch.equal(fresh["rank3/optim/state/0/exp_avg"], snaps[3][1][2])


def test_check_writable(tmp_path):
    storage.check_writable(str(tmp_path / "new" / "dir"))
    assert os.listdir(tmp_path / "new" / "dir") == []  # the probe is cleaned up
    (tmp_path / "file").write_text("x")
    with pytest.raises(StorageError) as e:
        storage.check_writable(str(tmp_path / "file" / "sub"))
    assert "\n" not in str(e.value) and "not writable" in str(e.value)
    with pytest.raises(StorageError, match="unsupported storage URL"):
        storage.check_writable("nosuchproto://x/y")


def test_bad_snapshot_rejected(tmp_path):
    meta, ts = make_snapshot(0, 1, 1)
    with pytest.raises(StorageError, match="describes"):
        storage.write_step(str(tmp_path), 1, {0: (meta, ts[:-1])}, world_size=1)


def test_s3_roundtrip_read_by_plain_dcp(s3_bucket):  # noqa: F811
    url = f"{s3_bucket}/run1"
    snaps = snapshots(11)
    storage.check_writable(url)
    storage.write_step(url, 11, snaps, world_size=2)
    assert [s["step"] for s in storage.list_steps(url)] == [11]
    assert_same(storage.read_rank(url, 11, 1), snaps[1])
    import torch.distributed.checkpoint as dcp

    fresh = {"rank0/model/layer.weight": torch.zeros(8, 16),
             "rank1/model/layer.bias": torch.zeros(16, dtype=torch.bfloat16)}
    dcp.load(fresh, checkpoint_id=f"{url}/step-11")  # DCP picks its fsspec reader by itself
    assert torch.equal(fresh["rank0/model/layer.weight"], snaps[0][1][0])
    assert torch.equal(fresh["rank1/model/layer.bias"], snaps[1][1][1])
    storage.write_step(url, 12, snapshots(12), world_size=2)
    assert storage.prune(url, keep=1) == [11]
    assert storage.newest_step(url) == 12


def test_leader_refuses_a_step_whose_parts_it_cannot_see(tmp_path):
    """Several machines with unshared --persist-to paths (e.g. each its own run dir on a local
    disk): the leader must not finalize a step that no machine could read back."""
    from ckptrun.tiers.durable.rounds import _check_visible

    shared, elsewhere = str(tmp_path / "shared"), str(tmp_path / "node1-local")
    snaps = snapshots(5, world_size=4)
    part0 = storage.write_parts(shared, 5, {0: snaps[0], 1: snaps[1]}, node=0)
    part1 = storage.write_parts(elsewhere, 5, {2: snaps[2], 3: snaps[3]}, node=1)
    part1["url"] = elsewhere
    with pytest.raises(StorageError, match="node 1 wrote __1_0.distcp to .*node1-local"):
        _check_visible(shared, 5, [part1])
    with pytest.raises(StorageError, match="no such file"):  # no step directory at all
        _check_visible(str(tmp_path / "nowhere"), 5, [part1])
    part1 = storage.write_parts(shared, 5, {2: snaps[2], 3: snaps[3]}, node=1)
    with open(tmp_path / "shared" / "step-5" / "__1_0.distcp", "r+b") as f:
        f.truncate(10)  # a torn copy is not "visible" either
    with pytest.raises(StorageError, match="a shorter one"):
        _check_visible(shared, 5, [part1])
    part1 = storage.write_parts(shared, 5, {2: snaps[2], 3: snaps[3]}, node=1)
    _check_visible(shared, 5, [part1])  # shared and whole: fine
    storage.finalize(shared, 5, [part0, part1], world_size=4)
    assert_same(storage.read_rank(shared, 5, 3), snaps[3])
