"""Checkpointer under plain python: exact continuation, overlap structure, RNG, plain data."""

from __future__ import annotations

import dataclasses
import random
import threading

import numpy as np
import pytest
import torch

import ckptrun
from ckptrun.protocol import SlotHeader, SlotState
from ckptrun.snapshot import slots as slots_mod

pytestmark = pytest.mark.compat("the Checkpointer in one process (save, restore, numpy, dataclasses)")


def make_job(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3),
                                torch.nn.BatchNorm1d(32), torch.nn.Linear(32, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=40)
    return model, opt, sched


def train_step(model, opt, sched, extra):
    x = torch.randn(8, 16)
    y = torch.randn(8, 1) + random.random() + float(np.random.rand())
    loss = ((model(x) - y) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()
    extra["losses"].append(loss.item())
    extra["seen"] += 8


@pytest.mark.parametrize("overlap", [True, False])
def test_restore_continues_bitwise_like_an_uninterrupted_run(overlap):
    random.seed(1)
    np.random.seed(1)
    model, opt, sched = make_job()
    extra = {"losses": [], "seen": 0}
    ck = ckptrun.Checkpointer({"model": model, "optim": opt, "sched": sched, "extra": extra},
                              overlap=overlap)
    assert ck.restore() == 0  # nothing saved yet: state untouched
    for step in range(12):
        train_step(model, opt, sched, extra)
        assert ck.save(step + 1)
    ck.wait()
    for _ in range(12, 25):  # the "crashed" timeline: diverges the live state further
        train_step(model, opt, sched, extra)
    ref = [p.detach().clone() for p in model.state_dict().values()]
    ref_extra = {"losses": list(extra["losses"]), "seen": extra["seen"]}
    ref_lr = sched.get_last_lr()

    assert ck.restore() == 12
    assert len(extra["losses"]) == 12 and extra["seen"] == 96
    for _ in range(12, 25):
        train_step(model, opt, sched, extra)
    for a, b in zip(ref, model.state_dict().values()):
        assert torch.equal(a, b)
    assert extra == ref_extra and sched.get_last_lr() == ref_lr
    ck.close()


def test_restored_tensors_do_not_alias_the_snapshot():
    model, opt, sched = make_job()
    extra = {"losses": [], "seen": 0}
    with ckptrun.Checkpointer({"model": model, "optim": opt}) as ck:
        train_step(model, opt, sched, extra)
        ck.save(1)
        ck.restore()
        exp_avg = opt.state[opt.param_groups[0]["params"][0]]["exp_avg"]
        before = exp_avg.clone()
        train_step(model, opt, sched, extra)
        ck.save(2)  # writes the other buffer ...
        train_step(model, opt, sched, extra)
        ck.save(3)  # ... and then the one restore() read from
        ck.wait()
        assert not torch.equal(before, exp_avg)  # Adam updated it in place, nothing else did
        ck.restore()
        exp_avg2 = opt.state[opt.param_groups[0]["params"][0]]["exp_avg"]
        for k in range(2):
            mm = ck._slots.mms[k]
            base = torch.frombuffer(mm, dtype=torch.uint8).data_ptr()
            assert not base <= exp_avg2.data_ptr() < base + len(mm)


def test_overlapped_save_returns_before_the_copy_and_step_waits(monkeypatch):
    """Structural: the background copy is held on a gate; save() must return anyway, and
    optimizer.step() must not run until the copy has finished."""
    gate = threading.Event()
    real_copy = slots_mod.SlotWrite.copy

    def gated_copy(self, indices, *args):
        if threading.current_thread() is not threading.main_thread():
            gate.wait(60)
        return real_copy(self, indices, *args)

    monkeypatch.setattr(slots_mod.SlotWrite, "copy", gated_copy)
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 256)).sum().backward()
    opt.step()
    ck = ckptrun.Checkpointer({"model": model, "optim": opt})
    at_save = model.weight.detach().clone()
    ck.save(1)  # returns although the parameter copy is blocked
    assert ck._pending is not None and not ck._pending.is_set()
    k = next(i for i, mm in enumerate(ck._slots.mms) if mm is not None)
    assert SlotHeader.unpack_from(ck._slots.mms[k]).state == SlotState.WRITING

    stepped = threading.Event()

    def do_step():
        model(torch.randn(4, 256)).sum().backward()
        opt.step()
        stepped.set()

    th = threading.Thread(target=do_step)
    th.start()
    assert not stepped.wait(0.5)  # blocked in the step pre-hook (a broken hook fails here)
    gate.set()
    th.join(60)
    assert stepped.is_set()
    h = SlotHeader.unpack_from(ck._slots.mms[k])
    assert h.state == SlotState.COMMITTED and h.step == 1
    assert not torch.equal(model.weight.detach(), at_save)
    ck.restore()
    assert torch.equal(model.weight.detach(), at_save)  # the snapshot has pre-step weights
    ck.close()


