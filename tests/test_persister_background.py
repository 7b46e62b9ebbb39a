"""ckptrun.tiers.durable.persister: background persistence, failures, recovery, kill mid-write, keep."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time

import fsspec
import pytest
import torch
from fsspec.implementations.local import LocalFileOpener, LocalFileSystem
from s3util import s3_bucket, s3_endpoint  # noqa: F401  (pytest fixtures)
from test_storage_format import assert_same, snapshots

from ckptrun.tiers.durable import storage
from ckptrun.tiers.durable.persister import Persister


class SlowLocalFS(LocalFileSystem):
    """A local filesystem whose writes crawl, so a test can kill a persist half-way."""

    protocol = ("slowlocal",)
    delay = 0.02

    def _open(self, path, mode="rb", block_size=None, **kwargs):
        path = self._strip_protocol(path)
        if "w" in mode:
            self.makedirs(self._parent(path), exist_ok=True)
            return _SlowOpener(path, mode, fs=self, **kwargs)
        return super()._open(path, mode, block_size, **kwargs)


class _SlowOpener(LocalFileOpener):
    def write(self, data):
        time.sleep(SlowLocalFS.delay)
        return self.f.write(data)


fsspec.register_implementation("slowlocal", SlowLocalFS, clobber=True)


class FakeMemory:
    """Stands in for the agent's NodeMemory: the newest committed step of every local rank."""

    def __init__(self, world_size: int = 2):
        self.world_size = world_size
        self.step = 0
        self.snaps = {}
        self.lock = threading.Lock()
        self.reads = 0

    def commit(self, step: int) -> None:
        snaps = snapshots(step, self.world_size)
        with self.lock:
            self.step, self.snaps = step, snaps

    def read(self, min_step: int):
        with self.lock:
            if self.step < max(min_step, 1):
                return None
            self.reads += 1
            return self.step, self.snaps


class Events:
    def __init__(self):
        self.items = []

    def emit(self, event, **fields):
        self.items.append({"event": event, **fields})

    def of(self, name):
        return [e for e in self.items if e["event"] == name]


def wait_for(pred, timeout=30.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.02)
    return False


def train(mem, persister, stop, gaps, start=1, dt=0.01):
    """A 'training loop': commits a step every dt seconds; records the longest gap."""
    step, last = start, time.monotonic()
    while not stop.is_set():
        mem.commit(step)
        persister.notify(step)
        now = time.monotonic()
        gaps.append(now - last)
        last = now
        step += 1
        time.sleep(dt)


