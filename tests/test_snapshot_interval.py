"""Snapshot interval: every step by default, every N, or "auto" under a cost budget.

The "auto" policy is driven by a fake clock (no timing in these tests): a plain step takes
``STEP`` seconds and a step after a snapshot ``STEP + cost``.
"""

from __future__ import annotations

import pytest
import torch

import ckptrun
from ckptrun import protocol as P
from ckptrun.cli.args import UsageError, parse
from ckptrun.worker import interval as I

STEP = 0.010


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def drive(iv: I.SnapshotInterval, clock: FakeClock, steps, cost: float) -> list:
    """Call due() once per step like save() does; return the steps that snapshotted."""
    taken = []
    for step in steps:
        if iv.due(step):
            taken.append(step)
            clock.t += cost  # the snapshot's cost lands in the time to the next call
        clock.t += STEP
    return taken


@pytest.fixture
def clock(monkeypatch):
    c = FakeClock()
    monkeypatch.setattr(I.time, "perf_counter", c)
    return c


def test_default_is_every_step(clock, monkeypatch):
    monkeypatch.delenv(P.ENV_EVERY, raising=False)
    iv = I.SnapshotInterval()
    assert iv.mode == "1" and drive(iv, clock, range(1, 300), cost=STEP) == list(range(1, 300))


def test_fixed_interval_takes_the_multiples_and_the_first_call(clock):
    iv = I.SnapshotInterval(every=4)
    assert drive(iv, clock, range(3, 20), cost=0) == [3, 4, 8, 12, 16]
    iv.restart()  # after a restore: the next call snapshots again
    assert drive(iv, clock, range(13, 18), cost=0) == [13, 16]
    iv = I.SnapshotInterval(every=10)
    assert drive(iv, clock, range(5, 60, 7), cost=0) == [5, 12, 26, 33, 40, 54]  # steps with gaps


def test_auto_keeps_every_step_when_snapshots_are_cheap(clock):
    iv = I.SnapshotInterval(every="auto", budget=0.03)
    taken = drive(iv, clock, range(1, 1025), cost=0.01 * STEP)
    assert iv.every == 1 and iv.overhead == pytest.approx(0.01)
    skipped = set(range(1, 1025)) - set(taken)
    assert skipped and len(skipped) < 1024 / I.PROBE  # only the probes timing a plain step


@pytest.mark.parametrize("cost,budget,expect", [(0.5, 0.03, 32), (0.5, 0.10, 8),
                                                (0.05, 0.03, 2), (100.0, 0.03, I.MAX_EVERY)])
def test_auto_stretches_the_interval_to_fit_the_budget(clock, cost, budget, expect):
    iv = I.SnapshotInterval(every="auto", budget=budget)
    taken = drive(iv, clock, range(1, 2049), cost=cost * STEP)
    assert iv.every == expect
    assert iv.overhead == pytest.approx(cost / expect)
    tail = [s for s in taken if s > 1536]
    assert tail and all(s % expect == 0 for s in tail)
    if expect <= 32:  # and back to every step once snapshots got cheap (the cost is only
        # measured at snapshots: half of the window must be new ones to move its median)
        drive(iv, clock, range(2049, 2049 + 64 * 40), cost=0.001 * STEP)
        assert iv.every == 1


def test_ranks_agree_on_the_largest_interval(clock, monkeypatch):
    """Two ranks measuring different costs pick different intervals alone; the all_reduce
    (here: both ranks' wishes, maxed) makes them snapshot the same steps."""
    wishes = {}

    def fake_max(value):
        wishes[len(wishes) % 2] = value
        return max(wishes.values())

    monkeypatch.setattr(I, "_all_ranks_max", fake_max)
    cheap = I.SnapshotInterval(every="auto", world_size=2)
    costly = I.SnapshotInterval(every="auto", world_size=2)
    cheap_clock, costly_clock = FakeClock(), FakeClock()
    taken = {0: [], 1: []}
    for step in range(1, 1025):  # lockstep, like ranks of one job
        for r, iv, c, cost in ((0, cheap, cheap_clock, 0.1 * STEP),
                               (1, costly, costly_clock, 0.5 * STEP)):
            monkeypatch.setattr(I.time, "perf_counter", c)
            if iv.due(step):
                taken[r].append(step)
                c.t += cost
            c.t += STEP
    assert cheap.every == costly.every == 32
    assert [s for s in taken[0] if s > 512] == [s for s in taken[1] if s > 512]


