"""Several "machines" on localhost for the benchmarks: one ``ckptrun`` agent each.

Every machine is one agent (``--nnodes N --nproc-per-node 1``, c10d rendezvous on
127.0.0.1) running ``benchmarks/jobs/recovery_job.py``; all of them write their step logs
into one directory.  With ``private_shm`` (root and util-linux ``unshare`` needed, see
:func:`namespace_problem`) each agent runs in its own mount namespace with its own tmpfs
on ``/dev/shm``, as ``tests/test_machine_loss.py`` does: killing a machine then loses
every byte of memory it held, and nothing of it can be reached from the others except
over the network.  Every machine is started in its own session, so the harness can kill
it, and only it, whole.  Workers run one OpenMP thread (``OMP_NUM_THREADS=1``, what torchrun
sets for several processes per machine): a machine here is about one core, and two
2-thread workers on these 2 cores would spin against each other, so that the numbers
would be about OpenMP contention instead of ckptrun.

Shared by the replication-overhead and machine-loss sections.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from typing import Dict, List, Optional

from benchmarks.jobrun import JOB, ROOT, kill_group, read_events, shm_leftovers

UNSHARE = shutil.which("unshare")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def namespace_problem() -> Optional[str]:
    """Why machines with private memory cannot be simulated here (None: they can)."""
    if not UNSHARE:
        return "unshare (util-linux) is not installed"
    if os.geteuid() != 0:
        return "mounting a private /dev/shm needs root"
    try:
        r = subprocess.run([UNSHARE, "-m", "--propagation", "private", "sh", "-c",
                            "mount -t tmpfs -o size=1m tmpfs /dev/shm"],
                           capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"mount namespaces unavailable: {e}"
    return None if r.returncode == 0 else f"mount namespaces unavailable: {r.stderr[-300:]}"


class Machine:
    """One agent (and, once it started them, its workers) -- a machine of the job."""

    def __init__(self, name: str, work: str, agent_args: List[str], job_args: List[str],
                 log_dir: str, env: Dict[str, str], private_shm: bool,
                 shm_size: str = "4g") -> None:
        self.name = name
        self.run_dir = os.path.join(work, name)
        self.log_path = os.path.join(work, f"{name}.log")
        cmd = [sys.executable, "-m", "ckptrun.cli", *agent_args, "--run-dir", self.run_dir,
               JOB, "--log-dir", log_dir, *job_args]
        if private_shm:
            cmd = [UNSHARE, "-m", "--propagation", "private", "sh", "-c",
                   f'mount -t tmpfs -o size={shm_size},mode=1777 tmpfs /dev/shm && exec "$@"',
                   name, *cmd]  # unshare and sh exec: the agent keeps this pid
        self.private_shm = private_shm
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                         env=dict(os.environ, PYTHONPATH=ROOT,
                                                  **{"OMP_NUM_THREADS": "1", **env}),
                                         start_new_session=True)
        self.killed_at: Optional[float] = None

    def status(self) -> dict:
        try:
            with open(os.path.join(self.run_dir, "status.json")) as f:
                return json.load(f)
        except (OSError, ValueError):
            return {}

    def events(self) -> List[dict]:
        return read_events(self.run_dir)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def processes(self) -> List[int]:
        """Every process of this machine: the agent and all its descendants (its reaper
        and warm spares included), and with a private ``/dev/shm`` everything else in the
        agent's mount namespace."""
        import psutil

        try:
            agent = psutil.Process(self.proc.pid)
            pids = {agent.pid} | {p.pid for p in agent.children(recursive=True)}
        except psutil.Error:
            return []
        if self.private_shm:
            try:
                ns = os.readlink(f"/proc/{agent.pid}/ns/mnt")
            except OSError:
                ns = None
            for p in psutil.pids():
                try:
                    if ns and os.readlink(f"/proc/{p}/ns/mnt") == ns:
                        pids.add(p)
                except OSError:
                    continue
        return sorted(pids)

    def power_off(self) -> float:
        """SIGKILL every process of the machine at once (a machine that loses power: no
        agent is left to clean up or say goodbye); returns ``time.time()`` of the kill."""
        pids = self.processes()
        self.killed_at = time.time()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            pass
        return self.killed_at

    def stop(self) -> None:
        """End whatever is left of the machine (the harness's own clean-up)."""
        if self.proc.poll() is None:
            kill_group(self.proc)
        for pid in self.processes():  # a warm spare or reaper in its own session
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def tail(self, n: int = 2000) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-n:]
        except OSError:
            return ""

    def shm_left(self) -> List[str]:
        """``/dev/shm`` files of this machine's job left behind (host namespace only)."""
        return [] if self.private_shm else shm_leftovers(self.events())


