"""Hangs by progress: a job is hung only when no rank advances.  A long eval on rank 0 while
rank 1 waits is not a hang; a stopped rank is caught within the timeout and named alone; a
deadlock of every rank is caught and names them all."""

from __future__ import annotations

import os

import pytest
from conftest import SCRIPTS, run_events

from ckptrun.agent.hang import HangDetector
from ckptrun.protocol import Phase

JOB = os.path.join(SCRIPTS, "progress_job.py")


def of(evts, name):
    return [e for e in evts if e["event"] == name]


def watched(d: HangDetector, rank: int, now: float, advanced: float, sampled: float = None):
    d.observe(rank, 1, now - 50, sampled=now if sampled is None else sampled,
              advanced=advanced, phase=Phase.RUNNING)


def test_one_rank_advancing_keeps_the_job_alive():
    d = HangDetector(2.0)
    d.reset(now=0.0)
    watched(d, 0, 100.0, advanced=99.9)  # evaluating
    watched(d, 1, 100.0, advanced=40.0)  # waiting in the all-reduce for a minute
    assert d.verdict(now=100.0) is None


def test_a_stopped_rank_is_named_not_the_one_waiting():
    d = HangDetector(2.0)
    d.reset(now=0.0)
    watched(d, 0, 100.0, advanced=97.0)  # waiting, its sampler alive
    watched(d, 1, 100.0, advanced=97.0, sampled=97.0)  # stopped at 97
    hang = d.verdict(now=100.0)
    assert hang is not None and hang.ranks == [1] and not hang.deadlock and hang.silent_s == 3


def test_a_rank_stopped_for_the_timeout_is_named_while_the_others_advance():
    """Independent workers: rank 0 advances, rank 1 is stopped (state T) -- hung, named.  A
    silent sampler in a process that is not stopped (a native call holding the GIL) is no
    verdict while another rank advances."""
    d = HangDetector(2.0)
    d.reset(now=0.0)
    watched(d, 0, 100.0, advanced=99.9)
    watched(d, 1, 100.0, advanced=97.0, sampled=97.0)
    assert d.verdict(now=100.0) is None  # someone advances: the job-wide rule says no
    hang = d.verdict(now=100.0, is_stopped=lambda r: r == 1)
    assert hang is not None and hang.ranks == [1] and not hang.deadlock and hang.silent_s == 3
    assert d.verdict(now=100.0, is_stopped=lambda r: False) is None
    assert d.verdict(now=98.5, is_stopped=lambda r: r == 1) is None  # within the timeout


def test_a_deadlock_names_every_rank_and_waits_for_other_nodes_first():
    d = HangDetector(2.0)
    d.reset(now=0.0)
    watched(d, 0, 100.0, advanced=97.0)
    watched(d, 1, 100.0, advanced=97.0)
    assert d.verdict(now=100.0).ranks == [0, 1] and d.verdict(now=100.0).deadlock
    # another node advanced 1 s ago: not hung; silent there too but within the grace
    # (its own agent may name a stopped rank of its own first): not yet
    assert d.verdict(now=100.0, remote_age=1.0) is None
    assert d.verdict(now=100.0, remote_age=3.5) is None
    for rank in (0, 1):  # 5 s later, still nothing anywhere
        watched(d, rank, 105.0, advanced=97.0)
    assert d.verdict(now=105.0, remote_age=5.0).deadlock


def test_saving_restoring_and_done_ranks_never_hang_and_auto_learns_step_times():
    d = HangDetector(None, first_window=120, floor=3, factor=10)
    d.reset(now=0.0)
    d.observe(0, 1, 100.0, sampled=100.0, advanced=100.0)
    assert d.timeout_for(0) == 120  # until the second beat
    for i in range(2, 12):
        t = 100.0 + (i - 1)  # one beat a second
        d.observe(0, i, t, sampled=t, advanced=t)
    assert d.timeout_for(0) == 10.0
    assert d.verdict(now=119.0) is None  # last progress at 110: 9 s
    assert d.verdict(now=121.0).ranks == [0]  # a lone rank that stops moving: a deadlock
    d.observe(0, 11, 110.0, sampled=121.0, advanced=110.0, phase=Phase.SAVING)
    assert d.verdict(now=121.0) is None
    # stopped in the middle of a snapshot (its copy thread stopped too): stopped all the same
    d.observe(0, 11, 110.0, sampled=110.0, advanced=110.0, phase=Phase.SAVING)
    assert d.verdict(now=121.0).ranks == [0]
    d.observe(0, 11, 110.0, sampled=121.0, advanced=110.0, phase=Phase.DONE)
    assert d.verdict(now=500.0) is None
    never = HangDetector(1.0)
    never.observe(0, 0, 0.0, sampled=1.0, advanced=1.0)  # no heartbeat ever: not watched
    assert never.verdict(now=1e9) is None


