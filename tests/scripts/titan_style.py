"""A Llama-style training loop written the way torchtitan's trainer is, under ckptrun.

What it has that a user brings from torchtitan: a small Llama (RMSNorm, rotary embeddings,
SwiGLU) with each transformer block ``torch.compile``d and sharded with FSDP2's ``fully_shard``,
a ``torchdata`` ``StatefulDataLoader`` with loader workers (its position is in the snapshot
through its own ``state_dict``), a warm-up/decay ``LambdaLR``, gradient clipping over the
sharded gradients, and a ``TrainState`` object (step, epoch, the losses it logged) saved
through ``state_dict``/``load_state_dict``.

``--steps N``; ``--crash-at K`` SIGKILLs rank 1 after step K in the first attempt;
``--in-place`` runs the training under ``@ckptrun.resilient``; ``--out F``: rank 0 writes
the full model, the optimizer state and the logged losses with ``torch.save``, and how many
Python frames ``torch.compile`` compiled in its last call of the training function (a
survivor that recovered in place keeps its code).
"""

from __future__ import annotations

import argparse
import math
import os
import signal
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.fsdp import fully_shard
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

import ckptrun


class RMSNorm(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


def rotary(x: torch.Tensor) -> torch.Tensor:
    t, d = x.shape[-2], x.shape[-1]
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    ang = torch.outer(torch.arange(t, dtype=torch.float32), inv)
    cos, sin = ang.cos(), ang.sin()
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), -1).flatten(-2)


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.attn_norm, self.ffn_norm = RMSNorm(d), RMSNorm(d)
        self.wqkv, self.wo = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
        self.w1, self.w3 = nn.Linear(d, 2 * d, bias=False), nn.Linear(d, 2 * d, bias=False)
        self.w2 = nn.Linear(2 * d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.wqkv(self.attn_norm(x)).view(b, t, 3, self.heads, -1).unbind(2)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(rotary(q), rotary(k), v, is_causal=True)
        x = x + self.wo(y.transpose(1, 2).reshape(b, t, d))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Llama(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.layers = nn.ModuleDict({str(i): Block(d, heads) for i in range(layers)})
        self.norm, self.out = RMSNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.tok(idx)
        for layer in self.layers.values():
            h = layer(h)
        return self.out(self.norm(h))


class Tokens(Dataset):
    """A deterministic token stream cut into (input, target) windows."""

    def __init__(self, n: int, seq: int, vocab: int) -> None:
        g = torch.Generator().manual_seed(1234)
        self.data = torch.randint(0, vocab, (n * seq + 1,), generator=g)
        self.n, self.seq = n, seq

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.data[i * self.seq: (i + 1) * self.seq + 1]
        return w[:-1], w[1:]


@dataclass
class TrainState:
    """torchtitan keeps its step and logged losses in an object like this."""

    step: int = 0
    epoch: int = 0
    losses: list = field(default_factory=list)

    def state_dict(self) -> dict:
        return {"step": self.step, "epoch": self.epoch, "losses": list(self.losses)}

    def load_state_dict(self, sd: dict) -> None:
        self.step, self.epoch = int(sd["step"]), int(sd["epoch"])
        self.losses = list(sd["losses"])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--crash-at", type=int, default=-1)
    p.add_argument("--in-place", action="store_true")
    p.add_argument("--out", default="")
    a = p.parse_args()
    (ckptrun.resilient(train) if a.in_place else train)(a)


def train(a: argparse.Namespace) -> None:
    frames = counters["frames"]["ok"]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    vocab, warmup = 96, 3
    model = Llama(vocab, d=32, layers=2, heads=4)
    for block in model.layers.values():
        block.compile()
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / warmup, 0.5 * (1 + math.cos(math.pi * s / a.steps))))
    sampler = torch.utils.data.distributed.DistributedSampler(
        Tokens(32 * world, 16, vocab), num_replicas=world, rank=rank, shuffle=True, seed=7)
    loader = StatefulDataLoader(sampler.dataset, batch_size=4, sampler=sampler, num_workers=2,
                                persistent_workers=True)
    state = TrainState()
    ckpt = ckptrun.Checkpointer({"model": model, "optim": opt, "lr": sched,
                                 "dataloader": loader, "train_state": state})
    ckpt.restore()
    print(f"rank {rank}/{world}: start at step {state.step}", flush=True)
    # the epoch is kept in the state, not derived from the step: a StatefulDataLoader restored
    # after the last batch of an epoch yields nothing before the next epoch starts
    while state.step < a.steps:
        sampler.set_epoch(state.epoch)
        for x, y in loader:
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            state.step += 1
            state.losses.append(round(loss.item(), 6))
            ckpt.save(state.step)
            if state.step == a.crash_at and rank == 1 \
                    and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
                os.kill(os.getpid(), signal.SIGKILL)
            if state.step >= a.steps:
                break
        else:
            state.epoch += 1
    ckpt.close()
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    if a.out and rank == 0:
        torch.save({"model": msd, "optim": osd["state"], "losses": state.losses,
                    "frames": counters["frames"]["ok"] - frames}, a.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
