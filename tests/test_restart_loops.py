"""No restart loops: a failure that repeats with no step committed in between stops the job
after the third attempt (exit 1, one line saying why), whatever ``--max-restarts``; failures
between which training advanced are restarted up to the budget."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = pytest.mark.slow

CRASH_AT_START = textwrap.dedent("""
    import ckptrun, torch
    ckpt = ckptrun.Checkpointer({"w": torch.zeros(4)})
    ckpt.restore()
    raise ValueError("config.yaml has no key 'lr'")
""")

# crashes two steps after every restore, until step 12: every attempt makes progress
CRASH_WITH_PROGRESS = textwrap.dedent("""
    import os, signal, torch, ckptrun
    w = torch.zeros(4)
    ckpt = ckptrun.Checkpointer({"w": w})
    start = ckpt.restore()
    for step in range(start, 12):
        w += 1
        ckpt.save(step + 1)
        ckpt.wait()
        if step + 1 == start + 2 and step + 1 < 12:
            os.kill(os.getpid(), signal.SIGKILL)
    ckpt.close()
""")


# a plain DataLoader registered: the first save() cannot snapshot it, and never will
UNSNAPSHOTTABLE = textwrap.dedent("""
    import ckptrun, torch
    loader = torch.utils.data.DataLoader(list(range(8)), batch_size=2)
    ckpt = ckptrun.Checkpointer({"w": torch.zeros(4), "data": loader})
    ckpt.restore()
    for step, batch in enumerate(loader, 1):
        ckpt.save(step)
""")


# an object whose load_state_dict refuses what its state_dict() gave: the first attempt
# saves, its rank 1 is killed; every restore afterwards would be refused the same way
REFUSES_ITS_STATE = textwrap.dedent("""
    import os, signal, torch, torch.distributed as dist, ckptrun
    dist.init_process_group("gloo")
    class Picky:
        def __init__(self): self.n = 0
        def state_dict(self): return {"n": self.n}
        def load_state_dict(self, sd): raise ValueError(f"Picky cannot take {sd}")
    picky = Picky()
    ckpt = ckptrun.Checkpointer({"w": torch.zeros(4), "picky": picky})
    start = ckpt.restore()
    for step in range(start, 6):
        dist.barrier()  # the ranks go step by step: both hold step 3 when rank 1 dies
        picky.n = step + 1
        ckpt.save(step + 1)
        ckpt.wait()
        if step + 1 == 3 and dist.get_rank() == 1 \\
                and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
            os.kill(os.getpid(), signal.SIGKILL)
    ckpt.close()
