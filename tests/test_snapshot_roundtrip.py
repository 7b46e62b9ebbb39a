"""snapshot.flatten/unflatten: exact round trips of awkward state through a real slot."""

from __future__ import annotations

import math
import mmap
import pathlib
import random
import re

import numpy as np
import pytest
import torch

from ckptrun import snapshot as S
from ckptrun.snapshot.slots import layout


def through_slot(state):
    """flatten -> write_slot -> read_slot -> clone -> unflatten, like a real restore."""
    tree, items = S.flatten(state)
    tensors = [t for _, t in items]
    offsets, _ = layout([t.numel() * t.element_size() for t in tensors])
    meta = S.make_meta(3, 0, 1, tree, items, offsets)
    mm = mmap.mmap(-1, 4 << 20)
    S.write_slot(mm, meta, tensors)
    assert S.verify_slot(mm)
    _, meta2, views = S.read_slot(mm)
    return S.unflatten(meta2["tree"], [v.clone() for v in views]), meta2


def same(a, b):
    """Bitwise and type-exact equality (tuple != list, int != float, nan == nan)."""
    assert type(a) is type(b), (a, b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.reshape(-1).view(torch.uint8) if a.numel() else a,
                           b.reshape(-1).view(torch.uint8) if b.numel() else b)
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    elif isinstance(a, np.generic):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes()
    elif isinstance(a, dict):
        assert list(a.keys()) == list(b.keys())
        for k in a:
            same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            same(x, y)
    elif isinstance(a, float):
        assert (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b))
    else:
        assert a == b


def test_awkward_state_round_trips_exactly():
    g = torch.Generator().manual_seed(1)
    base = torch.randn(6, 5, generator=g)
    state = {
        "ints": {1: "one", -2: (3, 4), 2**80: [2**70, -(2**65)]},
        "mixed_keys": {(1, "a"): 1.5, 2.5: None, True: b"\x00\xff", None: bytearray(b"ab"), "1": 1},
        "floats": [float("inf"), -float("inf"), float("nan"), -0.0, 1e-310, 0.1],
        "tuple": (1, (2, [3, (4,)]), ()),
        "bf16": torch.randn(7, 3, generator=g).bfloat16(),
        "f16": torch.randn(4, generator=g).half(),
        "noncontig": base.t(),
        "strided": base[::2, 1:4],
        "expanded": torch.arange(3.0).expand(4, 3),
        "scalar": torch.tensor(7, dtype=torch.int64),
        "empty": torch.empty(0, 5),
        "bool": torch.rand(9, generator=g) > 0.5,
        "u8": torch.arange(200, dtype=torch.uint8),
        "c64": torch.randn(3, dtype=torch.complex64, generator=g),
        "np_f32": np.arange(12, dtype=np.float32).reshape(3, 4)[:, ::2],
        "np_i64": np.array([[1, -2], [3, 2**62]], dtype=np.int64),
        "np_be": np.arange(5, dtype=">i4"),
        "np_str": np.array(["ab", "xyz"]),
        "np_scalars": [np.float32(1.25), np.int16(-3), np.bool_(True), np.float64("nan")],
        "dtypes": [torch.bfloat16, torch.int8, torch.Size([2, 3]), torch.device("cpu")],
        "path/with/slashes": {"a/b": torch.ones(2), "a": {"b": torch.zeros(2)}},
    }
    out, meta = through_slot(state)
    want = dict(state)
    for k in ("noncontig", "strided", "expanded"):
        want[k] = state[k].contiguous()
    want["np_f32"] = np.ascontiguousarray(state["np_f32"])
    same(want, out)
    paths = [d["path"] for d in meta["tensors"]]
    assert len(set(paths)) == len(paths)
    assert "bf16" in paths and "path%2Fwith%2Fslashes/a%2Fb" in paths
    assert {d["dtype"] for d in meta["tensors"]} >= {"bfloat16", "bool", "int64", "uint8"}


