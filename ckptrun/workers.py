"""Starting and stopping one node's worker group: environment, log routing, warm spares.

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
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import IO, Dict, List, Optional

import psutil

from ckptrun.config import AgentConfig

_PR_SET_PDEATHSIG = 1
try:  # resolved once here, in the parent: the child only calls it between fork and exec
    _prctl = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # not Linux: orphans are left to the reaper
    _prctl = None


def _child_setup() -> None:
    """Runs in the child between fork and exec: die with the agent."""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


# ---------------------------------------------------------------------------- logs

_console_lock = threading.Lock()


@dataclass
class StreamRoute:
    """Where one standard stream of one worker goes."""

    to_file: bool  # write into <attempt dir>/<local_rank>/<name>.log
    to_console: bool  # copy to the agent's console with ``prefix``
    prefix: str = ""

    @property
    def piped(self) -> bool:
        return self.to_file or (self.to_console and bool(self.prefix))

    @property
    def inherit(self) -> bool:
        """Passed straight through to the agent's own stream (torchrun's default)."""
        return self.to_console and not self.prefix and not self.to_file


def _parse_std(spec: str, nproc: int) -> Dict[int, int]:
    from torch.distributed.elastic.multiprocessing.api import Std, to_map
    return {k: int(v) for k, v in to_map(Std.from_str(spec), nproc).items()}


def stream_routes(cfg: AgentConfig, local_rank: int, global_rank: int) -> Dict[str, StreamRoute]:
    """torchrun's ``--redirects/--tee/--local-ranks-filter`` meaning, or ckptrun's default.

    ckptrun's default (no log option given): both streams go to the run dir's log files and
    to the console, each line prefixed ``[rank<N>]: ``.  With any torchrun log option the
    torchrun rules apply, including its ``[<role><local_rank>]:`` tee header.
    """
    shown = cfg.local_ranks_filter is None or local_rank in cfg.local_ranks_filter
    explicit = bool(cfg.log_dir) or cfg.redirects not in ("0", "") or cfg.tee not in ("0", "")
    routes = {}
    if not explicit:
        for name in ("stdout", "stderr"):
            routes[name] = StreamRoute(True, shown, f"[rank{global_rank}]: ")
        return routes
    redirects = _parse_std(cfg.redirects or "0", cfg.nproc_per_node)[local_rank]
    tee = _parse_std(cfg.tee or "0", cfg.nproc_per_node)[local_rank]
    for name, bit in (("stdout", 1), ("stderr", 2)):
        teed = bool(tee & bit)
        to_file = bool(redirects & bit) or teed
        to_console = shown and (teed or not to_file)
        prefix = f"[{cfg.role}{local_rank}]:" if teed else ""
        routes[name] = StreamRoute(to_file, to_console, prefix)
    return routes


class _Pump(threading.Thread):
    """Copies a worker's pipe to its log file and/or the console, line by line."""

    def __init__(self, fd: int, log: Optional[IO[bytes]], console: Optional[IO[bytes]],
                 prefix: bytes):
        super().__init__(daemon=True, name="ckptrun-log")
        self.fd, self.log, self.console, self.prefix = fd, log, console, prefix

    def run(self) -> None:
        pending = b""
        while True:
            try:
                chunk = os.read(self.fd, 65536)
            except OSError:
                chunk = b""
            if not chunk:
                break
            if self.log is not None:
                self.log.write(chunk)
                self.log.flush()
            if self.console is not None:
                lines = (pending + chunk).split(b"\n")
                pending = lines.pop()
                if lines:
                    self._show(b"".join(self.prefix + ln + b"\n" for ln in lines))
        if self.console is not None and pending:
            self._show(self.prefix + pending + b"\n")
        os.close(self.fd)
        if self.log is not None:
            self.log.close()

    def _show(self, data: bytes) -> None:
        with _console_lock:
            try:
                self.console.write(data)
                self.console.flush()
            except (OSError, ValueError):
                pass  # console gone (agent output closed): keep writing the log file


