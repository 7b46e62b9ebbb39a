"""Checkpointer under a simulated ckptrun agent: the writer's rule, /dev/shm checks, and a
SIGKILLed worker restored from shared memory to a bitwise-identical result."""

from __future__ import annotations

import glob
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest
import torch

import ckptrun
from ckptrun.protocol import ControlBlock, Phase, control_path
from ckptrun.tiers.memory.node import NodeMemory
from ckptrun.worker import slotset

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "scripts", "mem_worker.py")


@pytest.fixture
def node():
    """A job token, its NodeMemory and a control block, all removed afterwards."""
    token = f"t{uuid.uuid4().hex[:10]}"
    mem = NodeMemory(token, num_slots=3)
    block = ControlBlock(control_path(token), nranks=2, create=True)
    yield token, mem, block
    block.close()
    mem.cleanup()
    assert not glob.glob(f"/dev/shm/ckptrun-{token}-*")


def agent_env(token, mem, rank, world=1, restore=None, port=0):
    env = dict(os.environ)
    env.update({
        "CKPTRUN_CONTROL": control_path(token), "CKPTRUN_SLOT_PREFIX": mem.slot_prefix(rank),
        "CKPTRUN_NUM_SLOTS": "3", "RANK": str(rank), "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
        "CKPTRUN_RESTORE": json.dumps({"step": restore or 0, "tier": "memory"}),
    })
    return env


def set_env(monkeypatch, env):
    for k, v in env.items():
        if k.startswith("CKPTRUN_") or k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
            monkeypatch.setenv(k, v)


def test_writer_keeps_two_newest_skips_pinned_and_counts(node, monkeypatch):
    token, mem, block = node
    set_env(monkeypatch, agent_env(token, mem, 0))
    state = {"w": torch.zeros(1000)}
    ck = ckptrun.Checkpointer(state)
    for s in (1, 2, 3):
        state["w"].fill_(s)
        assert ck.save(s)
    assert sorted(mem.steps(0)) == [1, 2, 3]
    state["w"].fill_(4)
    assert ck.save(4)  # overwrites the oldest (step 1), never 2 or 3
    assert sorted(mem.steps(0)) == [2, 3, 4]
    assert block.get(0, "committed_step") == 4 and block.get(0, "saves") == 4

    block.set(0, "pin", mem.steps(0)[2])  # the agent reads step 2: the only writable slot
    assert not ck.save(5)  # skipped, not blocked, nothing corrupted
    assert block.get(0, "skipped_saves") == 1 and sorted(mem.steps(0)) == [2, 3, 4]
    assert all(mem.verify(0, s) for s in (2, 3, 4))
    assert block.get(0, "phase") == Phase.RUNNING
    block.set(0, "pin", -1)
    assert ck.save(5)
    assert sorted(mem.steps(0)) == [3, 4, 5] and mem.common_step([0]) == 5
    _, got = mem.read(0, 3)
    assert torch.equal(got[0], torch.full((1000,), 3.0))
    ck.close()


def test_choice_rule_unit():
    s = slotset.SlotSet(None, 3, keep=2)
    assert s.choose() == 0
    assert s.choose(pin=0) == 1
    s2 = slotset.SlotSet(None, 2, keep=1)
    assert s2.choose(pin=0) == 1
    with pytest.raises(ValueError):
        slotset.SlotSet(None, 2, keep=2)


def test_the_first_save_allocates_the_other_slots_off_the_loop(node, monkeypatch):
    """The first save allocates its slot and starts a thread that allocates the others at
    the same size; the second save waits for its slot only (not for the third), and once
    the thread is done no later save allocates anything."""
    import threading

    token, mem, block = node
    set_env(monkeypatch, agent_env(token, mem, 0))
    calls, gate = [], threading.Event()
    real = slotset.SlotSet._allocate

    def allocate(self, k, size):
        calls.append((k, threading.current_thread().name))
        if k == 2:
            gate.wait(10)  # the third slot takes long: the second save must not wait for it
        real(self, k, size)

    monkeypatch.setattr(slotset.SlotSet, "_allocate", allocate)
    ck = ckptrun.Checkpointer({"w": torch.zeros(1 << 18)})
    assert ck.save(1) and ck.save(2)
    ck.wait()
    deadline = time.monotonic() + 10
    while len(calls) < 3 and time.monotonic() < deadline:  # the thread reaches slot 2
        time.sleep(0.01)
    assert calls[0] == (0, "MainThread")
    assert (1, "ckptrun-slot-alloc") in calls and len(calls) == 3, calls
    sizes = {os.path.getsize(p) for p in mem.slot_paths(0)}
    assert len(mem.slot_paths(0)) >= 2 and len(sizes) == 1  # slot 2 may still be on its way
    gate.set()
    assert ck.save(3)
    ck.wait()
    assert calls[2] == (2, "ckptrun-slot-alloc") and len(calls) == 3, calls
    assert len(mem.slot_paths(0)) == 3
    assert sorted(mem.steps(0)) == [1, 2, 3]
    ck.close()