def test_no_optimizer_means_synchronous_copy():
    model = torch.nn.Linear(64, 64)
    ck = ckptrun.Checkpointer({"model": model})
    ck.save(1)
    assert ck._pending is None and ck.saves == 1
    ck.close()


def test_state_growth_reallocates_and_plain_python_values_restore():
    state = {"buf": torch.zeros(10), "note": "a", "hist": [1]}
    ck = ckptrun.Checkpointer(state, capture_rng=False)
    ck.save(1)
    state["buf"] = torch.arange(3_000_000, dtype=torch.float32)  # 30x the first allocation
    state["note"] = "b"
    ck.save(2)
    state["buf"] = torch.zeros(1)
    state["note"] = "c"
    assert ck.restore() == 2
    assert state["note"] == "b" and torch.equal(state["buf"], torch.arange(3_000_000.0))
    ck.close()


@pytest.mark.parametrize("value,says", [
    (iter([1, 2]), "an iterator's position cannot be read back"),
    (torch.utils.data.DataLoader([1, 2]), "StatefulDataLoader is a drop-in replacement"),
    (torch.utils.data.RandomSampler([1, 2]), "a sampler's position is kept by the loader"),
    ({1, 2}, "use tensors, numpy arrays"),
], ids=["iterator", "DataLoader", "sampler", "set"])
def test_unsupported_state_fails_clearly(value, says):
    ck = ckptrun.Checkpointer({"loader": value})
    with pytest.raises(TypeError, match="'loader'") as err:  # (Unsnapshottable)
        ck.save(1)
    assert says in str(err.value)
    ck.close()


@dataclasses.dataclass
class TrainState:
    """A train-state container as scripts keep one: no state_dict() of its own."""
    step: int = 0
    best: float = float("inf")
    losses: list = dataclasses.field(default_factory=list)
    ema: torch.Tensor = dataclasses.field(default_factory=lambda: torch.zeros(3))


def test_a_registered_dataclass_is_restored_field_by_field_in_place():
    ts = TrainState()
    ema = ts.ema
    ck = ckptrun.Checkpointer({"state": ts}, capture_rng=False)
    ts.step, ts.best, ts.losses = 2, 0.5, [1.0, 0.5]
    ts.ema += 1.0
    ck.save(2)
    ck.wait()
    ts.step, ts.best, ts.losses = 9, 0.1, [1.0, 0.5, 0.25]
    ts.ema += 5
    assert ck.restore() == 2
    assert (ts.step, ts.best, ts.losses) == (2, 0.5, [1.0, 0.5])
    assert ts.ema is ema and torch.equal(ema, torch.ones(3))  # the script's tensor, in place
    ck.close()


def test_a_registered_generator_is_restored_in_place():
    """A script drawing its batches from its own ``torch.Generator`` registers it as is."""
    g = torch.Generator().manual_seed(7)
    ck = ckptrun.Checkpointer({"gen": g}, capture_rng=False)
    torch.randn(3, generator=g)
    ck.save(1)
    ck.wait()
    want = torch.randn(5, generator=g)
    torch.randn(9, generator=g)
    assert ck.restore() == 1
    assert torch.equal(torch.randn(5, generator=g), want)
    ck.close()


