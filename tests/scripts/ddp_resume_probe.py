"""3+ ranks: does a new process's DDP reduce its first iteration like the process it
replaces?  (``torch.distributed.run`` launches it; rank 0 writes the JSON result to argv[1].)

A reference DDP trains 4 iterations (SGD) and keeps every iteration's averaged gradients.  A
second DDP -- what a restored process builds -- starts from the reference's weights after
iteration 2, with the bucket layout the reference settled on handed to
``ckptrun.adapters.ddp.give_back_layout`` (``rebuilt``: the reducer built again in it), to
``FirstIterationAsSettled`` (``hook``: the fallback), or to neither (``plain``), and trains
iterations 3 and 4 on the same batches.  Writes ``{"rebuilt": bool, "hook": bool, "plain":
bool, "how": str, "hooked_after": bool, "emulated": n, "buckets": n}``: whether each run's
gradients equal the reference's bitwise, how the layout was given back, whether the rebuilt
DDP has a comm hook, and how many buckets the hook reduced in the settled layout.
"""

from __future__ import annotations

import datetime
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from ckptrun.adapters.ddp import (
    FirstIterationAsSettled,
    give_back_layout,
    reducer_params,
    settled_layout,
)


def model() -> nn.Module:
    torch.manual_seed(0)  # > 1 MiB of parameters: DDP settles on several buckets
    return nn.Sequential(nn.Linear(384, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                         nn.Linear(512, 384), nn.ReLU(), nn.Linear(384, 8))


def batch(it: int) -> torch.Tensor:
    return torch.randn(16, 384, generator=torch.Generator().manual_seed(100 * it + dist.get_rank()))


def train(ddp, opt, iters) -> list:
    out = []
    for it in iters:
        opt.zero_grad()
        ddp(batch(it)).square().mean().backward()
        out.append([p.grad.clone() for p in ddp.module.parameters()])
        opt.step()
    return out


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    ref_model = model()
    ref = nn.parallel.DistributedDataParallel(ref_model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    grads = train(ref, ref_opt, [1, 2])
    weights = {k: v.clone() for k, v in ref_model.state_dict().items()}
    grads += train(ref, ref_opt, [3, 4])
    layout = settled_layout(ref, len(reducer_params(ref)))
    result = {"buckets": len(layout or [])}
    for how in ("rebuilt", "hook", "plain"):
        m = model()
        m.load_state_dict(weights)
        ddp = nn.parallel.DistributedDataParallel(m)
        hook = None
        if how == "rebuilt":
            result["how"] = give_back_layout(ddp, layout)
            result["hooked_after"] = bool(getattr(ddp, "_comm_hooks", None))
        elif how == "hook":
            hook = FirstIterationAsSettled.arm(ddp, layout)
        again = train(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), [3, 4])
        result[how] = all(
            torch.equal(a, b) for got, want in zip(again, grads[2:]) for a, b in zip(got, want))
        if hook is not None:
            result["emulated"] = hook.emulated
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(result, f)
    dist.barrier()
    os._exit(0)  # DDP's gloo group in a reference cycle: no teardown in interpreter shutdown


if __name__ == "__main__":
    main()
