"""Replication pacing: rounds take as much time as the measured slowdown allows."""

from __future__ import annotations

import random

import pytest

from ckptrun.tiers.peer.pacing import DEFAULT_BUDGET, Pacer, parse_budget


def test_parse_budget():
    assert parse_budget("5%") == pytest.approx(0.05)
    assert parse_budget("0.1") == pytest.approx(0.1)
    assert parse_budget("") == DEFAULT_BUDGET
    for off in ("off", "0", "none", "OFF"):
        assert parse_budget(off) is None
    for bad in ("150%", "-1", "1", "abc"):
        with pytest.raises(ValueError):
            parse_budget(bad)


def feed(p: Pacer, idle_rate: float, active_rate: float, seconds: float, duty: float) -> None:
    """Alternate windows (0.1 s of rounds, the rest idle) with exact beat counts."""
    t = 0.0
    while t < seconds:
        p.observe(True, 0.1, 0.1 * active_rate)
        idle = 0.1 / duty - 0.1
        p.observe(False, idle, idle * idle_rate)
        t += 0.1 / duty


def test_until_the_cost_is_measured_rounds_run_half_the_time():
    p = Pacer(0.05, rng=random.Random(1))
    assert p.slowdown_while_active() is None
    assert p.duty() == Pacer.INITIAL_DUTY == 0.5
    assert p.pause(0.1) == pytest.approx(0.1)  # no beat interval known: no jitter
    feed(p, idle_rate=50, active_rate=25, seconds=1.0, duty=0.5)  # a second of training
    assert p.slowdown_while_active() == pytest.approx(0.5)  # measured already
    assert p.duty() == pytest.approx(0.1 * Pacer.AIM)


def test_free_rounds_run_nearly_back_to_back():
    p = Pacer(0.05)
    feed(p, idle_rate=50, active_rate=50, seconds=30, duty=0.5)
    assert p.slowdown_while_active() == pytest.approx(0.0, abs=1e-9)
    assert p.duty() == Pacer.MAX_DUTY


def test_costly_rounds_get_budget_over_cost():
    p = Pacer(0.05)
    feed(p, idle_rate=50, active_rate=25, seconds=30, duty=0.2)  # half speed in rounds
    assert p.slowdown_while_active() == pytest.approx(0.5)
    assert p.duty() == pytest.approx(0.1 * Pacer.AIM)  # aims a little below the budget
    feed(p, idle_rate=50, active_rate=0, seconds=300, duty=0.1)  # training stops in rounds
    assert p.duty() == pytest.approx(0.05 * Pacer.AIM, rel=0.05)


def test_old_evidence_fades():
    p = Pacer(0.05, half_life_s=10)
    feed(p, idle_rate=50, active_rate=10, seconds=60, duty=0.1)
    assert p.duty() < 0.1
    feed(p, idle_rate=50, active_rate=50, seconds=120, duty=0.5)  # a GPU phase: rounds free
    assert p.duty() == Pacer.MAX_DUTY


def test_off_means_back_to_back():
    p = Pacer(None)
    feed(p, idle_rate=50, active_rate=10, seconds=30, duty=0.5)
    assert p.duty() == 1.0 and p.pause(1.0) == 0.0


@pytest.mark.parametrize("cost", [0.0, 0.3, 0.8])
def test_closed_loop_keeps_the_slowdown_within_budget(cost):
    """A simulated job: steps of 16 ms, two beats each (save() start and end); a round of
    10 ms starts after the pause once a step newer than the last round's has committed
    (with no pause: right at a commit, so just after a beat -- the bias the jitter is there
    to remove), and slows training by ``cost`` while it runs.  The job must end at most
    about the budget slower, and the pacer must have measured the cost."""
    budget, step, round_s = 0.05, 0.016, 0.010
    p = Pacer(budget, rng=random.Random(7))
    t, progress, beats = 0.0, 0.0, 0
    pause_until = 0.0
    rounds_time = 0.0
    dt = 0.0005
    mark = (0.0, 0, False)
    in_round_until, replicated = -1.0, -1
    while t < 120.0:
        active = t < in_round_until
        progress += dt / step * ((1 - cost) if active else 1.0)
        beats = int(progress * 2)
        committed = beats // 2  # the newest committed step
        t += dt
        if active and t >= in_round_until:  # round over: window, then the pause
            p.observe(True, t - mark[0], beats - mark[1])
            mark = (t, beats, False)
            pause_until = t + p.pause(round_s)
        elif not active and t >= pause_until and committed > replicated:
            p.observe(False, t - mark[0], beats - mark[1])
            mark, replicated = (t, beats, True), committed
            in_round_until = t + round_s
            rounds_time += round_s
    slowdown = 1 - progress * step / t
    assert slowdown <= budget * 1.3 + 0.005, (slowdown, p.duty(), p.slowdown_while_active())
    if cost == 0.0:  # free rounds: nearly all the time
        assert rounds_time / t > 0.5
    else:
        assert p.slowdown_while_active() == pytest.approx(cost, abs=0.12)


def test_free_rounds_with_slow_steps_stay_back_to_back():
    """Steps of 0.5 s (2 beats/s) and free rounds: once measured, rounds run nearly all the
    time, and the little time left without rounds (too few beats to pass the first
    estimate's threshold again) does not send the pacer back to its initial half."""
    p = Pacer(0.05, rng=random.Random(3))
    feed(p, idle_rate=2, active_rate=2, seconds=60, duty=0.5)
    assert p.duty() == Pacer.MAX_DUTY
    for _ in range(20):  # 2 minutes at the duty it chose
        feed(p, idle_rate=2, active_rate=2, seconds=6, duty=p.duty())
        assert p.duty() == Pacer.MAX_DUTY
    feed(p, idle_rate=2, active_rate=1, seconds=120, duty=p.duty())  # now rounds cost
    assert p.duty() < 0.2


def test_the_random_phase_does_not_lengthen_pauses():
    """Pauses are moved by up to half a beat interval either way (every phase of the step),
    not lengthened: at the initial duty rounds still run about half of the time."""
    p = Pacer(0.05, rng=random.Random(5))
    p.observe(False, 1.0, 4.0)  # beats every 0.25 s; the cost is not known yet
    pauses = [p.pause(0.25) for _ in range(4000)]
    assert sum(pauses) / len(pauses) == pytest.approx(0.25, rel=0.05)
    assert min(pauses) < 0.13 and max(pauses) > 0.37  # a spread of one interval
    assert max(pauses) - min(pauses) <= 0.25


def test_a_pause_stays_bounded_when_the_workers_have_stopped():
    """Beats stop when the workers do (a failure, the end): the beat interval then grows
    without bound, and a pause that followed it overflowed ``Event.wait`` (a traceback on
    the user's console at a Slurm requeue)."""
    p = Pacer(0.05, rng=random.Random(3))
    p._idle = (1.0, 1e12)  # one beat in a very long silence
    assert p.beat_interval() == 1e12
    for _ in range(20):
        assert 0.0 <= p.pause(0.5) <= Pacer.MAX_PAUSE_S
    assert 0.0 <= Pacer(0.0).pause(0.5) <= Pacer.MAX_PAUSE_S  # a zero budget: no division
