"""Two gloo ranks for tests/test_inplace.py: rank 1 leaves an all-reduce queued that rank 0
(alive, connected, busy) never matches -- what a survivor holds when gloo had closed the
connection under an operation queued before the break -- and destroys its groups.  Then both
form a new group.  Prints, as JSON, how long the destroy took, whether it finished, the new
group's sum, and how soon an unmatched operation on a broken group gave up."""

import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from ckptrun.worker import collectives

rank, store_dir = int(sys.argv[1]), sys.argv[2]


def emit(record: dict) -> None:
    sys.stdout.write(json.dumps({"rank": rank, **record}) + "\n")
    sys.stdout.flush()


def group(name: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store_dir}/{name}", rank=rank,
                            world_size=2, timeout=datetime.timedelta(seconds=60))


group("first")
dist.all_reduce(torch.ones(4))  # connected
if rank == 1:
    work = dist.all_reduce(torch.ones(4), async_op=True)  # never matched
    time.sleep(0.3)
    t0 = time.time()
    done = collectives.destroy_groups(8.0)
    emit({"destroyed": done, "destroy_s": time.time() - t0,
          "initialized": dist.is_initialized()})
    del work
    collectives.release_retired()
else:
    time.sleep(12)  # busy: keeps its connection open and silent
    collectives.destroy_groups(8.0)
group("second")
t = torch.full((4,), float(rank + 1))
dist.all_reduce(t)
emit({"sum": t.tolist()})
# a broken group: operations issued after the break give up at once, not after 60 s
collectives._shorten_timeouts()
if rank == 1:
    t0 = time.time()
    try:
        dist.all_reduce(t)  # rank 0 never joins it
        emit({"late_raised": False})
    except Exception:
        emit({"late_raised": True, "late_s": time.time() - t0})
else:
    time.sleep(6)
os._exit(0)
