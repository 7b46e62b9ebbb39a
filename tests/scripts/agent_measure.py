"""Recovery timings of the agent (not a test): SIGKILL of a worker -> replacement running /
first heartbeat, warm spares vs cold vs torchrun; SIGSTOP hang -> restart (hang timeout 2 s).

    python tests/scripts/agent_measure.py [--reps 2] [--nproc 2]

Times come from marks the training script writes (``agent_train.py --marks``): "kill" just
before the worker kills/stops itself, "start" when the replacement's script begins, "beat1"
after its first step.  All on one clock (time.time()).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
TRAIN = os.path.join(HERE, "agent_train.py")
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")


def one(case: str, nproc: int) -> dict:
    tmp = tempfile.mkdtemp(prefix="ckptrun-measure-")
    marks = os.path.join(tmp, "marks.jsonl")
    job = [TRAIN, "--steps", "260", "--step-time", "0.05", "--marks", marks]
    env = dict(os.environ, CKPTRUN_SPARE_DELAY="1")
    if case == "torchrun":
        # torch 2.13's shared agent store makes restarted workers read the previous
        # attempt's gloo addresses (DESIGN lessons); this is the documented way around it
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        cmd = [TORCHRUN, "--standalone", "--nproc-per-node", str(nproc), "--max-restarts", "1",
               *job, "--crash-at", "200"]
    else:
        cmd = [sys.executable, "-m", "ckptrun.cli", "--standalone", "--nproc-per-node",
               str(nproc), "--run-dir", os.path.join(tmp, "run"), *job]
        if case == "hang":
            cmd[cmd.index("--run-dir"):cmd.index("--run-dir")] = ["--hang-timeout", "2"]
            cmd += ["--hang-at", "200"]
        else:
            cmd += ["--crash-at", "200"]
        if case == "cold":
            env["CKPTRUN_WARM_SPARES"] = "0"
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=env, start_new_session=True)
    try:
        _, err = p.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)  # torchrun's workers outlive it otherwise
        raise
    if p.returncode != 0:
        raise RuntimeError(f"{case}: exit {p.returncode}\n{err[-3000:]}")
    recs = [json.loads(line) for line in open(marks)]
    kill = next(r["t"] for r in recs if r["what"] == "kill")
    again = [r for r in recs if r["attempt"] == 1]
    out = {"running_s": max(r["t"] for r in again if r["what"] == "start") - kill,
           "beat_s": max(r["t"] for r in again if r["what"] == "beat1") - kill}
    if case != "torchrun":
        evts = [json.loads(line) for line in open(os.path.join(tmp, "run", "events.jsonl"))]
        restart = next(e["time"] for e in evts if e["event"] == "restart")
        out["restart_event_s"] = restart - kill
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--cases", default="warm,cold,torchrun,hang")
    args = ap.parse_args()
    for case in args.cases.split(","):
        runs = [one(case, args.nproc) for _ in range(args.reps)]
        summary = {k: round(statistics.median(r[k] for r in runs), 3) for k in runs[0]}
        print(json.dumps({"case": case, "nproc": args.nproc, "median": summary,
                          "runs": runs}), flush=True)


if __name__ == "__main__":
    main()