def test_standalone_persists_and_a_new_process_resumes_from_storage(tmp_path):
    from ckptrun.tiers.durable import storage
    url = str(tmp_path / "ckpts")
    random.seed(3)
    np.random.seed(3)
    model, opt, sched = make_job()
    extra = {"losses": [], "seen": 0}
    state = {"model": model, "optim": opt, "sched": sched, "extra": extra}
    with ckptrun.Checkpointer(state, persist_to=url, persist_every=4) as ck:
        assert ck.restore() == 0
        for step in range(10):
            train_step(model, opt, sched, extra)
            ck.save(step + 1)
            if step + 1 in (4, 8):
                ck.wait()  # the copy commits, then the write starts in its own thread
                ck._persist.join()
                assert storage.newest_step(url) == step + 1
    assert storage.newest_step(url) == 10  # close() persisted the final step
    for _ in range(5):
        train_step(model, opt, sched, extra)
    ref = [t.clone() for t in model.state_dict().values()]

    # "a new process": fresh objects, no in-process snapshot; RNG state comes from storage
    random.seed(77)
    model2, opt2, sched2 = make_job(seed=5)
    extra2 = {"losses": [], "seen": 0}
    state2 = {"model": model2, "optim": opt2, "sched": sched2, "extra": extra2}
    ck2 = ckptrun.Checkpointer(state2, persist_to=url)
    assert ck2.restore() == 10
    assert extra2["seen"] == 80 and len(extra2["losses"]) == 10
    for _ in range(5):
        train_step(model2, opt2, sched2, extra2)
    for a, b in zip(ref, model2.state_dict().values()):
        assert torch.equal(a, b)
    ck2.close()


def test_numpy_state_restores_without_writing_into_readonly_arrays():
    ro = np.frombuffer(b"\x01\x02\x03\x04", dtype=np.uint8)  # read-only memory
    state = {"ro": ro, "rw": np.arange(4.0)}
    ck = ckptrun.Checkpointer(state, capture_rng=False)
    ck.save(1)
    rw = state["rw"]
    rw += 10
    state["ro"] = np.frombuffer(b"\x09\x09\x09\x09", dtype=np.uint8)
    assert ck.restore() == 1
    assert state["ro"].tolist() == [1, 2, 3, 4] and state["rw"] is rw  # writable: in place
    assert rw.tolist() == [0.0, 1.0, 2.0, 3.0]
    ck.close()


def test_close_ends_the_background_threads():
    """No ckptrun thread outlives close(): a daemon thread still running when the interpreter
    finalizes is stopped inside whatever it runs, and the plain-python HF job aborted at exit
    now and then ("terminate called without an active exception")."""
    model, opt, sched = make_job()
    extra = {"losses": [], "seen": 0}
    ck = ckptrun.Checkpointer({"model": model, "optim": opt, "sched": sched})
    for step in range(1, 4):
        train_step(model, opt, sched, extra)
        ck.save(step)
    assert any(t.name.startswith("ckptrun-") for t in threading.enumerate())
    ck.close()
    # the progress sampler (under an agent only) lives as long as the process: the script
    # may compute after close(); it ends at interpreter exit (its atexit handler)
    assert [t.name for t in threading.enumerate()
            if t.name.startswith("ckptrun-") and t.name != "ckptrun-progress"] == []
    from ckptrun.worker import progress

    if progress.sampler() is not None:
        progress.sampler().stop()  # what atexit runs
        assert "ckptrun-progress" not in [t.name for t in threading.enumerate()]
        progress._sampler = None  # the next test's link starts its own