def agent_args(port: int, rdzv_id: str, nnodes: int, extra: List[str]) -> List[str]:
    """The command line every machine of one job runs (the same on all of them)."""
    return ["--nnodes", str(nnodes), "--nproc-per-node", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", rdzv_id, *extra]


def start_job(work: str, nnodes: int, extra_agent_args: List[str], job_args: List[str],
              env: Dict[str, str], private_shm: bool, store_timeout_s: float = 60.0,
              names: Optional[List[str]] = None,
              standby_env: Optional[Dict[str, str]] = None) -> List[Machine]:
    """Start ``nnodes`` machines of one job; the first hosts the rendezvous store (it is
    started alone and the others only once its port listens, so the store host is known:
    losing it ends the job, as with torchrun).

    ``standby_env``: also a ``--standby`` machine (with these variables), last in the list.
    It starts right after the store host, and the others only once its warm spare has
    imported torch: on machines of their own its start-up would cost the job nothing,
    while here it shares two cores with the job's first seconds -- where the replication
    pacer measures what a round costs, and a round would look three times dearer for the
    next minute (its estimate fades with a 20 s half-life)."""
    import secrets
    import uuid

    env = {"CKPTRUN_SECRET": secrets.token_hex(32), **env}  # what every machine of a job shares
    log_dir = os.path.join(work, "steps")
    os.makedirs(log_dir, exist_ok=True)
    port, rdzv = free_port(), uuid.uuid4().hex[:8]
    args = agent_args(port, rdzv, nnodes, extra_agent_args)
    names = names or [f"node{i}" for i in range(nnodes)]
    machines = [Machine(names[0], work, args, job_args, log_dir, env, private_shm)]
    deadline = time.monotonic() + store_timeout_s
    while not listening(port):
        if not machines[0].alive() or time.monotonic() > deadline:
            return machines  # the caller sees a machine missing and reports the tail
        time.sleep(0.05)
    standby = None
    if standby_env is not None:
        from benchmarks.recovery import spares_warm

        standby = Machine("standby", work, args + ["--standby"], job_args, log_dir,
                          {**env, **standby_env}, private_shm)
        while not spares_warm(standby.run_dir, 1) and standby.alive() \
                and time.monotonic() < deadline + 120.0:
            time.sleep(0.1)
    machines += [Machine(n, work, args, job_args, log_dir, env, private_shm)
                 for n in names[1:nnodes]]
    if standby is not None:
        machines.append(standby)
    for m in machines:
        m.command_args = args  # type: ignore[attr-defined]
        m.job_env = env  # type: ignore[attr-defined]
    return machines


def replacement(like: Machine, name: str, work: str, job_args: List[str],
                env: Dict[str, str], extra_args: Optional[List[str]] = None) -> Machine:
    """A new machine running the same command as ``like`` (its own run directory: a new
    machine has its own disk), with ``extra_args`` (e.g. ``--standby``)."""
    m = Machine(name, work, like.command_args + list(extra_args or []),  # type: ignore[attr-defined]
                job_args,
                os.path.join(work, "steps"), {**like.job_env, **env},  # type: ignore[attr-defined]
                like.private_shm)
    m.command_args, m.job_env = like.command_args, like.job_env  # type: ignore[attr-defined]
    return m


def teardown(machines: List[Machine], work: str) -> None:
    """Stop every machine of a run, remove shared-memory files a killed one left, and the
    run's working directory."""
    for m in machines:
        m.stop()
        for path in m.shm_left():
            try:
                os.unlink(path)
            except OSError:
                pass
    shutil.rmtree(work, ignore_errors=True)
