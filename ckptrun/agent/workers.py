"""Starting and stopping one node's worker group: environment, warm spares, restarts
(log routing: ``ckptrun.agent.logs``).

Why ``subprocess.Popen`` and not torch's ``start_processes``: torch's process context owns
the whole life of a group (start, tail the logs, close) and gives no way to (a) make each
child die with the agent (``prctl(PR_SET_PDEATHSIG)``), (b) hand a worker over to a
*pre-started* interpreter that already imported torch (warm spares, the point of a fast
restart), or (c) put each worker in its own process group so that a whole tree, grand
children included, can be killed even after the worker itself died.  The pieces of torch
that carry meaning for users are reused: the ``Std`` redirect/tee spec and torchrun's log
layout and line headers.

Every child is spawned from the agent's main thread: ``PR_SET_PDEATHSIG`` fires when the
*thread* that forked the child exits, so a child forked by a short-lived helper thread
would be killed when that thread ends.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, FrozenSet, List, Optional, Tuple

import psutil

from ckptrun.agent.logs import Pump, StreamRoute, attach_pumps, stream_routes
from ckptrun.agent.numa import Binder
from ckptrun.agent.stopping import (
    EXIT_POLL_S,
    PF_EXITING,
    kill_trees,
    maps_a_device,
    reap_all,
    stat_flags,
    threads_exiting,
)
from ckptrun.config import AgentConfig
from ckptrun.protocol.priority import renice

_PR_SET_PDEATHSIG = 1
RETIRE_WAIT_S = 1.0  # longest wait for a killed group's threads to stop running user code
try:  # resolved once here, in the parent: the child only calls it between fork and exec
    _prctl = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # not Linux: orphans are left to the reaper
    _prctl = None


def _child_setup(cpus: Optional[FrozenSet[int]] = None) -> None:
    """Runs in the child between fork and exec: die with the agent; on ``cpus`` only
    (``--numa-binding``), as ``numactl --physcpubind`` would put it."""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if cpus:
        os.sched_setaffinity(0, cpus)


# ---------------------------------------------------------------------------- processes


@dataclass
class Worker:
    """One running worker process."""

    local_rank: int
    global_rank: int
    proc: subprocess.Popen
    bootstrapped: bool  # runs ckptrun.worker.bootstrap: has the faulthandler SIGUSR1 hook
    warm: bool  # was a pre-started spare
    started: float = field(default_factory=time.monotonic)
    pumps: List[Pump] = field(default_factory=list)
    stat_fd: int = -1  # /proc/<pid>/stat, kept open; -1 where there is none

    pid = property(lambda self: self.proc.pid)

    def __post_init__(self) -> None:
        with contextlib.suppress(OSError):
            self.stat_fd = os.open(f"/proc/{self.proc.pid}/stat", os.O_RDONLY)

    def status(self) -> Optional[int]:
        """Like ``proc.poll()``, but a worker that has begun to exit *with a failure*
        counts as exited with it (:meth:`failing`)."""
        code = self.proc.poll()
        return code if code is not None else self.failing()

    def failing(self) -> Optional[int]:
        """The exit status (``proc.returncode`` encoding) of a worker that has begun to
        exit with a failure, else None.  The kernel frees a dead process's memory before it
        can be reaped (~0.15 s per 256 MiB here); its exit status and PF_EXITING are in
        ``/proc/<pid>/stat`` from the start, so a crash is acted on while that runs."""
        if self.stat_fd < 0:
            return None
        try:
            flags, status = stat_flags(os.pread(self.stat_fd, 4096, 0))
        except (OSError, ValueError, IndexError):
            return None
        if not flags & PF_EXITING or status == 0:
            return None  # running, or a clean exit: that one is taken when reaped
        return -(status & 0x7F) if status & 0x7F else status >> 8  # waitpid encoding

    def close(self) -> None:
        if self.stat_fd >= 0:
            os.close(self.stat_fd)
            self.stat_fd = -1

    def row(self, rec: dict, node: int, now: float) -> dict:
        """This worker in ``status.json`` (``rec``: its control-block record)."""
        code = self.proc.poll()
        return {"rank": self.global_rank, "local_rank": self.local_rank, "node": node,
                "pid": self.pid, "step": rec["step"], "warm": self.warm,
                "state": "running" if code is None else "succeeded" if code == 0 else "failed",
                "heartbeat_age_s": round(now - rec["heartbeat"], 3) if rec["beats"] else None,
                # the snapshots of this process (0 before its first save)
                "saves": rec["saves"], "save_block_s": round(rec["save_block_s"], 6),
                "save_copy_s": round(rec["save_copy_s"], 6), "state_bytes": rec["state_bytes"]}


@dataclass
class _Spare:
    local_rank: int
    proc: subprocess.Popen
    go_fd: int  # write end of the "go" pipe
    pipes: Dict[str, Optional[int]]  # read ends of stdout/stderr, None when inherited


@dataclass
class HotSpare:
    """A process that ran the script up to its ``@ckptrun.resilient`` function and waits
    there (``--hot-spares``) on control record ``record``, to take ``global_rank``."""

    local_rank: int
    global_rank: int
    record: int
    proc: subprocess.Popen
    pumps: List[Pump]


def _bootstrap_argv(go_fd: int, nice: int = 0, slots: Optional[tuple] = None,
                    warm: bool = False) -> List[str]:
    python = os.getenv("PYTHON_EXEC", sys.executable)
    argv = [python, "-u", "-m", "ckptrun.worker.bootstrap", "--go-fd", str(go_fd)]
    argv += ["--nice", str(nice)] if nice else []
    argv += ["--warm"] if warm else []  # a hot spare: warmed up although its go is there
    return argv + (["--slots", slots[0], str(slots[1])] if slots else [])


def _spawn(argv: List[str], env: Dict[str, str], routes: Dict[str, StreamRoute],
           pass_fds: tuple = (), cwd: Optional[str] = None, umask: int = -1,
           cpus: Optional[FrozenSet[int]] = None):
    """Popen with PDEATHSIG, its own process group, pipes for captured streams, the
    user's own umask (``-1``: the agent's) and, with ``cpus``, that CPU affinity."""
    std: Dict[str, object] = {}
    reads: Dict[str, Optional[int]] = {}
    for name in ("stdout", "stderr"):
        r = routes[name]
        if r.piped:
            rfd, wfd = os.pipe()
            std[name], reads[name] = wfd, rfd
        elif r.inherit:
            std[name], reads[name] = None, None
        else:  # filtered out by --local-ranks-filter and not written to a file
            std[name], reads[name] = subprocess.DEVNULL, None
    try:
        proc = subprocess.Popen(
            argv, env=env, cwd=cwd, stdout=std["stdout"], stderr=std["stderr"],
            pass_fds=pass_fds, preexec_fn=functools.partial(_child_setup, cpus),
            process_group=0, close_fds=True,
            umask=umask,
        )
    except BaseException:
        for fd in reads.values():
            if fd is not None:
                os.close(fd)
        raise
    finally:
        for v in std.values():
            if isinstance(v, int) and v >= 0:
                os.close(v)
    return proc, reads


def go_message(cfg: AgentConfig, env: Dict[str, str], argv: List[str]) -> bytes:
    """The JSON a bootstrap waits for: what ``python [-m] script args`` would have run."""
    kind = "module" if cfg.module else "script"
    return json.dumps({"env": env, "argv": argv, "kind": kind, "target": cfg.script,
                       "cwd": os.getcwd(), "nice": os.getpriority(os.PRIO_PROCESS, 0)}).encode()


def script_args(cfg: AgentConfig, local_rank: int) -> List[str]:
    """Arguments after the script, with torchrun's ``--local-rank=N`` when not use_env."""
    extra = [] if cfg.use_env else [f"--local-rank={local_rank}"]
    return extra + list(cfg.script_args)


