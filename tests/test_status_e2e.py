"""``ckptrun status --json`` against a real job (needs the agent): running, then finished."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.slow

SCRIPT = """
import os, sys, time
import torch, ckptrun
stop = sys.argv[1]
w = torch.zeros(16)
ckpt = ckptrun.Checkpointer({"w": w})
step = ckpt.restore()
while not os.path.exists(stop):
    step += 1
    w += 1
    ckpt.save(step)
    time.sleep(0.05)
ckpt.close()
"""


def _env():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "CKPTRUN_"))}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _status(run_dir):
    proc = subprocess.run([sys.executable, "-m", "ckptrun", "status", "--run-dir", str(run_dir),
                           "--json"], capture_output=True, text=True, timeout=60, env=_env())
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_status_of_running_and_finished_job(tmp_path):
    (tmp_path / "hb.py").write_text(SCRIPT)
    stop, run_dir = tmp_path / "stop", tmp_path / "run"
    job = subprocess.Popen(
        [sys.executable, "-m", "ckptrun", "--nproc-per-node", "2", "--run-dir", str(run_dir),
         "--max-restarts", "0", "hb.py", str(stop)],
        cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        deadline, st = time.time() + 120, {}
        while time.time() < deadline and job.poll() is None:
            if (run_dir / "status.json").exists():
                st = _status(run_dir)
                # the workers report their step as they train; the agent reports a memory
                # step once it has seen a committed snapshot, up to a status period later
                if st["state"] == "running" and all((w.get("step") or -1) > 0 for w in st["workers"]) \
                        and (st.get("checkpoint", {}).get("memory_step") or 0) > 0:
                    break
            time.sleep(0.5)
        assert job.poll() is None, job.stdout.read()
        assert st.get("state") == "running", st
        assert {"run_id", "state", "restarts", "workers", "checkpoint"} <= set(st)
        assert sorted(w["rank"] for w in st["workers"]) == [0, 1]
        for w in st["workers"]:
            assert {"rank", "local_rank", "node", "pid", "state", "step", "heartbeat_age_s"} <= set(w)
            assert isinstance(w["heartbeat_age_s"], (int, float)) and w["heartbeat_age_s"] < 30
        assert st["agent_pid"] == job.pid or st["agent_pid"] > 0
        assert (st["checkpoint"]["memory_step"] or 0) > 0 and any(st["slots"].values()), st
        stop.write_text("")
        assert job.wait(timeout=120) == 0, job.stdout.read()
        st = _status(run_dir)
        assert st["state"] == "succeeded" and st["restarts"] == 0
        # the agent unlinked its memory on exit: a finished job shows none
        assert st["checkpoint"]["memory_step"] is None and st["slots"] == {}, st
        # --watch into a pipe prints the table (and stops: the job is over)
        shown = subprocess.run(f"{sys.executable} -m ckptrun status --watch --run-dir "
                               f"{run_dir} | cat", shell=True, capture_output=True, text=True,
                               timeout=60, env=_env())
        assert shown.returncode == 0 and "succeeded" in shown.stdout, shown
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
