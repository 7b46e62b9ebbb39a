"""In-process recovery (``@ckptrun.resilient``): the ranks that did not fail go on in their
own processes -- their blocked collectives broken, the function called again with the next
attempt's environment -- and the run still ends bitwise equal to one without failures.

The end-to-end runs use only the contract: the command line, ``events.jsonl``, the script's
output and its final weights."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from typing import Dict

import pytest
import torch
from conftest import SCRIPTS, shared_weights

from ckptrun.agent.inplace import ask, await_unwound, hand_over, keepable
from ckptrun.protocol import ControlBlock
from ckptrun.protocol.recovery import message, message_path, read_message

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "examples", "train.py")
STEPS = 16


# ----------------------------------------------------------------------------- the protocol


class _FakeWorker:
    def __init__(self, local_rank: int, alive: bool = True):
        self.local_rank = self.global_rank = local_rank
        self.alive = alive

    def status(self):
        return None if self.alive else -9


def test_only_live_resilient_workers_of_the_attempt_are_kept(tmp_path):
    block = ControlBlock(str(tmp_path / "ctl"), 5, create=True)
    workers = [_FakeWorker(0), _FakeWorker(1), _FakeWorker(2, alive=False), _FakeWorker(3),
               _FakeWorker(4)]
    for lr in range(5):
        block.set(lr, "resilient", 3)  # attempt 2 + 1
    block.set(3, "resilient", 0)  # not (or no longer) in a resilient function
    block.set(4, "raised", 1)  # its own exception: on its way out
    got = keepable(workers, block, 2, excluded=[1])  # rank 1 named by a hang verdict
    assert [w.local_rank for w in got] == [0]
    assert keepable(workers, block, 1, excluded=[]) == []  # another attempt's


def test_unwind_keeps_who_unwinds_in_time_and_hand_over_starts_them(tmp_path):
    block = ControlBlock(str(tmp_path / "ctl"), 2, create=True)
    a, b = _FakeWorker(0), _FakeWorker(1)
    block.set(0, "unwound", 4)  # as the worker would, once it saw recover = 4
    t0 = time.monotonic()
    ask([a, b], block, 4)
    kept = await_unwound([a, b], block, 4, deadline=time.monotonic() + 0.3)
    assert list(kept) == [0] and time.monotonic() - t0 >= 0.3  # rank 1 never answered
    assert block.get(0, "recover") == 4 and block.get(1, "recover") == 4
    block.set(0, "first_step_at", 12.5)
    block.set(0, "committed_step", 7)
    hand_over(str(tmp_path), block, 0, 4, {"MASTER_PORT": "1234", "RANK": "0",
                                           "TORCHELASTIC_RESTART_COUNT": "4"})
    assert block.get(0, "recover_go") == 4 and block.get(0, "first_step_at") == 0
    assert block.get(0, "committed_step") == 7  # the slot it holds is still the restore's
    assert read_message(message_path(str(tmp_path), 4, 0), 4) == {
        "MASTER_PORT": "1234", "TORCHELASTIC_RESTART_COUNT": "4"}  # only what changes
    assert os.stat(os.path.dirname(message_path(str(tmp_path), 4, 0))).st_mode & 0o077 == 0


def test_after_a_long_rendezvous_round_the_workers_that_unwound_are_still_kept(tmp_path):
    """A machine loss asks first and looks after the new membership formed -- a torch round
    waiting for a replacement can outlast the deadline; who unwound meanwhile is kept."""
    block = ControlBlock(str(tmp_path / "ctl"), 3, create=True)
    a, b, dead = _FakeWorker(0), _FakeWorker(1), _FakeWorker(2)
    ask([a, b, dead], block, 2)
    assert [block.get(lr, "recover") for lr in range(3)] == [2, 2, 2]
    block.set(0, "unwound", 2)
    block.set(2, "unwound", 2)
    dead.alive = False  # unwound, then died: replaced
    kept = await_unwound([a, b, dead], block, 2, deadline=time.monotonic() - 60)
    assert list(kept) == [0]


class _FakeLauncher:
    def __init__(self):
        self.retired = []

    def retire(self, workers):
        self.retired += [w.local_rank for w in workers]
        for w in workers:
            w.alive = False


def _fake_agent(tmp_path, workers, attempt: int):
    """What Agent's kept-worker bookkeeping reads, without an agent."""
    import types

    from ckptrun.agent.supervisor import Agent

    fake = types.SimpleNamespace(
        workers=workers, control=ControlBlock(str(tmp_path / "ctl"), len(workers), create=True),
        epoch=types.SimpleNamespace(attempt=attempt), kept={}, _hung=[], _retired_early=set(),
        launcher=_FakeLauncher(), reaper=types.SimpleNamespace(forget=lambda pid: None),
        _kept_target=0, _kept_deadline=0.0)
    for name in ("settle_kept", "drop_kept", "_retire_asked", "_ask_survivors"):
        setattr(fake, name, types.MethodType(getattr(Agent, name), fake))
    fake._await_copies = lambda going: None
    return fake


