"""Example (and adapter test job) -- Lightning job for the adapter tests: a small MLP LightningModule, synthetic data with a
shuffling sampler, dropout, AdamW + StepLR, DDP on CPU (gloo), 2 epochs.  ``--crash-at K``
SIGKILLs rank 1 after optimizer step K in the first attempt (``--in-place``: the fit runs
under ``@ckptrun.resilient`` and rank 0 recovers in its own process); ``--out F``: final
weights."""

from __future__ import annotations

import argparse
import os
import signal

import lightning as L
import torch
import torch.nn as nn
from ckptrun.adapters.lightning import CkptrunCallback

import ckptrun


class Tiny(L.LightningModule):
    def __init__(self, crash_at: int = -1) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 1))
        self.crash_at = crash_at

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def on_train_batch_start(self, batch, batch_idx):
        if self.global_step == self.crash_at and self.global_rank == 1 \
                and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            os.kill(os.getpid(), signal.SIGKILL)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--crash-at", type=int, default=-1)
    p.add_argument("--out", default="")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--no-ckpt", action="store_true")
    p.add_argument("--in-place", action="store_true",
                   help="@ckptrun.resilient: a rank that did not fail recovers in its process")
    a = p.parse_args()
    (ckptrun.resilient(fit) if a.in_place else fit)(a)


def fit(a: argparse.Namespace) -> None:
    """One fit: a fresh Trainer (it forms the process group) and module each call."""
    L.seed_everything(1, verbose=False)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(48, 8, generator=g)
    data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True).sin())
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    trainer = L.Trainer(max_epochs=a.epochs, accelerator="cpu", devices=world,
                        strategy="ddp" if world > 1 else "auto", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False,
                        callbacks=[] if a.no_ckpt else [CkptrunCallback()])
    model = Tiny(a.crash_at)
    trainer.fit(model, loader)
    if a.out and trainer.global_rank == 0:
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, a.out)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # gloo teardown can abort when one rank exits first
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
