"""save() keeps its slot layout, meta JSON and background copy plan from one step to the
next; whatever changes the tensors under it must make it start over, and the batched copy
must write the same bytes as a copy tensor by tensor."""

from __future__ import annotations

import copy
import math
import mmap

import pytest
import torch

import ckptrun
from ckptrun import snapshot as S
from ckptrun.protocol import SLOT_HEADER_SIZE
from ckptrun.snapshot.slots import CHUNK, SlotWrite, layout, meta_bytes, read_slot, slot_checksum


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    """With one intra-op thread runs of small tensors are copied by one torch.cat; with
    more, tensor by tensor (both must write the same bytes)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def odd_tensors():
    g = torch.Generator().manual_seed(0)
    big = torch.randn(CHUNK // 4 + 77, generator=g)  # more than one CHUNK: copied in pieces
    square = torch.randn(33, 33, generator=g)
    return [
        torch.randn(3, generator=g),
        torch.tensor(2.5),  # 0-dim, 4 bytes: padding follows
        torch.empty(0),
        torch.arange(5, dtype=torch.int8),
        torch.tensor([True, False, True]),
        torch.randn(7, generator=g).half(),
        big,
        square.t(),  # not contiguous
        torch.randn(1000, 3, generator=g, dtype=torch.float64),
        torch.randn(4, generator=g, dtype=torch.complex64),
        torch.randn(2, 2, generator=g).to(torch.bfloat16),
        torch.randn(3, generator=g, dtype=torch.complex64).conj(),  # conjugate bit set
        torch.randn(3, generator=g, dtype=torch.complex64).conj().imag,  # negative bit set
    ]


def write(tensors, start_split=None):
    offsets, data_len = layout([t.numel() * t.element_size() for t in tensors])
    mm = mmap.mmap(-1, data_len + (1 << 16))
    mm[:] = b"\xab" * len(mm)  # garbage where padding goes: it must come out zeroed
    items = [(str(i), t) for i, t in enumerate(tensors)]
    meta = meta_bytes(S.make_meta(1, 0, 1, None, items, offsets))
    job = SlotWrite(mm, meta, tensors, offsets, data_len, 1, 0, 1)
    job.begin()
    n = len(tensors) if start_split is None else start_split
    job.copy(range(n))
    if n < len(tensors):
        job.copy(range(n, len(tensors)))
    job.commit()
    return mm


def test_batched_copy_writes_the_same_bytes_as_a_copy_per_tensor():
    tensors = odd_tensors()
    torch.set_num_threads(2)
    try:
        ref = write(tensors)
        torch.set_num_threads(1)
        for split in (None, 3, 7):
            mm = write(tensors, split)
            assert mm[SLOT_HEADER_SIZE:] == ref[SLOT_HEADER_SIZE:]  # the header has a time
            h, _, views = read_slot(mm)
            assert slot_checksum(mm) == h.checksum == read_slot(ref)[0].checksum
            for t, v in zip(tensors, views):
                assert t.dtype == v.dtype and t.shape == v.shape and torch.equal(t, v)
    finally:
        torch.set_num_threads(1)


def test_meta_json_is_meta_bytes_of_make_meta():
    state = {"a": {"w": torch.zeros(2, 3), 1: [torch.ones(1), 2.5, math.inf]},
             "n": (None, True, "s/%"), "f": -0.0}
    fl = S.flatten_state(state)
    offsets, _ = layout([t.numel() * t.element_size() for _, t in fl.items])
    fl.shards[0] = {"global_shape": [4, 3], "global_offset": [2, 0], "placements": ["S0"],
                    "mesh_shape": [2]}
    tj = meta_bytes(S.tensor_entries(fl.items, offsets, fl.shards))
    want = meta_bytes(S.make_meta(7, 1, 2, fl.tree, fl.items, offsets, fl.shards))
    assert S.meta_json(7, 1, 2, fl.tree, tj) == want


def make(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return model, opt


def step(model, opt):
    model(torch.randn(4, 6)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def states(model, opt):
    return copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())


def same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape \
            and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def check_restores(ck, model, opt, saved, step_no):
    step(model, opt)  # move the live state away from the snapshot
    assert ck.restore() == step_no
    assert same(states(model, opt), saved)


def test_layout_and_plan_are_kept_while_the_state_keeps_its_tensors(threads):
    model, opt = make()
    ck = ckptrun.Checkpointer({"model": model, "optim": opt}, capture_rng=False)
    step(model, opt)
    ck.save(1)
    lay, plan = ck._layout, ck._layout.plan
    for n in range(2, 5):
        step(model, opt)
        ck.save(n)
    assert ck._layout is lay and ck._layout.plan is plan
    ck.wait()
    saved = states(model, opt)
    model.load_state_dict(copy.deepcopy(saved[0]))  # copies into the same tensors
    ck.save(5)
    assert ck._layout is lay and ck._layout.plan is plan
    check_restores(ck, model, opt, saved, 5)
    ck.close()


def test_optimizer_state_created_by_the_first_step_gets_a_new_layout(threads):
    model, opt = make()
    ck = ckptrun.Checkpointer({"model": model, "optim": opt}, capture_rng=False)
    ck.save(1)  # no optimizer state yet
    first = ck._layout
    step(model, opt)
    ck.save(2)
    assert ck._layout is not first and ck._layout.deferred
    ck.wait()
    check_restores(ck, model, opt, states(model, opt), 2)
    ck.close()


@pytest.mark.parametrize("change", ["new-storage", "transposed", "optimizer-load",
                                    "param-group"])
def test_replaced_tensors_are_copied_from_where_they_are_now(threads, change):
    model, opt = make()
    ck = ckptrun.Checkpointer({"model": model, "optim": opt}, capture_rng=False)
    step(model, opt)
    ck.save(1)
    step(model, opt)
    ck.save(2)
    ck.wait()
    plan = ck._layout.plan
    w = model[0].weight
    if change == "new-storage":  # same shape and dtype, other memory
        w.data = torch.randn(6, 6)
    elif change == "transposed":  # same address and shape, no longer contiguous
        w.data = w.data.t()
    elif change == "optimizer-load":  # load_state_dict puts new tensors into opt.state
        other_model, other = make(seed=3)
        step(other_model, other)
        opt.load_state_dict(other.state_dict())
    else:
        extra = torch.nn.Parameter(torch.randn(3))
        model.register_parameter("extra", extra)
        opt.add_param_group({"params": [extra], "lr": 0.5})
        step(model, opt)
    ck.save(3)
    assert ck._layout.plan is not plan
    ck.wait()
    saved = states(model, opt)
    check_restores(ck, model, opt, saved, 3)
    ck.close()