def test_workers_kept_for_an_attempt_that_never_started_are_asked_again(tmp_path):
    """A machine lost while the next attempt began (its restore decision raised): the
    workers kept for it wait unwound (``resilient`` still names the attempt they ran) and
    are asked for the later attempt, not killed as not resilient."""
    a, b = _FakeWorker(0), _FakeWorker(1)
    for w in (a, b):
        w.pid = 1000 + w.local_rank
    agent = _fake_agent(tmp_path, [a, b], attempt=3)
    for lr in (0, 1):
        agent.control.set(lr, "resilient", 3)  # ran attempt 2, unwound for 3
        agent.control.set(lr, "unwound", 3)
    asked = agent._ask_survivors(4, [a, b])
    assert asked == [a, b] and agent.launcher.retired == []
    assert [agent.control.get(lr, "recover") for lr in (0, 1)] == [4, 4]


def test_kept_workers_are_dropped_when_the_next_attempt_is_older_than_their_target(tmp_path):
    """The failure was not counted (no store): an unwound worker takes only a go for its
    target or later, so it would wait 15 minutes for the older attempt -- retire it."""
    a = _FakeWorker(0)
    a.pid = 1000
    agent = _fake_agent(tmp_path, [a], attempt=2)
    agent.control.set(0, "unwound", 3)
    agent.kept, agent._kept_target = {0: a}, 3
    agent._kept_deadline = time.monotonic() + 5
    agent.settle_kept()
    assert agent.kept == {} and agent.launcher.retired == [0]
    b = _FakeWorker(0)
    b.pid = 1001
    agent.epoch.attempt, agent.kept, agent.launcher.retired = 3, {0: b}, []
    agent.settle_kept()  # the attempt it unwound for: kept
    assert agent.kept == {0: b} and agent.launcher.retired == []


def test_a_kept_worker_retired_late_may_finish_the_snapshot_it_is_saving(tmp_path):
    """After a machine loss, a worker asked to unwind that did not by the deadline is
    retired -- but if it is in the middle of a snapshot it may finish it first, as every
    worker a restart kills may: otherwise the step it was saving is lost with it."""
    import threading
    import types

    from ckptrun.agent.supervisor import Agent
    from ckptrun.protocol.control import Phase

    a = _FakeWorker(0)
    a.pid = 1000
    agent = _fake_agent(tmp_path, [a], attempt=3)
    agent.cfg = types.SimpleNamespace(shutdown_timeout=5.0)
    agent._await_copies = types.MethodType(Agent._await_copies, agent)
    retired_at = []
    retire = agent.launcher.retire
    agent.launcher.retire = lambda ws: (retired_at.append(time.monotonic()), retire(ws))
    agent.control.set(0, "phase", Phase.SAVING)
    agent.control.set(0, "save_copy_s", 0.5)  # up to 1.1 s of grace
    agent.kept, agent._kept_target = {0: a}, 3
    agent._kept_deadline = time.monotonic() - 1  # it never unwound: retired
    saved: list = []
    done = threading.Timer(0.3, lambda: (agent.control.set(0, "phase", Phase.RUNNING),
                                         saved.append(time.monotonic())))
    done.start()
    try:
        agent.settle_kept()
    finally:
        done.cancel()
    assert agent.kept == {} and agent.launcher.retired == [0]
    assert saved and retired_at[0] >= saved[0], "retired in the middle of its snapshot"


