"""``--metrics-port``: Prometheus metrics of the agent, scraped during a job with a failure,
and the options' mistakes refused before anything starts."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ckptrun.agent.metrics import AgentMetrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "examples", "train.py")


def samples(text: str) -> dict:
    """{(sample name, frozenset(labels)): value} of a scrape."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(got: dict, name: str, **labels) -> float:
    return got[(name, frozenset(labels.items()))]


def scrape_text(metrics: AgentMetrics) -> str:
    from prometheus_client import CollectorRegistry, generate_latest
    reg = CollectorRegistry(auto_describe=False)
    reg.register(metrics)
    return generate_latest(reg).decode()


def test_events_and_status_become_metrics():
    m = AgentMetrics()
    t = time.time()
    for rec in ({"event": "start", "time": t - 100},
                {"event": "worker_failed", "rank": 1, "signal": "SIGKILL"},
                {"event": "restart", "attempt": 1},
                {"event": "restored", "tier": "memory", "seconds": 0.02, "step": 7},
                {"event": "recovered", "downtime_s": 3.5,
                 "phases": {"detect_s": 0.1, "stop_s": 0.2, "start_s": 1.0, "restore_s": 0.05,
                            "first_step_s": 2.15}},
                {"event": "hang_detected", "rank": 0, "seconds_silent": 4},
                {"event": "restart", "attempt": 2},
                {"event": "restart", "attempt": 3},  # another machine's failure
                {"event": "persisted", "step": 10, "bytes": 1000, "seconds": 0.5},
                {"event": "persist_failed", "step": 20, "error": "no"},
                {"event": "progress_lost", "step": 23, "attempt": 4}):
        m.event(rec)
    m.status({"run_id": "r", "node": 0, "state": "running", "attempt": 3,
              "workers": [{"rank": 0, "step": 21, "saves": 14, "save_block_s": 0.001,
                           "save_copy_s": 0.004, "state_bytes": 4096}],
              "checkpoint": {"memory_step": 21, "peer_step": 20, "persisted_step": 10,
                             "replication_rounds": 9, "replicated_bytes": 36864,
                             "replication_lag_steps": 1}})
    got = samples(scrape_text(m))
    want = [  # (sample, labels, value)
        ("ckptrun_restarts_total", {"cause": "worker_signal"}, 1),
        ("ckptrun_restarts_total", {"cause": "hang"}, 1),
        ("ckptrun_restarts_total", {"cause": "remote_failure"}, 1),
        ("ckptrun_restarts_total", {"cause": "worker_exit"}, 0),
        ("ckptrun_worker_failures_total", {"reason": "signal"}, 1),
        ("ckptrun_restore_seconds_count", {"tier": "memory"}, 1),
        ("ckptrun_restore_seconds_sum", {"tier": "memory"}, pytest.approx(0.02)),
        ("ckptrun_recovery_downtime_seconds_count", {}, 1),
        ("ckptrun_recovery_downtime_seconds_bucket", {"le": "2.0"}, 0),
        ("ckptrun_recovery_downtime_seconds_bucket", {"le": "5.0"}, 1),
        ("ckptrun_last_recovery_phase_seconds", {"phase": "first_step"}, 2.15),
        ("ckptrun_step", {"rank": "0"}, 21),
        ("ckptrun_snapshots_total", {"rank": "0"}, 14),
        ("ckptrun_snapshot_bytes", {"rank": "0"}, 4096),
        ("ckptrun_checkpoint_step", {"tier": "peer"}, 20),
        ("ckptrun_persisted_bytes_total", {}, 1000),
        ("ckptrun_persist_failures_total", {}, 1),
        ("ckptrun_steps_lost_total", {}, 23),
        ("ckptrun_replicated_bytes_total", {}, 36864),
        ("ckptrun_replication_lag_steps", {}, 1),
    ]
    for name, labels, expected in want:
        assert value(got, name, **labels) == expected, (name, labels)
    eff = value(got, "ckptrun_effective_training_seconds")
    assert value(got, "ckptrun_elapsed_seconds") - eff == pytest.approx(3.5, abs=0.01)


def _status(run_dir) -> dict:
    try:
        with open(os.path.join(run_dir, "status.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def test_a_killed_rank_is_the_cause_not_the_peer_whose_collective_broke():
    """Rank 1 SIGKILLed, rank 0 raising from its broken all-reduce (or gloo's SIGABRT) in the
    same poll: the restart's cause is the signal; an exit alone is still an exit."""
    from ckptrun.agent.supervisor import primary_first
    got = primary_first([("r0", 1), ("r1", -9), ("r2", -6), ("r3", -11)])
    assert [w for w, _ in got] == ["r1", "r3", "r0", "r2"]
    assert primary_first([("r0", 1), ("r1", -6)]) == [("r0", 1), ("r1", -6)]


@pytest.mark.slow
def test_a_job_with_a_failure_is_scraped_while_it_runs(tmp_path):
    """Rank 1 killed after step 6: a scrape after the recovery shows the restart, the
    memory restore, the downtime and the ranks' progress."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "ckptrun.cli", "--standalone", "--nproc-per-node", "2",
         "--run-dir", str(run_dir), "--metrics-port", "0", TRAIN, "--width", "32",
         "--steps", "400", "--step-time", "0.05", "--crash-at", "6"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline, got = time.monotonic() + 150, {}
        while time.monotonic() < deadline and proc.poll() is None:
            url = _status(run_dir).get("metrics_url")
            if url:
                with urllib.request.urlopen(url, timeout=5) as r:
                    got = samples(r.read().decode())
                if got.get(("ckptrun_recovery_downtime_seconds_count", frozenset())) == 1:
                    break
            time.sleep(0.5)
        assert url and url.startswith("http://127.0.0.1:"), _status(run_dir)
        assert value(got, "ckptrun_recovery_downtime_seconds_count") == 1, got
        restarts = value(got, "ckptrun_restarts_total", cause="worker_signal")
        assert restarts == 1, got
        assert value(got, "ckptrun_restore_seconds_count", tier="memory") == 1, got
        assert value(got, "ckptrun_recovery_downtime_seconds_sum") > 0
        time.sleep(1.0)  # status is refreshed every 0.5 s
        with urllib.request.urlopen(url, timeout=5) as r:
            got = samples(r.read().decode())
        assert value(got, "ckptrun_step", rank="0") > 6 and value(got, "ckptrun_step", rank="1") > 6
        assert value(got, "ckptrun_snapshots_total", rank="1") >= 1
        assert value(got, "ckptrun_snapshot_bytes", rank="0") > 0
        assert value(got, "ckptrun_checkpoint_step", tier="memory") > 6
    finally:
        proc.terminate()
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1, err[-3000:]  # stopped by SIGTERM, as torchrun exits


@pytest.mark.parametrize("args,message", [
    (["--metrics-port", "99999"], "--metrics-port takes a port 0..65535"),
    (["--metrics-port", "x"], "--metrics-port takes a port 0..65535"),
])
def test_a_bad_port_is_one_usage_line(tmp_path, args, message):
    proc = subprocess.run([sys.executable, "-m", "ckptrun.cli", "--standalone",
                           "--nproc-per-node", "1", "--run-dir", str(tmp_path / "run"), *args,
                           TRAIN], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr


def test_a_port_in_use_stops_before_anything_starts(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "ckptrun.cli", "--standalone",
                               "--nproc-per-node", "1", "--run-dir", str(tmp_path / "run"),
                               "--metrics-port", str(port), TRAIN],
                              capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"ckptrun: error: --metrics-port {port} on 127.0.0.1: Address already in use"]
