"""A user's script (test job): a char-level GPT trained with PyTorch Lightning the way people
write it -- train and val loaders with persistent prefetching workers, gradient accumulation,
clipping, a cosine schedule stepped per optimizer step, validation every 10 batches with a
synced metric printed on rank zero, DDP on CPU.

``--crash-at K`` SIGKILLs rank 1 as the batch after optimizer step K starts (after ckptrun's
snapshot of step K; first attempt only); ``--in-place`` runs the fit under
``@ckptrun.resilient``; ``--out F``: final weights."""

import argparse
import math
import os
import signal

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from char_corpus import BLOCK, Chunks, chars, data, n
from ckptrun.adapters.lightning import CkptrunCallback
from lightning.pytorch.utilities import rank_zero_info

import ckptrun


class GPT(L.LightningModule):
    def __init__(self, vocab, d=64, layers=2, heads=4, lr=3e-3, max_steps=36):
        super().__init__()
        self.save_hyperparameters()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(BLOCK, d)
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.1, batch_first=True,
                                           norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers)
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(BLOCK))

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.size(1), device=idx.device))
        return self.head(self.ln(self.blocks(x, mask=self.mask, is_causal=True)))

    def training_step(self, batch, i):
        x, y = batch
        loss = F.cross_entropy(self(x).flatten(0, 1), y.flatten())
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, i):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x).flatten(0, 1), y.flatten()), sync_dist=True)

    def on_validation_epoch_end(self):
        rank_zero_info(f"step {self.global_step}: val "
                       f"{self.trainer.callback_metrics['val_loss']:.4f}")

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.1)
        warm, total = 5, self.hparams.max_steps

        def f(s):
            if s < warm:
                return (s + 1) / warm
            return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, (s - warm) / (total - warm))))
        return {"optimizer": opt,
                "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.LambdaLR(opt, f),
                                 "interval": "step"}}


class Crash(L.Callback):
    def __init__(self, at):
        self.at = at

    def on_train_batch_start(self, trainer, module, batch, i):
        if trainer.global_step == self.at and trainer.global_rank == 1 \
                and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
            os.kill(os.getpid(), signal.SIGKILL)


def fit(a):
    L.seed_everything(1337, verbose=False)
    kw = dict(batch_size=8, num_workers=2, persistent_workers=True, prefetch_factor=4)
    train = torch.utils.data.DataLoader(Chunks(data[:n]), shuffle=True, **kw)
    val = torch.utils.data.DataLoader(Chunks(data[n:], limit=24), **kw)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    trainer = L.Trainer(max_epochs=a.epochs, accelerator="cpu", devices=world,
                        strategy="ddp" if world > 1 else "auto", accumulate_grad_batches=2,
                        gradient_clip_val=1.0, val_check_interval=10, log_every_n_steps=5,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False,
                        callbacks=[CkptrunCallback(), Crash(a.crash_at)])
    model = GPT(len(chars))
    trainer.fit(model, train, val)
    if a.out and trainer.global_rank == 0:
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, a.out)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--crash-at", type=int, default=-1)
    p.add_argument("--out", default="")
    p.add_argument("--in-place", action="store_true")
    a = p.parse_args()
    (ckptrun.resilient(fit) if a.in_place else fit)(a)