def _open_log(path: str) -> IO[bytes]:
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb")


# ---------------------------------------------------------------------------- processes


@dataclass
class Worker:
    """One running worker process."""

    local_rank: int
    global_rank: int
    proc: subprocess.Popen
    bootstrapped: bool  # runs ckptrun.bootstrap: has the faulthandler SIGUSR1 hook
    warm: bool  # was a pre-started spare
    started: float = field(default_factory=time.monotonic)
    pumps: List[_Pump] = field(default_factory=list)

    pid = property(lambda self: self.proc.pid)

    def row(self, rec: dict, node: int, now: float) -> dict:
        """This worker in ``status.json`` (``rec``: its control-block record)."""
        code = self.proc.poll()
        return {"rank": self.global_rank, "local_rank": self.local_rank, "node": node,
                "pid": self.pid, "step": rec["step"], "warm": self.warm,
                "state": "running" if code is None else "succeeded" if code == 0 else "failed",
                "heartbeat_age_s": round(now - rec["heartbeat"], 3) if rec["beats"] else None}


@dataclass
class _Spare:
    local_rank: int
    proc: subprocess.Popen
    go_fd: int  # write end of the "go" pipe
    pipes: Dict[str, Optional[int]]  # read ends of stdout/stderr, None when inherited


def _bootstrap_argv(go_fd: int, nice: int = 0) -> List[str]:
    python = os.getenv("PYTHON_EXEC", sys.executable)
    argv = [python, "-u", "-m", "ckptrun.bootstrap", "--go-fd", str(go_fd)]
    return argv + (["--nice", str(nice)] if nice else [])


def _spawn(argv: List[str], env: Dict[str, str], routes: Dict[str, StreamRoute],
           pass_fds: tuple = (), cwd: Optional[str] = None):
    """Popen with PDEATHSIG, its own process group, and pipes for captured streams."""
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
            pass_fds=pass_fds, preexec_fn=_child_setup, process_group=0, close_fds=True,
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