@pytest.mark.slow
def test_a_rank_0_eval_ten_times_the_timeout_is_not_a_hang(tmp_path, ckptrun_run):
    run_dir = str(tmp_path / "run")
    p = ckptrun_run("--standalone", "--nproc-per-node", "2", "--hang-timeout", "1",
                    "--run-dir", run_dir, JOB, "--mode", "eval", "--seconds", "10")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "evaluated for 10.0 s" in p.stdout
    evts = run_events(run_dir)
    assert not of(evts, "hang_detected") and not of(evts, "restart"), evts


def test_a_stopped_rank_is_caught_within_the_timeout_and_named(tmp_path, ckptrun_run):
    run_dir, mark = str(tmp_path / "run"), str(tmp_path / "stopped-at")
    p = ckptrun_run("--standalone", "--nproc-per-node", "2", "--hang-timeout", "2",
                    "--run-dir", run_dir, JOB, "--mode", "stop", "--mark", mark)
    assert p.returncode == 0, p.stderr[-3000:]
    evts = run_events(run_dir)
    hangs = of(evts, "hang_detected")
    assert [(e["rank"], e["why"]) for e in hangs] == [(1, "stopped")], evts
    stopped_at = float(open(mark).read())
    assert 2.0 <= hangs[0]["time"] - stopped_at <= 2.0 + 1.0, (hangs, stopped_at)
    assert "ckptrun: rank 1 stopped (no sign of life): no rank advanced for" in p.stderr
    assert [e["attempt"] for e in of(evts, "restart")] == [1]


def test_a_stopped_rank_is_caught_while_independent_ranks_advance(tmp_path, ckptrun_run):
    """No collectives: rank 0 goes on stepping while rank 1 is stopped; rank 1 is named and
    the job restarted within the timeout all the same."""
    run_dir, mark = str(tmp_path / "run"), str(tmp_path / "stopped-at")
    p = ckptrun_run("--standalone", "--nproc-per-node", "2", "--hang-timeout", "2",
                    "--run-dir", run_dir, JOB, "--mode", "stop", "--mark", mark,
                    "--independent", "--steps", "150", "--step-time", "0.05")
    assert p.returncode == 0, p.stderr[-3000:]
    evts = run_events(run_dir)
    hangs = of(evts, "hang_detected")
    assert [(e["rank"], e["why"]) for e in hangs] == [(1, "stopped")], evts
    # silent for the timeout since its sampler's last sample, which came a little before the
    # mark the script wrote just before stopping itself
    assert hangs[0]["seconds_silent"] >= 2.0, hangs
    stopped_at = float(open(mark).read())
    assert 1.5 <= hangs[0]["time"] - stopped_at <= 2.0 + 1.5, (hangs, stopped_at)
    assert [e["attempt"] for e in of(evts, "restart")] == [1]
    assert of(evts, "finished")[-1]["exit_code"] == 0


@pytest.mark.parametrize("at", [3, 0])
def test_a_deadlock_is_caught_and_names_both_ranks(tmp_path, ckptrun_run, at):
    """After step 3, or right after ``restore()`` found nothing, before the first save (CI
    once: a Lightning job stuck in its first batches held the machine for minutes, unwatched
    until a worker had saved)."""
    run_dir = str(tmp_path / "run")
    p = ckptrun_run("--standalone", "--nproc-per-node", "2", "--hang-timeout", "2",
                    "--run-dir", run_dir, JOB, "--mode", "deadlock", "--at", str(at))
    assert p.returncode == 0, p.stderr[-3000:]
    evts = run_events(run_dir)
    hangs = of(evts, "hang_detected")
    assert sorted((e["rank"], e["why"]) for e in hangs) == [(0, "deadlock"), (1, "deadlock")]
    assert [e["attempt"] for e in of(evts, "restart")] == [1]
    assert "rank 0 done at step 6" in p.stdout
    assert of(evts, "finished")[-1]["exit_code"] == 0
