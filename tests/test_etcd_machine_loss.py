"""Losing the machine that would host torchrun's store: with ``--rdzv-backend etcd-v2`` the
agents coordinate through a real etcd (started here), so the job survives the loss of group
rank 0 -- the machine whose agent hosts the c10d store and whose loss ends a torchrun job.

Each machine is an agent in its own mount namespace with a private /dev/shm (as in
``test_machine_loss.py``), so the lost machine's snapshots are really gone: the replacement
gets them from its peer.  The run ends bitwise equal to a failure-free run.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
import uuid

import pytest
from machines import (
    assert_bitwise_equal,
    free_port,
    hurry,
    machine,
    of,
    recovery,
    reference_weights,
    require_namespaces,
    status,
    wait_until,
)

ETCD = shutil.which("etcd")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def etcd_endpoint(tmp_path_factory):
    """A real etcd (v2 API on, as torch's etcd-v2 backend needs) on 127.0.0.1."""
    if not ETCD:
        pytest.skip("etcd is not installed (Debian: apt-get install etcd-server)")
    pytest.importorskip("etcd", reason="python-etcd is not installed (pip install python-etcd)")
    d = tmp_path_factory.mktemp("etcd")
    client, peer = free_port(), free_port()
    log = open(d / "etcd.log", "w")
    p = subprocess.Popen([ETCD, "--data-dir", str(d / "data"), "--enable-v2",
                          "--listen-client-urls", f"http://127.0.0.1:{client}",
                          "--advertise-client-urls", f"http://127.0.0.1:{client}",
                          "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                          "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                          "--initial-cluster", f"default=http://127.0.0.1:{peer}"],
                         stdout=log, stderr=subprocess.STDOUT)
    log.close()
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", client)) == 0:
                    break
            assert p.poll() is None, (d / "etcd.log").read_text()[-2000:]
            time.sleep(0.1)
        yield f"127.0.0.1:{client}"
    finally:
        p.kill()
        p.wait(timeout=30)


def test_cas_store_has_c10d_compare_set_semantics(etcd_endpoint):
    import etcd

    from ckptrun.store.etcd import CasEtcdStore

    host, port = etcd_endpoint.split(":")
    s = CasEtcdStore(etcd.Client(host, int(port)), f"/test/{uuid.uuid4().hex}")
    assert s.compare_set("k", "x", "y") == b"x"  # missing key, non-empty expected: untouched
    assert not s.check(["k"])
    assert s.compare_set("k", "", "a") == b"a"  # missing key, empty expected: created
    assert s.compare_set("k", "", "b") == b"a"  # exists: no match, current value back
    assert s.compare_set("k", "a", "c") == b"c" and s.get("k") == b"c"
    s.set("n", "1:-")
    assert s.multi_get(["k", "n"]) == [b"c", b"1:-"]

    def bump(who: int, times: int) -> None:  # increments that only compare_set makes atomic
        for i in range(times):
            while True:
                cur = s.get("n")
                new = f"{int(cur.split(b':')[0]) + 1}:{who}.{i}".encode()  # unique values
                if s.compare_set("n", cur, new) == new:
                    break

    threads = [threading.Thread(target=bump, args=(w, 15)) for w in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert s.get("n").split(b":")[0] == b"46"


def test_jobs_sharing_an_etcd_do_not_see_each_others_keys(etcd_endpoint):
    """torch puts every job's store under one prefix; ckptrun's own keys (epochs, done
    counts, standby offers) are per job (per ``--rdzv-id``), or a job that ended would tell
    the next one's standby that its job is over."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from ckptrun.store.etcd import create_etcd_v2_handler

    def store(run_id):
        params = RendezvousParameters(backend="etcd-v2", endpoint=etcd_endpoint, run_id=run_id,
                                      min_nodes=1, max_nodes=1, timeout=5)
        return create_etcd_v2_handler(params)[1]

    one, two = store(f"one/{uuid.uuid4().hex}"), store(f"two {uuid.uuid4().hex}")
    one.set("ckptrun/done/0", "1")
    assert one.get("ckptrun/done/0") == b"1"
    assert not two.check(["ckptrun/done/0"])
    assert two.add("ckptrun/done/0", 0) == 0 and one.add("ckptrun/done/0", 0) == 1


def _two_machines(tmp_path, etcd_endpoint, standby: bool = False, script_args=()):
    """Machines a and b (and standby s) of one etcd-v2 job; returns ``(procs, common, out,
    victim, survivor)`` once both are in the job: the victim is group rank 0, whoever the
    rendezvous made it -- the machine whose loss ends a c10d job.  ``script_args``: more
    arguments of the training script."""
    common = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "etcd-v2",
              "--rdzv-endpoint", etcd_endpoint, "--rdzv-id", uuid.uuid4().hex[:8],
              "--max-restarts", "3", "--replicas", "2"]
    out = str(tmp_path / "final.pt")
    procs = {n: machine(tmp_path, n, common, out, script_args=script_args) for n in "ab"}
    if standby:
        procs["s"] = machine(tmp_path, "s", common + ["--standby"], out,
                             script_args=script_args)
    try:
        nodes = wait_until(lambda: all("node" in status(procs[n].run_dir) for n in "ab")
                           and {n: status(procs[n].run_dir)["node"] for n in "ab"},
                           120, "both machines in the job", list(procs.values()))
    except BaseException:
        _stop_all(procs)
        raise
    victim = next(n for n, g in nodes.items() if g == 0)
    return procs, common, out, victim, procs["b" if victim == "a" else "a"]


def _hurry_once_restored(tmp_path, survivor) -> None:
    """Once the survivor restored, the rest of the job need not sleep between steps."""
    wait_until(lambda: of(survivor.run_dir, "restored"), 180, "the survivor's restore",
               [survivor])
    hurry(tmp_path)


def _stop_all(procs) -> None:
    for p in procs.values():
        if p.poll() is None:
            p.kill()
            p.wait(timeout=30)


def test_losing_group_rank_0_with_etcd_restores_from_peer_bitwise(tmp_path, etcd_endpoint,
                                                                   tmp_path_factory):
    require_namespaces()
    reference = reference_weights(tmp_path_factory)(2)
    procs, common, out, victim, survivor = _two_machines(tmp_path, etcd_endpoint)
    try:
        wait_until(lambda: of(survivor.run_dir, "replicated")
                   and any(w.get("step", 0) >= 10
                           for w in status(survivor.run_dir).get("workers", [])),
                   120, "step 10 and a replicated snapshot", list(procs.values()))
        os.kill(procs[victim].pid, signal.SIGKILL)  # agent, workers (reaper), its memory
        procs[victim].wait(timeout=30)
        procs["c"] = machine(tmp_path, "c", common, out)
        _hurry_once_restored(tmp_path, survivor)
        codes = [p.wait(timeout=240) for p in (survivor, procs["c"])]
    finally:
        _stop_all(procs)
    logs = {n: (tmp_path / f"{n}.log").read_text()[-3000:] for n in procs}
    assert codes == [0, 0], logs
    assert of(procs["c"].run_dir, "start")[0]["node"] == 0  # the newcomer took rank 0
    rs, rc = recovery(survivor.run_dir), recovery(procs["c"].run_dir)
    assert rs["tier"] == "memory" and rc["tier"] == "peer", (rs, rc)
    assert rs["step"] == rc["step"] > 0
    assert_bitwise_equal(out, reference)


@pytest.mark.spares
def test_a_standby_takes_group_rank_0s_place_with_etcd_in_place(tmp_path, etcd_endpoint,
                                                                tmp_path_factory):
    """``--standby`` with ``--rdzv-backend etcd-v2``: the standby waits in etcd's store
    (the takeover's agreement is a compare-and-set there), holds both machines' copies, and
    takes the place of group rank 0 -- whose loss ends a c10d job -- when its agent is
    SIGKILLed; nobody is started after the loss, and the run ends bitwise exact.  The
    survivor's rank (``@ckptrun.resilient``) goes on in its own process, its process group
    re-formed with the standby's new rank 0 (the group's store moved).  (With the survivors
    restarted the takeover's agreement is the same: tests/test_machine_loss.py covers that
    with torch's c10d store.)"""
    require_namespaces()
    reference = reference_weights(tmp_path_factory)(2)
    procs, _, out, victim, survivor = _two_machines(
        tmp_path, etcd_endpoint, standby=True, script_args=["--in-place"])
    standby = procs["s"]
    try:
        def ready() -> bool:
            st, su = status(standby.run_dir), status(survivor.run_dir)
            return bool(st.get("standby") and st.get("standby_holds_step") is not None
                        and st.get("spare_pids") and su.get("spare_pids")
                        and any(w.get("step", 0) >= 10 for w in su.get("workers", []))
                        and of(survivor.run_dir, "replicated"))
        wait_until(ready, 180, "step 10, copies on the peer and on the standby, warm spares",
                   list(procs.values()))
        os.kill(procs[victim].pid, signal.SIGKILL)  # agent, workers (reaper), its memory
        procs[victim].wait(timeout=30)
        _hurry_once_restored(tmp_path, survivor)
        codes = [p.wait(timeout=240) for p in (survivor, standby)]
    finally:
        _stop_all(procs)
    logs = {n: (tmp_path / f"{n}.log").read_text()[-3000:] for n in procs}
    assert codes == [0, 0], logs
    assert of(standby.run_dir, "standby_joined"), logs["s"]
    assert of(standby.run_dir, "start")[0]["node"] == 0  # took group rank 0's place
    rs, rb = recovery(survivor.run_dir), recovery(standby.run_dir)
    assert rs["tier"] == "memory" and rb["tier"] in ("memory", "peer"), (rs, rb)
    assert rs["step"] == rb["step"] > 0
    # one restart for the loss: the survivor's worker raised (its peer's connection closed)
    # a moment before the link to the lost agent broke, and that is not a second failure
    restarts = of(survivor.run_dir, "restart")
    assert len(restarts) == 1 and restarts[0].get("standby_took") == [0], restarts
    assert not of(survivor.run_dir, "worker_failed"), of(survivor.run_dir, "worker_failed")
    # the survivor (rank 1) was not restarted
    assert restarts[0].get("in_place") == [1], restarts
    log = (tmp_path / f"{'a' if survivor is procs['a'] else 'b'}.log").read_text()
    pids = set(re.findall(r"\[demo\] rank 1: attempt \d+ in pid (\d+)", log))
    assert len(pids) == 1 and "rank 1: recovering in place into attempt 1" in log, log[-3000:]
    # the standby's process had imported torch
    assert all(w["warm"] for w in status(standby.run_dir)["workers"]), status(standby.run_dir)
    lost = of(survivor.run_dir, "node_lost")
    assert lost[0]["detected_by"] == "link", lost
    print(f"\netcd standby: {recovery(survivor.run_dir, 'recovered')}")
    assert_bitwise_equal(out, reference)
