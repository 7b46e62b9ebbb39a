"""A GPT training loop written the way open-source trainers write it, under ckptrun.

What it does that makes exact resume hard, and how the Checkpointer is told about it:

* the next batch is fetched *before* the step ends (``X, Y = get_batch("train")`` after the
  backward), so the batch the next step uses must be in the snapshot: ``batch=(X, Y)``;
* plain numbers the loop rebinds (``best_val_loss``, ``iter_num``) are given at save time:
  the Checkpointer would keep the first value of a number registered in its dict;
* gradient accumulation under ``no_sync``, an LR schedule computed from ``iter_num``, a
  ``GradScaler`` (inactive on CPU, still checkpointed), dropout, batches drawn from torch's
  global RNG (captured by ckptrun), and an evaluation on rank 0 only while the other ranks
  wait in the next all-reduce.

Runs under ``ckptrun``, ``torchrun`` or ``python``::

    ckptrun --standalone --nproc-per-node 3 examples/gpt_train.py --iters 40
    ckptrun --standalone --nproc-per-node 3 examples/gpt_train.py --iters 40 --crash-at 25

The data is a deterministic synthetic token stream, so nothing is downloaded.
"""

from __future__ import annotations

import argparse
import math
import os
import signal

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn import functional as F

import ckptrun


class Block(nn.Module):
    def __init__(self, d: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, dropout=dropout, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d),
                                 nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.size(1)
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, block: int, d: int, layers: int, heads: int,
                 dropout: float) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(block, d)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d, heads, dropout) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.tok(idx) + self.pos(torch.arange(idx.size(1))))
        for b in self.blocks:
            x = b(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--eval-interval", type=int, default=10)
    p.add_argument("--accum", type=int, default=2, help="gradient accumulation steps")
    p.add_argument("--crash-at", type=int, default=-1, help="SIGKILL rank 1 after this iter")
    p.add_argument("--out", default="")
    args = p.parse_args()

    ddp = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if ddp:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if ddp else 0
    torch.manual_seed(1337)  # the same model on every rank
    vocab, block, batch = 65, 32, 8
    data = torch.randint(vocab, (20000,), generator=torch.Generator().manual_seed(0))
    train_data, val_data = data[:18000], data[18000:]

    def get_batch(split: str):
        d = train_data if split == "train" else val_data
        ix = torch.randint(len(d) - block, (batch,))  # the global RNG: in every snapshot
        return (torch.stack([d[i:i + block] for i in ix]),
                torch.stack([d[i + 1:i + 1 + block] for i in ix]))

    model = GPT(vocab, block, d=64, layers=2, heads=4, dropout=0.1)
    raw_model = model
    if ddp:
        model = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(raw_model.parameters(), lr=1e-3, weight_decay=0.1)
    scaler = torch.amp.GradScaler("cpu", enabled=False)  # fp16 only on GPUs
    torch.manual_seed(1337 + rank)  # each rank its own batches and dropout

    def lr_at(it: int) -> float:  # warmup, then cosine decay: a pure function of iter_num
        if it < 5:
            return 1e-3 * (it + 1) / 5
        return 1e-4 + 0.5 * (1 + math.cos(math.pi * min(1.0, (it - 5) / args.iters))) * 9e-4

    @torch.no_grad()
    def estimate_loss() -> float:
        raw_model.eval()
        losses = [raw_model(*get_batch("val")).item() for _ in range(4)]
        raw_model.train()
        return sum(losses) / len(losses)

    ckpt = ckptrun.Checkpointer({"model": raw_model, "optimizer": optimizer, "scaler": scaler})
    iter_num = ckpt.restore()  # 0: a fresh start
    best_val_loss = ckpt.get("best_val_loss", 1e9)
    X, Y = ckpt.get("batch") or get_batch("train")  # the batch fetched ahead, if resumed
    while iter_num < args.iters:
        for g in optimizer.param_groups:
            g["lr"] = lr_at(iter_num)
        if iter_num % args.eval_interval == 0 and rank == 0:  # the others wait in all-reduce
            val = estimate_loss()
            if val < best_val_loss:
                best_val_loss = val
            print(f"iter {iter_num}: val loss {val:.4f} (best {best_val_loss:.4f})", flush=True)
        for micro in range(args.accum):
            sync = micro == args.accum - 1
            with (model.no_sync() if ddp and not sync else torch.enable_grad()):
                loss = model(X, Y) / args.accum
                X, Y = get_batch("train")  # prefetch the next batch
                scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        iter_num += 1
        ckpt.save(iter_num, best_val_loss=best_val_loss, batch=(X, Y))
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if iter_num == args.crash_at and rank == 1 and first_attempt:
            os.kill(os.getpid(), signal.SIGKILL)
    ckpt.close()
    if args.out and rank == 0:
        torch.save({"weights": {k: v.clone() for k, v in raw_model.state_dict().items()},
                    "best_val_loss": torch.tensor(best_val_loss, dtype=torch.float64)},
                   args.out)
    if ddp:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
