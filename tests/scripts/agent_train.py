"""A tiny gloo job for the agent tests: N steps of all_reduce + heartbeat, with failure injection.

Flags: --steps N, --step-time S, --fail-rank R, and (first attempt only, on rank R):
--crash-at K (SIGKILL itself), --raise-at K (exception), --hang-at K (SIGSTOP itself),
--exit-at K (sys.exit(3)), --fatal-at K (set the control block's fatal flag and sleep),
--child-hang-at K (wait for a child process that SIGSTOPs itself: a stopped data worker);
--always-crash-at K crashes in every attempt.  --marks FILE appends timing marks (JSON lines):
"start" when the script begins, "beat1" at the first heartbeat, "kill" just before a crash.
--no-pg skips the process group; --grandchild starts a ``sleep 300`` child (orphan tests);
--trap-sigterm records a SIGTERM (a "sigterm" mark) and carries on; --slow-save S spends S
seconds of every step in phase SAVING, between "saving" and "saved" marks (except on R);
with it, --crash-at waits until another rank is inside such a copy.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

T0 = time.time()


def mark(path, what: str, **kw) -> None:
    if path:
        rec = {"what": what, "t": time.time(), "rank": int(os.environ.get("RANK", 0)),
               "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)), **kw}
        with open(path, "a") as f:
            f.write(json.dumps(rec) + "\n")


def wait_for_peer_saving(path: str, rank: int, timeout: float = 60.0) -> None:
    """Block until another rank's latest mark is "saving" (it is inside a snapshot copy)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        latest: dict[int, str] = {}
        with open(path) as f:
            for line in f:
                if not line.endswith("\n"):  # a mark being written
                    break
                rec = json.loads(line)
                if rec["rank"] != rank and rec["what"] in ("saving", "saved"):
                    latest[rec["rank"]] = rec["what"]
        if "saving" in latest.values():
            return
        time.sleep(0.01)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--step-time", type=float, default=0.05)
    ap.add_argument("--fail-rank", type=int, default=1)
    for flag in ("crash-at", "raise-at", "hang-at", "exit-at", "fatal-at", "always-crash-at",
                 "child-hang-at"):
        ap.add_argument(f"--{flag}", type=int, default=-1)
    ap.add_argument("--marks", default="")
    ap.add_argument("--no-pg", action="store_true")
    ap.add_argument("--grandchild", action="store_true", help="start a `sleep` child process")
    ap.add_argument("--trap-sigterm", action="store_true")
    ap.add_argument("--slow-save", type=float, default=0.0)
    args = ap.parse_args()
    mark(args.marks, "start", t0=T0)
    if args.trap_sigterm:
        signal.signal(signal.SIGTERM, lambda *_: mark(args.marks, "sigterm"))
    if args.grandchild:
        import subprocess

        child = subprocess.Popen(["sleep", "300"])
        mark(args.marks, "grandchild", pid=child.pid)

    import torch
    import torch.distributed as dist

    import ckptrun

    rank = int(os.environ.get("RANK", 0))
    first = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if not args.no_pg:
        dist.init_process_group("gloo")
    t = torch.ones(4)
    for step in range(1, args.steps + 1):
        if not args.no_pg:
            dist.all_reduce(t)
        time.sleep(args.step_time)
        ckptrun.heartbeat(step)
        if step == 1:
            mark(args.marks, "beat1")
        if args.slow_save and rank != args.fail_rank:  # a snapshot copy, to the agent
            from ckptrun.protocol import Phase
            from ckptrun.worker.heartbeat import worker_link

            block, lr = worker_link()
            block.set(lr, "save_copy_s", args.slow_save)
            ckptrun.heartbeat(step, phase=Phase.SAVING)
            mark(args.marks, "saving", step=step)
            time.sleep(args.slow_save)
            mark(args.marks, "saved", step=step)
            ckptrun.heartbeat(step)
        victim = rank == args.fail_rank
        if victim and step == args.always_crash_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if not (victim and first):
            continue
        if step == args.crash_at:
            if args.slow_save:  # crash inside a peer's copy, however late the peer started
                wait_for_peer_saving(args.marks, rank)
            mark(args.marks, "kill")
            os.kill(os.getpid(), signal.SIGKILL)
        if step == args.raise_at:
            raise RuntimeError(f"injected failure at step {step}")
        if step == args.exit_at:
            sys.exit(3)
        if step == args.hang_at:
            mark(args.marks, "kill")
            os.kill(os.getpid(), signal.SIGSTOP)
        if step == args.child_hang_at:  # waits for a batch from a worker process that stopped
            import subprocess

            child = subprocess.Popen([sys.executable, "-c", "import os, signal; "
                                      "os.kill(os.getpid(), signal.SIGSTOP); print('batch')"],
                                     stdout=subprocess.PIPE)
            mark(args.marks, "child", pid=child.pid)
            child.stdout.read()
        if step == args.fatal_at:
            from ckptrun.worker.heartbeat import worker_link

            block, lr = worker_link()
            block.set(lr, "fatal", 1)
            time.sleep(60)
    print(f"rank {rank} done attempt {os.environ.get('TORCHELASTIC_RESTART_COUNT')}", flush=True)
    if not args.no_pg:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