""")


def run(tmp_path, source: str, nproc: int = 1):
    script = tmp_path / "train.py"
    script.write_text(source)
    run_dir = tmp_path / "run"
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "ckptrun.cli", "--standalone",
                           "--nproc-per-node", str(nproc), "--run-dir", str(run_dir),
                           str(script)],
                          capture_output=True, text=True, timeout=300)
    with open(run_dir / "events.jsonl") as f:
        evts = [json.loads(line) for line in f if line.strip()]
    return proc, evts, time.monotonic() - t0


def test_a_deterministic_crash_at_start_up_stops_after_three_attempts(tmp_path):
    proc, evts, _ = run(tmp_path, CRASH_AT_START)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert len([e for e in evts if e["event"] == "worker_failed"]) == 3
    assert [e["attempt"] for e in evts if e["event"] == "restart"] == [1, 2]
    loop = [e for e in evts if e["event"] == "restart_loop"]
    assert len(loop) == 1 and loop[0]["failures"] == 3 and loop[0]["how"] == "exit code 1"
    lines = [ln for ln in proc.stderr.splitlines() if "failed the same way 3 times" in ln]
    assert len(lines) == 1 and "not restarting again" in lines[0], proc.stderr[-2000:]
    # the traceback once; each later attempt's the same one as one line (not 11 copies)
    assert proc.stderr.count("Traceback (most recent call last)") == 1, proc.stderr[-3000:]
    assert proc.stderr.count("(the same traceback as before: ValueError: config.yaml has no "
                             "key 'lr')") == 2, proc.stderr[-3000:]


def test_failures_with_progress_in_between_are_all_restarted(tmp_path):
    proc, evts, _ = run(tmp_path, CRASH_WITH_PROGRESS)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len([e for e in evts if e["event"] == "worker_failed"]) == 5  # 2, 4, 6, 8, 10
    assert not [e for e in evts if e["event"] == "restart_loop"]
    assert [e["step"] for e in evts if e["event"] == "restored"] == [2, 4, 6, 8, 10]


def test_state_that_cannot_be_snapshotted_stops_the_job_at_once(tmp_path):
    """Not three attempts that fail the same way: the type of a registered object is wrong
    in every process; the message says what to register instead."""
    proc, evts, _ = run(tmp_path, UNSNAPSHOTTABLE)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert not [e for e in evts if e["event"] == "restart"], evts
    failed = [e for e in evts if e["event"] == "worker_failed"]
    assert [(e["rank"], e.get("fatal")) for e in failed] == [(0, 1)], failed
    assert "cannot snapshot torch.utils.data.dataloader.DataLoader at 'data'" in proc.stderr
    assert "StatefulDataLoader is a drop-in replacement" in proc.stderr


def test_a_restored_state_an_object_refuses_stops_the_job_in_one_attempt(tmp_path):
    """The restore after the kill finds the state, and a registered object's load_state_dict
    refuses it on both ranks: the job stops after that one attempt (exit 2), saying which
    entry, which rank and why -- not a restart into the same refusal, three times."""
    proc, evts, _ = run(tmp_path, REFUSES_ITS_STATE, nproc=2)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert [e["attempt"] for e in evts if e["event"] == "restart"] == [1], evts
    fatal = [e for e in evts if e["event"] == "worker_failed" and e.get("fatal")]
    assert fatal and fatal[0]["fatal"] == 3, evts
    assert ("cannot load the restored 'picky' into Picky.load_state_dict: ValueError: Picky "
            "cannot take {'n': 3}") in proc.stderr, proc.stderr[-3000:]
    assert "could not load its restored state; a restart would load the same: no restart" \
        in proc.stderr, proc.stderr[-3000:]


@pytest.mark.parametrize("attempts,stops", [
    # whichever ranks reported it, the same failure: the third stops the job
    ([[(0, "exit code 1", "E: rank 0"), (1, "exit code 1", "E: rank 1")],
      [(1, "exit code 1", "E: rank 1")],
      [(0, "exit code 1", "E: rank 0")]], [False, False, True]),
    # a failure that is no longer among them starts the count again
    ([[(0, "exit code 1", "A"), (1, "exit code 1", "B")],
      [(1, "exit code 1", "B")],
      [(0, "exit code 1", "A")],
      [(0, "exit code 1", "A")],
      [(0, "exit code 1", "A"), (1, "signal SIGKILL", "")]], [False, False, False, False, True]),
    # no message (no @record): the same only while some same rank fails each time
    ([[(0, "exit code 1", ""), (1, "exit code 1", "")],
      [(1, "exit code 1", "")],
      [(1, "exit code 1", "")]], [False, False, True]),
    ([[(0, "exit code 1", "")], [(1, "exit code 1", "")], [(0, "exit code 1", "")],
      [(0, "exit code 1", "")]], [False, False, False, False]),
])
def test_the_same_failure_is_counted_whichever_ranks_reported_it(attempts, stops):
    from ckptrun.agent.restart_loops import RestartLoops, signature

    loops = RestartLoops()
    assert [loops.failed(signature(a), progressed=False) for a in attempts] == stops
    assert not loops.failed(signature(attempts[-1]), progressed=True)  # progress: from 1
