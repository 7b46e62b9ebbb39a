"""Two ranks that all-reduce every step and save; in the first attempt, after step ``--at``
(3; 0: right after ``restore()``, before the first save):

``--mode eval``: rank 0 evaluates alone (a Python loop of small matmuls) for ``--seconds``
while rank 1 waits in the next all-reduce -- a healthy job;
``--mode stop``: rank 1 writes the time to ``--mark`` and SIGSTOPs itself;
``--mode deadlock``: both ranks wait to receive from each other.
``--independent``: no all-reduce, each rank steps alone (``--step-time`` s a step): a rank
never waits on another.
"""

from __future__ import annotations

import argparse
import os
import signal
import time

import torch
import torch.distributed as dist

import ckptrun


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", required=True)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--mark", default="")
    ap.add_argument("--at", type=int, default=3)
    ap.add_argument("--independent", action="store_true")
    ap.add_argument("--step-time", type=float, default=0.0)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, first = dist.get_rank(), os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    w = torch.zeros(4)
    ckpt = ckptrun.Checkpointer({"w": w})
    step = ckpt.restore()
    while step < args.steps:
        if step == args.at and first:
            fail(args, rank)
        g = torch.ones(4) * (rank + 1)
        if args.independent:
            time.sleep(args.step_time)
        else:
            dist.all_reduce(g)
        w += g
        step += 1
        ckpt.save(step)
    print(f"rank {rank} done at step {step}", flush=True)


def fail(args: argparse.Namespace, rank: int) -> None:
    if args.mode == "eval" and rank == 0:
        end = time.monotonic() + args.seconds
        while time.monotonic() < end:
            torch.randn(32, 32) @ torch.randn(32, 32)
        print(f"evaluated for {args.seconds} s", flush=True)
    elif args.mode == "stop" and rank == 1:
        with open(args.mark, "w") as f:
            f.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGSTOP)
    elif args.mode == "deadlock":
        dist.recv(torch.zeros(1), src=1 - rank)


if __name__ == "__main__":
    main()
