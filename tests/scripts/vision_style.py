"""An image-classification loop written the way torchvision's reference scripts are, under
ckptrun.

What it has that such a user brings: a small CNN with BatchNorm and dropout under DDP, an
exponential moving average of the weights (``torch.optim.swa_utils.AveragedModel``), SGD
with momentum and ``OneCycleLR``, a ``DistributedSampler`` told the epoch with
``set_epoch`` before each epoch, and a torchdata ``StatefulDataLoader`` whose 2 persistent
workers apply random flips and noise drawn from the worker's own RNG -- kept in the
dataset's ``state_dict()`` so a restore continues each worker's stream (docs/exact.md §4).

``--epochs N`` (8 batches a rank each at 2 ranks); in the first attempt, on rank 1 after
its step K: ``--crash-at K`` SIGKILLs the rank, ``--kill-worker-at K`` SIGKILLs one of its
loader workers (the rank then fails on its next batch), ``--stop-worker-at K`` SIGSTOPs one
(the rank waits for that worker's batch for ever: a hang whose culprit is the rank's own
child); ``--in-place`` runs the training under ``@ckptrun.resilient``; ``--out F``: rank 0
writes the model and the EMA model with ``torch.save``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import Dataset, DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

import ckptrun

BATCH = 8


class Images(Dataset):
    """Synthetic 3x16x16 images; the augmentation draws from the worker's global RNG."""

    def __len__(self) -> int:
        return 128

    def __getitem__(self, i: int):
        x = torch.randn(3, 16, 16, generator=torch.Generator().manual_seed(i))
        if torch.rand(()) < 0.5:
            x = x.flip(-1)
        return x + 0.05 * torch.randn_like(x), i % 10

    # torchdata calls these inside each worker, after the batch the state belongs to
    def state_dict(self) -> dict:
        return {"rng": torch.get_rng_state()}

    def load_state_dict(self, state: dict) -> None:
        torch.set_rng_state(state["rng"])


def net() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1, stride=2), nn.BatchNorm2d(32), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.2), nn.Linear(32, 10))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--crash-at", type=int, default=-1)
    p.add_argument("--kill-worker-at", type=int, default=-1)
    p.add_argument("--stop-worker-at", type=int, default=-1)
    p.add_argument("--in-place", action="store_true")
    p.add_argument("--loader-outside", action="store_true",
                   help="build the loader (and start its workers) once per process, outside "
                        "the training function")
    p.add_argument("--out", default="")
    p.add_argument("--pids", default="", help="rank 0 appends, at each attempt's first "
                   "batch, the attempt and its pid to this file (JSON lines)")
    a = p.parse_args()
    made = loader_parts() if a.loader_outside else None
    (ckptrun.resilient(train) if a.in_place else train)(a, made)


def loader_parts() -> tuple:
    """The dataset, its sampler and the loader with its persistent workers."""
    data = Images()
    # rank and world from the environment: the group does not exist yet outside the function
    sampler = DistributedSampler(data, num_replicas=int(os.environ["WORLD_SIZE"]),
                                 rank=int(os.environ["RANK"]), shuffle=True, seed=1)
    loader = StatefulDataLoader(data, batch_size=BATCH, sampler=sampler, num_workers=2,
                                persistent_workers=True)
    return data, sampler, loader


def train(a: argparse.Namespace, made=None) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = net()
    ddp = nn.parallel.DistributedDataParallel(model)
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    data, sampler, loader = made or loader_parts()
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, 0.05, total_steps=a.epochs * len(loader))
    ckpt = ckptrun.Checkpointer({"model": ddp, "ema": ema, "optim": opt, "sched": sched,
                                 "data": loader})
    step = start = ckpt.restore()
    epoch = ckpt.get("epoch", 0)
    first = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    while epoch < a.epochs:
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = F.cross_entropy(ddp(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            ema.update_parameters(model)
            step += 1
            if rank == 0 and a.pids and step == start + 1:
                with open(a.pids, "a") as f:
                    f.write(json.dumps({"attempt": os.environ["TORCHELASTIC_RESTART_COUNT"],
                                        "pid": os.getpid()}) + "\n")
            ckpt.save(step, epoch=epoch)
            if rank == 1 and first:
                fail(a, step, loader)
        epoch += 1
    if rank == 0 and a.out:
        torch.save({"model": model.state_dict(), "ema": ema.state_dict()}, a.out)
    ckpt.close()
    dist.destroy_process_group()


def fail(a: argparse.Namespace, step: int, loader: StatefulDataLoader) -> None:
    """The injected failure of rank 1's first attempt after ``step``."""
    if step == a.crash_at:
        os.kill(os.getpid(), signal.SIGKILL)
    for at, sig in ((a.kill_worker_at, signal.SIGKILL), (a.stop_worker_at, signal.SIGSTOP)):
        if step == at:
            os.kill(loader._iterator._workers[0].pid, sig)
            time.sleep(0.2)  # the next batch is that worker's or waits behind it


if __name__ == "__main__":
    main()
