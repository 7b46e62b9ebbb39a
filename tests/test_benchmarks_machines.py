"""The machine-loss benchmark's arithmetic, on made-up step logs (no job is launched)."""

from __future__ import annotations

from benchmarks.machine_loss import _lost_rank_phases, _measure, summarize


def _log(rank: int, steps, t0: float, dt: float, restored=None):
    recs = [] if restored is None else [{"event": "restored", "step": restored, "time": t0}]
    return recs + [{"event": "step", "step": s, "time": t0 + i * dt}
                   for i, s in enumerate(steps, 1)]


def test_measure_counts_from_the_last_step_every_rank_completed():
    t_fail = 100.0
    logs = {
        (0, 0): _log(0, range(1, 21), 100.0 - 20 * 0.2, 0.2),  # rank 0 reached step 20
        (1, 0): _log(1, range(1, 20), 100.0 - 19 * 0.2, 0.2),  # rank 1 died after 19
        (0, 1): _log(0, range(19, 24), 110.0, 0.2, restored=18),
        (1, 1): _log(1, range(19, 24), 112.0, 0.2, restored=18),
    }
    got = _measure(logs, t_fail)
    assert got["fail_step"] == 19 and got["restored_step"] == 18 and got["steps_lost"] == 1
    assert abs(got["recovery_s"] - 12.2) < 1e-9  # the last rank's first step after restore
    assert abs(got["step_s"] - 0.2) < 1e-9


def test_the_lost_ranks_downtime_is_split_at_its_own_records():
    logs = {(1, 1): [{"event": "start", "time": 101.0},
                     {"event": "restored", "step": 18, "seconds": 0.25, "time": 101.75},
                     {"event": "step", "step": 19, "time": 102.5},
                     {"event": "step", "step": 20, "time": 103.0}]}
    events = [{"event": "standby_joined", "time": 100.25}, {"event": "start", "time": 100.3}]
    got = _lost_rank_phases(logs, 1, 100.0, events)
    assert got == {"taken_s": 0.25, "to_function_s": 0.75, "group_and_model_s": 0.5,
                   "restore_s": 0.25, "first_step_s": 0.75}
    assert _lost_rank_phases(logs, 0, 100.0, events) == {}  # no attempt-1 records: none


def test_measure_without_a_restart_is_an_error_and_summary_says_why():
    logs = {(0, 0): _log(0, range(1, 5), 90.0, 0.1), (1, 0): _log(1, range(1, 5), 90.0, 0.1)}
    sample = _measure(logs, 100.0)
    assert "error" in sample
    row = summarize(64, 0.15, [sample], private_shm=True)
    assert row["reps"] == 0 and "1 run(s) failed" in row["note"] and "met" not in row


def test_summary_judges_the_lost_rank_by_its_tier():
    base = {"recovery_s": 9.0, "steps_lost": 0, "step_s": 0.15, "round_s": 0.1,
            "lag_steps": 0, "detect_s": 5.0, "lost_node": 1}
    ok = summarize(64, 0.15, [dict(base, tiers={0: "memory", 1: "peer"})], private_shm=True)
    assert ok["met"] == "yes" and "rank 1 (lost): peer" in ok["tiers"]
    bad = summarize(64, 0.15, [dict(base, tiers={0: "storage", 1: "storage"})],
                    private_shm=False)
    assert bad["met"] == "no"
    # a standby restores the copy it was sent from its own memory; rows read back from the
    # results JSON have string keys
    standby = summarize(64, 0.15, [dict(base, tiers={"0": "memory", "1": "memory"})],
                        private_shm=True)
    assert standby["met"] == "yes"


def test_machine_loss_cases_name_who_takes_the_place():
    from types import SimpleNamespace

    import pytest

    from benchmarks.machine_loss import _cases

    ctx = SimpleNamespace(quick=False, options={
        "machine_loss_cases": "64@0.15,256@0.5@5%@standby,256@0.5@5%@standby-pull"})
    assert [c[3] for c in _cases(ctx)] == ["", "standby", "standby-pull"]
    ctx.options["machine_loss_cases"] = "64@0.15@5%@spare"
    with pytest.raises(ValueError, match="standby"):
        _cases(ctx)
