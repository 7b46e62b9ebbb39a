"""``--numa-binding``: each worker bound to the CPUs near its GPU, as torchrun binds them.

torch decides which CPUs belong to a GPU (``torch.numa.binding``: the GPU's NUMA node, its
socket, an exclusive share of its node's cores, or one core complex); torchrun then starts
the worker under ``numactl --physcpubind``.  ckptrun asks torch for the same CPU set and
applies it with ``sched_setaffinity`` in the child before it runs anything, so no
``numactl`` is needed and a warm spare (started before it is given a rank's work) is bound
from birth too: a spare belongs to one local rank, and so to one GPU.
"""

from __future__ import annotations

from typing import Dict, FrozenSet, Optional

from ckptrun.torchcompat import numa as torch_numa


def modes() -> tuple:
    """The affinity modes this torch knows (empty before torch 2.9, which has no binding)."""
    return torch_numa.modes()


def check(mode: str, nproc: int) -> None:
    """Raise ValueError (one line, for the usage error) where ``mode`` cannot apply here,
    before anything starts: also where torch cannot tell the CPUs of a local rank's GPU."""
    known = modes()
    if not known:
        raise ValueError(f"--numa-binding {mode}: this torch has no torch.numa.binding "
                         "(torch >= 2.9 has)")
    if mode not in known:
        raise ValueError(f"--numa-binding {mode}: not one of {', '.join(known)}")
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        raise ValueError(f"--numa-binding {mode} binds each worker to the CPUs near its "
                         "GPU (GPU index = local rank); this machine has no CUDA GPU")
    for local_rank in range(nproc):
        try:
            torch_cpus(mode, local_rank)
        except Exception as exc:  # noqa: BLE001  (sysfs, a GPU index past the count, ...)
            raise ValueError(f"--numa-binding {mode}: no CPUs for local rank {local_rank}'s "
                             f"GPU: {exc}") from None


class Binder:
    """The CPU set of each local rank under one ``--numa-binding`` mode, asked of torch
    once per local rank (it reads sysfs, and "exclusive" shares a node's cores out among
    the GPUs on it)."""

    def __init__(self, mode: Optional[str]) -> None:
        self.mode = mode
        self._cpus: Dict[int, FrozenSet[int]] = {}

    def cpus(self, local_rank: int) -> Optional[FrozenSet[int]]:
        """The CPUs worker ``local_rank`` runs on; None without ``--numa-binding``."""
        if self.mode is None:
            return None
        if local_rank not in self._cpus:
            self._cpus[local_rank] = frozenset(torch_cpus(self.mode, local_rank))
        return self._cpus[local_rank]


def torch_cpus(mode: str, gpu_index: int) -> set:
    """torch's CPU set for GPU ``gpu_index`` (validated: non-empty, allowed to this process);
    torch's own error where it cannot tell (the run stops, as torchrun's would)."""
    return torch_numa.cpus_for_gpu(mode, gpu_index)
