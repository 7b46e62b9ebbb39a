"""Test worker for the memory tier: a small deterministic MLP (with dropout) trained for
``--steps`` steps with ``ckptrun.Checkpointer``; optionally SIGKILLs itself right after
``save(--kill-after)``; writes the final parameters as raw float32 bytes to ``--out``.

Runs unchanged under plain python, torchrun-style env (``--ddp``: gloo DDP) or a simulated
ckptrun agent environment (``CKPTRUN_*`` set by the test).
"""

from __future__ import annotations

import argparse
import os
import signal

import torch
import torch.distributed as dist

import ckptrun


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--kill-after", type=int, default=0)
    ap.add_argument("--wait-before-kill", action="store_true")
    ap.add_argument("--ddp", action="store_true")
    ap.add_argument("--optim", choices=["sgd", "adam"], default="sgd")
    ap.add_argument("--persist-to", default=None)
    ap.add_argument("--persist-every", type=int, default=None)
    ap.add_argument("--no-ckpt", action="store_true", help="baseline: no Checkpointer at all")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    if args.ddp:
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Dropout(0.25),
                                torch.nn.Linear(64, 4))
    net = torch.nn.parallel.DistributedDataParallel(model) if args.ddp else model
    if args.optim == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.7)
    torch.manual_seed(1000 + rank)  # data and dropout differ per rank; restored by ckptrun
    ckpt = ckptrun.Checkpointer({"model": model, "optim": opt, "sched": sched},
                                persist_to=args.persist_to, persist_every=args.persist_every)
    if args.no_ckpt:
        ckpt = _NoCkpt()
    start = ckpt.restore()
    print(f"rank {rank} starts at step {start}", flush=True)
    for step in range(start, args.steps):
        x = torch.randn(16, 32)
        y = torch.randn(16, 4)
        loss = ((net(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        ckpt.save(step + 1)
        if step + 1 == args.kill_after and rank == 0:
            if args.wait_before_kill:
                ckpt.wait()
            os.kill(os.getpid(), signal.SIGKILL)
    ckpt.close()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    flat.numpy().tofile(args.out)
    if args.ddp:
        # torch 2.13 + gloo: destroying the group while the peer is already tearing its own
        # down intermittently aborts ("terminate called without an active exception") --
        # also without ckptrun; a barrier first lets both ranks leave together.
        dist.barrier()
        dist.destroy_process_group()


class _NoCkpt:
    def restore(self) -> int:
        return 0

    def save(self, step: int) -> None:
        pass

    def wait(self) -> None:
        pass

    def close(self) -> None:
        pass


if __name__ == "__main__":
    main()
