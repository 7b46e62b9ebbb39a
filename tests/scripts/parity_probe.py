"""What a script sees of how it was started; one JSON line per rank (``PROBE {...}``).

``--mode show``: its ``__file__``, ``sys.argv``, ``sys.path[0]``, whether torch was imported
before it, whether a thread count set before ``import torch`` applies, whether ``pgrep -f``
finds it by its name, LOCAL_RANK and CUDA_VISIBLE_DEVICES; ``--mode fail``: rank 1 raises
inside a ``@record`` entry point; ``--mode lines``: each rank prints a line with and one
without the word "needle"; ``--mode restart``: the first attempt's rank 0 exits 3 after 4 s,
the second attempt shows as ``show`` does.
"""

import json
import os
import subprocess
import sys
import time

preloaded = "torch" in sys.modules
os.environ["OMP_NUM_THREADS"] = "1"

import torch  # noqa: E402
from torch.distributed.elastic.multiprocessing.errors import record  # noqa: E402


@record
def main() -> None:
    mode = sys.argv[sys.argv.index("--mode") + 1]
    rank = int(os.environ["RANK"])
    if mode == "fail":
        if rank == 1:
            raise ValueError("parity probe failed on purpose")
        return
    if mode == "restart" and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
        time.sleep(4 if rank == 0 else 60)
        sys.exit(3)
    if mode == "lines":
        print(f"rank {rank} says needle", flush=True)
        print(f"rank {rank} says hay", flush=True)
        return
    found = subprocess.run(["pgrep", "-f", os.path.basename(__file__)], capture_output=True,
                           text=True).stdout.split()
    print("PROBE " + json.dumps({
        "rank": rank, "attempt": os.environ.get("TORCHELASTIC_RESTART_COUNT"), "file": __file__, "argv": sys.argv, "path0": sys.path[0],
        "torch_preloaded": preloaded, "threads": torch.get_num_threads(),
        "pgrep_finds_me": str(os.getpid()) in found,
        "local_rank": os.environ.get("LOCAL_RANK"),
        "world_size": os.environ.get("WORLD_SIZE"),
        "local_world_size": os.environ.get("LOCAL_WORLD_SIZE"),
        "group_world_size": os.environ.get("GROUP_WORLD_SIZE"),
        "cuda_visible": os.environ.get("CUDA_VISIBLE_DEVICES")}), flush=True)


main()
