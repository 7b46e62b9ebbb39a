"""Goodput model: the paper's reference point, closed forms vs Monte Carlo, monotonicity."""

from __future__ import annotations

from dataclasses import replace

import pytest

from ckptrun.sim import (
    DAY_S,
    ClusterInputs,
    goodput,
    memory_recovery_odds,
    monte_carlo_recovery,
    monte_carlo_wasted,
    paper_reference_inputs,
    projection,
    wasted_per_failure,
)
from ckptrun.tiers.peer.placement import recovery_probability


def small_cluster(**kw) -> ClusterInputs:
    base = dict(machines=16, iteration_s=1.0, state_bytes=1e9, snapshot_bytes_per_s=10e9,
                network_bytes_per_s=2e9, storage_bytes_per_s=1e9, storage_shared=True,
                failure_rate_per_day=0.015, replicas=2, restart_s=5.0, snapshot_stall_s=0.01)
    base.update(kw)
    return ClusterInputs(**base)


def test_paper_reference_1000_instances_about_91_percent():
    res = goodput(paper_reference_inputs())
    assert res.machines == 1000
    assert res.ckptrun.failures_per_day == pytest.approx(15.0)
    assert res.ckptrun.effective_ratio == pytest.approx(0.91, abs=0.01)
    # Storage-only cannot even finish a checkpoint of 1,000 machines between failures.
    assert res.storage_only.effective_ratio < 0.5
    # The result is not an artefact of the assumed iteration time.
    for it in (10.0, 60.0):
        inp = replace(paper_reference_inputs(), iteration_s=it, memory_ckpt_s=it)
        assert goodput(inp).ckptrun.effective_ratio == pytest.approx(0.91, abs=0.015)


def test_wasted_time_closed_form_matches_monte_carlo():
    for ckpt, interval, rtvl, restart in [(0.5, 1.0, 0.2, 3.0), (10.0, 30.0, 2.0, 5.0), (3.0, 3.0, 0.0, 0.0)]:
        closed = wasted_per_failure(ckpt, interval, rtvl, restart)
        mc = monte_carlo_wasted(ckpt, interval, rtvl, restart, trials=40_000, seed=1)
        assert mc == pytest.approx(closed, rel=0.02)
    with pytest.raises(ValueError):
        monte_carlo_wasted(2.0, 1.0, 0.0)


@pytest.mark.parametrize("n,m,k", [(16, 2, 2), (16, 2, 3), (10, 3, 4), (9, 2, 3), (64, 4, 6)])
def test_recovery_probability_monte_carlo(n, m, k):
    exact = float(recovery_probability(n, m, k))
    mc = monte_carlo_recovery(n, m, k, trials=30_000, seed=7)
    # 30k Bernoulli trials: standard error <= 0.003
    assert mc == pytest.approx(exact, abs=0.012)


def test_memory_odds_is_one_failure_safe_and_degrades_with_window():
    inp = small_cluster()
    assert memory_recovery_odds(inp, window_s=0.0) == pytest.approx(1.0)
    short = memory_recovery_odds(inp.with_machines(1000), window_s=10.0)
    long = memory_recovery_odds(inp.with_machines(1000), window_s=DAY_S)
    assert 0.0 < long < short <= 1.0
    assert memory_recovery_odds(replace(inp, replicas=1), window_s=10.0) == 0.0


def test_ckptrun_beats_storage_only_and_ratios_fall_with_scale():
    rows = projection(small_cluster(), sizes=(16, 256, 1000, 10_000))
    prev = 1.0
    for row in rows:
        assert 0.0 <= row.ckptrun.effective_ratio <= 1.0
        if row.machines >= 256:
            assert row.ckptrun.effective_ratio > row.storage_only.effective_ratio
        assert row.ckptrun.effective_ratio <= prev + 1e-12
        prev = row.ckptrun.effective_ratio
    assert rows[0].as_dict()["ckptrun"]["name"] == "ckptrun"
    # On a small cluster that rarely fails, a 1% stall on *every* iteration costs more
    # than storage-only loses to failures: the per-iteration stall must stay tiny.
    assert rows[0].storage_only.effective_ratio > rows[0].ckptrun.effective_ratio


def test_storage_only_frequency_is_bandwidth_bound():
    inp = small_cluster(machines=100)
    res = goodput(inp).storage_only
    assert res.checkpoint_s == pytest.approx(100 * 1e9 / 1e9)
    assert res.interval_s == pytest.approx(res.checkpoint_s)
    strawman = goodput(replace(inp, storage_interval_s=3 * 3600)).storage_only
    assert strawman.interval_s == 3 * 3600
    assert strawman.wasted_per_failure_s > res.wasted_per_failure_s
    # Per-machine (non-shared) storage bandwidth scales with the cluster.
    assert goodput(replace(inp, storage_shared=False)).storage_only.checkpoint_s == pytest.approx(1.0)


def test_stalls_cost_throughput():
    fast = goodput(small_cluster(snapshot_stall_s=0.0)).ckptrun
    slow = goodput(small_cluster(snapshot_stall_s=0.5)).ckptrun
    assert fast.overhead_fraction == 0.0
    assert slow.overhead_fraction == pytest.approx(0.5)
    assert slow.effective_ratio == pytest.approx(fast.effective_ratio * 0.5, rel=1e-9)


def test_restart_costs_by_mode_say_where_a_recovery_saves_time():
    from ckptrun.sim import RECOVERY_MODES, RestartCosts, recovery_downtime

    c = RestartCosts(detect_s=1, process_s=2, cuda_context_s=3, comm_init_s=5, compile_s=7,
                     setup_s=11, node_start_s=100, partition_detect_s=13, transfer_s=17)
    total = {m: sum(recovery_downtime(c, m).values()) for m in RECOVERY_MODES}
    assert total["restart (cold)"] == 1 + 2 + 3 + 11 + 5 + 7
    assert total["restart + warm spares"] == total["restart (cold)"] - 2  # no interpreter
    # the group waits for its replacement: keeping the survivors alone saves no downtime
    assert total["in-process"] == total["restart + warm spares"]
    assert total["in-process + hot spares"] == 1 + 5 + 7  # the start-up was paid ahead
    lost = {m: sum(recovery_downtime(c, m, machine_lost=True).values()) for m in RECOVERY_MODES}
    assert lost["standby machine"] == 13 + 17 + 5 + 7  # no machine to bring up
    assert all(lost[m] == 13 + 100 + 2 + 3 + 11 + 5 + 7 for m in RECOVERY_MODES[:-1])
    with pytest.raises(ValueError, match="unknown recovery mode"):
        recovery_downtime(c, "reboot")


def test_goodput_by_mode_orders_the_modes_and_break_even_bandwidth_is_a_boundary():
    from dataclasses import replace

    from ckptrun.sim import (
        RestartCosts,
        ckptrun_policy,
        goodput_by_mode,
        storage_break_even,
        storage_only,
    )

    inp = paper_reference_inputs()
    got = goodput_by_mode(inp, RestartCosts())
    ratios = [got[m]["effective_ratio"] for m in ("restart (cold)", "in-process + hot spares",
                                                  "standby machine")]
    assert ratios == sorted(ratios) and ratios[0] < ratios[-1]
    bw = storage_break_even(inp)
    assert bw is not None
    target = ckptrun_policy(inp).effective_ratio

    def at(b):
        return storage_only(replace(inp, storage_shared=False, storage_bytes_per_s=b)
                            ).effective_ratio
    assert at(bw) >= target > at(bw * 0.9)
    assert storage_break_even(inp, hi_bytes_per_s=1e6) is None  # not even 1 MB/s a machine
