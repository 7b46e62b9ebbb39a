"""Machines on one host for the multi-machine tests: every agent runs in its own mount
namespace with a private tmpfs on /dev/shm, so SIGKILLing it (its reaper then kills its
workers) really loses every snapshot it held.  Shared by ``test_machine_loss.py`` and
``test_etcd_machine_loss.py``."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from typing import Callable, List, Optional

import pytest
import torch
from conftest import SCRIPTS, file_tail, run_events
from conftest import run_status as status

from ckptrun.cli.status import load_status

SCRIPT = os.path.join(SCRIPTS, "e2e_train.py")
# 20 s of training (40 s at the 0.2 s steps of the tests that wait for the pacers): the
# tests wait (at step 10) for a durable step, for every peer to hold a copy and for every
# agent's pacer to have measured a round's cost before they kill machines; on a loaded
# 2-core machine 40 steps (CI once), 80 (CI, 2026-12-05) and 120 (the standby test beside
# another, 2026-12-07: its pacers unmeasured after 24 s) were over before all of that was
# reported (alone: step 10 after 6-11 s, every pacer measured after 9-12 s).  The steps
# after the test is ready do not sleep: the extra ones cost ~25 ms each
STEPS = 200
STEP_TIME = "0.1"
UNSHARE = shutil.which("unshare")


def namespace_problem() -> Optional[str]:
    """Why private-memory machines cannot be simulated here (None: they can)."""
    if not UNSHARE:
        return "unshare (util-linux) is not installed"
    if os.geteuid() != 0:
        return "mounting a private /dev/shm needs root"
    r = subprocess.run([UNSHARE, "-m", "--propagation", "private", "sh", "-c",
                        "mount -t tmpfs -o size=1m tmpfs /dev/shm"],
                       capture_output=True, text=True, timeout=30)
    return None if r.returncode == 0 else f"mount namespaces unavailable: {r.stderr[-300:]}"


def require_namespaces() -> None:
    """Skip the calling test (or module fixture) when private-memory machines are impossible."""
    problem = namespace_problem()
    if problem:
        pytest.skip(problem)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def machine(tmp_path, name: str, agent_args, out: str, step_time: str = STEP_TIME,
            env=None, script_args=()) -> subprocess.Popen:
    """One machine: an agent in its own mount namespace with its own /dev/shm
    (``script_args``: more arguments of the training script, e.g. ``--in-place``).  Its
    steps stop sleeping once the test calls :func:`hurry` (what it waited for is over)."""
    run_dir = str(tmp_path / name)
    cmd = [UNSHARE, "-m", "--propagation", "private", "sh", "-c",
           'mount -t tmpfs -o size=2g,mode=1777 tmpfs /dev/shm && exec "$@"', name,
           sys.executable, "-m", "ckptrun.cli", *agent_args, "--run-dir", run_dir, SCRIPT,
           "--steps", str(STEPS), "--step-time", step_time, "--out", out,
           "--fast-after-file", str(tmp_path / "hurry"), *script_args]
    log = open(tmp_path / f"{name}.log", "w")
    p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True,
                         env=None if env is None else {**os.environ, **env})
    log.close()
    p.run_dir = run_dir  # type: ignore[attr-defined]
    p.log_path = str(tmp_path / f"{name}.log")  # type: ignore[attr-defined]
    return p


def hurry(tmp_path) -> None:
    """The machines of this test train the rest of their steps without ``--step-time``
    (after the recovery a test waits only for the job's end: up to 18 s of sleeping)."""
    (tmp_path / "hurry").touch()


def wait_until(pred, timeout: float, what, procs=()):
    """Poll ``pred`` until it is true; fail if a machine of ``procs`` exits first or the
    time runs out.  ``what`` is a string or a callable giving one (called only on failure,
    so it can say which part of a compound condition was still unmet)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        for p in procs:
            assert p.poll() is None, (f"{_say(what)}: a machine exited early ({p.returncode}): "
                                      + file_tail(getattr(p, "log_path", None)))
        time.sleep(0.05)
    # every machine's log tail: a timeout in a loaded full run must be diagnosable from
    # the report alone, since it rarely recurs when the test is run by itself
    paths = [getattr(p, "log_path", None) for p in procs]
    tails = "".join(f"\n--- {path}\n{file_tail(path, 2500)}" for path in paths)
    raise AssertionError(f"timed out waiting for {_say(what)}{tails}")


def _say(what) -> str:
    return what() if callable(what) else str(what)


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def of(run_dir, name):
    return [e for e in run_events(run_dir) if e["event"] == name]


def recovery(run_dir, name: str = "restored") -> dict:
    """The first ``name`` event of the recovery from a machine loss: for a survivor the
    first after its first ``node_lost``, for a replacement (it saw no loss) its first.

    Later ones belong to later restarts (e.g. a worker aborting in torch's interpreter
    teardown after the last step, which restarts the job from that step); the tests judge
    the recovery, and the final weights judge the whole run."""
    evts = run_events(run_dir)
    lost = [e["time"] for e in evts if e["event"] == "node_lost"]
    after = [e for e in evts if e["event"] == name and (not lost or e["time"] > lost[0])]
    if not after:  # rare (CI once, 2026-12-06): say everything this machine knows
        st = status(run_dir)
        raise AssertionError(
            f"no {name!r} event in {run_dir}: events "
            f"{[e for e in evts if e['event'] not in ('heartbeat', 'persisted')]}; status "
            f"{ {k: st.get(k) for k in ('state', 'attempt', 'restore', 'workers')} }; log "
            f"tail:\n{file_tail(run_dir + '.log', 3000)}")
    return after[0]


def finish(procs, timeout: float):
    try:
        return [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)


def reference_weights(tmp_path_factory) -> Callable[[int], dict]:
    """``references(world)``: the final weights of a failure-free run with ``world`` ranks on
    one machine (computed once per world size)."""
    from conftest import shared_weights

    def make(world: int, d) -> str:
        # the weights do not depend on the step time, and a run without a failure has
        # no use for warm spares: the reference pays for neither
        p = machine(d, "ref", ["--standalone", "--nproc-per-node", str(world)],
                    str(d / "final.pt"), step_time="0", env={"CKPTRUN_WARM_SPARES": "0"})
        assert finish([p], 180) == [0], (d / "ref.log").read_text()[-3000:]
        return str(d / "final.pt")

    return lambda world: shared_weights(tmp_path_factory, f"machines-ref{world}-{STEPS}",
                                        lambda d: make(world, d))


def assert_bitwise_equal(path: str, reference: dict) -> None:
    got = torch.load(path, weights_only=True)
    assert got.keys() == reference.keys()
    for k in got:
        assert torch.equal(got[k], reference[k]), k


def peer_copies(run_dir: str) -> List[dict]:
    """``checkpoint.peers`` as ``ckptrun status --json`` reports it for this machine."""
    try:
        return load_status(run_dir)["checkpoint"]["peers"]
    except (OSError, ValueError, KeyError):
        return []
