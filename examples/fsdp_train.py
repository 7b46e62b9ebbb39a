"""Example (and adapter test job) -- FSDP2 job for the adapter tests: fully_shard MLP, AdamW, dropout, gloo on CPU.

``--steps N`` trains to step N (resuming from whatever ``Checkpointer.restore()`` finds);
``--state dcp`` registers the model and optimizer the way torchtitan does -- wrappers whose
``state_dict()``/``load_state_dict()`` are DCP's ``get_/set_model_state_dict`` and
``get_/set_optimizer_state_dict`` (DTensor values, a flattened optimizer state) -- instead
of the module and optimizer themselves;
``--crash-at K`` SIGKILLs rank 1 after step K in the first attempt (``--in-place``: rank 0
recovers in its own process, ``@ckptrun.resilient``); ``--out F`` writes every
rank's full (gathered) model and optimizer state, from rank 0, with ``torch.save``.
"""

from __future__ import annotations

import argparse
import os
import signal

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import fully_shard

import ckptrun


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--crash-at", type=int, default=-1)
    p.add_argument("--out", default="")
    p.add_argument("--persist-to", default=None)
    p.add_argument("--persist-every", type=int, default=None)
    p.add_argument("--state", choices=("modules", "dcp"), default="modules",
                   help="register the module and optimizer, or DCP state_dict wrappers")
    p.add_argument("--in-place", action="store_true",
                   help="@ckptrun.resilient: a rank that did not fail recovers in its process")
    a = p.parse_args()
    (ckptrun.resilient(train) if a.in_place else train)(a)


class ModelState:
    """A model as torchtitan's ``ModelWrapper`` hands it to DCP (DTensor values)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict:
        return get_model_state_dict(self.model)

    def load_state_dict(self, sd: dict) -> None:
        set_model_state_dict(self.model, sd)


class OptimState:
    """An optimizer as torchtitan's ``OptimizersContainer`` hands it to DCP (flattened)."""

    options = StateDictOptions(flatten_optimizer_state_dict=True)

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        self.model, self.opt = model, opt

    def state_dict(self) -> dict:
        return get_optimizer_state_dict(self.model, self.opt, options=self.options)

    def load_state_dict(self, sd: dict) -> None:
        # a fresh optimizer has no state yet for DCP to load into (torch asks for a device):
        # getting its state dict creates it, as torchtitan's init_optim_state does
        get_optimizer_state_dict(self.model, self.opt, options=self.options)
        set_optimizer_state_dict(self.model, self.opt, sd, options=self.options)


def train(a: argparse.Namespace) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 33), nn.ReLU(), nn.Dropout(0.1), nn.Linear(33, 5))
    for layer in (model[0], model[3]):
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(1 + rank)
    state = {"model": model, "optim": opt} if a.state == "modules" else \
        {"model": ModelState(model), "optim": OptimState(model, opt)}
    ckpt = ckptrun.Checkpointer(state, persist_to=a.persist_to, persist_every=a.persist_every)
    start = ckpt.restore()
    print(f"rank {rank}/{world}: start {start}", flush=True)
    for step in range(start, a.steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(4, 8, generator=g)
        loss = (model(x) - x[:, :5].sin()).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        ckpt.save(step + 1)
        if step + 1 == a.crash_at and rank == 1 \
                and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            os.kill(os.getpid(), signal.SIGKILL)
    ckpt.close()
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    if a.out and rank == 0:
        torch.save({"model": msd, "optim": osd["state"], "start": start}, a.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
