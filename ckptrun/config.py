"""The agent's configuration: what the command line (``ckptrun.cli.args``) builds and the agent
(``ckptrun.agent``) and its tiers (``ckptrun.tiers``) read.

Plain data with no ckptrun imports, kept apart from all of them so the parser, the supervisor
and the tiers can be written and tested separately; plus the parsing of a share ('3%') that
several options use.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set


@dataclass
class AgentConfig:
    """Everything one ``ckptrun`` agent needs to launch and supervise its node's workers."""

    # --- what to run (torchrun semantics) ---------------------------------------------
    script: str  # training script path, module name (module=True) or program (no_python=True)
    script_args: List[str] = field(default_factory=list)
    module: bool = False  # -m/--module
    no_python: bool = False  # --no-python: exec the program directly
    run_path: bool = False  # --run-path
    use_env: bool = True  # False: pass --local-rank=<n> like torchrun without --use-env

    # --- topology and rendezvous (torchrun semantics) ---------------------------------
    nproc_per_node: int = 1
    min_nodes: int = 1
    max_nodes: int = 1
    rdzv_backend: str = "c10d"
    rdzv_endpoint: str = "localhost:0"
    rdzv_id: str = "none"
    rdzv_configs: Dict[str, object] = field(default_factory=dict)
    standalone: bool = False
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: Optional[int] = None
    local_addr: Optional[str] = None
    role: str = "default"

    # --- supervision (torchrun semantics, ckptrun defaults) ----------------------------
    max_restarts: int = 10  # counted for the whole job, all nodes together
    monitor_interval: float = 0.1
    start_method: str = "spawn"
    shutdown_timeout: float = 5.0  # grace between SIGTERM and SIGKILL when stopping workers
    signals_to_handle: str = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"

    # --- logs (torchrun semantics) ------------------------------------------------------
    log_dir: Optional[str] = None
    redirects: str = "0"  # torchrun Std spec: 0 none, 1 stdout, 2 stderr, 3 both, or "0:1,1:2"
    tee: str = "0"
    local_ranks_filter: Optional[Set[int]] = None
    duplicate_stdout_filters: List[str] = field(default_factory=list)  # -> filtered_stdout.log
    duplicate_stderr_filters: List[str] = field(default_factory=list)
    event_log_handler: str = "null"  # torch.distributed.elastic.events handler for our events
    virtual_local_rank: bool = False  # LOCAL_RANK=0, CUDA_VISIBLE_DEVICES = the worker's GPU
    numa_binding: Optional[str] = None  # --numa-binding: workers on their GPU's CPUs
    metrics_port: Optional[int] = None  # --metrics-port (0: any free port); None: no metrics
    metrics_addr: str = "127.0.0.1"

    # --- ckptrun's own options -----------------------------------------------------------
    run_dir: str = ""  # resolved by args.py: ckptrun-runs/<run-id> by default
    persist_to: str = ""  # fsspec URL; default <run-dir>/checkpoints
    persist_every_steps: Optional[int] = None  # exactly one of these two is set
    persist_every_seconds: Optional[float] = 600.0
    keep: int = 3
    replicas: int = 2
    hot_spares: bool = False  # --hot-spares: spares run the script to its resilient function
    standby: bool = False  # --standby: wait without ranks, warm, to take a lost machine's place
    hang_timeout: Optional[float] = None  # None = auto
    resume_from: Optional[str] = None
    replication_rate: Optional[float] = None  # bytes/s per agent; None = unpaced
    replication_budget: Optional[float] = 0.05  # slowdown rounds may cause; None = unpaced
    num_slots: int = 3
    snapshot_every: str = "1"  # N or "auto" (workers read CKPTRUN_SNAPSHOT_EVERY)
    # the job secret (protocol.job_secret); never logged, never in a worker's environment
    secret: Optional[bytes] = field(default=None, repr=False)
    insecure: bool = False  # several machines without a secret, accepted by the user

    @property
    def nnodes_fixed(self) -> bool:
        return self.min_nodes == self.max_nodes


def parse_share(value: Any, what: str, example: str) -> float:
    """``0.03``, ``"0.03"`` or ``"3%"`` -> 0.03; ValueError naming ``what`` unless the
    share is strictly between 0 and 1."""
    text = str(value).strip()
    try:
        share = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        share = -1.0
    if not 0 < share < 1:
        raise ValueError(f"ckptrun: {what} must be a fraction in (0, 1) or a percentage like "
                         f"{example}, got {value!r}")
    return share
