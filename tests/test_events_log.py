"""Unit tests for ckptrun.agent.events: the event log, its reader and atomic JSON writes."""

from __future__ import annotations

import json
import multiprocessing
import os
import stat
import time

import pytest

from ckptrun.agent.events import (
    EVENTS_FILE,
    EventLog,
    describe,
    rank_ranges,
    read_events,
    read_json,
    write_json_atomic,
)


def test_emit_appends_one_json_line(tmp_path):
    log = EventLog(str(tmp_path / "run"))
    before = time.time()
    rec = log.emit("start", nnodes=1, nproc_per_node=2)
    log.emit("worker_failed", rank=1, exit_code=-9)
    log.close()
    assert rec["event"] == "start" and rec["nnodes"] == 1
    assert isinstance(rec["time"], float) and rec["time"] >= before
    lines = (tmp_path / "run" / EVENTS_FILE).read_text().splitlines()
    assert len(lines) == 2
    assert json.loads(lines[1]) == {
        "time": json.loads(lines[1])["time"], "event": "worker_failed", "rank": 1, "exit_code": -9
    }


def test_modes_are_owner_only(tmp_path):
    run_dir = tmp_path / "a" / "run"
    with EventLog(str(run_dir)) as log:
        log.emit("start", nnodes=1, nproc_per_node=1)
    assert stat.S_IMODE(os.stat(run_dir).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(run_dir / EVENTS_FILE).st_mode) == 0o600


def test_fields_cannot_override_time_and_event_and_odd_values_are_stringified(tmp_path):
    log = EventLog(str(tmp_path))
    rec = log.emit("persisted", time="x", url=tmp_path, step=3)
    assert rec["event"] == "persisted" and isinstance(rec["time"], float)
    assert read_events(str(tmp_path))[0]["url"] == str(tmp_path)


def test_emit_after_close_raises(tmp_path):
    log = EventLog(str(tmp_path))
    log.close()
    with pytest.raises(ValueError):
        log.emit("start")


def test_reopening_appends(tmp_path):
    EventLog(str(tmp_path)).emit("start", nnodes=1, nproc_per_node=1)
    EventLog(str(tmp_path)).emit("finished", exit_code=0)
    assert [e["event"] for e in read_events(str(tmp_path))] == ["start", "finished"]


def test_read_events_missing_dir_is_empty(tmp_path):
    assert read_events(str(tmp_path / "nope")) == []


def test_read_events_tolerates_torn_last_line_and_garbage(tmp_path):
    log = EventLog(str(tmp_path))
    log.emit("start", nnodes=1, nproc_per_node=1)
    log.emit("restart", attempt=1)
    with open(tmp_path / EVENTS_FILE, "a") as f:
        f.write("[1, 2]\n")  # valid JSON but not an event object
        f.write('{"time": 1.0, "event": "hang_det')  # writer killed mid-line
    assert [e["event"] for e in read_events(str(tmp_path))] == ["start", "restart"]


def _writer(run_dir: str, who: int, n: int) -> None:
    log = EventLog(run_dir)
    for i in range(n):
        log.emit("replicated", who=who, i=i, pad="x" * 2000)
    log.close()


def test_concurrent_writers_never_interleave(tmp_path):
    n, procs = 200, 3
    ps = [multiprocessing.Process(target=_writer, args=(str(tmp_path), w, n)) for w in range(procs)]
    for p in ps:
        p.start()
    for p in ps:
        p.join(60)
    lines = (tmp_path / EVENTS_FILE).read_text().splitlines()
    assert len(lines) == n * procs
    events = [json.loads(line) for line in lines]  # every line parses: nothing interleaved
    for w in range(procs):
        assert [e["i"] for e in events if e["who"] == w] == list(range(n))


def test_write_json_atomic(tmp_path):
    path = tmp_path / "status.json"
    write_json_atomic(str(path), {"state": "running", "step": 1})
    write_json_atomic(str(path), {"state": "succeeded"})
    assert read_json(str(path)) == {"state": "succeeded"}
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["status.json"]  # no temp file left