def test_every_steps_local_keep_and_final(tmp_path):
    url = f"file://{tmp_path}/ck"
    mem, ev = FakeMemory(), Events()
    p = Persister(url, reader=mem.read, world_size=2, every_steps=5, every_seconds=None, keep=2,
                  emit=ev.emit, poll_s=0.05)
    p.start()
    for s in range(1, 23):
        mem.commit(s)
        p.notify(s)
        time.sleep(0.03)
    assert wait_for(lambda: len(ev.of("persisted")) >= 2)
    assert p.final(22)
    p.stop()
    steps = [e["step"] for e in ev.of("persisted")]
    assert steps == sorted(steps) and steps[-1] == 22
    # every 5 steps (not the final): the next multiple of 5, or a later step where this
    # reader (the newest step) was late -- the count goes on from there
    assert all(b >= (a // 5 + 1) * 5 for a, b in zip(steps, steps[1:-1])), steps
    done = ev.of("persisted")[-1]
    assert done["url"] == f"{url}/step-22" and done["bytes"] > 0 and done["seconds"] >= 0
    assert [s["step"] for s in storage.list_steps(url)] == steps[-2:]  # keep=2
    assert_same(storage.read_rank(url, 22, 1), mem.snaps[1])
    assert p.status() == {"persisted_step": 22, "persisted_url": f"{url}/step-22",
                          "last_error": None, "persisting": None, "failures": 0}
    assert not ev.of("persist_failed")


def test_every_seconds_s3_read_by_plain_dcp(s3_bucket):  # noqa: F811
    url = f"{s3_bucket}/job"
    mem, ev = FakeMemory(), Events()
    p = Persister(url, reader=mem.read, world_size=2, every_steps=None, every_seconds=0.3,
                  keep=3, emit=ev.emit, poll_s=0.05)
    p.start()
    stop, gaps = threading.Event(), []
    t = threading.Thread(target=train, args=(mem, p, stop, gaps))
    t.start()
    try:
        assert wait_for(lambda: len(ev.of("persisted")) >= 2, timeout=60)
    finally:
        stop.set()
        t.join()
        p.stop()
    step = ev.of("persisted")[-1]["step"]
    import torch.distributed.checkpoint as dcp

    want = snapshots(step, 2)[1]
    fresh = {"rank1/model/layer.weight": torch.zeros(8, 16)}
    dcp.load(fresh, checkpoint_id=f"{url}/step-{step}")
    assert torch.equal(fresh["rank1/model/layer.weight"], want[1][0])


def test_storage_refusing_writes_then_recovering(tmp_path):
    root = tmp_path / "ck"
    mem, ev = FakeMemory(), Events()
    p = Persister(str(root), reader=mem.read, world_size=2, every_steps=None,
                  every_seconds=0.2, keep=3, emit=ev.emit, poll_s=0.05, retry_base_s=0.1,
                  retry_max_s=0.4)
    p.start()
    stop, gaps = threading.Event(), []
    t = threading.Thread(target=train, args=(mem, p, stop, gaps))
    t.start()
    try:
        assert wait_for(lambda: ev.of("persisted"))
        # The storage goes bad: the persist root becomes a plain file (writes fail even as root).
        with p._io:  # not mid-write while we swap the directory out
            shutil.move(str(root), str(tmp_path / "ck.saved"))
            root.write_text("not a directory")
        assert wait_for(lambda: len(ev.of("persist_failed")) >= 3)
        fails_at = len(ev.of("persisted"))
        step_during = mem.step
        assert wait_for(lambda: mem.step > step_during + 20)  # training goes on meanwhile
        assert p.status()["last_error"] and p.status()["failures"] >= 3
        # The storage comes back: the next retry persists the newest step.
        root.unlink()
        shutil.move(str(tmp_path / "ck.saved"), str(root))
        assert wait_for(lambda: len(ev.of("persisted")) > fails_at)
    finally:
        stop.set()
        t.join()
        p.stop()
    failed = ev.of("persist_failed")
    assert all(isinstance(e["step"], int) and "\n" not in e["error"] for e in failed)
    assert max(gaps) < 1.0  # training was never held up by the persister
    assert p.status()["last_error"] is None
    newest = storage.newest_step(str(root))
    assert newest == ev.of("persisted")[-1]["step"]
    assert_same(storage.read_rank(str(root), newest, 0), snapshots(newest, 2)[0])


def test_reader_errors_and_final_failure_never_raise(tmp_path):
    ev = Events()

    def broken(min_step):
        raise RuntimeError("slot vanished")

    p = Persister(str(tmp_path), reader=broken, world_size=2, every_steps=1, every_seconds=None,
                  emit=ev.emit, poll_s=0.02, retry_base_s=0.01)
    p.start()
    assert wait_for(lambda: ev.of("persist_failed"))
    assert p.final(3, attempts=2) is False
    p.stop()
    assert "slot vanished" in ev.of("persist_failed")[-1]["error"]
    with pytest.raises(ValueError):
        Persister(str(tmp_path), reader=broken, world_size=1, every_steps=2, every_seconds=5)


def test_a_final_persist_to_storage_the_machines_do_not_share_is_not_retried(tmp_path):
    """Machines that do not share --persist-to (each its own local path): the leader's check
    refuses the step, and no wait makes them share it -- the final persist gives up at
    once, on every node alike (they all read the leader's answer), with that one line;
    other failures are still retried."""
    from ckptrun.tiers.durable.rounds import NOT_SHARED

    ev, calls = Events(), []

    def refused(url, step, snaps, world_size, threads=2):
        calls.append(step)
        raise storage.StorageError(f"node 1 wrote __1_0.distcp to /b, but /a has no such file: "
                                   f"{NOT_SHARED}")

    p = Persister(str(tmp_path), reader=lambda s: (s, {}), world_size=2, every_steps=100,
                  every_seconds=None, emit=ev.emit, retry_base_s=0.01, write=refused)
    assert p.final(7, attempts=3) is False
    assert calls == [7]
    assert NOT_SHARED in ev.of("persist_failed")[-1]["error"]

    def flaky(url, step, snaps, world_size, threads=2):
        calls.append(step)
        raise OSError("connection reset")

    calls.clear()
    p = Persister(str(tmp_path), reader=lambda s: (s, {}), world_size=2, every_steps=100,
                  every_seconds=None, emit=ev.emit, retry_base_s=0.01, write=flaky)
    assert p.final(7, attempts=3) is False
    assert calls == [7, 7, 7]


def test_kill_during_persist_leaves_no_visible_step(tmp_path):
    root = tmp_path / "ck"
    storage.write_step(str(root), 1, snapshots(1, 2), world_size=2)
    here = os.path.dirname(os.path.abspath(__file__))
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {here!r})
        import test_persister_background as t  # registers slowlocal://
        from test_storage_format import snapshots
        from ckptrun.tiers.durable import storage
        storage.write_step("slowlocal://{root}", 2, snapshots(2, 2, scale=64), world_size=2)
        print("finished")
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
    try:
        assert wait_for(lambda: (root / "step-2" / "__0_0.distcp").exists(), timeout=60)
        time.sleep(0.3)  # well inside the write
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        out, _ = proc.communicate(timeout=30)
    assert b"finished" not in out
    assert not (root / "step-2" / "ckptrun.json").exists()
    assert [s["step"] for s in storage.list_steps(str(root))] == [1]
    assert storage.newest_step(str(root)) == 1
    assert not storage.is_checkpoint(str(root / "step-2"))
    assert_same(storage.read_rank(str(root), 1, 1), snapshots(1, 2)[1])
    storage.write_step(str(root), 3, snapshots(3, 2), world_size=2)
    assert storage.prune(str(root), keep=5) == [2]  # the torn step is debris now
    assert sorted(os.listdir(root)) == ["step-1", "step-3"]


class HistoryMemory(FakeMemory):
    """Holds every committed step, as a reader that catches its target would see them."""

    def read(self, min_step: int):
        with self.lock:
            if self.step < max(min_step, 1):
                return None
            return min_step, snapshots(min_step, self.world_size)


def test_every_steps_asks_for_the_multiples_of_n(tmp_path):
    """The reader is asked for 5, 10, 15, ... (not "5 steps after the last one"); a count
    resumed from a final step that is not a multiple (37) goes on at the next one (40)."""
    url = f"file://{tmp_path}/ck"
    mem, ev = HistoryMemory(), Events()
    p = Persister(url, reader=mem.read, world_size=2, every_steps=5, every_seconds=None,
                  keep=10, emit=ev.emit, poll_s=0.02)
    p.start()
    for s in range(1, 18):
        mem.commit(s)
        p.notify(s)
        time.sleep(0.03)
    assert wait_for(lambda: [e["step"] for e in ev.of("persisted")] == [5, 10, 15])
    p.stop()
    ev2 = Events()
    p = Persister(url, reader=mem.read, world_size=2, every_steps=20, every_seconds=None,
                  keep=10, emit=ev2.emit, poll_s=0.02, start_step=37)
    p.start()
    mem.commit(45)
    p.notify(45)
    assert wait_for(lambda: [e["step"] for e in ev2.of("persisted")] == [40])
    p.stop()


@contextlib.contextmanager
def one_machine_tier(tmp_path, **cfg_fields):
    """``(tier, memory, control, events)``: the durable tier of a 2-rank machine, as an
    agent builds it, with its shared memory removed afterwards."""
    import uuid

    from ckptrun import protocol as P
    from ckptrun.config import AgentConfig
    from ckptrun.tiers.durable import tier as durable
    from ckptrun.tiers.interface import TierContext
    from ckptrun.tiers.memory.node import NodeMemory

    token, events = "tier" + uuid.uuid4().hex[:8], []
    cfg = AgentConfig(script="train.py", nproc_per_node=2, persist_to=str(tmp_path / "ck"),
                      **cfg_fields)
    memory = NodeMemory(token, num_slots=3)
    control = P.ControlBlock(P.control_path(token), 2, create=True)
    tier = durable.DurableTier(TierContext(
        cfg=cfg, node=0, nnodes=1, store=None, memory=memory, control=control, token=token,
        emit=lambda event, **f: events.append(dict(f, event=event))))
    try:
        yield tier, memory, control, events
    finally:
        tier.close()
        control.close()
        memory.cleanup()
        for f in os.listdir("/dev/shm"):
            if token in f:
                os.unlink(os.path.join("/dev/shm", f))


def _commit(memory, rank: int, step: int, state: dict) -> list:
    """``state`` committed as ``rank``'s ``step`` in ``memory``; its tensors, copied."""
    from ckptrun import snapshot as S

    tree, items = S.flatten(state)
    memory.write(rank, S.make_meta(step, rank, 2, tree, items, [0] * len(items)),
                 [t for _, t in items], step=step)
    return [t.clone() for _, t in items]


def _soon(pred, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not pred() and time.monotonic() < deadline:
        time.sleep(0.01)
    return bool(pred())


@pytest.mark.parametrize("due", [{"persist_every_steps": 5, "persist_every_seconds": None},
                                 {"persist_every_seconds": 10.0}])
def test_a_persist_due_within_the_first_steps_imports_at_the_start(tmp_path, monkeypatch,
                                                                   due):
    """``--persist-every N`` (or a short period): the first persist comes within a few
    steps, and importing then would make it miss the multiples it is to catch."""
    imports = []
    monkeypatch.setattr(storage, "warm_up", lambda: imports.append(time.monotonic()))
    with one_machine_tier(tmp_path, **due):
        assert _soon(lambda: imports)
        assert len(imports) == 1


def test_the_final_persist_writes_the_slots_without_copying_them_out(tmp_path, monkeypatch):
    """At the job's end the workers are stopped: the final step is written from the slots
    themselves (verified, pinned), not from private copies -- and reads back bitwise."""
    with one_machine_tier(tmp_path) as (tier, memory, _, events):
        want = {r: _commit(memory, r, 5, {"w": torch.randn(
            1000, generator=torch.Generator().manual_seed(r)), "step": 5}) for r in (0, 1)}

        def no_copies(*a, **k):
            raise AssertionError("the final persist copied the slots out")
        monkeypatch.setattr(memory, "read_common", no_copies)
        tier.finished(0)
        assert [e["step"] for e in events if e["event"] == "persisted"] == [5], events
        for r in (0, 1):
            _, tensors = storage.read_rank(str(tmp_path / "ck"), 5, r)
            assert all(torch.equal(a, b) for a, b in zip(want[r], tensors))


def test_what_a_persist_imports_is_imported_once_the_job_saves(tmp_path, monkeypatch):
    """The durable tier imports DCP (seconds of CPU) only when the job's first snapshot
    shows up, not at the start, when the workers are importing torch on the same cores --
    and a job that never saves never pays for it."""
    imports = []
    monkeypatch.setattr(storage, "warm_up", lambda: imports.append(time.monotonic()))
    with one_machine_tier(tmp_path) as (tier, memory, control, _):
        for _ in range(3):
            tier.tick()
        time.sleep(0.1)
        assert imports == []  # no snapshot yet
        _commit(memory, 0, 1, {"w": torch.ones(4)})
        control.set(0, "committed_step", 1)  # what the worker's save says when it commits
        for _ in range(3):
            tier.tick()
        assert _soon(lambda: imports)
        for _ in range(3):
            tier.tick()
        assert len(imports) == 1  # once, on its own thread


@pytest.mark.parametrize("ended_ok", [1, 0])
def test_the_last_step_is_persisted_while_the_workers_tear_down(tmp_path, ended_ok):
    """Every local script ended successfully (``ended_ok``, phase DONE) with its last save
    committed: the agent's tick writes that step at once, before the workers have exited,
    and the end of the job finds it durable (one ``persisted``).  A script that failed
    leaves the decision to the job's end, as before."""
    from ckptrun.protocol import Phase

    with one_machine_tier(tmp_path) as (tier, memory, control, events):
        for r in (0, 1):
            _commit(memory, r, 7, {"w": torch.full((100,), float(r)), "step": 7})
            control.set(r, "committed_step", 7)
            control.set(r, "step", 7)
            control.set(r, "ended_ok", ended_ok)
        tier.tick()
        assert tier._early is None  # still running: nothing yet
        for r in (0, 1):
            control.set(r, "phase", Phase.DONE)
        tier.tick()
        if ended_ok:
            tier._early.join(30)
            assert [e["step"] for e in events if e["event"] == "persisted"] == [7]
        else:
            assert tier._early is None and not events
        tier.finished(0)
        assert [e["step"] for e in events if e["event"] == "persisted"] == [7], events
        assert storage.newest_step(str(tmp_path / "ck")) == 7


def test_a_job_whose_teardown_is_slow_is_persisted_before_it_ends(tmp_path):
    """Under ``ckptrun`` the last step of a script that ended successfully is written while
    the script's process still tears down (here an ``atexit`` handler of 5 s, as a data
    loader's or NCCL's shutdown can take), not after it exited."""
    import json

    from conftest import ckptrun_cmd

    script = tmp_path / "slow_teardown.py"
    script.write_text(textwrap.dedent("""
        import atexit, sys, time
        import torch
        import ckptrun

        def teardown():
            time.sleep(5.0)  # 2 s was too little on a loaded 2-core CI machine
            with open(sys.argv[1], "w") as f:
                f.write(repr(time.time()))

        atexit.register(teardown)
        w = torch.zeros(1000)
        ck = ckptrun.Checkpointer({"w": w})
        for step in range(ck.restore() + 1, 6):
            w += 1
            ck.save(step)
    """))
    run_dir, ended = tmp_path / "run", tmp_path / "ended"
    proc = subprocess.run(ckptrun_cmd("--standalone", "--nproc-per-node", "1", "--run-dir",
                                      str(run_dir), str(script), str(ended)),
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    with open(run_dir / "events.jsonl") as f:
        events = [json.loads(line) for line in f if line.strip()]
    persisted = [e for e in events if e["event"] == "persisted"]
    assert [e["step"] for e in persisted] == [5], events
    assert persisted[0]["time"] < float(ended.read_text()), "persisted only after the exit"


def test_a_round_stopped_while_a_machine_is_silent_is_no_failed_persist(tmp_path):
    """A persist round waits for every machine's newest step; a machine is lost and the
    agent stops the tier to re-form the job.  The round is abandoned -- not reported as a
    failed persist of a step that was not even due (``persisting step 40 failed: ...
    stopped while waiting`` on every machine loss)."""
    import torch.distributed as dist

    from ckptrun.tiers.durable.rounds import PersistRounds

    class Empty:  # this node's ranks committed step 3
        def newest_committed(self, ranks):
            return 3

    events: list = []
    rounds = PersistRounds(dist.HashStore(), 0, 2, [0], Empty(),
                           lambda e, **f: events.append(e), str(tmp_path / "durable"))
    persister = Persister(str(tmp_path / "durable"), reader=rounds.read, world_size=2,
                          emit=lambda e, **f: events.append(e))
    threading.Timer(0.3, rounds.stop).start()  # node 1 never answers
    t0 = time.monotonic()
    assert persister._persist_once(1, exact=False) is None
    assert time.monotonic() - t0 < 5
    assert events == [] and persister.status()["last_error"] is None


def test_a_round_stopped_while_its_step_is_awaited_is_no_failed_persist(tmp_path):
    """The round's step was agreed and the leader waits for its ranks to commit it when a
    machine is lost and the tier is stopped: abandoned, not ``persisting step 15 failed:
    reading the memory tier: KeyError: step 15 is not (or no longer) in this node's
    memory`` (every machine-loss test with --persist-to printed it)."""
    import torch.distributed as dist

    from ckptrun.tiers.durable.rounds import KEY, PersistRounds

    class Behind:  # this node's ranks committed step 3, and never get further
        def newest_committed(self, ranks):
            return 3

        def headers(self, rank):
            return {}

        def steps(self, rank):
            return {3: 0}

    store = dist.HashStore()
    store.set(f"{KEY}1/newest/1", "3")  # machine 1 answered the round, then was lost
    events: list = []
    rounds = PersistRounds(store, 0, 2, [0], Behind(),
                           lambda e, **f: events.append(e), str(tmp_path / "durable"))
    persister = Persister(str(tmp_path / "durable"), reader=rounds.read, world_size=2,
                          emit=lambda e, **f: events.append(e))
    threading.Timer(0.3, rounds.stop).start()
    t0 = time.monotonic()
    assert persister._persist_once(1, exact=False) is None
    assert time.monotonic() - t0 < 5
    assert store.get(f"{KEY}1/step") == b"5"  # the round did agree a step
    assert events == [] and persister.status()["last_error"] is None


def test_a_preempted_two_machine_job_persists_the_newest_step_both_hold(tmp_path):
    """Slurm preempts a job by signalling every machine on its own: when the agents stop,
    one machine's ranks may have committed a step more than the other's.  The final round
    persists the newest step *both* hold (the leader's ranks still hold the one before their
    newest) -- it failed before (``node 1: JobEnded: the job ended before step 26``), which
    left the preempted job to resume from an old persist."""
    import torch.distributed as dist

    from ckptrun.tiers.durable.rounds import PersistRounds

    class Held:
        """A machine's memory tier: its one rank holds two committed steps."""

        def __init__(self, rank: int, steps):
            self.rank, self.held = rank, {s: snapshots(s)[rank] for s in steps}

        def newest_committed(self, ranks):
            return max(self.held)

        def steps(self, rank):
            return dict.fromkeys(self.held, 0)

        def read(self, rank, step):
            return self.held[step]

    url, store = str(tmp_path / "durable"), dist.HashStore()
    events = {0: Events(), 1: Events()}
    leader = PersistRounds(store, 0, 2, [0], Held(0, [25, 26]), events[0].emit, url)
    follower = PersistRounds(store, 1, 2, [1], Held(1, [24, 25]), events[1].emit, url)
    persister = Persister(url, reader=leader.read, write=leader.write, world_size=2,
                          emit=events[0].emit)
    follower.start_follower()
    # both agents were signalled: the follower answers the final round until it is closed
    ended = threading.Thread(target=follower.finish_follower, kwargs={"timeout": 60})
    ended.start()
    try:
        leader.job_done(26)  # what the leader's own ranks hold (the tier's common_step)
        assert persister.final(26, exact=False, attempts=1)
    finally:
        leader.close_leader()
        ended.join()
    assert [e["step"] for e in events[0].of("persisted")] == [25], events[0].items
    assert [e["step"] for e in events[1].of("persisted")] == [25], events[1].items
    assert not events[0].of("persist_failed") and not events[1].of("persist_failed")
    for r in (0, 1):
        assert_same(storage.read_rank(url, 25, r), snapshots(25)[r])
