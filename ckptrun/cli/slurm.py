"""Running under ``srun``: the rendezvous and run directory read from the Slurm allocation.

``srun --ntasks-per-node=1 ckptrun train.py`` needs no rendezvous flags: inside a job step
(``SLURM_STEP_ID`` set) ckptrun takes, as defaults that any flag or ``PET_*`` variable
overrides,

* ``--nnodes``: the step's node count (``SLURM_STEP_NUM_NODES``);
* ``--rdzv-backend c10d --rdzv-endpoint HOST:PORT``: HOST is the first node of the step
  (its ``NodeAddr`` as ``scontrol`` reports it: the address Slurm itself reaches it by;
  ``MASTER_ADDR`` wins), PORT is ``MASTER_PORT`` or 20000 + job id mod 20000, so that two
  jobs sharing a node do not meet on one port;
* ``--rdzv-id slurm-<SLURM_JOB_ID>``: a requeued job keeps its id, so it meets in the same
  rendezvous namespace and resumes from its own checkpoints;
* the run directory ``ckptrun-runs/slurm-<job id>/node-<SLURM_NODEID>`` (one per machine:
  the submit directory is usually shared) and ``--persist-to`` the job's
  ``ckptrun-runs/slurm-<job id>/checkpoints``, which every machine then shares.

Only inside a step: the batch script itself runs on the first node alone, and a job of N
nodes started there would wait for N - 1 machines that never come.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from dataclasses import dataclass
from typing import Dict, List, Optional


@dataclass(frozen=True)
class SlurmStep:
    """What ckptrun takes from the job step it runs in."""

    job_id: str
    nnodes: int
    ntasks: int
    node_id: int
    nodelist: str  # Slurm's compact form, e.g. n[1-3]
    master_addr: str  # MASTER_ADDR when set
    port: str

    def endpoint(self) -> str:
        """HOST:PORT of the rendezvous store: the step's first node (asked of ``scontrol``
        only when the endpoint is used, not when a flag gives it)."""
        return f"{self.master_addr or first_node_addr(self.nodelist)}:{self.port}"

    @property
    def rdzv_id(self) -> str:
        return f"slurm-{self.job_id}"

    def run_dir(self, base: str = "ckptrun-runs") -> str:
        return os.path.join(base, self.rdzv_id, f"node-{self.node_id}")

    def persist_to(self, base: str = "ckptrun-runs") -> str:
        return os.path.join(base, self.rdzv_id, "checkpoints")

    def defaults(self) -> Dict[str, str]:
        """torchrun options this step gives defaults for (argparse ``dest`` names)."""
        return {"nnodes": str(self.nnodes), "rdzv_backend": "c10d",
                "rdzv_endpoint": FROM_SLURM, "rdzv_id": self.rdzv_id}


FROM_SLURM = "<the first node of the Slurm step>"  # the endpoint default, resolved late


class SlurmError(ValueError):
    """The step cannot be read (one line for the usage error)."""


_VARS = ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_STEP_NUM_NODES", "SLURM_NNODES",
         "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NODEID", "SLURM_STEP_NODELIST",
         "SLURM_JOB_NODELIST", "MASTER_ADDR", "MASTER_PORT")


def current_step(env: Optional[Dict[str, str]] = None) -> Optional[SlurmStep]:
    """The Slurm job step this process runs in, or None outside one."""
    env = os.environ if env is None else env
    return _step(tuple(env.get(v, "") for v in _VARS))


@functools.lru_cache(maxsize=8)  # one command line asks more than once
def _step(values: tuple) -> Optional[SlurmStep]:
    env = dict(zip(_VARS, values))
    job, step = env.get("SLURM_JOB_ID", "").strip(), env.get("SLURM_STEP_ID", "").strip()
    if not job or not step:
        return None
    try:
        nnodes = int(env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_NNODES") or "1")
        ntasks = int(env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS") or str(nnodes))
        node_id = int(env.get("SLURM_NODEID") or "0")
    except ValueError as exc:
        raise SlurmError(f"the Slurm step's environment is not readable: {exc}") from None
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or ""
    port = env.get("MASTER_PORT", "").strip() or str(20000 + _job_number(job) % 20000)
    return SlurmStep(job_id=job, nnodes=nnodes, ntasks=ntasks, node_id=node_id,
                     nodelist=nodelist, master_addr=env.get("MASTER_ADDR", "").strip(),
                     port=port)


def _job_number(job: str) -> int:
    digits = "".join(c for c in job if c.isdigit())  # "1234_7" (an array task) too
    return int(digits[-9:] or "0")


@functools.lru_cache(maxsize=8)
def first_node_addr(nodelist: str) -> str:
    """The address of the first node of ``nodelist`` (Slurm's compact form, ``n[1-3]``):
    its ``NodeAddr`` where ``scontrol`` tells it, else its name."""
    names = _hostnames(nodelist)
    if not names:
        raise SlurmError(f"no nodes in the Slurm node list {nodelist!r}")
    first = names[0]
    addr = _scontrol(["-o", "show", "node", first])
    for field in (addr or "").split():
        if field.startswith("NodeAddr="):
            value = field.partition("=")[2]
            if value and value != "(null)":
                return value
    return first


def _hostnames(nodelist: str) -> List[str]:
    out = _scontrol(["show", "hostnames", nodelist]) if nodelist else None
    if out is not None:
        return [h for h in out.split() if h]
    return expand_nodelist(nodelist)  # scontrol missing or failing: the common forms


def expand_nodelist(nodelist: str) -> List[str]:
    """``a,n[01-03,7]x`` -> ``a n01x n02x n03x n7x``: Slurm's compact host list with at most
    one bracket per name (what ``scontrol show hostnames`` prints, for the usual lists)."""
    names, depth, item = [], 0, ""
    for ch in nodelist + ",":
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            names += _expand_one(item.strip(), nodelist) if item.strip() else []
            item = ""
        else:
            item += ch
    return names


def _expand_one(name: str, whole: str) -> List[str]:
    if "[" not in name:
        return [name]
    head, _, rest = name.partition("[")
    ranges, _, tail = rest.partition("]")
    if "[" in tail or "]" in tail or not ranges:
        raise SlurmError(f"cannot read the Slurm node list {whole!r}: give --rdzv-endpoint "
                         "HOST:PORT")
    out = []
    for part in ranges.split(","):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise SlurmError(f"cannot read the Slurm node list {whole!r}: give "
                             "--rdzv-endpoint HOST:PORT")
        width = len(lo) if lo.startswith("0") else 0
        out += [f"{head}{i:0{width}d}{tail}" for i in range(int(lo), int(hi or lo) + 1)]
    return out


def _scontrol(args: List[str]) -> Optional[str]:
    exe = shutil.which("scontrol")
    if exe is None:
        return None
    try:
        done = subprocess.run([exe, *args], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None
