"""3+ ranks: the averaged gradients of one batch under two different DDP bucket layouts.

Writes ``{"exact": bool, "plain": bool, "correct": bool}`` (rank 0) to argv[1]: whether the
two layouts gave bitwise-equal gradients with ``make_exact`` and without it, and whether the
exact hook's result equals the plain all-reduce mean to float tolerance.

``argv[2] == "peer-dies"``: the last rank exits in the middle of the job instead, and rank 0
writes ``{"raised": bool}``: whether its next backward with ``make_exact`` failed (it must:
a step on partial sums would train on silently wrong gradients).
"""

from __future__ import annotations

import datetime
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from ckptrun.adapters.ddp import make_exact


def grads(exact: bool, bucket_cap_mb: float) -> list:
    torch.manual_seed(0)  # the same weights on every rank and in every layout
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(6)])
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
    if exact:
        make_exact(ddp)
    g = torch.Generator().manual_seed(100 + dist.get_rank())
    for _ in range(2):  # the second iteration runs with the rebuilt buckets
        ddp.zero_grad()
        ddp(torch.randn(32, 256, generator=g)).square().mean().backward()
    return [p.grad.clone() for p in model.parameters()]


def peer_dies(out: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(3)])
    ddp = make_exact(nn.parallel.DistributedDataParallel(model))
    for _ in range(2):  # every rank: good steps, the second with the rebuilt buckets
        ddp(torch.randn(8, 64)).sum().backward()
    if dist.get_rank() == dist.get_world_size() - 1:
        os._exit(0)
    try:
        ddp(torch.randn(8, 64)).sum().backward()
        raised = False
    except Exception:  # gloo's error for the closed connection
        raised = True
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump({"raised": raised}, f)
    os._exit(0)  # the group is broken: no orderly teardown


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=20))
    if sys.argv[2:] == ["peer-dies"]:
        return peer_dies(sys.argv[1])
    same = {}
    for exact in (True, False):
        a, b = grads(exact, 0.05), grads(exact, 25.0)  # many small buckets vs one large
        same["exact" if exact else "plain"] = all(torch.equal(x, y) for x, y in zip(a, b))
        if exact:
            c = grads(False, 25.0)
            same["correct"] = all(torch.allclose(x, y, atol=1e-6) for x, y in zip(a, c))
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(same, f)
    dist.barrier()
    # the DDP modules hold the gloo group in reference cycles; freed during interpreter
    # shutdown it can abort the process (see ckptrun/worker/clean_exit.py): this probe has no
    # Checkpointer to register that collection, and nothing left to do
    os._exit(0)


if __name__ == "__main__":
    main()