def _attach_pumps(reads: Dict[str, Optional[int]], routes: Dict[str, StreamRoute],
                  log_dir: str) -> List[_Pump]:
    pumps = []
    for name, fd in reads.items():
        if fd is None:
            continue
        r = routes[name]
        log = _open_log(os.path.join(log_dir, f"{name}.log")) if r.to_file else None
        console = None
        if r.to_console:
            console = (sys.stdout if name == "stdout" else sys.stderr).buffer
        pump = _Pump(fd, log, console, r.prefix.encode())
        pump.start()
        pumps.append(pump)
    return pumps


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

    def __init__(self, cfg: AgentConfig, base_env: Dict[str, str], on_spawn=None):
        self.cfg = cfg
        self.base_env = base_env  # the agent's environment + job-constant worker variables
        # knobs for measurements: CKPTRUN_WARM_SPARES=0 (cold restarts), CKPTRUN_SPARE_DELAY
        self.use_spares = os.environ.get("CKPTRUN_WARM_SPARES", "1") != "0" and not cfg.no_python
        self.spare_delay = float(os.environ.get("CKPTRUN_SPARE_DELAY", "3"))
        self.on_spawn = on_spawn or (lambda pid: None)  # tells the reaper
        self._spares: Dict[int, _Spare] = {}
        self._spares_due: Optional[float] = None
        self._spare_nice = 10 if os.geteuid() == 0 else 0  # only root can un-nice at "go"

    # -- starting ----------------------------------------------------------------------
    def start(self, local_rank: int, global_rank: int, env: Dict[str, str],
              log_dir: str) -> Worker:
        """Start one worker with ``env`` (complete environment); logs under ``log_dir``."""
        os.makedirs(log_dir, mode=0o700, exist_ok=True)
        routes = stream_routes(self.cfg, local_rank, global_rank)
        cfg = self.cfg
        if cfg.no_python:
            proc, reads = _spawn([cfg.script, *script_args(cfg, local_rank)], env, routes)
            self.on_spawn(proc.pid)
            return Worker(local_rank, global_rank, proc, False, False,
                          pumps=_attach_pumps(reads, routes, log_dir))
        argv = [cfg.script, *script_args(cfg, local_rank)]
        spare = self._take_spare(local_rank, routes)
        warm = spare is not None
        if spare is None:
            spare = self._spawn_bootstrap(local_rank, routes, env)
        msg = go_message(cfg, env, argv)
        with contextlib.suppress(BrokenPipeError):  # died meanwhile: its exit code tells
            os.write(spare.go_fd, msg)  # < pipe buffer (64 KiB) for any sane environment
        os.close(spare.go_fd)
        pumps = _attach_pumps(spare.pipes, routes, log_dir)
        return Worker(local_rank, global_rank, spare.proc, True, warm, pumps=pumps)

    def _spawn_bootstrap(self, local_rank: int, routes: Dict[str, StreamRoute],
                         env: Dict[str, str], nice: int = 0) -> _Spare:
        rfd, wfd = os.pipe()
        try:
            proc, reads = _spawn(_bootstrap_argv(rfd, nice), env, routes, pass_fds=(rfd,))
        finally:
            os.close(rfd)
        os.set_inheritable(wfd, False)
        self.on_spawn(proc.pid)
        return _Spare(local_rank, proc, wfd, reads)

    # -- warm spares -------------------------------------------------------------------
    def schedule_spares(self) -> None:
        """Called after a group starts: spares come up once the workers are past start-up."""
        if self.use_spares:
            self._spares_due = time.monotonic() + self.spare_delay

    def tick(self) -> None:
        """Main-thread housekeeping: start due spares, drop spares that died."""
        for lr, sp in list(self._spares.items()):
            if sp.proc.poll() is not None:
                self._discard(lr)
        if self._spares_due is None or time.monotonic() < self._spares_due:
            return
        self._spares_due = None
        for lr in range(self.cfg.nproc_per_node):
            if lr not in self._spares:
                # a spare's rank is only known at "go": route as for the same local rank
                routes = stream_routes(self.cfg, lr, lr)
                self._spares[lr] = self._spawn_bootstrap(lr, routes, self.base_env,
                                                         self._spare_nice)

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
        return [sp.proc.pid for sp in self._spares.values()]

    def close(self) -> None:
        """Stop all spares (end of job)."""
        self._spares_due = None
        for lr in list(self._spares):
            self._discard(lr)


# ---------------------------------------------------------------------------- stopping


def _descendants(pid: int) -> List[psutil.Process]:
    with contextlib.suppress(psutil.Error):
        return psutil.Process(pid).children(recursive=True)
    return []


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)  # the worker leads its own process group


def kill_trees(procs: List[subprocess.Popen], grace: float,
               sig: int = signal.SIGTERM) -> None:
    """Stop processes and everything they started: ``sig``, up to ``grace`` s, then SIGKILL.

    Descendants are listed *before* the first signal: once a worker is dead its children
    are re-parented and can no longer be found from it.  Returns as soon as all are gone.
    """
    tree: List[psutil.Process] = []
    for p in procs:
        tree += _descendants(p.pid)
    if grace > 0:
        for p in procs:
            if p.poll() is None:
                _signal_group(p, sig)
                _signal_group(p, signal.SIGCONT)  # a stopped (hung) worker must see it
        for d in tree:
            with contextlib.suppress(psutil.Error):
                d.send_signal(sig)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            time.sleep(0.01)
    for p in procs:
        tree += _descendants(p.pid)
        _signal_group(p, signal.SIGKILL)
    for d in tree:
        with contextlib.suppress(psutil.Error):
            d.kill()
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):  # unkillable (D state)
            p.wait(timeout=10)
    psutil.wait_procs(tree, timeout=1)


def stop_workers(workers: List[Worker], grace: float) -> None:
    """Stop a group (SIGTERM, grace, SIGKILL) and wait until their logs are drained."""
    kill_trees([w.proc for w in workers], grace)
    for w in workers:
        for pump in w.pumps:
            pump.join(timeout=2)