def test_exit_collects_cycles_while_the_interpreter_is_whole_then_freezes():
    """The exit collection (``collect_at_exit``) tears down reference cycles -- DDP's with
    its process group -- while modules still work, and leaves the rest frozen, so that
    interpreter shutdown does not walk torch's import-time objects a second time."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import atexit, gc, sys
        atexit.register(lambda: print("frozen", gc.get_freeze_count() > 0, flush=True))
        from ckptrun.worker.clean_exit import collect_at_exit
        collect_at_exit()
        class Cycle:
            def __del__(self):
                print("collected", sys.modules["json"].dumps(1), flush=True)
        import json
        a = Cycle(); a.me = a; del a
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["collected 1", "frozen True"], out.stdout


def test_steps_start_at_one_and_are_integers():
    """``save(0)`` would never be restored (``restore()`` returns 0 for "nothing"): refused
    with a message saying how a loop counts, like any step that is not an int."""
    ck = ckptrun.Checkpointer({"w": torch.zeros(2)})
    with pytest.raises(ValueError, match=r"save\(0\): steps start at 1"):
        ck.save(0)
    for bad in (1.5, True, "3", None):
        with pytest.raises(TypeError, match="step must be an int"):
            ck.save(bad)
    assert ck.save(1) and ck.restore() == 1
    ck.close()


def test_values_given_at_save_time_come_back_at_restore(capfd):
    """What a loop rebinds or prefetches -- a number, the batch fetched ahead -- is given to
    ``save()`` and read back with ``get()`` after the restore, the values of that step."""
    w = torch.zeros(4)
    ck = ckptrun.Checkpointer({"w": w})
    assert ck.get("best", 9.0) == 9.0  # a fresh start: the default
    x, y = torch.arange(6.0).view(2, 3), torch.tensor([1, 2])
    best = 0.5
    ck.save(1, best=best, batch=(x, y), note="first")
    x += 100  # the live batch moves on; the snapshot holds the saved one
    ck.save(2, best=0.25, batch=(x, y), note="second")
    ck.wait()
    w += 1
    assert ck.restore() == 2
    assert ck.get("best") == 0.25 and ck.get("note") == "second"
    bx, by = ck.get("batch")
    assert torch.equal(bx, torch.arange(6.0).view(2, 3) + 100) and torch.equal(by, y)
    assert bx.data_ptr() != x.data_ptr()  # a private copy, not a view of a slot
    assert torch.equal(w, torch.zeros(4))
    assert "values" not in ck.state  # the script's dict is not touched
    ck.close()
    assert "warning" not in capfd.readouterr().err


def test_a_registered_number_that_never_changes_is_named_once(capfd):
    """A plain number in the state dict is the value it had when the Checkpointer was built;
    a loop that rebinds the name leaves it behind.  Said once, with the fix; not said for a
    number the loop updates in the dict."""
    iter_num, lr = 0, 0.1
    state = {"w": torch.zeros(2), "iter_num": iter_num, "lr": lr}
    ck = ckptrun.Checkpointer(state)
    for step in range(1, 7):
        iter_num += 1  # rebinds the name: the Checkpointer's entry stays 0
        state["lr"] = lr * step  # updated in the dict: live
        ck.save(step)
    ck.close()
    err = capfd.readouterr().err
    assert err.count("warning") == 1, err
    assert "'iter_num'" in err and "ckpt.save(step, iter_num=iter_num)" in err


def test_a_checkpointer_dropped_without_close_is_collected_with_its_slots():
    """Its optimizer hook and copy thread must not keep it: its slots' CUDA registration
    is undone when it is collected (on a GPU, a map freed while registered broke the next
    Checkpointer's copies), and a new Checkpointer for the same optimizer is not slowed by
    the old one's hook."""
    import gc
    import weakref

    model = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ck = ckptrun.Checkpointer({"model": model, "optim": opt})
    for step in range(3):
        model(torch.ones(2, 64)).sum().backward()
        opt.step()
        ck.save(step + 1)
    ck.wait()
    gone, slots = weakref.ref(ck), ck._slots._finalizer
    thread = ck._copier._thread
    del ck
    gc.collect()
    assert gone() is None and not slots.alive
    thread.join(5)
    assert not thread.is_alive()  # the copy thread ended with it
    opt.step()  # the old hook is harmless
