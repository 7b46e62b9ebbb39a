"""Test helper: run the agent from a few torchrun-like flags (until/besides ``ckptrun.cli``).

    python tests/scripts/agent_launch.py --nproc-per-node 2 --run-dir D [--standalone]
        [--nnodes 2 --rdzv-endpoint H:P --rdzv-id X] [--max-restarts N] [--hang-timeout S]
        [-m] [--no-python] SCRIPT [ARGS...]
"""

from __future__ import annotations

import sys

from ckptrun.agent.supervisor import run_agent
from ckptrun.config import AgentConfig


def main(argv: list) -> int:
    opts = {"--nproc-per-node": "1", "--run-dir": "", "--nnodes": "1", "--max-restarts": "10",
            "--rdzv-endpoint": "", "--rdzv-id": "none", "--hang-timeout": "auto",
            "--monitor-interval": "0.1", "--shutdown-timeout": "5"}
    flags = {"--standalone": False, "-m": False, "--no-python": False}
    i = 0
    while i < len(argv) and argv[i].startswith("-"):
        if argv[i] in flags:
            flags[argv[i]] = True
            i += 1
        else:
            opts[argv[i]] = argv[i + 1]
            i += 2
    nnodes = int(opts["--nnodes"])
    cfg = AgentConfig(
        script=argv[i], script_args=argv[i + 1:], module=flags["-m"],
        no_python=flags["--no-python"], nproc_per_node=int(opts["--nproc-per-node"]),
        min_nodes=nnodes, max_nodes=nnodes, standalone=flags["--standalone"],
        rdzv_endpoint=opts["--rdzv-endpoint"], rdzv_id=opts["--rdzv-id"],
        max_restarts=int(opts["--max-restarts"]), run_dir=opts["--run-dir"],
        monitor_interval=float(opts["--monitor-interval"]),
        shutdown_timeout=float(opts["--shutdown-timeout"]),
        hang_timeout=None if opts["--hang-timeout"] == "auto" else float(opts["--hang-timeout"]),
    )
    return run_agent(cfg)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
