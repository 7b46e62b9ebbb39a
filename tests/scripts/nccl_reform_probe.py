"""An NCCL group of one formed, aborted the way in-place recovery aborts a survivor's
(``ckptrun.worker.collectives.CollectiveBreaker.break_all``) and formed again, twice, in one
process; prints one JSON line of timings and checks.  Needs a GPU.

    python nccl_reform_probe.py STORE_PREFIX

Used by ``tests/test_cuda.py`` (the checks) and ``benchmarks/cuda.py`` (the timings).
"""

from __future__ import annotations

import json
import sys
import time

t0 = time.perf_counter()
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

t1 = time.perf_counter()
torch.cuda.set_device(0)
torch.zeros(1, device="cuda").add_(1)
torch.cuda.synchronize()
t2 = time.perf_counter()

from ckptrun.worker.collectives import CollectiveBreaker, destroy_groups  # noqa: E402

breaker = CollectiveBreaker()
out = {"import_s": t1 - t0, "context_s": t2 - t1, "installed": breaker.install()}
for attempt in range(2):
    t0 = time.perf_counter()
    dist.init_process_group("nccl", init_method=f"file://{sys.argv[1]}-{attempt}", rank=0,
                            world_size=1, device_id=torch.device("cuda", 0))
    x = torch.ones(1 << 20, device="cuda")
    dist.all_reduce(x)
    torch.cuda.synchronize()
    out[f"form_s_{attempt}"] = time.perf_counter() - t0
    out[f"sum_{attempt}"] = float(x[0])
    t0 = time.perf_counter()
    breaker.break_all()  # aborts the NCCL communicator
    out[f"destroyed_{attempt}"] = destroy_groups()
    breaker.forget()
    out[f"abort_s_{attempt}"] = time.perf_counter() - t0
y = torch.full((4,), 2.0, device="cuda")
out["cuda_after"] = float((y * y).sum())  # the process's CUDA context survived the aborts
print(json.dumps(out))
