"""The first saves of a job whose CPU waits during a step (a GPU step, modelled by a sleep).

Run under ckptrun with one rank, e.g.::

    CKPTRUN_SLOTS_AHEAD=0 ckptrun --standalone --nproc-per-node 1 \
        benchmarks/jobs/first_saves_job.py --gib 1

It prints one JSON line: how long each ``save()`` blocked the loop and the loop's wall
time.  With ``CKPTRUN_SLOTS_AHEAD=0`` every slot is allocated by the save that first needs
it (the second and third saves block for their slot's page faults); by default the first
save allocates the others on a thread while the next steps' CPU is idle.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import ckptrun


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.0, help="state size")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--step-s", type=float, default=0.8, help="the accelerator's step")
    args = ap.parse_args()
    state = {"w": torch.ones(int(args.gib * (1 << 30)) // 4)}
    ck = ckptrun.Checkpointer(state)
    start = ck.restore()
    blocked, t0 = [], time.perf_counter()
    for step in range(start, args.steps):
        time.sleep(args.step_s)  # the CPU waits for the device
        state["w"].add_(1)
        t = time.perf_counter()
        ck.save(step + 1)
        blocked.append(round(time.perf_counter() - t, 3))
    print(json.dumps({"save_blocked_s": blocked,
                      "loop_s": round(time.perf_counter() - t0, 2)}), flush=True)


if __name__ == "__main__":
    main()
