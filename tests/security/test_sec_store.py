"""Attacks on the rendezvous store, which answers anyone who can reach its port: a value
forged by someone without the job secret, a value moved from another key or replayed from
another job, and a pickle payload where torch's rendezvous keeps its state.  None is used or
unpickled; each is reported and treated as absent, and a two-machine job under attack -- its
replica servers flooded with garbage too -- finishes normally."""

from __future__ import annotations

import contextlib
import datetime
import os
import pickle
import re
import socket
import subprocess
import threading
import time
import uuid

import pytest
import torch.distributed as dist
from conftest import ROOT, ckptrun_cmd, run_events
from test_agent_multinode import free_port

from ckptrun.store.authenticated import MAGIC, AuthenticatedStore, SealedStoreBackend

KEY = os.urandom(32)
TRAIN = os.path.join(ROOT, "examples", "train.py")


@pytest.fixture
def raw():
    store = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=5),
                          wait_for_workers=False)
    yield store


class _Payload:
    def __reduce__(self):
        return (os.system, (f"touch {os.environ['CKPTRUN_TEST_MARK']}",))


def test_values_are_sealed_and_read_back(raw):
    forged = []
    s = AuthenticatedStore(raw, KEY, forged.append)
    s.set("k", b"value")
    assert s.get("k") == b"value" and raw.get("k") != b"value"
    assert s.compare_set("c", "", "one") == b"one" and s.compare_set("c", "one", "two") == b"two"
    assert s.compare_set("c", "one", "three") == b"two"  # a failed compare-and-set
    assert forged == []


def test_a_forged_value_is_dropped_and_the_reader_waits_for_a_real_one(raw):
    forged = []
    s = AuthenticatedStore(raw, KEY, forged.append)
    raw.set("epoch", b'{"attempt": 99}')  # written by someone without the key
    writer = AuthenticatedStore(raw.clone(), KEY)  # another agent: its own connection
    threading.Timer(0.5, lambda: writer.set("epoch", b'{"attempt": 1}')).start()
    assert s.get("epoch") == b'{"attempt": 1}'
    assert forged == ["epoch"]


def test_a_value_moved_from_another_key_or_job_is_refused(raw):
    forged = []
    ours, other_job = AuthenticatedStore(raw, KEY, forged.append), AuthenticatedStore(raw, os.urandom(32))
    ours.set("a", b"1")
    raw.set("b", raw.get("a"))  # a genuine sealed value, under another name
    other_job.set("c", b"2")  # sealed, but with another job's key
    assert ours.compare_set("b", "", "fresh") == b"fresh"
    assert ours.compare_set("c", "", "fresh") == b"fresh"
    assert forged == ["b", "c"]


def test_a_pickle_in_the_rendezvous_state_is_never_unpickled(raw, tmp_path, monkeypatch):
    mark = tmp_path / "pwned"
    monkeypatch.setenv("CKPTRUN_TEST_MARK", str(mark))
    forged = []
    backend = SealedStoreBackend(AuthenticatedStore(raw, KEY, forged.append), "job1")
    raw.set("ckptrun/rendezvous-state/job1", pickle.dumps(_Payload()))
    assert backend.get_state() is None  # a forgery reads as no state ...
    state = pickle.dumps({"round": 1})
    got = backend.set_state(state, None)
    assert got is not None and got[0] == state and got[2]  # ... which the next write replaces
    assert backend.get_state()[0] == state
    assert not mark.exists() and forged


