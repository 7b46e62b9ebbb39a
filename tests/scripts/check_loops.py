"""Small training loops, each with one of the mistakes ``ckptrun check`` must name.

``--mode correct``: the prefetched batch and the rebound number are given to save();
``prefetch``: the batch fetched ahead is not in the snapshot; ``rebind``: ``best`` and
``seen`` are registered in the state dict as plain numbers and rebound by the loop;
``nondeterministic``: the data depends on the OS's entropy, so no two runs agree.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn

import ckptrun


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", default="correct")
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    torch.manual_seed(1 + dist.get_rank())

    def get_batch():
        x = torch.randn(4, 8)
        if args.mode == "nondeterministic":
            x += int.from_bytes(os.urandom(2), "little") * 1e-4
        return x, x.sum(1, keepdim=True)

    best, seen = 1e9, 0
    state = {"model": model, "opt": opt}
    if args.mode == "rebind":
        state.update(best=best, seen=seen)
    ckpt = ckptrun.Checkpointer(state)
    step = ckpt.restore()
    if args.mode == "rebind":
        best, seen = state["best"], state["seen"]
    else:
        best, seen = ckpt.get("best", best), ckpt.get("seen", seen)
    x, y = ckpt.get("batch") if args.mode != "prefetch" and ckpt.get("batch") else get_batch()
    while step < args.steps:
        loss = nn.functional.mse_loss(ddp(x), y) * (1 + seen % 3)  # seen feeds the loss
        x, y = get_batch()  # prefetch the next batch
        opt.zero_grad()
        loss.backward()
        opt.step()
        best, seen = min(best, loss.item()), seen + 1
        step += 1
        if args.mode == "correct":
            ckpt.save(step, best=best, seen=seen, batch=(x, y))
        elif args.mode == "prefetch":
            ckpt.save(step, best=best, seen=seen)
        else:
            ckpt.save(step)
    ckpt.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
