"""A user's script (test job): a char-level GPT trained with 🤗 Accelerate the way people write
it -- a loader with two persistent workers prefetching, gradient accumulation, clipping, a
cosine schedule with warm-up set by hand each step, evaluation and printing on the main
process only, plain counters rebound from the checkpointed dict.

``--crash-at K`` SIGKILLs rank 1 right after its snapshot of step K (first attempt only);
``--in-place`` runs the training under ``@ckptrun.resilient``; ``--out F``: final weights."""

import argparse
import math
import os
import signal
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, set_seed
from char_corpus import BLOCK, Chunks, chars, data, n

import ckptrun

train_data, val_data = data[:n], data[n:]


class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, h, dropout=0.1, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d),
                                 nn.Dropout(0.1))

    def forward(self, x):
        T = x.size(1)
        mask = torch.triu(torch.ones(T, T, dtype=torch.bool), 1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab, d=64, layers=2, heads=4):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(BLOCK, d)
        self.blocks = nn.Sequential(*[Block(d, heads) for _ in range(layers)])
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, idx, targets=None):
        x = self.tok(idx) + self.pos(torch.arange(idx.size(1)))
        logits = self.head(self.ln(self.blocks(x)))
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1),
                                                            targets.flatten())
        return logits, loss


def get_lr(it, warmup=10, max_it=40, lr=3e-3):
    if it < warmup:
        return lr * (it + 1) / warmup
    return 0.1 * lr + 0.45 * lr * (1 + math.cos(math.pi * min(1.0, (it - warmup) / (max_it - warmup))))


@torch.no_grad()
def evaluate(model):
    model.eval()
    val = Chunks(val_data)
    losses = [model(val[i][0].unsqueeze(0), val[i][1].unsqueeze(0))[1].item() for i in range(20)]
    model.train()
    return sum(losses) / len(losses)


def train(args):
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=args.accum,
                              dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    set_seed(1337)
    model = GPT(len(chars))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    loader = torch.utils.data.DataLoader(Chunks(train_data), batch_size=8, shuffle=True,
                                         num_workers=2, persistent_workers=True, prefetch_factor=4,
                                         generator=torch.Generator().manual_seed(7))
    model, opt, loader = accelerator.prepare(model, opt, loader)
    state = {"iter_num": 0, "best_val_loss": 1e9}
    ckpt = ckptrun.Checkpointer({"model": accelerator.unwrap_model(model),
                                 "optimizer": opt.optimizer, "state": state})
    if ckpt.restore() and accelerator.is_main_process:
        print(f"resumed at iter {state['iter_num']}", flush=True)
    iter_num, best_val_loss = state["iter_num"], state["best_val_loss"]
    per_epoch = len(loader) // args.accum
    t0 = time.time()
    for epoch in range(iter_num // per_epoch, args.epochs):
        loader.set_epoch(epoch)
        done = iter_num - epoch * per_epoch
        batches = accelerator.skip_first_batches(loader, done * args.accum) if done else loader
        for x, y in batches:
            with accelerator.accumulate(model):
                _, loss = model(x, y)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                for g in opt.param_groups:
                    g["lr"] = get_lr(iter_num)
                opt.step()
                opt.zero_grad(set_to_none=True)
            if not accelerator.sync_gradients:
                continue
            iter_num += 1
            if iter_num % args.eval_interval == 0 and accelerator.is_main_process:
                val = evaluate(accelerator.unwrap_model(model))
                best_val_loss = min(best_val_loss, val)
                print(f"iter {iter_num}: train {loss.item():.4f} val {val:.4f} "
                      f"({time.time() - t0:.1f}s)", flush=True)
            state.update(iter_num=iter_num, best_val_loss=best_val_loss)
            ckpt.save(iter_num)
            if iter_num == args.crash_at and accelerator.process_index == 1 \
                    and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
                os.kill(os.getpid(), signal.SIGKILL)
    ckpt.close()
    if accelerator.is_main_process and args.out:
        torch.save({k: v.detach().clone()
                    for k, v in accelerator.unwrap_model(model).state_dict().items()}, args.out)
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--eval-interval", type=int, default=5)
    p.add_argument("--crash-at", type=int, default=-1)
    p.add_argument("--out", default="")
    p.add_argument("--in-place", action="store_true")
    a = p.parse_args()
    (ckptrun.resilient(train) if a.in_place else train)(a)
