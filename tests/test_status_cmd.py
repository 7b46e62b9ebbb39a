"""``ckptrun status`` on hand-written run directories: running, finished, dead agent, no run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from ckptrun.agent.events import EventLog, write_json_atomic
from ckptrun.cli.status import find_run_dir, load_status, status_command

DESIGN_KEYS = {"run_id", "state", "restarts", "workers", "checkpoint"}
WORKER_KEYS = {"rank", "local_rank", "node", "pid", "state", "step", "heartbeat_age_s"}


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _status(state="running", agent_pid=None, updated=None, **extra):
    st = {
        "run_id": "job1", "state": state, "restarts": 1, "attempt": 1, "nnodes": 1,
        "nproc_per_node": 2, "agent_pid": os.getpid() if agent_pid is None else agent_pid,
        "updated": time.time() if updated is None else updated, "job_token": "tok",
        "persist_to": "/tmp/ck", "hang_timeout_s": 5.0, "slots": {}, "failures": [],
        "workers": [
            {"rank": r, "local_rank": r, "node": 0, "pid": 1000 + r, "state": "running",
             "step": 41 + r, "heartbeat_age_s": 0.5} for r in range(2)
        ],
        "checkpoint": {"memory_step": 41, "peer_step": 40, "persisted_step": 30,
                       "persisted_url": "/tmp/ck/step-30"},
    }
    st.update(extra)
    return st


def _make_run(path, status=None, events=()):
    log = EventLog(str(path))
    log.emit("start", nnodes=1, nproc_per_node=2)
    for name, fields in events:
        log.emit(name, **fields)
    log.close()
    if status is not None:
        write_json_atomic(str(path / "status.json"), status)
    return str(path)


def _json(args):
    result = CliRunner().invoke(status_command, args)
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_running_job(tmp_path):
    run = _make_run(tmp_path / "r", _status(updated=time.time() - 5),
                    [("worker_failed", {"rank": 1, "exit_code": -9}), ("restart", {"attempt": 1})])
    st = _json(["--run-dir", run, "--json"])
    assert DESIGN_KEYS <= set(st) and st["state"] == "running" and st["restarts"] == 1
    assert all(WORKER_KEYS <= set(w) for w in st["workers"]) and len(st["workers"]) == 2
    # ages were 0.5 s when written 5 s ago: now about 5.5 s
    assert all(5.4 <= w["heartbeat_age_s"] <= 7 for w in st["workers"])
    assert st["checkpoint"] == {"memory_step": 41, "peer_step": 40, "persisted_step": 30,
                                "persisted_url": "/tmp/ck/step-30", "peers": []}
    assert [f["event"] for f in st["failures"]] == ["worker_failed"]


def test_finished_job(tmp_path):
    run = _make_run(tmp_path / "r", _status("succeeded", agent_pid=_dead_pid(),
                                             updated=time.time() - 100),
                    [("finished", {"exit_code": 0})])
    st = load_status(run)
    assert st["state"] == "succeeded" and not st.get("agent_died")
    assert st["workers"][0]["heartbeat_age_s"] == 0.5  # not aged: the job is over


def test_dead_agent_is_failed(tmp_path):
    run = _make_run(tmp_path / "r", _status("running", agent_pid=_dead_pid()))
    st = _json(["--run-dir", run, "--json"])
    assert st["state"] == "failed" and st["agent_died"] is True and "died" in st["error"]


def test_finished_event_wins_over_stale_live_status(tmp_path):
    run = _make_run(tmp_path / "r", _status("running", agent_pid=_dead_pid()),
                    [("finished", {"exit_code": 1})])
    st = load_status(run)
    assert st["state"] == "failed" and st["exit_code"] == 1 and not st.get("agent_died")


def test_events_only_run(tmp_path):
    run = _make_run(tmp_path / "r", None, [("restart", {"attempt": 1}),
                                           ("hang_detected", {"rank": 0, "seconds_silent": 6.2})])
    st = load_status(run)
    assert DESIGN_KEYS <= set(st) and st["run_id"] == "r" and st["state"] == "starting"
    assert st["restarts"] == 1 and st["nproc_per_node"] == 2 and st["workers"] == []
    assert st["checkpoint"]["memory_step"] is None
    assert st["failures"][0]["event"] == "hang_detected"


def test_newest_run_is_default(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    old = _make_run(tmp_path / "ckptrun-runs" / "old", _status(run_id="old"))
    new = _make_run(tmp_path / "ckptrun-runs" / "new", _status(run_id="new"))
    (tmp_path / "ckptrun-runs" / "empty").mkdir()
    os.utime(os.path.join(old, "status.json"), (time.time() + 50,) * 2)
    os.utime(os.path.join(old, "events.jsonl"), (time.time() + 50,) * 2)
    assert find_run_dir() == old
    os.utime(os.path.join(new, "status.json"), (time.time() + 100,) * 2)
    assert _json(["--json"])["run_id"] == "new"


@pytest.mark.parametrize("args", [[], ["--run-dir", "nowhere"], ["--run-dir", "."]])
def test_no_run_is_a_usage_error(tmp_path, monkeypatch, args):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(status_command, args + ["--json"])
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line]
    assert len(lines) == 1 and lines[0].startswith("ckptrun: error: ")


def test_table(tmp_path):
    run = _make_run(tmp_path / "r", _status(),
                    [("worker_failed", {"rank": 1, "signal": "SIGKILL"}),
                     ("node_lost", {"node": 1, "seconds_silent": 5.3, "step": 9}),
                     ("persist_failed", {"step": 30, "error": "disk full"})])
    result = CliRunner().invoke(status_command, ["--run-dir", run])
    assert result.exit_code == 0, result.output
    out = result.output
    for text in ("job1", "running", "workers", "checkpoint", "memory", "peer", "storage",
                 "/tmp/ck/step-30", "recent failures", "rank 1 was killed by SIGKILL",
                 "machine 1 lost: no heartbeat for 5.30 s, its ranks at step 9",
                 "disk full", "1001", "42"):
        assert text in out, text


def test_hot_spares_are_shown(tmp_path):
    st = {**_status(), "hot_spares": [{"local_rank": 0, "rank": 0, "pid": 7, "ready": True},
                                      {"local_rank": 1, "rank": 1, "pid": 8, "ready": False}]}
    result = CliRunner().invoke(status_command, ["--run-dir", _make_run(tmp_path / "r", st, [])])
    assert result.exit_code == 0, result.output
    assert "hot spares: 1 ready (ranks 0), 1 still starting" in result.output


def _peer_checkpoint(now):
    return {"memory_step": 41, "peer_step": 39, "persisted_step": 30,
            "persisted_url": "/tmp/ck/step-30", "replica_peers": [1, 2],
            "replica_holders": [1, 2], "replication_mb_s": 812.5,
            "peers": [{"node": 1, "holds_step": 40, "mb_s": 901.2, "updated": now - 2.0},
                      {"node": 2, "holds_step": 39, "mb_s": 455.0, "updated": now - 3.0},
                      {"node": 3, "holds_step": None, "mb_s": None, "updated": None}]}


def test_table_shows_where_peer_copies_live(tmp_path):
    run = _make_run(tmp_path / "r", _status(checkpoint=_peer_checkpoint(time.time())))
    result = CliRunner().invoke(status_command, ["--run-dir", run])
    assert result.exit_code == 0, result.output
    assert "node(s) 1, 2" in result.output and "812 MB/s" in result.output
    lines = result.output.splitlines()
    for node, step, rate in (("1", "40", "901 MB/s"), ("2", "39", "455 MB/s")):
        row = next(line for line in lines if f"node {node} " in line and "MB/s" in line)
        assert f" {step} " in row and rate in row and "pushed" in row, row
    row = next(line for line in lines if "node 3" in line)
    assert "no copy yet" in row, row


def test_json_lists_every_peer_with_its_step(tmp_path):
    now = time.time()
    run = _make_run(tmp_path / "r", _status(checkpoint=_peer_checkpoint(now)))
    ck = _json(["--run-dir", run, "--json"])["checkpoint"]
    for key, value in (("memory_step", 41), ("peer_step", 39), ("persisted_step", 30),
                       ("persisted_url", "/tmp/ck/step-30")):
        assert ck[key] == value
    assert [(p["node"], p["holds_step"]) for p in ck["peers"]] == [(1, 40), (2, 39), (3, None)]
    assert ck["peers"][0]["mb_s"] == 901.2 and ck["peers"][0]["updated"] == now - 2.0
    # peer_step is what every holder has: never newer than any holder's own step
    assert ck["peer_step"] <= min(p["holds_step"] for p in ck["peers"] if p["holds_step"])


def test_watch_returns_when_job_is_over(tmp_path):
    run = _make_run(tmp_path / "r", _status("failed", agent_pid=_dead_pid()))
    result = CliRunner().invoke(status_command, ["--run-dir", run, "--watch", "--interval", "0.1"])
    assert result.exit_code == 0 and "failed" in result.output
    result = CliRunner().invoke(status_command, ["--run-dir", run, "--watch", "--json"])
    assert result.exit_code == 0 and json.loads(result.output)["state"] == "failed"


def test_status_subprocess(tmp_path):
    run = _make_run(tmp_path / "r", _status())
    proc = subprocess.run([sys.executable, "-m", "ckptrun", "status", "--run-dir", run, "--json"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["run_id"] == "job1"
