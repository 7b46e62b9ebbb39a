"""Hang detection: a SIGSTOPped worker is detected, its stack dumped, the group restarted."""

from __future__ import annotations

import os

from conftest import SCRIPTS, job_shm_files, run_events

TRAIN = os.path.join(SCRIPTS, "agent_train.py")


def of(evts, name):
    return [e for e in evts if e["event"] == name]


def test_sigstop_hang_detected_dumped_restarted(tmp_path, ckptrun_run):
    run_dir = str(tmp_path / "run")
    p = ckptrun_run("--standalone", "--nproc-per-node", "2", "--hang-timeout", "2",
                    "--run-dir", run_dir, TRAIN, "--steps", "6", "--hang-at", "3")
    assert p.returncode == 0, p.stderr[-3000:]
    evts = run_events(run_dir)
    hangs = of(evts, "hang_detected")
    assert 1 in {e["rank"] for e in hangs}, evts  # rank 0 waits on rank 1: may be silent too
    assert all(e["seconds_silent"] >= 2 for e in hangs), evts
    dumps = {e["path"] for e in of(evts, "stacks_dumped")}
    path = os.path.join(run_dir, "stacks", "attempt_0-rank1.txt")
    assert path in dumps, evts
    text = open(path).read()
    assert "agent_train.py" in text and "in main" in text, text
    assert [e["attempt"] for e in of(evts, "restart")] == [1]
    assert of(evts, "finished")[-1]["exit_code"] == 0
    # the hang was reported before the restart, the dump between the two
    names = [e["event"] for e in evts]
    assert names.index("hang_detected") < names.index("stacks_dumped") < names.index("restart")
    assert not job_shm_files(run_dir)


def test_script_without_heartbeat_is_never_hung(tmp_path, ckptrun_run):
    run_dir = str(tmp_path / "run")
    p = ckptrun_run("--standalone", "--nproc-per-node", "1", "--hang-timeout", "1",
                    "--run-dir", run_dir, os.path.join(SCRIPTS, "agent_sleeper.py"), "3")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "slept" in p.stdout
    evts = run_events(run_dir)
    assert not of(evts, "hang_detected") and not of(evts, "restart")


def test_auto_timeout_learns_from_intervals():
    from ckptrun.agent.hang import HangDetector
    from ckptrun.protocol import Phase

    d = HangDetector(None, first_window=120, floor=3, factor=10)
    d.observe(0, 1, 100.0)
    assert d.timeout_for(0) == 120  # until the second beat
    assert d.check(0, Phase.RUNNING, now=200.0) is None
    for i in range(2, 12):
        d.observe(0, i, 100.0 + (i - 1) * 1.0)  # one beat a second
    assert d.timeout_for(0) == 10.0
    assert d.check(0, Phase.RUNNING, now=119.0) is None  # last beat at 110: 9 s silent
    assert d.check(0, Phase.RUNNING, now=121.0) is not None  # 11 s > 10 s
    assert d.check(0, Phase.SAVING, now=121.0) is None  # never while saving
    assert d.check(0, Phase.RESTORING, now=121.0) is None
    fixed = HangDetector(2.0)
    assert fixed.check(0, Phase.RUNNING, now=1e9) is None  # never heartbeat: not watched
