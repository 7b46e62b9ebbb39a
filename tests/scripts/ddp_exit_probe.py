"""Writes whether its DDP module (and so the process group the module holds) was freed
before interpreter shutdown -- the garbage collector's job, since DDP sits in a reference
cycle -- to the file named by argv[1].  Automatic collection is off, as in training loops
that collect on their own schedule (torchtitan does), so nothing frees it by chance."""

import gc
import sys

import torch
import torch.distributed as dist
import torch.nn as nn


class Probe:
    def __init__(self, path: str) -> None:
        self.path = path

    def __del__(self) -> None:
        with open(self.path, "w") as f:
            f.write("finalizing" if sys.is_finalizing() else "collected")


def main() -> None:
    gc.disable()
    dist.init_process_group("gloo")
    ddp = nn.parallel.DistributedDataParallel(nn.Linear(4, 4))
    ddp(torch.randn(2, 4)).sum().backward()
    ddp.probe = Probe(sys.argv[1])  # lives exactly as long as the module
    if "--checkpointer" in sys.argv:  # a job using ckptrun's API (here under plain torchrun)
        import ckptrun

        ckpt = ckptrun.Checkpointer({"model": ddp})
        ckpt.save(1)
        ckpt.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
