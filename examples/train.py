"""A small, deterministic DDP training job that uses ckptrun's Python API.

Runs unchanged under ``ckptrun``, ``torchrun`` or plain ``python``::

    ckptrun --standalone --nproc-per-node 2 examples/train.py --steps 60
    ckptrun --standalone --nproc-per-node 2 examples/train.py --steps 60 --crash-at 25

``--in-place`` runs the training under ``@ckptrun.resilient``: the ranks that did not fail
recover in their own processes.  ``--crash-at N`` kills rank ``--crash-rank`` with SIGKILL after step N, ``--hang-at N`` stops it
with SIGSTOP, ``--raise-at N`` raises an exception -- each only in the first attempt, so the
restarted job runs through.  ``--out FILE`` writes the final weights (rank 0) so a run with
failures can be compared bitwise with one without.  ``--device cuda`` trains on the GPU
(rank ``LOCAL_RANK`` on GPU ``LOCAL_RANK % count``; NCCL where every rank has a GPU of its
own, else gloo, which reduces CUDA tensors too).
"""

from __future__ import annotations

import argparse
import os
import signal
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import ckptrun


def build_model(width: int = 512) -> nn.Module:
    """Wide enough (1.1 MiB at 512) that DDP reduces it in more than one bucket."""
    torch.manual_seed(0)  # identical initial weights on every rank
    return nn.Sequential(
        nn.Linear(32, width), nn.ReLU(), nn.Dropout(0.1), nn.Linear(width, width), nn.ReLU(),
        nn.Dropout(0.1), nn.Linear(width, 1),
    )


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic data that depends only on (step, rank): exact resume needs no data state."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, 32, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def place(kind: str, backend: str = "auto") -> tuple[torch.device, str]:
    """The device this rank trains on and the process group's backend."""
    if kind == "cpu":
        return torch.device("cpu"), "gloo" if backend == "auto" else backend
    # bitwise-equal runs need cuBLAS's deterministic workspace, set before its first use
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    count = torch.cuda.device_count()
    if count == 0:
        raise SystemExit("--device cuda: this machine has no GPU")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local % count)
    torch.cuda.set_device(device)
    own_gpu = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) <= count
    if backend == "auto":
        backend = "nccl" if own_gpu else "gloo"
    return device, backend


def inject_failure(args: argparse.Namespace, step: int, rank: int) -> None:
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0" or rank != args.crash_rank:
        return
    if step == args.crash_at:
        print(f"[demo] rank {rank}: injecting SIGKILL after step {step}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    if step == args.hang_at:
        print(f"[demo] rank {rank}: injecting a hang (SIGSTOP) after step {step}", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
    if step == args.raise_at:
        raise RuntimeError(f"injected failure after step {step}")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--crash-at", type=int, default=-1)
    p.add_argument("--hang-at", type=int, default=-1)
    p.add_argument("--raise-at", type=int, default=-1)
    p.add_argument("--crash-rank", type=int, default=1)
    p.add_argument("--step-time", type=float, default=0.0, help="extra sleep per step (s)")
    p.add_argument("--width", type=int, default=512, help="hidden width of the model")
    p.add_argument("--out", default="")
    p.add_argument("--ballast-mib", type=int, default=0,
                   help="extra state (MiB) so that each snapshot takes a while to copy")
    p.add_argument("--setup-s", type=float, default=0.0,
                   help="seconds of per-process start-up before training (a tokenizer, a "
                        "dataset index), outside the function --in-place wraps")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the model, batches and ballast live")
    p.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto",
                   help="the process group's backend (auto: NCCL where every rank has a GPU "
                        "of its own, else gloo)")
    p.add_argument("--in-place", action="store_true",
                   help="@ckptrun.resilient: after a failure elsewhere this rank recovers "
                        "in its own process instead of restarting")
    return p.parse_args()


def train(args: argparse.Namespace) -> None:
    """Everything of one run: process group, model, loop (what @ckptrun.resilient wraps)."""
    distributed = "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1
    device, backend = place(args.device, args.backend)
    if distributed:
        dist.init_process_group(backend)
    rank = dist.get_rank() if distributed else 0

    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    print(f"[demo] rank {rank}: attempt {attempt} in pid {os.getpid()}", flush=True)
    model = build_model(args.width).to(device)
    # plain DDP: ckptrun keeps a resumed run bitwise equal to an uninterrupted one at any
    # world size (it gives a restored process the bucket layout DDP had settled on)
    ids = [device.index] if device.type == "cuda" else None
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=ids) if distributed else model
    optim = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=20, gamma=0.5)
    torch.manual_seed(1 + rank)  # per-rank dropout stream; captured in every snapshot

    state = {"model": model, "optim": optim, "sched": sched}
    ballast = torch.zeros(args.ballast_mib << 18, device=device)  # float32: 4 bytes each
    if args.ballast_mib:
        state["ballast"] = ballast
    ckpt = ckptrun.Checkpointer(state)
    start = ckpt.restore()
    if start:
        print(f"[demo] rank {rank}: resumed at step {start}", flush=True)
    for step in range(start, args.steps):
        x, y = (t.to(device) for t in batch(step, rank))
        loss = nn.functional.mse_loss(ddp(x), y)
        optim.zero_grad()
        loss.backward()
        optim.step()
        sched.step()
        ballast.add_(1.0)
        ckpt.save(step + 1)
        if rank == 0 and (step + 1) % 10 == 0:
            print(f"[demo] step {step + 1}/{args.steps} loss {loss.item():.5f}", flush=True)
        if args.step_time:
            time.sleep(args.step_time)
        inject_failure(args, step + 1, rank)
    ckpt.close()

    if args.out and rank == 0:
        torch.save({k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
                   args.out)
    if distributed:
        # gloo can abort in its teardown when one rank destroys the group while another is
        # still in flight (seen with plain torchrun too): meet first
        dist.barrier()
        dist.destroy_process_group()


def main() -> None:
    args = parse_args()
    if args.setup_s:  # the process's own start-up, outside the training function
        time.sleep(args.setup_s)
        print(f"[demo] set-up done in pid {os.getpid()}", flush=True)
    (ckptrun.resilient(train) if args.in_place else train)(args)


if __name__ == "__main__":
    main()