class WorkerLauncher:
    """Starts workers (from a warm spare when one is ready) and keeps spares for restarts."""

    def __init__(self, cfg: AgentConfig, base_env: Dict[str, str], on_spawn=None,
                 umask: int = -1):
        self.cfg = cfg
        self.umask = umask  # the user's: workers create files as they would under torchrun
        self.base_env = base_env  # the agent's environment + job-constant worker variables
        # knobs for measurements: CKPTRUN_WARM_SPARES=0 (cold restarts), CKPTRUN_SPARE_DELAY
        self.use_spares = os.environ.get("CKPTRUN_WARM_SPARES", "1") != "0" and not cfg.no_python
        self.spare_delay = float(os.environ.get("CKPTRUN_SPARE_DELAY", "3"))
        self.on_spawn = on_spawn or (lambda pid: None)  # tells the reaper
        self._spares: Dict[int, _Spare] = {}
        self._spares_due: Optional[float] = None
        self._spare_slots: Dict[int, str] = {}  # local rank -> slot prefix its spare maps
        self._retired: List[Tuple[List[Worker], List[psutil.Process]]] = []  # dying groups
        self._spare_nice = 10 if os.geteuid() == 0 else 0  # only root can un-nice at "go"
        self.numa = Binder(cfg.numa_binding)
        # --hot-spares: {local rank: spare that ran the script to its resilient function}
        self.hot_spares = bool(cfg.hot_spares) and self.use_spares
        self._hot: Dict[int, HotSpare] = {}
        self.hot_note: Optional[str] = None  # why hot spares were turned off, once

    # -- starting ----------------------------------------------------------------------
    def start(self, local_rank: int, global_rank: int, env: Dict[str, str],
              log_dir: str) -> Worker:
        """Start one worker with ``env`` (complete environment); logs under ``log_dir``."""
        os.makedirs(log_dir, mode=0o700, exist_ok=True)
        routes = stream_routes(self.cfg, local_rank, global_rank)
        cfg = self.cfg
        if cfg.no_python:
            proc, reads = _spawn([cfg.script, *script_args(cfg, local_rank)], env, routes,
                                 umask=self.umask, cpus=self.numa.cpus(local_rank))
            self.on_spawn(proc.pid)
            return Worker(local_rank, global_rank, proc, False, False,
                          pumps=attach_pumps(reads, routes, log_dir))
        argv = [cfg.script, *script_args(cfg, local_rank)]
        spare = self._take_spare(local_rank, routes)
        warm = spare is not None
        msg = go_message(cfg, env, argv)
        if spare is None:
            # "go" is in the pipe before the process exists: it sees a cold start for sure
            # (and imports nothing before the script), however slow the machine
            spare = self._spawn_bootstrap(local_rank, routes, env, go=msg)
        else:
            if self._spare_nice:
                # At full priority before it wakes: a niced spare waits behind every busy
                # process for the CPU it needs to read "go" (~35 ms here under load).
                renice(spare.proc.pid, os.getpriority(os.PRIO_PROCESS, 0))
            with contextlib.suppress(BrokenPipeError):  # died meanwhile: its exit code tells
                os.write(spare.go_fd, msg)  # < pipe buffer (64 KiB) for any sane environment
        os.close(spare.go_fd)
        pumps = attach_pumps(spare.pipes, routes, log_dir)
        return Worker(local_rank, global_rank, spare.proc, True, warm, pumps=pumps)

    def _spawn_bootstrap(self, local_rank: int, routes: Dict[str, StreamRoute],
                         env: Dict[str, str], nice: int = 0,
                         slots: Optional[tuple] = None, go: Optional[bytes] = None,
                         warm: bool = False) -> _Spare:
        rfd, wfd = os.pipe()
        early = go is not None and len(go) < 65536  # fits the pipe: no reader needed yet
        if early:
            os.write(wfd, go)
        try:
            proc, reads = _spawn(_bootstrap_argv(rfd, nice, slots, warm), env, routes,
                                 pass_fds=(rfd,), umask=self.umask,
                                 cpus=self.numa.cpus(local_rank))
        finally:
            os.close(rfd)
        if go is not None and not early:
            with contextlib.suppress(BrokenPipeError):
                os.write(wfd, go)
        os.set_inheritable(wfd, False)
        self.on_spawn(proc.pid)
        return _Spare(local_rank, proc, wfd, reads)

    # -- warm spares -------------------------------------------------------------------
    def schedule_spares(self, slot_prefixes: Optional[Dict[int, str]] = None) -> None:
        """Called after a group starts: spares come up once the workers are past start-up.
        ``slot_prefixes`` (local rank -> ``CKPTRUN_SLOT_PREFIX``): slot files each spare
        maps ahead of need."""
        if self.use_spares:
            self._spares_due = time.monotonic() + self.spare_delay
            self._spare_slots = dict(slot_prefixes or {})

    def tick(self) -> None:
        """Main-thread housekeeping: start due spares, drop spares that died, reap."""
        self._reap_retired()
        for lr, sp in list(self._spares.items()):
            if sp.proc.poll() is not None:
                self._discard(lr)
        if self._spares_due is None or time.monotonic() < self._spares_due:
            return
        self._spares_due = None
        for lr in range(self.cfg.nproc_per_node):
            if lr not in self._spares and lr not in self._hot:
                # a spare's rank is only known at "go": route as for the same local rank
                routes = stream_routes(self.cfg, lr, lr)
                prefix = self._spare_slots.get(lr)
                slots = (prefix, self.cfg.num_slots) if prefix else None
                self._spares[lr] = self._spawn_bootstrap(lr, routes, self.base_env,
                                                         self._spare_nice, slots)

    def _take_spare(self, local_rank: int, routes: Dict[str, StreamRoute]) -> Optional[_Spare]:
        sp = self._spares.get(local_rank)
        if sp is None or sp.proc.poll() is not None:
            if sp is not None:
                self._discard(local_rank)
            return None
        want = {n: r.piped for n, r in routes.items()}
        if want != {n: fd is not None for n, fd in sp.pipes.items()}:
            self._discard(local_rank)  # routed differently (prefix uses the global rank only)
            return None
        return self._spares.pop(local_rank)

    def _discard(self, local_rank: int) -> None:
        sp = self._spares.pop(local_rank)
        os.close(sp.go_fd)  # EOF: an idle bootstrap exits by itself
        for fd in sp.pipes.values():
            if fd is not None:
                os.close(fd)
        kill_trees([sp.proc], grace=0.0)

    def spare_pids(self) -> List[int]:
        return ([sp.proc.pid for sp in self._spares.values()]
                + [h.proc.pid for h in self._hot.values()])

    # -- hot spares (--hot-spares) -----------------------------------------------------
    def start_hot(self, local_rank: int, global_rank: int, env: Dict[str, str], record: int,
                  log_dir: str) -> None:
        """Run the script in a new process that waits at its resilient function's entry
        (``env``: the rank's own, pointed at ``record`` and at no process group)."""
        if local_rank in self._hot or not self.hot_spares:
            return
        if local_rank in self._spares:
            self._discard(local_rank)  # the hot one replaces the warm one
        os.makedirs(log_dir, mode=0o700, exist_ok=True)
        routes = stream_routes(self.cfg, local_rank, global_rank)
        argv = [self.cfg.script, *script_args(self.cfg, local_rank)]
        sp = self._spawn_bootstrap(local_rank, routes, env, go=go_message(self.cfg, env, argv),
                                   warm=True)
        os.close(sp.go_fd)
        self._hot[local_rank] = HotSpare(local_rank, global_rank, record, sp.proc,
                                         attach_pumps(sp.pipes, routes, log_dir))

    def take_hot(self, local_rank: int, global_rank: int, ready) -> Optional[HotSpare]:
        """The hot spare for ``local_rank`` when it is ``ready(record)`` and was started for
        ``global_rank``; None otherwise (a cold or warm start then)."""
        hot = self._hot.get(local_rank)
        if hot is None or hot.global_rank != global_rank or not ready(hot.record):
            return None
        return self._hot.pop(local_rank)

    def hot_status(self, ready) -> List[dict]:
        """The hot spares for ``status.json``: local rank, pid, and whether it waits ready."""
        return [{"local_rank": lr, "rank": h.global_rank, "pid": h.proc.pid,
                 "ready": bool(h.proc.poll() is None and ready(h.record))}
                for lr, h in sorted(self._hot.items())]

    def hot_wanted(self) -> bool:
        return self.hot_spares or bool(self._hot)

    def hot_pending(self) -> Dict[int, HotSpare]:
        """{local rank: its hot spare}, ready or still running the script's start-up."""
        return self._hot

    def check_hot(self) -> None:
        """A hot spare that exited never reached a resilient function: hot spares go off."""
        for lr, hot in list(self._hot.items()):
            code = hot.proc.poll()
            if code is not None:
                del self._hot[lr]
                for pump in hot.pumps:
                    pump.join(timeout=1)
                self.hot_spares = False
                self.hot_note = (f"a hot spare for local rank {lr} exited (code {code}) before "
                                 "it reached a @ckptrun.resilient function: hot spares are off "
                                 "for this job (warm spares instead)")

    def close(self) -> None:
        """Stop all spares and reap retired groups (end of job)."""
        self._spares_due = None
        for lr in list(self._spares):
            self._discard(lr)
        hot, self._hot = list(self._hot.values()), {}
        kill_trees([h.proc for h in hot], grace=0.0)
        for h in hot:
            for pump in h.pumps:
                pump.join(timeout=2)
        for workers, tree in self._retired:
            drain(workers, tree)
        self._retired = []

    # -- retiring a group for a restart ------------------------------------------------
    def retire(self, workers: List[Worker]) -> None:
        """SIGKILL a group for a restart and return once none of its threads can run user
        code -- write a slot -- any more (milliseconds), rather than once the kernel has
        freed its memory (~0.15 s per 256 MiB here): that runs while the next attempt
        starts, and :meth:`tick`/:meth:`close` reap them.  A group that mapped a device
        (GPU) is reaped first: its device memory is only free once it is gone."""
        device = any(maps_a_device(w.pid) for w in workers if w.proc.poll() is None)
        tree = kill_trees([w.proc for w in workers], 0.0, reap=False)
        deadline = time.monotonic() + RETIRE_WAIT_S
        while not device and time.monotonic() < deadline:
            if all(w.proc.poll() is not None or threads_exiting(w.pid) for w in workers):
                self._retired.append((workers, tree))
                return
            time.sleep(0.002)
        drain(workers, tree)  # a device, or a thread stuck in the kernel: wait it out

    def _reap_retired(self) -> None:
        self._retired = [(ws, tree) for ws, tree in self._retired
                         if not drain(ws, tree, block=False)]


