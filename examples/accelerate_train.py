"""Example (and test job) -- a plain 🤗 Accelerate loop under ckptrun: ``Accelerator()``,
``prepare`` of model, optimizer, scheduler and a shuffling loader, gradient accumulation,
per-step memory snapshots through ``ckptrun.Checkpointer``.

    ckptrun --standalone --nproc-per-node 2 examples/accelerate_train.py --crash-at 7

``--crash-at K`` SIGKILLs rank 1 after optimizer step K in the first attempt; ``--in-place``
runs the training under ``@ckptrun.resilient`` (rank 0 recovers in its own process: a new
``Accelerator`` in the same process forms the new group); ``--out F`` writes the final
weights (rank 0).  Resuming mid-epoch skips the consumed batches with accelerate's
``skip_first_batches``; the loader's shuffle order comes from the seed and the epoch
(``use_seedable_sampler``, ``set_epoch``).
"""

from __future__ import annotations

import argparse
import os
import signal

import torch
import torch.nn as nn
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, set_seed

import ckptrun

ACCUM = 2


def train(a: argparse.Namespace) -> None:
    """One training: the Accelerator (it forms the process group), model, loop."""
    # the shuffle order from (seed, epoch), not from the global RNG of the moment the
    # iterator is made: a resume mid-epoch makes it at another moment than the first run
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUM,
                              dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    set_seed(1)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(96, 8, generator=g)
    data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True).sin())
    # its own generator: making an iterator draws a seed, from the global RNG without one --
    # and a resumed epoch makes its iterator after the restore, not before the dropout
    # masks of its first steps as the first run did
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True,
                                         generator=torch.Generator().manual_seed(2))
    model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.8)
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)

    position = {"step": 0}  # optimizer steps done; the loop rebinds plain numbers from it
    ckpt = ckptrun.Checkpointer({"model": accelerator.unwrap_model(model), "optim": opt.optimizer,
                                 "sched": sched.scheduler, "position": position})
    ckpt.restore()
    step = position["step"]
    per_epoch = len(loader) // ACCUM
    for epoch in range(step // per_epoch, a.epochs):
        loader.set_epoch(epoch)
        done = step - epoch * per_epoch  # optimizer steps of this epoch already taken
        batches = accelerator.skip_first_batches(loader, done * ACCUM) if done else loader
        for xb, yb in batches:
            with accelerator.accumulate(model):
                loss = nn.functional.mse_loss(model(xb), yb)
                accelerator.backward(loss)
                opt.step()
                sched.step()
                opt.zero_grad()
            if not accelerator.sync_gradients:
                continue
            step += 1
            position["step"] = step
            ckpt.save(step)
            if step == a.crash_at and accelerator.process_index == 1 \
                    and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
                os.kill(os.getpid(), signal.SIGKILL)
        if accelerator.is_main_process:
            print(f"epoch {epoch}: loss {loss.item():.4f}", flush=True)
    ckpt.close()
    if a.out and accelerator.is_main_process:
        torch.save({k: v.detach().clone()
                    for k, v in accelerator.unwrap_model(model).state_dict().items()}, a.out)
    accelerator.wait_for_everyone()
    accelerator.end_training()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--crash-at", type=int, default=-1)
    p.add_argument("--out", default="")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--in-place", action="store_true",
                   help="@ckptrun.resilient: a rank that did not fail recovers in its process")
    a = p.parse_args()
    (ckptrun.resilient(train) if a.in_place else train)(a)


if __name__ == "__main__":
    main()