def test_write_json_atomic_failure_leaves_old_file(tmp_path):
    path = tmp_path / "status.json"
    write_json_atomic(str(path), {"ok": 1})

    class Boom:
        def __str__(self):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        write_json_atomic(str(path), {"bad": Boom()})
    assert read_json(str(path)) == {"ok": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["status.json"]


def test_read_json_missing_or_not_what_ckptrun_writes(tmp_path):
    """Missing: None.  Not JSON (ckptrun replaces its files whole, never half written), a
    symlink, a FIFO: refused in one line (tests/security/test_sec_planted_files.py has more)."""
    from ckptrun.protocol.untrusted import UntrustedFile

    assert read_json(str(tmp_path / "none.json")) is None
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(UntrustedFile, match="bad.json is not JSON"):
        read_json(str(tmp_path / "bad.json"))
    os.symlink("/dev/zero", tmp_path / "zero.json")  # the user's own link, to a device
    with pytest.raises(UntrustedFile, match="not a regular file"):
        read_json(str(tmp_path / "zero.json"))
    if os.geteuid() == 0:  # another user's link is not even followed
        os.lchown(tmp_path / "zero.json", 65534, 65534)
        with pytest.raises(UntrustedFile, match="symbolic link of another user"):
            read_json(str(tmp_path / "zero.json"))
    os.mkfifo(tmp_path / "fifo.json")
    with pytest.raises(UntrustedFile, match="not a regular file"):
        read_json(str(tmp_path / "fifo.json"))


def test_failures_and_recoveries_are_echoed_one_line_each(tmp_path):
    """The agent echoes what a person should see; routine events stay in the log only."""
    lines: list = []
    log = EventLog(str(tmp_path), echo=lines.append)
    log.emit("start", nnodes=1, nproc_per_node=2)
    log.emit("worker_failed", rank=1, attempt=0, signal="SIGKILL")
    log.emit("worker_failed", rank=0, attempt=0, exit_code=1)
    log.emit("restart", attempt=1, restarts=1)
    log.emit("restored", step=25, tier="memory", seconds=0.0213)
    log.emit("persisted", step=30, url="file:///x/step-30", bytes=10, seconds=0.1)
    log.emit("replicated", step=30, peer=1, bytes=10, seconds=0.01)
    log.emit("persist_failed", step=40, error="disk full")
    log.emit("finished", exit_code=0)
    log.close()
    assert lines == ["rank 1 was killed by SIGKILL (attempt 0)",
                     "rank 0 exited with code 1 (attempt 0)",
                     "restarting the workers: attempt 1, 1 restart(s) of the budget used",
                     "restored step 25 from memory in 21.3 ms",
                     "persisting step 40 failed: disk full"]
    assert len(read_events(str(tmp_path))) == 9  # everything is in the log


def test_events_of_a_group_are_logged_each_and_said_once(tmp_path):
    lines: list = []
    log = EventLog(str(tmp_path), echo=lines.append)
    for r in range(3):
        log.emit("stacks_dumped", say=False, path=f"/r/s-rank{r}.txt", rank=r)
    log.say("stacks of the hung workers (ranks 0-2) are in /r/s-rank*.txt")
    assert lines == ["stacks of the hung workers (ranks 0-2) are in /r/s-rank*.txt"]
    assert [e["rank"] for e in read_events(str(tmp_path))] == [0, 1, 2]
    EventLog(str(tmp_path)).say("nothing echoes this")  # a log without echo says nothing


@pytest.mark.parametrize("ranks, text", [
    ([], ""), ([3], "3"), ([0, 1, 2, 3, 5, 7, 6], "0-3, 5-7"), ([4, 0, 2], "0, 2, 4"),
    ([1, 1, 2], "1-2")])
def test_rank_ranges(ranks, text):
    assert rank_ranges(ranks) == text


@pytest.mark.parametrize("event, fields, text", [
    ("hang_detected", {"rank": 2, "seconds_silent": 30.5, "attempt": 1, "why": "stopped"},
     "rank 2 stopped (no sign of life): no rank advanced for 30.50 s (attempt 1)"),
    ("hang_detected", {"rank": 0, "seconds_silent": 4.0, "attempt": 0, "why": "deadlock"},
     "rank 0 waiting, as every other rank (a deadlock or a stuck collective): no rank "
     "advanced for 4.00 s (attempt 0)"),
    ("node_lost", {"node": 1, "seconds_silent": 5.3, "step": 9, "attempt": 0},
     "machine 1 lost: no heartbeat for 5.30 s, its ranks at step 9 (attempt 0)"),
    ("worker_failed", {"rank": 0, "exit_code": 2, "fatal": 7},
     "rank 0: a fatal error (code 7): no restart"),
    ("stacks_dumped", {"path": "/r/stacks-1.txt"}, "stacks of the hung workers are in /r/stacks-1.txt"),
    ("replication_refused", {"peer": "127.0.0.1:5"},
     "refused a replication connection without the job's secret from 127.0.0.1:5"),
    ("finished", {"exit_code": 1}, "the job failed (exit code 1)"),
    ("finished", {"exit_code": 1, "signal": "SIGTERM"},
     "stopped by SIGTERM (exit code 1): the same command run again resumes from the newest "
     "persisted step"),
    ("finished", {"exit_code": 0}, None),
    ("start", {"nnodes": 1}, None),
])
def test_describe(event, fields, text):
    assert describe({"time": 0.0, "event": event, **fields}) == text