@pytest.mark.slow
def test_a_two_machine_job_under_attack_finishes(tmp_path, monkeypatch):
    """Mid-training, an attacker who can reach the store overwrites every value the agents
    and torch's rendezvous keep there -- the pickled rendezvous state included -- with a
    pickle payload: no code runs, the agents report the forgeries, put the genuine values
    back, and the job ends as it would have."""
    mark = tmp_path / "pwned"
    monkeypatch.setenv("CKPTRUN_TEST_MARK", str(mark))
    port, rdzv = free_port(), uuid.uuid4().hex[:8]
    runs = [tmp_path / f"node{n}" for n in range(2)]
    procs = [subprocess.Popen(
        ckptrun_cmd("--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                    "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", rdzv,
                    "--run-dir", str(run), TRAIN, "--width", "64", "--steps", "60",
                    "--step-time", "0.1"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for run in runs]
    forged_keys = []
    try:
        deadline = time.monotonic() + 120
        while not all(any(e["event"] == "start" for e in run_events(str(r))) for r in runs):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
            time.sleep(0.2)
        time.sleep(2)  # training
        attacker = dist.TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=10))
        # the replica servers' addresses are in the store for anyone to read: flood them too
        replicas = {m.group(1).decode() for key in attacker.list_keys() if "addr/" in key
                    for m in [re.search(rb"(127\.0\.0\.1:\d+)", attacker.get(key))] if m}
        assert len(replicas) == 2, attacker.list_keys()
        for addr in replicas:
            _flood(addr)
        flooded_at = time.time()
        payload = pickle.dumps(_Payload())
        for key in attacker.list_keys():
            if attacker.get(key).startswith(MAGIC):  # a value the job MAC'd: forge it
                attacker.set(key, payload)
                forged_keys.append(key)
        outs = [p.communicate(timeout=240) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert any("rendezvous-state" in k for k in forged_keys), forged_keys
    for p, (_out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
        assert "Traceback" not in err
    assert not mark.exists(), "the payload ran"
    assert "[demo] step 60/60" in outs[0][0], outs[0][0][-2000:]
    forged = [e for r in runs for e in run_events(str(r)) if e["event"] == "store_forged"]
    assert forged, "the forgeries were not reported"
    # the flood: refused, reported a few times (rate-limited), and replication went on
    for _out, err in outs:
        assert 1 <= err.count("refused replica connection") <= 3, err[-3000:]
    replicated = [e for r in runs for e in run_events(str(r)) if e["event"] == "replicated"]
    assert [e for e in replicated if e["time"] > flooded_at], (flooded_at, replicated[-3:])


def _flood(addr: str) -> None:
    """What anyone on the network can send a replica server: 40 connections of garbage, a
    JSON hello nested 100,000 deep, a hello that claims 4 GiB."""
    host, port = addr.rsplit(":", 1)
    for junk in [os.urandom(4096)] * 40 + [b"[" * 100_000, b"\xff\xff\xff\xff{"]:
        with contextlib.suppress(OSError), socket.create_connection((host, int(port)), 5) as s:
            s.settimeout(5)
            s.sendall(junk)
            with contextlib.suppress(OSError):
                s.recv(1)  # until the server closes it


_ATTEMPTS = """
import os, socket, sys, time
attempt, port = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), int(os.environ["MASTER_PORT"])
out = sys.argv[1]
if os.environ["RANK"] == "0":
    open(os.path.join(out, f"port{attempt}"), "w").write(str(port))
    if attempt == 2:  # while attempt 2 runs: does attempt 1's store still answer?
        with socket.socket() as s:
            s.settimeout(1)
            open(os.path.join(out, "old_listens"), "w").write(
                str(s.connect_ex(("127.0.0.1", int(open(os.path.join(out, "port1")).read()))) == 0))
time.sleep(1)
if attempt < 2:
    sys.exit(1)
"""


@pytest.mark.slow
def test_the_previous_attempts_store_is_closed(tmp_path):
    """Each restart gives the workers a fresh store; the one before stops listening."""
    (tmp_path / "job.py").write_text(_ATTEMPTS)
    proc = subprocess.run(ckptrun_cmd("--standalone", "--nproc-per-node", "2", "--max-restarts",
                                      "2", "--run-dir", str(tmp_path / "run"),
                                      str(tmp_path / "job.py"), str(tmp_path)),
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "port1").read_text() != (tmp_path / "port2").read_text()
    assert (tmp_path / "old_listens").read_text() == "False", "attempt 1's store still listens"
