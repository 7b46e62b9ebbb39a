"""Real machine loss: an agent (its workers and its memory) disappears and a replacement
machine running the same command takes its place.

Every agent is its own machine with its own memory: it runs in a private mount namespace with
its own tmpfs on /dev/shm, so SIGKILLing it (the reaper then kills its workers) really loses
every snapshot it held.  The run must still end bitwise equal to a failure-free run of the
deterministic job (2 ranks; the weights do not depend on the 2-rank layout).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from typing import Optional

import pytest
import torch
from conftest import SCRIPTS, run_events

SCRIPT = os.path.join(SCRIPTS, "e2e_train.py")
STEPS = 40
STEP_TIME = "0.1"
UNSHARE = shutil.which("unshare")

pytestmark = pytest.mark.slow


def _namespace_problem() -> Optional[str]:
    """Why private-memory machines cannot be simulated here (None: they can)."""
    if not UNSHARE:
        return "unshare (util-linux) is not installed"
    if os.geteuid() != 0:
        return "mounting a private /dev/shm needs root"
    r = subprocess.run([UNSHARE, "-m", "--propagation", "private", "sh", "-c",
                        "mount -t tmpfs -o size=1m tmpfs /dev/shm"],
                       capture_output=True, text=True, timeout=30)
    return None if r.returncode == 0 else f"mount namespaces unavailable: {r.stderr[-300:]}"


@pytest.fixture(scope="module", autouse=True)
def namespaces():
    problem = _namespace_problem()
    if problem:
        pytest.skip(problem)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def machine(tmp_path, name: str, agent_args, out: str) -> subprocess.Popen:
    """One machine: an agent in its own mount namespace with its own /dev/shm."""
    run_dir = str(tmp_path / name)
    cmd = [UNSHARE, "-m", "--propagation", "private", "sh", "-c",
           'mount -t tmpfs -o size=2g,mode=1777 tmpfs /dev/shm && exec "$@"', name,
           sys.executable, "-m", "ckptrun.cli", *agent_args, "--run-dir", run_dir, SCRIPT,
           "--steps", str(STEPS), "--step-time", STEP_TIME, "--out", out]
    log = open(tmp_path / f"{name}.log", "w")
    p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
    log.close()
    p.run_dir = run_dir  # type: ignore[attr-defined]
    return p


def wait_until(pred, timeout: float, what: str, procs=()):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        for p in procs:
            assert p.poll() is None, f"{what}: a machine exited early ({p.returncode})"
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def status(run_dir: str) -> dict:
    try:
        with open(os.path.join(run_dir, "status.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def of(run_dir, name):
    return [e for e in run_events(run_dir) if e["event"] == name]


def finish(procs, timeout: float):
    try:
        return [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    d = tmp_path_factory.mktemp("ref")
    p = machine(d, "ref", ["--standalone", "--nproc-per-node", "2"], str(d / "final.pt"))
    assert finish([p], 180) == [0], (d / "ref.log").read_text()[-3000:]
    return torch.load(str(d / "final.pt"), weights_only=True)


def lose_and_replace(tmp_path, extra_args, victim_step: int = 10, persisted: bool = False):
    """Machines A (store host) and B; B is SIGKILLed after ``victim_step``; C, with B's
    command, replaces it.  Returns (A, C, seconds from the loss to A's first step after its
    restore, B's group rank).  ``persisted``: also wait for a durable step before the loss."""
    port, rdzv_id = free_port(), uuid.uuid4().hex[:8]
    common = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
              "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", rdzv_id,
              "--max-restarts", "3", *extra_args]
    out = str(tmp_path / "final.pt")
    a = machine(tmp_path, "a", common, out)
    b = c = None
    try:
        wait_until(lambda: listening(port), 60, "the store host", [a])  # A hosts the store
        b = machine(tmp_path, "b", common, out)
        wait_until(lambda: any(w.get("step", 0) >= victim_step
                               for w in status(b.run_dir).get("workers", []))
                   and (not persisted or of(a.run_dir, "persisted")),
                   120, f"machine B at step {victim_step}", [a, b])
        lost_node = status(b.run_dir)["node"]
        t_loss = time.monotonic()
        os.kill(b.pid, signal.SIGKILL)  # the agent: its reaper takes the workers with it
        b.wait(timeout=30)
        c = machine(tmp_path, "c", common, out)

        def stepped():
            st, restored = status(a.run_dir), of(a.run_dir, "restored")
            return restored and st.get("attempt", 0) > 0 and any(
                w.get("step", 0) > restored[-1]["step"] for w in st.get("workers", []))
        wait_until(stepped, 120, "A's first step after the restore", [a, c])
        recovery_s = time.monotonic() - t_loss
        codes = finish([a, c], 150)
    finally:
        for p in (a, b, c):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(timeout=30)
    logs = {n: (tmp_path / f"{n}.log").read_text()[-3000:] for n in "abc"}
    assert codes == [0, 0], logs
    return a, c, recovery_s, lost_node


def test_machine_lost_replacement_restores_from_peer(tmp_path, reference):
    a, c, recovery_s, lost_node = lose_and_replace(tmp_path, ["--replicas", "2"])
    lost = of(a.run_dir, "node_lost")
    assert [e["node"] for e in lost] == [lost_node]
    assert of(c.run_dir, "start")[0]["node"] == lost_node  # the newcomer took B's place
    ra, rc = of(a.run_dir, "restored"), of(c.run_dir, "restored")
    assert ra[-1]["tier"] == "memory" and rc[-1]["tier"] == "peer", (ra, rc)
    assert ra[-1]["step"] == rc[-1]["step"]
    restarts = [e["restarts"] for e in of(a.run_dir, "restart")]
    assert restarts[-1] == 1, restarts  # one loss, one restart job-wide
    steps_lost = lost[0]["step"] - ra[-1]["step"]
    print(f"\nmachine loss -> first step after restore: {recovery_s:.2f}s "
          f"(detection {lost[0]['seconds_silent']:.2f}s), steps lost: {steps_lost} "
          f"(restored step {ra[-1]['step']})")
    assert 0 <= steps_lost <= 3
    got = torch.load(str(tmp_path / "final.pt"), weights_only=True)
    assert got.keys() == reference.keys()
    for k in got:
        assert torch.equal(got[k], reference[k]), k


def test_placement_group_lost_everyone_restores_from_storage(tmp_path, reference):
    """No peer copies (--replicas 1: every machine is its own placement group): losing a
    machine loses its group, and every node restores the same durable step."""
    store = tmp_path / "durable"
    a, c, recovery_s, lost_node = lose_and_replace(
        tmp_path, ["--replicas", "1", "--persist-every", "5", "--persist-to", str(store)],
        persisted=True)
    lost = of(a.run_dir, "node_lost")
    assert [e["node"] for e in lost] == [lost_node]
    ra, rc = of(a.run_dir, "restored"), of(c.run_dir, "restored")
    assert ra[-1]["tier"] == "storage" and rc[-1]["tier"] == "storage", (ra, rc)
    assert ra[-1]["step"] == rc[-1]["step"] > 0
    steps_lost = lost[0]["step"] - ra[-1]["step"]
    print(f"\nplacement group lost -> first step after restore: {recovery_s:.2f}s "
          f"(detection {lost[0]['seconds_silent']:.2f}s), steps lost: {steps_lost} "
          f"(restored durable step {ra[-1]['step']})")
    got = torch.load(str(tmp_path / "final.pt"), weights_only=True)
    for k in got:
        assert torch.equal(got[k], reference[k]), k
