"""Two gloo ranks for tests/test_inplace.py: rank 0 waits in an all-reduce for rank 1, which
is alive but busy; a thread of rank 0 breaks its collectives.  Prints when each rank's
collective raised (seconds since the break), as JSON."""

import datetime
import json
import os
import sys
import threading
import time

import torch
import torch.distributed as dist

from ckptrun.worker.collectives import CollectiveBreaker, destroy_groups

rank, store_file = int(sys.argv[1]), sys.argv[2]
breaker = CollectiveBreaker()
assert breaker.install()
dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=60))
t = torch.ones(1 << 16)
dist.all_reduce(t)  # connected
broken_at = [0.0]
_out = threading.Lock()


def emit(record: dict) -> None:
    """One JSON line per record: print() writes the text and its newline separately, so the
    break thread's line and the main thread's could share a line."""
    with _out:
        sys.stdout.write(json.dumps(record) + "\n")
        sys.stdout.flush()


def brk() -> None:
    time.sleep(0.5)
    broken_at[0] = time.time()
    emit({"rank": rank, "shut": breaker.break_all()})


if rank == 0:
    threading.Thread(target=brk, daemon=True).start()
else:
    time.sleep(1.5)  # busy elsewhere: enters the collective after rank 0's break
t0 = time.time()
try:
    dist.all_reduce(t)
    emit({"rank": rank, "raised": False})
except Exception as exc:
    emit({"rank": rank, "raised": True, "after_s": time.time() - t0, "error": str(exc)[:120]})
emit({"rank": rank, "destroyed": destroy_groups(10.0)})
os._exit(0)