@pytest.mark.parametrize("text", ["", "[]", '{"attempt": 3, "env": {}}', "{not json",
                                  '{"attempt": 4, "env": {"LD_PRELOAD": "/tmp/x.so"}}',
                                  '{"attempt": 4, "env": {"MASTER_PORT": 1}}'])
def test_a_message_that_is_not_for_this_attempt_or_malformed_is_refused(tmp_path, text):
    path = tmp_path / "m.json"
    path.write_text(text)
    assert read_message(str(path), 4) is None
    assert read_message(str(tmp_path / "missing.json"), 4) is None
    good = message(4, {"MASTER_PORT": "99", "PATH": "/bin"})
    assert good == {"attempt": 4, "env": {"MASTER_PORT": "99"}}


# ----------------------------------------------------------------------------- end to end


def _run(tmp_path, name: str, nproc: int, *args: str, timeout: int = 300):
    run_dir, out = tmp_path / name, tmp_path / f"{name}.pt"
    proc = subprocess.run(
        [sys.executable, "-m", "ckptrun.cli", "--standalone", "--nproc-per-node", str(nproc),
         "--hang-timeout", "3", "--run-dir", str(run_dir), TRAIN, "--width", "64",
         "--steps", str(STEPS), "--out", str(out), *args],
        capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    with open(run_dir / "events.jsonl") as f:
        evts = [json.loads(line) for line in f if line.strip()]
    return proc, evts, torch.load(out, weights_only=True)


def _run_ref(tmp_path, nproc: int) -> str:
    """The failure-free run at ``nproc`` ranks; returns its weights file."""
    _run(tmp_path, "ref", nproc)
    return str(tmp_path / "ref.pt")


def _pids(output: str) -> Dict[int, Dict[int, int]]:
    """rank -> {attempt: the pid it ran in}, from the script's start line."""
    got: Dict[int, Dict[int, int]] = {}
    for rank, attempt, pid in re.findall(r"\[demo\] rank (\d+): attempt (\d+) in pid (\d+)",
                                         output):
        got.setdefault(int(rank), {})[int(attempt)] = int(pid)
    return got


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """The failure-free run's final weights at each world size, computed once."""
    return lambda nproc: shared_weights(tmp_path_factory, f"inplace-ref{nproc}",
                                        lambda d: _run_ref(d, nproc))


@pytest.mark.slow
# (2 ranks in place: the hot spare and the framework tests; 4: across two machines below)
@pytest.mark.parametrize("nproc,fault,rank", [
    pytest.param(3, "--crash-at", 0, marks=pytest.mark.compat("in-place recovery (3 ranks)")),
    (8, "--crash-at", 5), (3, "--hang-at", 2), (3, "--raise-at", 1)])
def test_survivors_recover_in_their_own_process_and_lose_nothing(tmp_path, references, nproc,
                                                                fault, rank):
    proc, evts, weights = _run(tmp_path, "job", nproc, "--in-place", fault, "6",
                               "--crash-rank", str(rank))
    survivors = [r for r in range(nproc) if r != rank]
    restarts = [e for e in evts if e["event"] == "restart"]
    assert len(restarts) == 1 and restarts[0]["in_place"] == survivors, restarts
    out = proc.stdout + proc.stderr
    for r in survivors:
        assert f"rank {r}: recovering in place into attempt 1" in out, out[-3000:]
    # the survivors ran attempt 1 in the process they started in; only the failed rank is new
    pids = _pids(out)
    assert all(sorted(pids[r]) == [0, 1] for r in range(nproc)), pids
    assert all(pids[r][0] == pids[r][1] for r in survivors), pids
    assert pids[rank][0] != pids[rank][1], pids
    restored = [e for e in evts if e["event"] == "restored"]
    assert restored and restored[0]["tier"] == "memory" and restored[0]["step"] >= 5
    if fault == "--raise-at":  # counted when the traceback is out, not at the process's end
        failed = [e for e in evts if e["event"] == "worker_failed"]
        assert failed == [{**failed[0], "rank": rank, "exit_code": 1}], failed
    assert _equal(weights, references(nproc)), "in-place recovery changed the result"


@pytest.mark.slow
def test_in_place_across_two_machines(tmp_path, references):
    """Two agents (2 ranks each): rank 3 dies on node 1; rank 2 beside it and both ranks of
    node 0 -- which learns of it through the store -- recover in their own processes."""
    import socket
    import uuid

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rdzv, procs = uuid.uuid4().hex[:8], []
    for node in range(2):
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "ckptrun.cli", "--nnodes", "2", "--nproc-per-node", "2",
             "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
             "--rdzv-id", rdzv, "--run-dir", str(tmp_path / f"node{node}"), TRAIN,
             "--width", "64", "--steps", str(STEPS), "--out", str(tmp_path / "out.pt"),
             "--in-place", "--crash-at", "6", "--crash-rank", "3"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=300)
            outs.append(out + err)
            assert p.returncode == 0, err[-4000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for node, want in ((0, [0, 1]), (1, [2])):
        with open(tmp_path / f"node{node}" / "events.jsonl") as f:
            restarts = [e for line in f for e in [json.loads(line)] if e["event"] == "restart"]
        assert len(restarts) == 1 and restarts[0]["in_place"] == want, (node, restarts)
    pids = _pids("".join(outs))
    assert all(pids[r][0] == pids[r][1] for r in (0, 1, 2)) and pids[3][0] != pids[3][1], pids
    assert _equal(torch.load(tmp_path / "out.pt", weights_only=True), references(4))


@pytest.mark.compat("in place: a blocked collective is broken")
def test_breaking_the_connections_wakes_a_collective_that_waits_for_a_live_rank(tmp_path):
    """gloo's abort() does not wake a waiting all-reduce; shutting the group's connections
    down does, on this rank at once and on the peer at its next collective."""
    store = str(tmp_path / "store")
    probe = os.path.join(ROOT, "tests", "scripts", "breaker_probe.py")
    procs = [subprocess.Popen([sys.executable, probe, str(r), store], stdout=subprocess.PIPE,
                              text=True) for r in range(2)]
    lines = []
    for p in procs:
        out, _ = p.communicate(timeout=120)
        lines += [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    raised = {d["rank"]: d for d in lines if "raised" in d}
    assert raised[0]["raised"] and raised[1]["raised"], lines
    assert raised[0]["after_s"] < 5.0, lines  # not the group's 60 s timeout
    assert [d["shut"] for d in lines if "shut" in d] == [1], lines  # its one pair, not the listener
    assert all(d["destroyed"] for d in lines if "destroyed" in d), lines


def test_a_group_whose_teardown_waits_does_not_hold_the_recovery(tmp_path):
    """A survivor's destroyed gloo group can have an operation queued on a connection that
    nothing will wake (seen in 8-rank soaks: a DDP bucket's all-reduce queued before the
    break); its destructor would wait the group's 60 s here.  The destroy returns at once and
    a new group forms while the old one's threads still wait; operations issued to a broken
    group give up within a second."""
    probe = os.path.join(ROOT, "tests", "scripts", "retire_probe.py")
    procs = [subprocess.Popen([sys.executable, probe, str(r), str(tmp_path)],
                              stdout=subprocess.PIPE, text=True) for r in range(2)]
    lines = []
    for p in procs:
        out, _ = p.communicate(timeout=120)
        lines += [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    (destroy,) = [d for d in lines if "destroyed" in d]
    assert destroy["destroyed"] and destroy["destroy_s"] < 2.0, lines
    assert not destroy["initialized"], lines
    assert [d["sum"] for d in lines if "sum" in d] == [[3.0] * 4] * 2, lines
    (late,) = [d for d in lines if "late_raised" in d]
    assert late["late_raised"] and late["late_s"] < 5.0, lines


@pytest.mark.compat("in place: torch's functional collectives use the new group")
def test_torchs_functional_collectives_use_the_new_group_after_recovery(tmp_path):
    """``torch.distributed.nn.functional``'s collectives take ``group=group.WORLD`` as a
    default argument, fixed when torch imports them -- with ``torch._dynamo``, after the first
    attempt's ``init_process_group``.  After an in-place recovery they used the destroyed
    group ("not initialized in the world group map") and kept it alive: its listener,
    connections and threads stayed in every survivor.  (``ShardedGradScaler``'s
    ``process_group`` default likewise.)"""
    script = os.path.join(ROOT, "tests", "scripts", "functional_collectives.py")
    proc = subprocess.run(
        [sys.executable, "-m", "ckptrun.cli", "--standalone", "--nproc-per-node", "2",
         "--run-dir", str(tmp_path / "run"), script],
        capture_output=True, text=True, timeout=180)
    lines = [json.loads(line.split("[fc] ", 1)[1]) for line in proc.stdout.splitlines()
             if "[fc] " in line]
    survivor = {d["attempt"]: d for d in lines if d["rank"] == 0}
    assert sorted(survivor) == [0, 1], (lines, proc.stderr[-3000:])
    assert survivor[0]["pid"] == survivor[1]["pid"], lines  # recovered in place
    assert survivor[1]["all_reduce"] == [2.0, 2.0], lines
    assert survivor[1]["scaler_group_current"], lines  # ShardedGradScaler's default too
    # the first attempt's group is gone: its listener with it
    assert survivor[1]["listening"] == survivor[0]["listening"], lines
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_a_group_made_outside_the_function_keeps_the_restart(tmp_path):
    script = tmp_path / "outside.py"
    script.write_text(
        "import datetime, sys, torch.distributed as dist, ckptrun\n"
        f"dist.init_process_group('gloo', init_method='file://{tmp_path}/s', rank=0,\n"
        "                        world_size=1)\n"
        "@ckptrun.resilient\n"
        "def train():\n"
        "    return 'ran'\n"
        "print(train())\n")
    ctl = str(tmp_path / "ctl")
    ControlBlock(ctl, 1, create=True)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env={**os.environ, "CKPTRUN_CONTROL": ctl, "CKPTRUN_LOCAL_RANK": "0"},
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ran", proc.stderr[-2000:]
    assert "in-process recovery needs init_process_group() inside it" in proc.stderr
    assert ControlBlock(ctl).get(0, "resilient") == 0


@pytest.mark.parametrize("given,want", [("1", "2"), ("3", "2"), (None, "2"), ("0", "0")])
def test_a_resilient_function_makes_nccl_errors_raise_instead_of_killing_it(tmp_path, given,
                                                                          want):
    """Under TORCH_NCCL_ASYNC_ERROR_HANDLING=1 (ckptrun's and torchrun's) or 3 (torch's
    default) NCCL's watchdog kills a survivor whose peer died; inside the function it is 2."""
    script = tmp_path / "nccl_env.py"
    script.write_text(
        "import os, ckptrun\n"
        "@ckptrun.resilient\n"
        "def train():\n"
        "    return os.environ.get('TORCH_NCCL_ASYNC_ERROR_HANDLING')\n"
        "print(train())\n")
    ctl = str(tmp_path / "ctl")
    ControlBlock(ctl, 1, create=True)
    env = {k: v for k, v in os.environ.items() if k != "TORCH_NCCL_ASYNC_ERROR_HANDLING"}
    env.update(CKPTRUN_CONTROL=ctl, CKPTRUN_LOCAL_RANK="0")
    if given is not None:
        env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = given
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == want, proc.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.spares
def test_a_hot_spare_takes_the_failed_rank_without_the_scripts_start_up(tmp_path):
    """``--hot-spares``: a spare runs the script's start-up (2 s here, outside the resilient
    function) and waits at the function; the failed rank's replacement is that process."""
    run_dir, out, hurry = tmp_path / "hot", tmp_path / "hot.pt", tmp_path / "hurry"
    # 0.25 s steps until the kill: the job must not end before the spare is ready (its
    # imports and set-up under load); after it the steps need not sleep
    proc = subprocess.Popen(
        [sys.executable, "-m", "ckptrun.cli", "--standalone", "--nproc-per-node", "2",
         "--hot-spares", "--run-dir", str(run_dir), os.path.join(SCRIPTS, "e2e_train.py"),
         "--fast-after-file", str(hurry), "--width", "64", "--steps", "120",
         "--step-time", "0.25", "--setup-s", "2", "--in-place", "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "CKPTRUN_SPARE_DELAY": "0"})
    try:
        deadline, hot, victim = time.monotonic() + 120, None, None
        while time.monotonic() < deadline and hot is None and proc.poll() is None:
            time.sleep(0.2)
            try:
                st = json.loads((run_dir / "status.json").read_text())
            except (OSError, ValueError):
                continue
            ready = [h for h in st.get("hot_spares") or [] if h["ready"] and h["rank"] == 1]
            workers = [w for w in st.get("workers") or [] if w["rank"] == 1 and w["step"] > 0]
            if ready and workers:
                hot, victim = ready[0], workers[0]
        assert hot is not None, "no hot spare became ready"
        os.kill(victim["pid"], 9)
        hurry.touch()
        stdout, stderr = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr[-4000:]
    text = stdout + stderr
    assert "rank 1: a hot spare takes the rank in attempt 1" in text, text[-3000:]
    pids = _pids(text)
    assert pids[1][1] == hot["pid"] and pids[0][0] == pids[0][1], (pids, hot)
    assert f"set-up done in pid {hot['pid']}" in text  # the spare ran it, before the failure
    with open(run_dir / "events.jsonl") as f:
        evts = [json.loads(line) for line in f]
    assert [e.get("in_place") for e in evts if e["event"] == "restart"] == [[0]]
    assert _equal(torch.load(out, weights_only=True), _reference(tmp_path, 120))


def _reference(tmp_path, steps: int) -> dict:
    """The failure-free 2-rank run to ``steps`` (the runs above stop at STEPS)."""
    run_dir, out = tmp_path / f"ref{steps}", tmp_path / f"ref{steps}.pt"
    proc = subprocess.run(
        [sys.executable, "-m", "ckptrun.cli", "--standalone", "--nproc-per-node", "2",
         "--run-dir", str(run_dir), TRAIN, "--width", "64", "--steps", str(steps),
         "--out", str(out)], capture_output=True, text=True, timeout=300,
        env={**os.environ, "CKPTRUN_WARM_SPARES": "0"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out, weights_only=True)


LATE_SURVIVOR = """
import os, signal, time
import torch, torch.distributed as dist
import ckptrun

@ckptrun.resilient
def train():
    dist.init_process_group("gloo")
    rank, first = dist.get_rank(), os.environ["TORCHELASTIC_RESTART_COUNT"] == "0"
    w = torch.zeros(4)
    ckpt = ckptrun.Checkpointer({"w": w})
    for step in range(ckpt.restore(), 6):
        t = torch.ones(4)
        dist.all_reduce(t)
        w += t
        ckpt.save(step + 1)
        if first and step + 1 == 3:
            if rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(8)  # rank 0: a long computation, no collective and no save()
    ckpt.close()
    dist.destroy_process_group()

train()
"""


@pytest.mark.slow
def test_a_survivor_that_does_not_unwind_in_time_is_restarted_and_its_stack_kept(tmp_path):
    script, run_dir = tmp_path / "late.py", tmp_path / "run"
    script.write_text(LATE_SURVIVOR)
    proc = subprocess.run(
        [sys.executable, "-m", "ckptrun.cli", "--standalone", "--nproc-per-node", "2",
         "--run-dir", str(run_dir), str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(run_dir / "events.jsonl") as f:
        evts = [json.loads(line) for line in f if line.strip()]
    late = [e for e in evts if e["event"] == "unwind_timeout"]
    assert [(e["rank"], e["attempt"]) for e in late] == [(0, 0)], evts
    assert "rank 0 did not unwind within 5.00 s to recover in place: it is restarted" \
        in proc.stderr, proc.stderr[-3000:]
    stack = open(late[0]["stacks"]).read()
    assert "time.sleep" in stack or "in train" in stack, stack
    restarts = [e for e in evts if e["event"] == "restart"]
    assert len(restarts) == 1 and not restarts[0].get("in_place"), restarts
    status = subprocess.run([sys.executable, "-m", "ckptrun.cli", "status", "--run-dir",
                             str(run_dir)], capture_output=True, text=True, timeout=60)
    assert "rank 0 did not unwind" in " ".join(status.stdout.split()), status.stdout
