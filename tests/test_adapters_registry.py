"""The adapter registry, DDP unwrap (snapshot of the wrapper restores into the module and back)
and exact single-copy storage of replicated tensors."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from adapter_util import run

import ckptrun
from ckptrun import adapters
from ckptrun import snapshot as S
from ckptrun.tiers.durable import storage


def test_registry_is_lazy_and_extensible():
    assert {"ddp", "fsdp", "lightning", "transformers"} <= set(adapters.names())
    assert adapters.get("ddp").unwrap is not None
    adapters.register("mine", "ckptrun.adapters.ddp")
    assert adapters.get("mine") is sys.modules["ckptrun.adapters.ddp"]
    with pytest.raises(ValueError):
        adapters.register("mine", "somewhere.else")
    with pytest.raises(KeyError):
        adapters.get("nope")


@pytest.fixture
def gloo1(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


@pytest.mark.parametrize("save_ddp,load_ddp", [(True, False), (False, True)])
def test_ddp_wrapper_and_module_are_interchangeable(tmp_path, gloo1, save_ddp, load_ddp):
    url = str(tmp_path / "ckpt")
    src = _model(0)
    opt = torch.optim.AdamW(src.parameters(), lr=0.1)
    src(torch.randn(3, 4)).sum().backward()
    opt.step()
    wrapped = nn.parallel.DistributedDataParallel(src) if save_ddp else src
    with ckptrun.Checkpointer({"model": wrapped, "optim": opt}, persist_to=url) as ck:
        ck.save(1)
    dst = _model(1)
    dopt = torch.optim.AdamW(dst.parameters(), lr=0.1)
    target = nn.parallel.DistributedDataParallel(dst) if load_ddp else dst
    with ckptrun.Checkpointer({"model": target, "optim": dopt}, persist_to=url) as ck:
        assert ck.restore() == 1
    for k, v in src.state_dict().items():
        assert torch.equal(v, dst.state_dict()[k])
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], dopt.state_dict()["state"][0]["exp_avg"])


def _snap(rank, model):
    state = {"model": model, "rng": {"torch": torch.full((5,), float(rank))}}
    tree, items = S.flatten(state)
    return S.make_meta(1, rank, 2, tree, items, [0] * len(items)), [t for _, t in items]


def test_replicated_tensors_are_stored_once_and_exact(tmp_path):
    import torch.distributed.checkpoint as dcp

    url = str(tmp_path / "ckpt")
    m = nn.Linear(256, 256)
    storage.write_step(url, 1, {0: _snap(0, m), 1: _snap(1, m)}, 2)
    index = storage.read_index(url, 1)
    assert index["bytes"] < 1.2 * m.weight.numel() * 4  # one copy of the weights, not two
    for r in (0, 1):
        meta, tensors = storage.read_rank(url, 1, r)
        got = S.unflatten(meta["tree"], tensors)
        assert torch.equal(got["model"]["weight"], m.weight)
        assert torch.equal(got["rng"]["torch"], torch.full((5,), float(r)))  # per rank
    sd = {"rank1/model/weight": torch.zeros(256, 256)}  # plain DCP reads the aliased key
    dcp.load(sd, checkpoint_id=os.path.join(url, "step-1"), no_dist=True)
    assert torch.equal(sd["rank1/model/weight"], m.weight)


def test_make_exact_gives_the_same_bits_whatever_the_bucket_layout(tmp_path):
    """DDP regroups its buckets after a restore; with ``make_exact`` the averaged gradients
    do not depend on the layout (3 ranks, where one all-reduce of a bucket does)."""
    out = tmp_path / "probe.json"
    script = os.path.join(os.path.dirname(__file__), "scripts", "ddp_bucket_probe.py")
    run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         "3", script, str(out)])
    result = json.loads(out.read_text())
    assert result["exact"] and result["correct"], result


def test_make_exact_fails_the_step_when_a_peer_dies(tmp_path):
    """A failed all-reduce must raise in backward: the survivor must not train on alone."""
    out = tmp_path / "probe.json"
    script = os.path.join(os.path.dirname(__file__), "scripts", "ddp_bucket_probe.py")
    run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         "2", script, str(out), "peer-dies"])
    assert json.loads(out.read_text()) == {"raised": True}
