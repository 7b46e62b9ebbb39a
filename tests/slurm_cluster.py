"""A real Slurm for the tests: Debian's slurmctld and one slurmd per emulated node, all on
127.0.0.1 (the packages' multiple-slurmd build), started by the tests that need it.

The packages are installed on first use when missing (root and a reachable Debian mirror;
~15 s); where that cannot be done the tests are skipped, saying why.  Authentication is off
(``auth/none``): the daemons listen on loopback only and live as long as the test module.
Every emulated node shares this machine's network and mount namespaces, so the nodes'
hostnames do not resolve -- Slurm reaches them at their ``NodeAddr`` (127.0.0.1), and so
does ckptrun (``ckptrun.cli.slurm``).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import pytest

PACKAGES = ["slurmctld", "slurmd", "slurm-client"]
CONF = """\
ClusterName=ckptrun-test
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
CommunicationParameters=NoInAddrAny,NoCtldInAddrAny
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool/%n
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd-%n.pid
SlurmctldLogFile={dir}/log/slurmctld.log
SlurmdLogFile={dir}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SlurmdParameters=config_overrides
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=20
InactiveLimit=0
MinJobAge=300
KillWait=30
Waittime=0
{nodes}
PartitionName=debug Nodes={names} Default=YES MaxTime=INFINITE State=UP
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def install_problem() -> Optional[str]:
    """None when Slurm's daemons are here (installed now if they were not); else why not."""
    if all(shutil.which(b) for b in ("slurmctld", "slurmd", "sbatch", "scontrol")):
        return None
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return "Slurm is not installed and cannot be installed here (needs root and apt-get)"
    try:
        done = subprocess.run(["apt-get", "install", "-y", "--no-install-recommends",
                               *PACKAGES], capture_output=True, text=True, timeout=600,
                              env=dict(os.environ, DEBIAN_FRONTEND="noninteractive"))
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"apt-get install {' '.join(PACKAGES)} failed: {exc}"
    if done.returncode != 0:
        return (f"apt-get install {' '.join(PACKAGES)} failed: "
                f"{(done.stderr or done.stdout).strip().splitlines()[-1:]}")
    return None


@dataclass
class Cluster:
    dir: str
    nodes: List[str]
    env: Dict[str, str]  # SLURM_CONF set
    procs: List[subprocess.Popen] = field(default_factory=list)

    def run(self, *args: str, timeout: float = 60, check: bool = True,
            cwd: Optional[str] = None, env: Optional[dict] = None) -> str:
        done = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout,
                              env=dict(self.env, **(env or {})), cwd=cwd)
        if check and done.returncode != 0:
            raise AssertionError(f"{' '.join(args)}: {done.stderr or done.stdout}")
        return done.stdout

    def job_field(self, job: str, name: str) -> Optional[str]:
        out = self.run("scontrol", "-o", "show", "job", job, check=False)
        for item in out.split():
            if item.startswith(name + "="):
                return item.partition("=")[2]
        return None

    def log(self, name: str) -> str:
        try:
            with open(os.path.join(self.dir, "log", name)) as f:
                return f.read()[-3000:]
        except OSError:
            return ""

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=15)


def start_cluster(base: str, nodes: List[str], cpus: int = 2) -> Cluster:
    """slurmctld and a slurmd per name in ``nodes``, up and idle."""
    problem = install_problem()
    if problem:
        pytest.skip(problem)
    d = os.path.abspath(base)
    for sub in ("state", "log", *(f"spool/{n}" for n in nodes)):
        os.makedirs(os.path.join(d, sub), exist_ok=True)
    node_lines = "\n".join(
        f"NodeName={n} NodeHostname=localhost NodeAddr=127.0.0.1 Port={_free_port()} "
        f"CPUs={cpus} RealMemory=1000 State=UNKNOWN" for n in nodes)
    conf = os.path.join(d, "slurm.conf")
    with open(conf, "w") as f:
        f.write(CONF.format(ctld_port=_free_port(), dir=d, nodes=node_lines,
                            names=",".join(nodes)))
    env = dict(os.environ, SLURM_CONF=conf)
    cluster = Cluster(d, nodes, env)
    out = open(os.path.join(d, "log", "daemons.out"), "w")
    cluster.procs.append(subprocess.Popen(["slurmctld", "-D", "-f", conf], env=env,
                                          stdout=out, stderr=subprocess.STDOUT))
    for n in nodes:
        cluster.procs.append(subprocess.Popen(["slurmd", "-D", "-f", conf, "-N", n], env=env,
                                              stdout=out, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        idle = cluster.run("sinfo", "-h", "-t", "idle", "-o", "%D", check=False).strip()
        if idle == str(len(nodes)):
            return cluster
        time.sleep(0.2)
    cluster.stop()
    raise AssertionError("the Slurm cluster did not come up: " + cluster.log("slurmctld.log"))
