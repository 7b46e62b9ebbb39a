"""A 2-rank @ckptrun.resilient loop that uses torch's differentiable collectives
(``torch.distributed.nn.functional``, as contrastive losses do) with their default group,
and FSDP's ``ShardedGradScaler`` with its default group.
DDP's constructor imports them (through ``torch._dynamo``) after ``init_process_group``,
so their ``group=group.WORLD`` defaults are the first attempt's group.  Rank 1 dies in
attempt 0; rank 0 recovers in place.  Each rank prints, per attempt, what the functional
all-reduce gave and how many TCP sockets it listens on once its group is up."""

import json
import os
import time

import psutil
import torch
import torch.distributed as dist
import torch.nn as nn

import ckptrun


@ckptrun.resilient
def train() -> None:
    dist.init_process_group("gloo")
    rank, attempt = dist.get_rank(), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    ddp = nn.parallel.DistributedDataParallel(nn.Linear(8, 8))
    import torch.distributed.nn.functional as F

    try:
        got = F.all_reduce(torch.ones(2)).tolist()
    except Exception as exc:
        got = f"{type(exc).__name__}: {exc}"[:200]
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    scaler_group = ShardedGradScaler(device="cpu").process_group
    listening = sum(c.status == psutil.CONN_LISTEN
                    for c in psutil.Process().net_connections("tcp"))
    current = scaler_group in (None, dist.group.WORLD)
    print("[fc] " + json.dumps({"rank": rank, "attempt": attempt, "all_reduce": got,
                                "listening": listening, "pid": os.getpid(),
                                "scaler_group_current": current}), flush=True)
    for step in range(6):
        ddp(torch.ones(4, 8)).sum().backward()
        time.sleep(0.05)
        if rank == 1 and attempt == 0 and step == 3:
            os._exit(9)
    dist.barrier()
    dist.destroy_process_group()


train()