def test_module_optimizer_state_paths_and_reload():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    fl = S.flatten_state({"model": model, "optim": opt})
    paths = [p for p, _ in fl.items]
    assert "model/0.weight" in paths and "optim/state/0/exp_avg" in paths
    by_path = dict(zip(paths, fl.deferrable))
    assert by_path["model/0.weight"] and by_path["optim/state/0/exp_avg"]
    assert not by_path["model/1.running_mean"]  # buffers change in forward: copied synchronously
    assert fl.optimizers == [opt]
    ema = torch.nn.Linear(3, 4)  # parameters no optimizer of the state owns: synchronous
    fl2 = S.flatten_state({"model": model, "ema": ema, "nested": [{"o": opt}]})
    by_path2 = dict(zip([p for p, _ in fl2.items], fl2.deferrable))
    assert by_path2["model/0.weight"] and not by_path2["ema/weight"]
    assert by_path2["nested/0/o/state/0/exp_avg"] and fl2.optimizers == [opt]
    out, _ = through_slot({"model": model, "optim": opt})
    sd = opt.state_dict()
    assert list(out["optim"]["state"].keys()) == list(sd["state"].keys())  # int keys stay int
    same(sd["param_groups"], out["optim"]["param_groups"])


def test_unsupported_value_names_its_path():
    with pytest.raises(TypeError, match=r"'a/b/1'"):
        S.flatten({"a": {"b": [1, object()]}})
    with pytest.raises(TypeError, match="set"):
        S.flatten({"x": {1, 2}})
    with pytest.raises(TypeError, match="dict key"):
        S.flatten({"x": {frozenset(): 1}})
    with pytest.raises(TypeError, match="object"):
        S.flatten({"x": np.array([object()])})


def test_rng_capture_restores_every_generator_exactly():
    random.seed(5)
    np.random.seed(5)
    torch.manual_seed(5)
    random.random(), np.random.rand(), torch.rand(1)
    out, _ = through_slot({"rng": S.capture_rng()})
    expect = (random.random(), np.random.rand(3).tolist(), torch.rand(4).tolist(), random.gauss(0, 1))
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    S.restore_rng(out["rng"])
    got = (random.random(), np.random.rand(3).tolist(), torch.rand(4).tolist(), random.gauss(0, 1))
    assert got == expect


def test_no_pickle_in_the_memory_tier():
    """Nothing on the save, restore or replication path pickles or unpickles: the snapshot
    format, the protocol, the worker side, the memory and peer tiers."""
    root = pathlib.Path(S.__file__).parent.parent
    files = [f for pkg in ("snapshot", "protocol", "worker", "tiers/memory", "tiers/peer")
             for f in sorted((root / pkg).glob("*.py"))]
    assert len(files) > 20
    for f in files:
        src = f.read_text()
        assert not re.search(r"import pickle|pickle\.(loads?|dumps?|Unpickler)|"
                             r"torch\.(save|load)\(|copyreg", src), f


def test_a_write_with_tensors_on_the_gpu_hashes_the_same_bytes(monkeypatch):
    """With GPU tensors in a plan, the CPU tensors beside them (AdamW's step counts) are
    copied during the device->host copies and everything is hashed afterwards, so that the
    state is released before the checksum: the slot and its checksum must be those of the
    plain write.  (On a machine without a GPU, two CPU tensors stand in for GPU ones.)"""
    import threading

    from ckptrun.snapshot.copyplan import CopyPlan
    from ckptrun.snapshot.slots import SlotWrite, meta_bytes, verify_slot

    class _Stream:
        def synchronize(self):
            pass
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: _Stream())
    g = torch.Generator().manual_seed(3)
    tensors = [torch.tensor(7.0), torch.randn(3000, generator=g),  # small: one torch.cat
               torch.randn(1 << 20, generator=g), torch.tensor(8.0),  # large: memmove
               torch.randn(5, 7, generator=g).t(), torch.randn(100, generator=g)]
    offsets, data_len = layout([t.numel() * t.element_size() for t in tensors])
    meta = meta_bytes({"tree": None, "tensors": []})

    def write(as_gpu):
        mm = mmap.mmap(-1, 8 << 20)
        job = SlotWrite(mm, meta, tensors, offsets, data_len, 5, 0, 1)
        job.begin()
        plan = CopyPlan(tensors, offsets, range(len(tensors)), 0)
        plan.gpu = as_gpu
        released = threading.Event()
        job.copy(plan, None, released)
        assert released.is_set()
        return mm, job.commit()

    plain_mm, plain = write([])
    mixed_mm, mixed = write([2, 5])
    assert mixed.checksum == plain.checksum
    data = slice(plain.data_offset, plain.data_offset + data_len)  # (headers: commit times)
    assert bytes(mixed_mm[data]) == bytes(plain_mm[data])
    assert verify_slot(mixed_mm, mixed)
