"""Example (and test job): torchtitan's own training-state components under ckptrun.

torchtitan hands DCP its ``ModelWrapper`` (the model's state dict, DTensors under FSDP2),
its ``OptimizersContainer`` (a flat, FQN-keyed optimizer state) and its
``LRSchedulersContainer``.  Registering those very objects with ckptrun is all a torchtitan-
style loop adds::

    ckpt = ckptrun.Checkpointer({"model": ModelWrapper(model), "optimizer": optimizers,
                                 "lr_scheduler": lr_schedulers, "train_state": train_state})
    step = ckpt.restore()
    ...
    ckpt.save(step)

The model is a small FSDP2-sharded MLP with dropout (torchtitan's llama3 needs triton, a
GPU-sized install); gloo on the CPU; batches drawn from the step number.  ``--crash-at K``
SIGKILLs rank 1 after step K in the first attempt (``--in-place``: the other ranks recover
in their own process); ``--out F`` writes the full model and optimizer state from rank 0.
"""

from __future__ import annotations

import argparse
import os
import signal
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.fsdp import fully_shard
from torchtitan.components.checkpointer.base import ModelWrapper
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
from torchtitan.components.optimizer.optimizer import ParamGroupConfig

import ckptrun


@dataclass
class TrainState:
    """What torchtitan's trainer keeps beside the components (its ``train_state``)."""

    step: int = 0
    ntokens_seen: int = 0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--crash-at", type=int, default=-1)
    p.add_argument("--out", default="")
    p.add_argument("--in-place", action="store_true")
    a = p.parse_args()
    (ckptrun.resilient(train) if a.in_place else train)(a)


def train(a: argparse.Namespace) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 33), nn.GELU(), nn.Dropout(0.1), nn.Linear(33, 5))
    for layer in (model[0], model[3]):
        fully_shard(layer)
    fully_shard(model)
    optimizers = OptimizersContainer(
        OptimizersContainer.Config(
            param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW",
                                           optimizer_kwargs={"lr": 1e-2, "weight_decay": 0.1})],
            implementation="for-loop"),
        model_parts=[model])
    lr_schedulers = LRSchedulersContainer(optimizers, lambda s: min(1.0, (s + 1) / 4))
    train_state = TrainState()
    torch.manual_seed(1 + rank)  # dropout differs per rank, as in a real job
    ckpt = ckptrun.Checkpointer({"model": ModelWrapper(model), "optimizer": optimizers,
                                 "lr_scheduler": lr_schedulers, "train_state": train_state})
    start = ckpt.restore()
    print(f"rank {rank}: start {start}", flush=True)
    while train_state.step < a.steps:
        g = torch.Generator().manual_seed(100 * train_state.step + rank)
        x = torch.randn(4, 8, generator=g)
        loss = (model(x) - x[:, :5].sin()).pow(2).mean()
        optimizers.zero_grad()
        loss.backward()
        optimizers.step()
        lr_schedulers.step()
        train_state.step += 1
        train_state.ntokens_seen += x.numel()
        ckpt.save(train_state.step)
        if train_state.step == a.crash_at and rank == 1 \
                and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            os.kill(os.getpid(), signal.SIGKILL)
    ckpt.close()
    inner = optimizers.optimizers[0]
    msd, osd = get_state_dict(model, inner, options=StateDictOptions(full_state_dict=True))
    if a.out and rank == 0:
        torch.save({"model": msd, "optim": osd["state"], "start": start,
                    "lr": [g["lr"] for g in inner.param_groups],
                    "ntokens_seen": train_state.ntokens_seen}, a.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
