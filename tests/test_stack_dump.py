"""Stack dumps of hung workers (``ckptrun.agent.hang.dump_stacks``): a stopped worker's
stacks are written and it is stopped again, so the restart finds the rank the verdict named
as it was judged; a running one is left running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from ckptrun.agent.hang import _stopped, dump_stacks

WORKER = """
import faulthandler, signal, sys, time
faulthandler.register(signal.SIGUSR1, file=open(sys.argv[1], "a"), all_threads=True)
def waiting_in_a_collective():
    print("ready", flush=True)  # from inside: a dump right after it shows this frame
    while True:
        time.sleep(0.01)
waiting_in_a_collective()
"""


def _start(tmp_path, name):
    fh = tmp_path / f"{name}.fh"
    proc = subprocess.Popen([sys.executable, "-c", WORKER, str(fh)], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc, str(fh)


def _state_settles(pid, stopped, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _stopped(pid) == stopped:
            return True
        time.sleep(0.01)
    return False


def test_a_stopped_worker_is_dumped_and_stopped_again_a_running_one_runs_on(tmp_path):
    hung, hung_fh = _start(tmp_path, "hung")
    live, live_fh = _start(tmp_path, "live")
    try:
        os.kill(hung.pid, signal.SIGSTOP)
        assert _state_settles(hung.pid, True)
        out = [str(tmp_path / "hung.txt"), str(tmp_path / "live.txt")]
        done = dump_stacks([(hung.pid, True, hung_fh, out[0]), (live.pid, True, live_fh, out[1])])
        assert sorted(done) == sorted(out)
        for path in out:
            with open(path) as f:
                assert "waiting_in_a_collective" in f.read()
        # the stopped one stays stopped (a second look, after any late SIGCONT would show)
        time.sleep(0.3)
        assert _stopped(hung.pid), "the hung worker was left running after its dump"
        assert not _stopped(live.pid)
    finally:
        for p in (hung, live):
            p.kill()
            p.wait(timeout=30)