def wait_for_exit(workers: List[Worker], timeout: float) -> None:
    """Sleep up to ``timeout`` s, but return within ``EXIT_POLL_S`` of one of the running
    ``workers`` exiting or starting to fail (:meth:`Worker.status`): a crash is acted on
    when it happens, not at the next monitor tick."""
    deadline = time.monotonic() + timeout
    while True:
        if any(w.proc.returncode is None and
               (w.failing() if w.stat_fd >= 0 else w.proc.poll()) is not None for w in workers):
            return
        left = deadline - time.monotonic()
        if left <= 0:
            return
        time.sleep(min(EXIT_POLL_S, left))


def stop_workers(workers: List[Worker], grace: float, sig: int = signal.SIGTERM) -> None:
    """Stop a group (``sig``, ``grace``, SIGKILL; ``grace`` 0: SIGKILL at once) and wait
    until their logs are drained.  ``sig``: the signal the agent received, as torchrun
    forwards it (a script may handle SIGINT and SIGTERM differently)."""
    drain(workers, kill_trees([w.proc for w in workers], grace, sig=sig))


def drain(workers: List[Worker], tree: List[psutil.Process], block: bool = True) -> bool:
    """Reap a killed group (``block`` False: only if it is gone already) and drain its
    logs; False if it is not gone yet."""
    if block:
        reap_all([w.proc for w in workers], tree)
    elif any(w.proc.poll() is None for w in workers):
        return False
    for w in workers:
        w.close()
        for pump in w.pumps:
            pump.join(timeout=2 if block else 0)
    return True
