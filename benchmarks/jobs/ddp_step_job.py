"""DDP step time of a fresh process and of one that restored a snapshot (3+ ranks, gloo).

Launched by ``benchmarks/ddp_exact.py`` under ``torch.distributed.run``.  Two models of the
same shape train in alternating blocks of steps in the same processes: ``plain`` is DDP as a
fresh process runs it (nothing of ckptrun on its path), ``restored`` is DDP given the
settled bucket layout back as a restore does (``ckptrun.adapters.ddp.give_back_layout``:
its reducer built again in those buckets, or the comm hook where that cannot be done; the
row names which).  Rank 0 writes ``{"plain": [block medians s], "restored": [...],
"param_bytes": n}`` to ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from ckptrun.adapters.ddp import give_back_layout, reducer_params, settled_layout


def build(width: int, layers: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def step(ddp, opt, x) -> None:
    opt.zero_grad(set_to_none=False)
    ddp(x).square().mean().backward()
    opt.step()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--block-steps", type=int, default=5)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    x = torch.randn(args.batch, args.width)
    runs = {}
    plain = nn.parallel.DistributedDataParallel(build(args.width, args.layers))
    plain_opt = torch.optim.SGD(plain.parameters(), lr=1e-3)
    for _ in range(3):  # DDP settles its buckets after the first iteration (and says so later)
        step(plain, plain_opt, x)
    layout = settled_layout(plain, len(reducer_params(plain)))
    restored = nn.parallel.DistributedDataParallel(build(args.width, args.layers))
    how = give_back_layout(restored, layout)
    restored_opt = torch.optim.SGD(restored.parameters(), lr=1e-3)
    step(restored, restored_opt, x)  # the first iteration in the settled layout: not timed
    runs = {"plain": (plain, plain_opt), "restored": (restored, restored_opt)}
    medians = {name: [] for name in runs}
    for _ in range(args.blocks):
        for name, (ddp, opt) in runs.items():
            times = []
            for _ in range(args.block_steps):
                dist.barrier()
                t0 = time.perf_counter()
                step(ddp, opt, x)
                times.append(time.perf_counter() - t0)
            medians[name].append(statistics.median(times))
    if dist.get_rank() == 0:
        nbytes = sum(p.numel() * p.element_size() for p in plain.parameters())
        with open(args.out, "w") as f:
            json.dump({**medians, "param_bytes": nbytes, "buckets": len(layout or []),
                       "how": how}, f)
    dist.barrier()
    os._exit(0)  # DDP holds the gloo group in a reference cycle: no teardown at shutdown


if __name__ == "__main__":
    main()
