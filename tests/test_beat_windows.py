"""The pacer's windows are cut at the workers' beats, so a round's cost is measured whole."""

from __future__ import annotations

import random
from typing import Dict, List, Tuple

import pytest

from ckptrun import protocol as P
from ckptrun.tiers.peer import beat_windows
from ckptrun.tiers.peer.beat_windows import BeatWindows
from ckptrun.tiers.peer.pacing import Pacer


class Block:
    """A control block's records for ``n`` workers (only what the windows read)."""

    def __init__(self, n: int = 1) -> None:
        self.rec: List[Dict[str, float]] = [
            {"phase": P.Phase.RUNNING, "beats": 0, "heartbeat": 0.0} for _ in range(n)]

    def get(self, lr: int, name: str):
        return self.rec[lr][name]

    def beat(self, lr: int, t: float) -> None:
        self.rec[lr]["beats"] += 1
        self.rec[lr]["heartbeat"] = t


class Recorder(Pacer):
    def __init__(self) -> None:
        super().__init__(0.05)
        self.seen: List[Tuple[bool, float, float]] = []

    def observe(self, active: bool, seconds: float, beats: float) -> None:
        self.seen.append((active, round(seconds, 6), beats))
        super().observe(active, seconds, beats)


class Clock:
    """Virtual time for the module under test; ``on_sleep`` lets the workers run."""

    def __init__(self) -> None:
        self.now = 0.0
        self.on_sleep = lambda dt: None

    def monotonic(self) -> float:
        return self.now

    def sleep(self, dt: float) -> None:
        self.on_sleep(dt)


@pytest.fixture
def clock(monkeypatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(beat_windows, "time", c)
    return c


def test_a_round_window_runs_from_the_beat_before_it_to_the_beat_after_it(clock):
    block, pacer = Block(2), Recorder()
    w = BeatWindows(pacer, block, 2)
    for lr in (0, 1):
        block.beat(lr, 10.0)
    w.round_starts()  # opens at the last beats (10.0), not at "now"
    assert pacer.seen == []  # nothing was open before
    block.beat(0, 10.05)  # one worker beats during the round
    pending = [(0, 10.12), (1, 10.14)]  # each beats once more after the round

    def run(dt: float) -> None:
        clock.now += dt
        while pending and clock.now >= pending[0][1] - 10.0:
            block.beat(*pending.pop(0))
    clock.on_sleep = run
    assert w.round_ended() == pytest.approx(0.13)  # mean of 10.12 and 10.14, less 10.0
    assert pacer.seen == [(True, 0.13, 1.5)]
    for lr in (0, 1):
        block.beat(lr, 10.5)
    w.round_starts()
    assert pacer.seen[-1] == (False, 0.37, 1.0)  # 10.5 - 10.13, each worker beat once


def test_a_cold_round_is_not_told_to_the_pacer(clock):
    block, pacer = Block(), Recorder()
    w = BeatWindows(pacer, block, 1)
    block.beat(0, 1.0)
    w.round_starts()
    clock.on_sleep = lambda dt: block.beat(0, 1.3)
    assert w.round_ended(measure=False) == pytest.approx(0.3)
    assert pacer.seen == []
    block.beat(0, 2.0)
    w.round_starts()  # the window after it is measured again
    assert pacer.seen == [(False, 0.7, 1)]


def test_no_beat_after_a_round_measures_nothing(clock):
    block, pacer = Block(), Recorder()
    w = BeatWindows(pacer, block, 1)
    block.beat(0, 1.0)
    w.round_starts()

    def idle(dt: float) -> None:
        clock.now += dt
    clock.on_sleep = idle
    assert w.round_ended() is None  # gave up after a second (no beat interval known yet)
    assert 1.0 <= clock.now < 1.1
    block.beat(0, 5.0)
    w.round_starts()  # the window after it had no start at a beat either
    assert pacer.seen == []


def test_a_worker_not_training_measures_nothing(clock):
    block, pacer = Block(2), Recorder()
    w = BeatWindows(pacer, block, 2)
    block.rec[1]["phase"] = P.Phase.RESTORING
    assert w.read() is None
    w.round_starts()
    assert w.round_ended() is None
    assert pacer.seen == []
    assert BeatWindows(pacer, None, 1).read() is None  # no control block at all


class Worker:
    """A training loop in virtual time: a step is ``step_s`` of work, done ``1 - cost``
    as fast while a replication round runs; it beats when a step ends."""

    def __init__(self, clock: Clock, block: Block, step_s: float, cost: float) -> None:
        self.clock, self.block, self.step_s, self.cost = clock, block, step_s, cost
        self.done, self.in_round = 0.0, False

    def run(self, dt: float) -> None:
        speed = 1.0 - self.cost if self.in_round else 1.0
        while dt > 0:
            left = (self.step_s - self.done) / speed
            if left > dt:
                self.done += dt * speed
                self.clock.now += dt
                return
            self.clock.now += left
            dt -= left
            self.done = 0.0
            self.block.beat(0, self.clock.now)


@pytest.mark.parametrize("round_s", [0.005, 0.02, 0.05])
def test_the_paced_job_loses_about_its_budget(clock, round_s):
    """A job with 20 ms steps that rounds slow by 60% while they run: cut at beats, the
    pacer sees the whole cost and the job loses about 0.8 x 5% of its steps -- whatever
    the length of a round.  (Cut at the times a round started and ended, with the
    fraction of the running step guessed from the step interval, the same pacer let
    this job lose 21%, 10% and 5% for these three round lengths.)"""
    block, pacer = Block(), Pacer(0.05, rng=random.Random(5))
    worker, w = Worker(clock, block, 0.02, 0.6), BeatWindows(pacer, block, 1)
    clock.on_sleep = worker.run
    worker.run(0.1)
    total_s = 600.0
    while clock.now < total_s:
        w.round_starts()
        worker.in_round = True
        worker.run(round_s)
        worker.in_round = False
        window = w.round_ended()
        assert window is not None
        worker.run(pacer.pause(window))
    lost = 1.0 - block.rec[0]["beats"] * 0.02 / clock.now
    assert 0.025 < lost < 0.05
    assert pacer.duty() * pacer.slowdown_while_active() == pytest.approx(0.04, rel=0.05)
