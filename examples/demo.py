"""`make demo`: a real training job, a worker killed mid-run, recovered from memory -- visibly.

1. runs ``examples/train.py`` under ``ckptrun`` with 2 workers and kills rank 1 with SIGKILL
   after step 25 (first attempt only),
2. shows what ckptrun recorded (``ckptrun status`` and the recovery events),
3. runs the same job without the failure and checks the final weights are bitwise equal.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
TRAIN = os.path.join(HERE, "train.py")


def ckptrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "ckptrun.cli", *args]


def banner(text: str) -> None:
    print(f"\n\033[1m=== {text}\033[0m", flush=True)


def main() -> int:
    import torch

    work = tempfile.mkdtemp(prefix="ckptrun-demo-")
    failed_run, clean_run = os.path.join(work, "with-failure"), os.path.join(work, "clean")
    steps = "60"

    banner("Training 60 steps on 2 workers; rank 1 is killed (SIGKILL) after step 25")
    rc = subprocess.call(ckptrun(
        "--standalone", "--nproc-per-node", "2", "--run-dir", failed_run,
        TRAIN, "--steps", steps, "--crash-at", "25", "--out", os.path.join(work, "a.pt"),
    ))
    if rc != 0:
        print(f"demo: the job failed (exit {rc})", file=sys.stderr)
        return rc

    banner("What ckptrun saw (ckptrun status --run-dir ...)")
    subprocess.call(ckptrun("status", "--run-dir", failed_run))
    banner("Recovery events (events.jsonl)")
    with open(os.path.join(failed_run, "events.jsonl")) as f:
        events = [json.loads(line) for line in f if line.strip()]
    for e in events:
        if e["event"] in ("worker_failed", "restart", "restored", "persisted", "finished"):
            fields = {k: v for k, v in e.items() if k not in ("time", "event")}
            print(f"  {e['event']:<14} {fields}")

    banner("The same job without any failure, for comparison")
    rc = subprocess.call(ckptrun(
        "--standalone", "--nproc-per-node", "2", "--run-dir", clean_run,
        TRAIN, "--steps", steps, "--out", os.path.join(work, "b.pt"),
    ), stdout=subprocess.DEVNULL)
    if rc != 0:
        print(f"demo: the reference job failed (exit {rc})", file=sys.stderr)
        return rc
    a = torch.load(os.path.join(work, "a.pt"), weights_only=True)
    b = torch.load(os.path.join(work, "b.pt"), weights_only=True)
    equal = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    restored = [e for e in events if e["event"] == "restored"]
    lost = 25 - restored[0]["step"] if restored else None
    banner("Result")
    print(f"  final weights bitwise equal to the failure-free run: {equal}")
    if restored:
        r = restored[0]
        print(f"  restored step {r['step']} from {r['tier']} in {r['seconds']:.3f} s; "
              f"steps lost: {lost}")
    print(f"  run directories: {work}")
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
