"""Smoke tests of the recovery/overhead harness: the arithmetic on synthetic step logs, and
one real ckptrun SIGKILL run at a tiny state (seconds, not a measurement)."""

from __future__ import annotations

import glob
import os

from benchmarks.jobrun import Outcome, launch
from benchmarks.recovery import CASES, FailTrigger, _judge, _summary, make_launch, measure
from benchmarks.report import recovery_findings


def _outcome(kill_step: int, restored: int, t_kill: float, t_first: float) -> Outcome:
    logs = {}
    for rank in (0, 1):
        steps = [{"event": "step", "step": n, "time": 100.0 + n * 0.1} for n in range(1, kill_step + 1)]
        logs[(rank, 0)] = [{"event": "start", "time": 99.0}, *steps]
        logs[(rank, 1)] = [{"event": "start", "time": t_kill + 0.5},
                           {"event": "restored", "step": restored, "time": t_first - 0.1},
                           {"event": "step", "step": restored + 1, "time": t_first + 0.01 * rank}]
    logs[(1, 0)].append({"event": "kill", "step": kill_step, "time": t_kill})
    events = [{"event": "restart", "time": t_kill + 0.2},
              {"event": "restored", "tier": "memory", "time": t_first - 0.1}]
    return Outcome(0, 1.0, logs, events, [], False, "")


def test_measure_and_summary_arithmetic():
    s = measure(_outcome(25, 20, 200.0, 203.0), hang=False)
    assert s["steps_lost"] == 5 and abs(s["recovery_s"] - 3.01) < 1e-9
    assert abs(s["lost_s"] - (3.01 + 5 * 0.1)) < 1e-6 and abs(s["restart_s"] - 0.2) < 1e-9
    ok = measure(_outcome(25, 25, 200.0, 200.5), hang=False)
    row = _summary("ckptrun", CASES["ckptrun"], 1, [ok, s, {"error": "boom"}])
    assert row["reps"] == 2 and row["min_s"] < row["median_s"] < row["max_s"]
    assert "1 run(s) failed: boom" in row["note"] and "memory" in row["note"]
    _judge(row, hang=False)
    assert row["met"] == "no"  # median 1.76 s > 1 s
    assert any("ckptrun, SIGKILL" in x for x in recovery_findings(
        {"sections": {"recovery": {"rows": [row]}}}))
    assert "error" in measure(_outcome(25, 20, 200.0, 203.0).__class__(
        1, 1.0, {}, [], [], False, "x"), hang=False)


def test_one_ckptrun_kill_run(tmp_path):
    """A real launch: rank 1 SIGKILLed, restored from memory, first step measured."""
    work = str(tmp_path)
    spec = make_launch(CASES["ckptrun"], 1, work)
    trigger = FailTrigger(work, "torchrun", 0.5, 0.0)  # do not wait for warm spares here
    out = launch(spec, work, timeout_s=50.0, stop_when=trigger)
    s = measure(out, hang=False)
    assert "error" not in s, s
    assert s["tier"] == "memory" and 0 <= s["steps_lost"] <= 1 and 0 < s["recovery_s"] < 30
    assert not out.shm_left and not glob.glob(os.path.join(work, "ckpt", "*"))
