"""Machine memory loss -> restored from a peer's copy (two agents on localhost).

Two ``ckptrun`` agents, one per "machine" (``--nnodes 2 --nproc-per-node 1``, c10d
rendezvous on 127.0.0.1, ``--replicas 2``), run the recovery job.  The failing rank first
makes every snapshot its machine holds unusable (its own slots and the peer copies its
agent keeps: checksums fail), then SIGKILLs itself: only the other machine's copy of its
state is left, so the restore must come from peer memory.  The agent of the "lost"
machine survives: a replacement agent joining the job is not what this measures.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Dict, List

from benchmarks.jobrun import JOB, ROOT, Outcome, kill_group, read_events, read_logs, shm_leftovers


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch_two(job_args: List[str], work: str, timeout_s: float, trigger) -> Outcome:
    """Start both agents, call ``trigger(log_dir)`` every 0.1 s, wait for both."""
    log_dir = os.path.join(work, "steps")
    os.makedirs(log_dir, exist_ok=True)
    port, rdzv = _free_port(), uuid.uuid4().hex[:8]
    procs, files = [], []
    for node in range(2):
        cmd = [sys.executable, "-m", "ckptrun.cli", "--nnodes", "2", "--nproc-per-node", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
               "--rdzv-id", rdzv, "--max-restarts", "1", "--replicas", "2",
               "--run-dir", os.path.join(work, f"node{node}"), JOB, "--log-dir", log_dir,
               *job_args]
        f = open(os.path.join(work, f"node{node}.log"), "w")
        files.append(f)
        procs.append(subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                      env=dict(os.environ, PYTHONPATH=ROOT,
                                               CKPTRUN_SPARE_DELAY="0"),
                                      start_new_session=True))
    t0 = time.monotonic()
    timed_out = False
    while any(p.poll() is None for p in procs):
        if time.monotonic() - t0 > timeout_s:
            timed_out = True
            break
        trigger(log_dir)
        time.sleep(0.1)
    for p in procs:
        if p.poll() is None:
            kill_group(p)
    for f in files:
        f.close()
    events: List[dict] = []
    left: List[str] = []
    for node in range(2):
        evs = read_events(os.path.join(work, f"node{node}"))
        events += [dict(e, node=node) for e in evs]
        left += shm_leftovers(evs)
    for path in left:
        os.unlink(path)
    with open(os.path.join(work, "node1.log"), errors="replace") as f:
        tail = f.read()[-2000:]
    rc = max((p.returncode or 0) for p in procs)
    return Outcome(rc, time.monotonic() - t0, read_logs(log_dir), events,
                   [os.path.basename(p) for p in left], timed_out, tail)


def run_once(mb: int, root: str, trigger_cls, measure) -> Dict[str, object]:
    """One two-machine run; a sample like the recovery section's, plus tiers per node."""
    work = tempfile.mkdtemp(prefix="machine-", dir=root)
    try:
        trigger = trigger_cls(work, "two-agents", 2.0, 60.0)
        job = ["--ckpt", "ckptrun", "--state-mb", str(mb), "--kill-at", "25", "--wipe",
               "--fail-file", os.path.join(work, "fail")]
        out = launch_two(job, work, 150.0, trigger)
        sample = measure(out, False)
        wiped = out.records("wiped", attempt=0)
        sample["wiped_files"] = wiped[0]["files"] if wiped else 0
        sample["tiers"] = {e["node"]: e.get("tier") for e in out.events
                           if e.get("event") == "restored"}
        sample["spares_warm"] = trigger.warm
        return sample
    finally:
        shutil.rmtree(work, ignore_errors=True)