def test_the_wait_in_the_agreement_is_not_taken_for_snapshot_cost(clock, monkeypatch):
    def slow_max(value):  # the all_reduce waits for the slowest rank
        clock.t += 100 * STEP
        return value

    monkeypatch.setattr(I, "_all_ranks_max", slow_max)
    iv = I.SnapshotInterval(every="auto", budget=0.03, world_size=2)
    drive(iv, clock, range(1, 4097), cost=0.5 * STEP)
    assert iv.every == 32 and iv.overhead == pytest.approx(0.5 / 32)


def test_auto_without_torch_distributed_snapshots_every_step(clock, capsys):
    iv = I.SnapshotInterval(every="auto", world_size=2)
    drive(iv, clock, range(1, 300), cost=STEP)
    assert iv.every == 1 and "torch.distributed" in capsys.readouterr().err


@pytest.mark.parametrize("bad", ["0", "-3", "often", "1.5"])
def test_bad_intervals(bad, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    with pytest.raises(ValueError, match="snapshot interval"):
        I.SnapshotInterval(every=bad)
    with pytest.raises(UsageError, match="--snapshot-every"):
        parse(["--snapshot-every", bad, "train.py"])


def test_cli_option_and_budget_spellings(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    assert parse(["--snapshot-every", "AUTO", "train.py"]).snapshot_every == "auto"
    assert parse(["train.py"]).snapshot_every == "1"
    monkeypatch.setenv("CKPTRUN_SNAPSHOT_EVERY", "8")
    assert parse(["train.py"]).snapshot_every == "8"
    assert I.parse_budget("5%") == I.parse_budget(0.05) == 0.05
    with pytest.raises(ValueError, match="budget"):
        I.parse_budget("2")


def test_checkpointer_every_n_restores_the_last_multiple_and_close_takes_the_final_step():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ck = ckptrun.Checkpointer({"model": model, "optim": opt}, every=4, capture_rng=False)
    assert ck.every == 4
    done = []
    for step in range(1, 11):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        done.append(ck.save(step))
        if step == 8:
            ck.wait()
            at8 = model.weight.detach().clone()
    assert done == [s in (1, 4, 8) for s in range(1, 11)]
    assert ck.restore() == 8 and torch.equal(model.weight.detach(), at8)
    assert ck.save(9)  # the first save after a restore snapshots
    ck.wait()
    assert ck._slots.header(ck._slots.newest()).step == 9
    ck.save(10)
    ck.close()  # 10 is not a multiple of 4: close() snapshots it, the job's final step
    assert ck._slots.header(ck._slots.newest()).step == 10


# ----------------------------------------------------------------------------- what they cost


def _loop(ckpt, steps: int, train_s: float) -> None:
    import time

    for step in range(steps):
        if train_s:
            time.sleep(train_s)
        ckpt.save(step + 1)
    ckpt.close()


def test_snapshots_that_make_the_loop_twice_as_slow_are_said_once(capsys):
    """Seen on an H200: 256 MiB with 3 ms steps ran 17x slower at every step, silently."""
    ckpt = ckptrun.Checkpointer({"ballast": torch.ones(16 << 18)})  # 16 MiB, no training
    _loop(ckpt, 80, 0.0)
    err = capsys.readouterr().err
    assert err.count("snapshots every 1 step(s) block the training loop") == 1, err
    assert "--snapshot-every auto" in err
    assert ckpt._cost.share() > 1.0


@pytest.mark.parametrize("every", ["1", "auto"])
def test_cheap_snapshots_or_auto_say_nothing(capsys, every):
    ckpt = ckptrun.Checkpointer({"w": torch.ones(1024)}, every=every)
    _loop(ckpt, 40, 0.005)
    assert "block the training loop" not in capsys.readouterr().err
    if every == "1":
        assert ckpt._cost.share() < 0.5  # a 4 KiB snapshot beside 5 ms of training
