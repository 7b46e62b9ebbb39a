"""Two agents on localhost, each its own node: a failure on one restarts both, and the
restart budget is counted once per failure for the whole job."""

from __future__ import annotations

import os
import socket
import subprocess
import uuid

from conftest import SCRIPTS, ckptrun_cmd, job_shm_files, run_events

TRAIN = os.path.join(SCRIPTS, "agent_train.py")


def of(evts, name):
    return [e for e in evts if e["event"] == name]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_nodes(tmp_path, agent_args, script_args, timeout=240):
    port, rdzv_id = free_port(), uuid.uuid4().hex[:8]
    procs, dirs = [], []
    for node in range(2):
        run_dir = str(tmp_path / f"node{node}")
        dirs.append(run_dir)
        procs.append(subprocess.Popen(
            ckptrun_cmd("--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                        "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", rdzv_id,
                        "--run-dir", run_dir, *agent_args, TRAIN, *script_args),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            outs.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return outs, dirs


def test_failure_on_one_node_restarts_both(tmp_path):
    outs, dirs = two_nodes(tmp_path, [], ["--steps", "6", "--crash-at", "3", "--fail-rank", "1"])
    for rc, _, err in outs:
        assert rc == 0, err[-3000:]
    e0, e1 = run_events(dirs[0]), run_events(dirs[1])
    assert of(e1, "worker_failed")[0]["signal"] == "SIGKILL"
    assert [e["attempt"] for e in of(e0, "restart")] == [1]
    assert [e["attempt"] for e in of(e1, "restart")] == [1]
    assert {of(e0, "start")[0]["job_token"]} != {of(e1, "start")[0]["job_token"]}
    assert of(e0, "start")[0]["nnodes"] == 2
    assert "rank 0 done attempt 1" in outs[0][1] and "rank 1 done attempt 1" in outs[1][1]
    assert not job_shm_files(dirs[0]) and not job_shm_files(dirs[1])


def test_budget_is_counted_job_wide(tmp_path):
    # rank 1 dies in every attempt; rank 0 then fails too (peer gone): two reports per
    # failure, but each failure counts once: 2 restarts, then both agents exit 1.
    outs, dirs = two_nodes(tmp_path, ["--max-restarts", "2"],
                           ["--steps", "50", "--step-time", "0.1", "--fail-rank", "1",
                            "--always-crash-at", "2"])
    assert [rc for rc, _, _ in outs] == [1, 1], [err[-2000:] for _, _, err in outs]
    for d in dirs:
        evts = run_events(d)
        assert [e["attempt"] for e in of(evts, "restart")] == [1, 2]
        assert of(evts, "finished")[-1]["exit_code"] == 1