def test_slots_ahead_can_be_turned_off(node, monkeypatch):
    token, mem, block = node
    set_env(monkeypatch, agent_env(token, mem, 0))
    monkeypatch.setenv("CKPTRUN_SLOTS_AHEAD", "0")
    ck = ckptrun.Checkpointer({"w": torch.zeros(1 << 18)})
    assert ck.save(1)
    ck.wait()
    assert len(mem.slot_paths(0)) == 1
    ck.close()


def test_shm_too_small_is_one_clear_fatal_line(node, monkeypatch):
    token, mem, block = node
    set_env(monkeypatch, agent_env(token, mem, 0))

    class Tiny:
        f_bavail, f_frsize = 16, 4096  # 64 KiB free

    monkeypatch.setattr(slotset.os, "statvfs", lambda p: Tiny())
    ck = ckptrun.Checkpointer({"w": torch.zeros(1 << 20)})
    with pytest.raises(RuntimeError) as ei:
        ck.save(1)
    msg = str(ei.value)
    assert "\n" not in msg and "/dev/shm has 0 MiB free" in msg and "--shm-size" in msg
    assert block.get(0, "fatal") == 1
    assert mem.slot_paths(0) == []  # nothing allocated, no SIGBUS later


def test_state_bytes_budget(node, monkeypatch):
    token, mem, block = node
    set_env(monkeypatch, agent_env(token, mem, 0))
    monkeypatch.setenv("CKPTRUN_MAX_STATE_BYTES", str(1 << 20))
    ck = ckptrun.Checkpointer({"w": torch.zeros(1 << 20)})
    with pytest.raises(RuntimeError, match="CKPTRUN_MAX_STATE_BYTES"):
        ck.save(1)
    assert block.get(0, "fatal") == 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_workers(envs, args, out_dir, tag, timeout=240, kill_rest=False):
    procs = []
    for r, env in enumerate(envs):
        out = os.path.join(out_dir, f"{tag}-r{r}.bin")
        procs.append(subprocess.Popen([sys.executable, WORKER, *args, "--out", out], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    codes = []
    for i, p in enumerate(procs):
        try:
            p.wait(timeout=timeout if i == 0 or not kill_rest else 20)
        except subprocess.TimeoutExpired:
            p.kill()  # a DDP peer of the killed rank hangs in allreduce: the agent would kill it
            p.wait()
        codes.append(p.returncode)
        if kill_rest and i == 0:
            for q in procs[1:]:
                q.send_signal(signal.SIGKILL)
    logs = [p.stdout.read() for p in procs]
    return codes, logs


def weights(out_dir, tag, r=0):
    return np.fromfile(os.path.join(out_dir, f"{tag}-r{r}.bin"), dtype=np.float32)


@pytest.mark.slow
@pytest.mark.parametrize("world,optim,wait", [(1, "adam", False), (2, "sgd", True)],
                         ids=["single-adam", "ddp2-sgd"])
def test_sigkill_then_restore_matches_uninterrupted(node, tmp_path, world, optim, wait):
    token, mem, block = node
    steps, kill = 14, 6
    base = ["--steps", str(steps), "--optim", optim] + (["--ddp"] if world > 1 else [])
    ranks = list(range(world))

    # 1) uninterrupted reference: plain torchrun-style environment, no agent
    port = free_port()
    plain = []
    for r in ranks:
        env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTRUN_")}
        env.update(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        plain.append(env)
    codes, logs = run_workers(plain, base, tmp_path, "ref")
    assert codes == [0] * world, logs

    # 2) under the simulated agent: rank 0 SIGKILLs itself right after save(kill)
    port = free_port()
    envs = [agent_env(token, mem, r, world, port=port) for r in ranks]
    args = base + ["--kill-after", str(kill)] + (["--wait-before-kill"] if wait else [])
    codes, logs = run_workers(envs, args, tmp_path, "killed", kill_rest=True)
    assert codes[0] == -signal.SIGKILL, logs

    # 3) the agent's restore decision, then a fresh start from memory
    step = mem.common_step(ranks)
    assert step in ((kill,) if wait else (kill - 1, kill)), (step, [mem.steps(r) for r in ranks])
    mem.discard_newer(ranks, step)
    for r in ranks:
        block.reset(r)
    port = free_port()
    envs = [agent_env(token, mem, r, world, restore=step, port=port) for r in ranks]
    codes, logs = run_workers(envs, base, tmp_path, "restored")
    assert codes == [0] * world, logs
    assert all(f"starts at step {step}" in log for log in logs), logs
    for r in ranks:
        assert block.get(r, "restored_step") == step and block.get(r, "restore_s") > 0
        assert block.get(r, "committed_step") == steps
        assert np.array_equal(weights(tmp_path, "ref", r), weights(tmp_path, "restored", r))


def test_torn_slot_is_reused_and_never_restored(node, monkeypatch):
    from ckptrun.protocol import SlotHeader, SlotState, open_shm_file, set_slot_state

    token, mem, block = node
    set_env(monkeypatch, agent_env(token, mem, 0))
    state = {"w": torch.zeros(100)}
    ck = ckptrun.Checkpointer(state)
    for s in (1, 2, 3):
        ck.save(s)
    k3 = mem.steps(0)[3]
    mm = open_shm_file(f"{mem.slot_prefix(0)}{k3}")
    set_slot_state(mm, SlotState.WRITING, 3, SlotHeader.unpack_from(mm).seq + 1)  # died mid-copy
    assert sorted(mem.steps(0)) == [1, 2] and mem.common_step([0]) == 2
    ck.save(4)  # the torn slot is the free one; 1 and 2 are the two newest commits
    assert mem.steps(0) == {1: mem.steps(0)[1], 2: mem.steps(0)[2], 4: k3}
    mm.close()
    ck.close()
    monkeypatch.setenv("CKPTRUN_RESTORE", json.dumps({"step": 3, "tier": "memory"}))
    with pytest.raises(RuntimeError, match="no committed slot for step 3"):
        ckptrun.Checkpointer(state).restore()


def test_state_growth_under_agent_keeps_older_commits(node, monkeypatch):
    token, mem, block = node
    set_env(monkeypatch, agent_env(token, mem, 0))
    torch.manual_seed(0)
    model = torch.nn.Linear(1000, 1000)
    opt = torch.optim.Adam(model.parameters())
    ck = ckptrun.Checkpointer({"model": model, "optim": opt})
    ck.save(1)  # before the first step: no Adam state yet
    small = os.path.getsize(mem.slot_paths(0)[0])
    for s in (2, 3, 4):
        model(torch.randn(2, 1000)).sum().backward()
        opt.step()  # Adam state appears: the state triples
        ck.save(s)
    ck.wait()
    assert max(os.path.getsize(p) for p in mem.slot_paths(0)) > 2 * small
    assert sorted(mem.steps(0)) == [2, 3, 4] and all(mem.verify(0, s) for s in (2, 3, 4))
    assert block.get(0, "state_bytes") > 3 * 1000 * 1000 * 4
    ck.close()


def test_failed_background_copy_does_not_stop_training(node, monkeypatch, capsys):
    from ckptrun.snapshot import slots as slots_mod

    token, mem, block = node
    set_env(monkeypatch, agent_env(token, mem, 0))
    model = torch.nn.Linear(50, 50)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ck = ckptrun.Checkpointer({"model": model, "optim": opt})
    ck.save(1)
    ck.wait()
    real = slots_mod.SlotWrite.commit

    def boom(self):
        raise OSError("simulated failure")

    monkeypatch.setattr(slots_mod.SlotWrite, "commit", boom)
    ck.save(2)
    opt.step()  # the hook waits for the copy; training goes on
    ck.wait()  # what the next save() does first: the error is reported there
    assert "snapshot failed" in capsys.readouterr().err
    assert sorted(mem.steps(0)) == [1] and block.get(0, "phase") == Phase.RUNNING
    monkeypatch.setattr(slots_mod.SlotWrite, "commit", real)
    ck.save(3)
    ck.close()
    assert sorted(mem.steps(0)) == [1, 3]


def test_persist_options_of_the_script_are_said_not_ignored_under_the_agent(node, monkeypatch,
                                                                            capsys, tmp_path):
    """``Checkpointer(persist_to=, persist_every=)`` are for runs without the launcher: under
    it the agent persists where --persist-to says, and rank 0 says so once."""
    token, mem, block = node
    set_env(monkeypatch, agent_env(token, mem, 0))
    monkeypatch.setenv("CKPTRUN_PERSIST_TO", str(tmp_path / "agents"))
    ck = ckptrun.Checkpointer({"w": torch.zeros(4)}, persist_to=str(tmp_path / "mine"),
                              persist_every=5)
    err = capsys.readouterr().err
    assert err.count("ckptrun: Checkpointer(persist_to=, persist_every=) apply without the "
                     "ckptrun launcher; this job persists to " + str(tmp_path / "agents")) == 1
    assert ck.persist_to == str(tmp_path / "agents")
    ck.close()
    ckptrun.Checkpointer({"w": torch.zeros(4)}).close()  # nothing asked: nothing said
    assert "persist_to" not in capsys.readouterr().err
