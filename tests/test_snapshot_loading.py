"""Restored state goes back into the live objects in the types their ``state_dict()`` gave
(``ckptrun/snapshot/loading.py``): DTensors with the live mesh and placements, tensors on the
live device; a refusal names the entry and the object."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ckptrun.snapshot import LoadFailed, load_into
from ckptrun.snapshot.loading import LiveMismatch, as_live

pytestmark = pytest.mark.compat("restored values in the types state_dict() gave (DTensor, device)")


@pytest.fixture
def mesh():
    """A one-rank gloo group and its CPU mesh (this process alone)."""
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def test_a_restored_shard_becomes_a_dtensor_laid_out_as_the_live_one(mesh):
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    live = {"w": distribute_tensor(torch.zeros(4, 3), mesh, [Shard(0)]), "n": 3,
            "nested": [torch.zeros(2)]}
    restored = {"w": torch.arange(12.0).reshape(4, 3), "n": 4, "nested": [torch.ones(2)]}
    got = as_live(restored, live)
    assert isinstance(got["w"], DTensor)
    assert got["w"].device_mesh == mesh and got["w"].placements == (Shard(0),)
    assert got["w"].shape == live["w"].shape and got["w"].stride() == live["w"].stride()
    assert torch.equal(got["w"].to_local(), restored["w"])
    assert got["n"] == 4 and got["nested"][0] is restored["nested"][0]
    with pytest.raises(LiveMismatch, match="w: the restored shard has shape"):
        as_live({"w": torch.zeros(2, 3)}, live)


def test_a_tensor_goes_back_to_the_live_device():
    live = {"w": torch.zeros(3, device="meta"), "c": torch.zeros(3)}
    got = as_live({"w": torch.ones(3), "c": torch.ones(3)}, live)
    assert got["w"].device.type == "meta" and got["c"].device.type == "cpu"


class Wrapper:
    """A framework wrapper that hands DCP DTensors and refuses anything else."""

    def __init__(self, t) -> None:
        self.t = t

    def state_dict(self):
        return {"t": self.t}

    def load_state_dict(self, sd) -> None:
        from torch.distributed.tensor import DTensor

        if not isinstance(sd["t"], DTensor):
            raise RuntimeError("got mixed torch.Tensor and DTensor")
        self.t.to_local().copy_(sd["t"].to_local())


def test_load_into_asks_the_live_state_only_for_what_needs_it(mesh):
    from torch.distributed.tensor import Shard, distribute_tensor

    w = Wrapper(distribute_tensor(torch.zeros(4), mesh, [Shard(0)]))
    shard = torch.arange(4.0)
    load_into({"w": w}, {"w": {"t": shard}}, needs_live={id(shard)})
    assert torch.equal(w.t.to_local(), shard)
    # without being told the tensor was a shard, the wrapper gets it plain and refuses:
    # the failure names the entry, the object and the reason, on one line
    with pytest.raises(LoadFailed) as err:
        load_into({"w": w}, {"w": {"t": shard}})
    assert str(err.value) == ("cannot load the restored 'w' into Wrapper.load_state_dict: "
                              "RuntimeError: got mixed torch.Tensor and DTensor")
