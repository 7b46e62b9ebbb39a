"""The agent: rendezvous, start the local workers, watch exits and heartbeats, restart.

``run_agent(cfg)`` is the whole life of one ``ckptrun`` process (one per machine)::

    rendezvous (torch handler)  ->  epoch = "<attempt>:<restarts>:<state>" in the store
    loop:   decide the restore step (tiers.restore_decision)  ->  start workers (attempt k)
            supervise: exit codes, heartbeats/hangs, fatal flag, the job-wide epoch
            failure anywhere  ->  epoch k+1 (counted once)  ->  every node restarts
            all nodes done    ->  exit 0;   budget spent -> 1;   fatal -> 2

Exit codes: 0 success, 1 job failed (restart budget spent, a restart loop) or stopped by a
signal (forwarded to the workers, as torchrun does; the newest step is persisted first),
2 configuration error.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence, Tuple

from ckptrun import protocol as P
from ckptrun.agent.downtime import RecoveryClock
from ckptrun.agent.events import (
    EventLog,
    ensure_run_dir,
    rank_ranges,
    read_json,
    to_stderr,
    write_json_atomic,
)
from ckptrun.agent.failure_summary import Exit, failure_summary
from ckptrun.agent.hang import (
    Hang,
    HangDetector,
    dump_stacks,
    process_stopped,
    stacks_path,
    stopped_descendant,
)
from ckptrun.agent.inplace import (
    UNWIND_TIMEOUT_S,
    ask,
    await_unwound,
    hand_over,
    hot_spare_ready,
    keepable,
)
from ckptrun.agent.membership import NodeLost, join_round, local_address, replace_nodes
from ckptrun.agent.metrics import AgentMetrics, MetricsServer
from ckptrun.agent.reaper import Reaper, unlink_shm
from ckptrun.agent.rendezvous import (
    FAILED,
    FATAL,
    RUN,
    Epoch,
    Rendezvous,
    agent_base_env,
    torchrun_env,
)
from ckptrun.agent.restart_loops import RestartLoops, describe_how, error_message, signature
from ckptrun.agent.standby import release_standbys, wait_for_a_place
from ckptrun.agent.workers import Worker, WorkerLauncher, stop_workers, wait_for_exit
from ckptrun.config import AgentConfig
from ckptrun.protocol.untrusted import UntrustedFile
from ckptrun.tiers.interface import Tier
from ckptrun.tiers.memory.node import NodeMemory
from ckptrun.tiers.peer.standby_copies import describe as describe_standby
from ckptrun.tiers.restore_decision import decide_restore

# How long a worker's exception waits for news of a lost machine before it counts as a
# failure of its own (the link to a lost machine's agent broke 20-130 ms after the
# survivor's worker raised, in the machine-loss tests)
LOSS_GRACE_S = 0.3


class ResumeRefused(Exception):
    """``--resume-from`` names a checkpoint no step of which every rank can restore: the job
    stops (exit 2) rather than train from scratch under a name that says it resumed."""


class AgentSignal(Exception):
    """Raised in the main thread by the agent's signal handler."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _config_error(cfg: AgentConfig) -> Optional[str]:
    """Last-line checks (args.py validates the command line with friendlier messages)."""
    for bad, msg in ((cfg.nproc_per_node < 1, "--nproc-per-node must be >= 1"),
                     (cfg.min_nodes < 1 or cfg.max_nodes < cfg.min_nodes, "invalid --nnodes"),
                     (cfg.max_restarts < 0, "--max-restarts must be >= 0"),
                     (cfg.module and cfg.no_python, "--no-python and --module exclude each other"),
                     (not cfg.run_dir, "run_dir is not set")):
        if bad:
            return msg
    return None


class Agent:
    """One node's supervisor; see the module docstring."""

    def __init__(self, cfg: AgentConfig, user_umask: int = 0o022):
        self.cfg = cfg
        self.user_umask = user_umask  # the workers get it back: their files are as under torchrun
        self.run_dir = ensure_run_dir(cfg.run_dir)
        self.events = EventLog(self.run_dir, echo=to_stderr, forward_to=cfg.event_log_handler)
        self.token = secrets.token_hex(6)  # distinct per agent: two agents on one host
        self.hang = HangDetector(cfg.hang_timeout)
        self.clock = RecoveryClock()
        self.exits: List[Exit] = []  # the last attempt's workers that exited with an error
        self.workers: List[Worker] = []
        self.tiers: List[Tier] = []  # nearest first; built for each membership (join_round)
        self.failures: List[dict] = []
        self.state = "starting"
        self.epoch = Epoch(0, 0)
        self.restore: Dict[str, object] = {"step": 0}
        self._last_status = 0.0
        self._intervals: Dict[int, int] = {}  # rank -> snapshot interval last logged
        self.loops = RestartLoops()
        self.stopped_by: Optional[int] = None  # the signal that stopped the job
        self.metrics: Optional[AgentMetrics] = None
        self.metrics_server: Optional[MetricsServer] = None
        self.kept: Dict[int, Worker] = {}  # local rank -> worker recovering in place
        # after a machine loss: the attempt the kept workers were asked to unwind for, and
        # until when they may take to do it (``settle_kept``)
        self._kept_target, self._kept_deadline = 0, 0.0
        self._retired_early: set = set()  # pids retired before the survivors unwound
        self._hung: List[int] = []  # local ranks the last hang verdict named

    def run(self) -> int:
        code = 1
        if self.cfg.metrics_port is not None:
            try:
                self._serve_metrics()
            except OSError as exc:  # the port is taken, the address not this machine's
                print(f"ckptrun: error: --metrics-port {self.cfg.metrics_port} on "
                      f"{self.cfg.metrics_addr}: {exc.strerror or exc}", file=sys.stderr)
                self.events.close()
                return 2
        self.reaper = Reaper(self.token)
        # --hot-spares: a record per local rank after the workers' for its hot spare
        records = self.cfg.nproc_per_node * (2 if self.cfg.hot_spares else 1)
        self.control = P.ControlBlock(P.control_path(self.token), records, create=True)
        self.memory = NodeMemory(self.token, self.cfg.num_slots)
        self.launcher = WorkerLauncher(self.cfg, agent_base_env(self.cfg),
                                       on_spawn=self.reaper.watch, umask=self.user_umask)
        old = {s: signal.signal(s, self._on_signal) for s in _signals(self.cfg)}
        try:
            code = self._run()
        except AgentSignal as e:  # preemption (Slurm, Kubernetes) or Ctrl-C
            self.stopped_by = e.signum
            print(f"ckptrun: received {e}: stopping the workers with {e}, then persisting "
                  "the newest step every rank committed", file=sys.stderr)
            code = 1  # as torchrun: it forwards the signal and exits 1
        finally:
            for s in old:
                signal.signal(s, signal.SIG_IGN)  # a 2nd Ctrl-C must not cut the cleanup
            self._shutdown(code)
            for s, h in old.items():
                signal.signal(s, h)
        return code

    def _serve_metrics(self) -> None:
        """Start ``--metrics-port`` before anything else: a port in use is one line, exit 2."""
        self.metrics = AgentMetrics()
        self.metrics_server = MetricsServer(self.metrics, self.cfg.metrics_port,
                                            self.cfg.metrics_addr)
        self.events.listeners.append(self.metrics.event)

    def _on_signal(self, signum, frame) -> None:  # raised wherever the main thread is
        raise AgentSignal(signum)

    def _run(self) -> int:
        cfg = self.cfg
        # a value in the store that is not this job's is dropped, and said so
        self.rdzv = Rendezvous(cfg, on_forged=lambda key: self.events.emit(
            "store_forged", key=key[-120:]))
        if cfg.standby:
            code = wait_for_a_place(self, join_round, local_address)
            if code is not None:
                return code
        elif not join_round(self):
            return 1
        self.events.emit("start", nnodes=self.info.group_world_size,
                         nproc_per_node=cfg.nproc_per_node, node=self.info.group_rank,
                         run_id=self.info.run_id, job_token=self.token,
                         **({"insecure": True} if cfg.insecure and cfg.secret is None else {}))
        while True:
            if self.epoch.state in (FAILED, FATAL):
                return 1 if self.epoch.state == FAILED else 2
            self._started = False
            try:
                self._start_group()
                outcome = self._supervise()
            except ResumeRefused as e:
                print(f"ckptrun: error: {e}", file=sys.stderr)
                self.events.emit("resume_refused", error=str(e))
                return 2
            except NodeLost as lost:
                outcome = lost
                self.clock.failed(at=time.monotonic() - lost.silent_s)
            restart = isinstance(outcome, NodeLost) or getattr(outcome, "state", "") == RUN
            # workers kept for an attempt that never started: a machine was lost while it
            # began (``decide_restore`` raised); they wait unwound and take a later attempt
            carried, self.kept = list(self.kept.values()), {}
            if restart and isinstance(outcome, Epoch):
                self.kept = self._unwind_survivors(outcome.attempt)
            elif isinstance(outcome, NodeLost):
                # a machine lost: where this machine's ranks stay what they are, its resilient
                # workers go on in their own processes with the new members.  They are asked
                # now and awaited once the membership is formed (``settle_kept``): the
                # standby's takeover does not wait for a survivor to reach a collective.
                # The next attempt is at least this one; an unwound worker takes a later go.
                self._kept_target = self.epoch.attempt + 1
                self._kept_deadline = time.monotonic() + UNWIND_TIMEOUT_S
                self.kept = {w.local_rank: w
                             for w in self._ask_survivors(self._kept_target, carried)}
            self._stop_group(restart)
            self.clock.stopped()
            if isinstance(outcome, NodeLost):
                if not replace_nodes(self, outcome):
                    self.drop_kept()
                    return 1
                continue
            if outcome == "done":
                self.coord.exit_barrier(self.epoch.attempt)
                return 0
            self.epoch = outcome
            if self.epoch.state == RUN:
                self.state = "restarting"
                inplace = ({"in_place": sorted(w.global_rank for w in self.kept.values())}
                           if self.kept else {})
                self.events.emit("restart", attempt=self.epoch.attempt,
                                 restarts=self.epoch.restarts, **inplace)

    def _unwind_survivors(self, target: int) -> Dict[int, Worker]:
        """In-process recovery: the live ``@ckptrun.resilient`` workers that unwound for
        attempt ``target`` (``ckptrun.agent.inplace``); the rest are restarted."""
        candidates = self._ask_survivors(target)
        kept = await_unwound(candidates, self.control, target,
                             time.monotonic() + UNWIND_TIMEOUT_S)
        late = [w for w in candidates if w.local_rank not in kept and w.proc.poll() is None]
        if late:
            self._say_late(late)
        return kept

    def _say_late(self, late: List[Worker]) -> None:
        """Survivors that did not unwind in time are restarted; their stacks say where they
        were (a wait that no broken collective reaches is a bug of in-place recovery)."""
        dumped = self._stacks_of(late, wait=0.5)
        for w in late:
            fields = {"seconds": UNWIND_TIMEOUT_S,
                      **({"stacks": dumped[w.global_rank]} if w.global_rank in dumped else {})}
            self.events.emit("unwind_timeout", rank=w.global_rank, attempt=self.epoch.attempt,
                             **fields)
            self._fail(w, event="unwind_timeout", **fields)

    def _ask_survivors(self, target: int, carried: Sequence[Worker] = ()) -> List[Worker]:
        """The live ``@ckptrun.resilient`` workers (and the live ``carried`` ones, unwound
        for an earlier target), asked to unwind for attempt ``target``; the others are
        retired first."""
        hung, self._hung = self._hung, []
        candidates = keepable(self.workers, self.control, self.epoch.attempt, hung)
        candidates += [w for w in carried if w.status() is None and w not in candidates]
        if not candidates:
            return []
        # the others (dead, hung, not resilient) go first: a survivor's collective with a
        # stopped rank -- one a stack dump's SIGCONT woke -- then fails at once, and its
        # group's teardown does not wait for that rank
        going = [w for w in self.workers if w not in candidates]
        if going:
            self._await_copies(going)
            self.launcher.retire(going)
            self._retired_early = {w.pid for w in going}
        ask(candidates, self.control, target)
        return candidates

    def settle_kept(self) -> None:
        """After a machine loss: keep the asked workers that unwound (by the deadline set
        when they were asked); retire the others."""
        if not self.kept:
            return
        if self.epoch.attempt < self._kept_target:
            # the failure was not counted (the store did not answer): the next attempt is
            # older than the one they unwound for, and an unwound worker takes only a later go
            self.drop_kept()
            return
        asked = list(self.kept.values())
        self.kept = await_unwound(asked, self.control, self._kept_target, self._kept_deadline)
        self._retire_asked([w for w in asked if w.local_rank not in self.kept])

    def drop_kept(self) -> None:
        """The kept workers cannot go on after all (the job ends, or a new membership gave
        this machine other ranks): retire them as a restart does."""
        kept, self.kept = list(self.kept.values()), {}
        self._retire_asked(kept)

    def _retire_asked(self, workers: List[Worker]) -> None:
        """Retire workers that were asked to unwind but will not go on."""
        if workers:
            # one that did not unwind in time may be in the middle of a snapshot: let it
            # finish, as a restart does, or the step it was saving is lost with it
            self._await_copies(workers)
            self.launcher.retire(workers)
            for w in workers:
                self.reaper.forget(w.pid)

    def _reached_step(self) -> int:
        """The newest step this machine's ranks are known to have committed: in their slots,
        or in their records of the attempt that just ended (0: none, e.g. a new machine)."""
        steps = [s for r in self._ranks() for s in self.memory.steps(r)]
        for lr in range(self.cfg.nproc_per_node):
            with contextlib.suppress(IndexError, ValueError):
                steps.append(int(self.control.get(lr, "committed_step")))
        return max([0, *steps])

    def _ranks(self) -> List[int]:
        base = self.info.group_rank * self.cfg.nproc_per_node
        return [base + lr for lr in range(self.cfg.nproc_per_node)]

    def _slot_prefix(self, rank: int) -> str:
        return self.memory.slot_prefix(rank)

    def _start_group(self) -> None:
        cfg, info, attempt = self.cfg, self.info, self.epoch.attempt
        reached = self._reached_step()
        forced = self.coord.rollback_step(attempt)
        self.restore = decide_restore(self.tiers, self._ranks(), self.coord, attempt, forced)
        self.restored_emitted = False
        if reached and not self.restore.get("step") and forced is None:
            # never a silent fresh start: hours of training may have just been lost
            self.events.emit("progress_lost", step=reached, attempt=attempt)
        if attempt == 0 and self.restore.get("step"):  # the same command run again
            to_stderr(f"resuming from step {self.restore['step']} ({self.restore['tier']})")
        elif attempt == 0 and cfg.resume_from:  # asked for a checkpoint: never a fresh start
            why = next((t.rejected for t in self.tiers if t.rejected), None)
            raise ResumeRefused(f"--resume-from {cfg.resume_from} cannot be restored: "
                                f"{why or 'no step every rank can read'}")
        master_addr, port = self.coord.master_port(attempt, info, self._own_addr)
        logs = os.path.join(self._log_root(), f"attempt_{attempt}")
        os.makedirs(os.path.join(self.run_dir, "stacks"), mode=0o700, exist_ok=True)
        self.hang.reset()
        self.exits = []
        self.workers = []
        kept, self.kept = self.kept, {}
        self._envs: Dict[int, Dict[str, str]] = {}
        for lr, rank in enumerate(self._ranks()):
            rank_logs = os.path.join(logs, str(lr))
            env = dict(self.launcher.base_env)
            env.update(torchrun_env(
                cfg, local_rank=lr, group_rank=info.group_rank,
                group_world_size=info.group_world_size, master_addr=master_addr,
                master_port=port, attempt=attempt, run_id=info.run_id,
                use_agent_store=info.use_agent_store,
                error_file=os.path.join(rank_logs, "error.json")))
            env.update({
                P.ENV_CONTROL: self.control.path, P.ENV_LOCAL_RANK: str(lr),
                P.ENV_SLOT_PREFIX: self._slot_prefix(rank),
                P.ENV_NUM_SLOTS: str(cfg.num_slots), P.ENV_RESTORE: json.dumps(self.restore),
                P.ENV_RUN_DIR: self.run_dir,
                P.ENV_STACKS_FILE: stacks_path(self.run_dir, attempt, rank),
            })
            if cfg.persist_to:
                env.setdefault(P.ENV_PERSIST_TO, cfg.persist_to)
            if cfg.snapshot_every != "1":
                env[P.ENV_EVERY] = cfg.snapshot_every
            self._envs[lr] = env
            if lr in kept:  # goes on in its own process (its logs stay where they were)
                os.makedirs(rank_logs, mode=0o700, exist_ok=True)  # its error file's place
                hand_over(self.run_dir, self.control, lr, attempt, env)
                self.workers.append(kept[lr])
                continue
            hot = self.launcher.take_hot(lr, rank, self._hot_ready)
            if hot is not None:  # ran the script to its resilient function already
                os.makedirs(rank_logs, mode=0o700, exist_ok=True)
                hand_over(self.run_dir, self.control, lr, attempt, env, record=hot.record)
                self.workers.append(Worker(lr, rank, hot.proc, True, True, pumps=hot.pumps))
                continue
            self.control.reset(lr)
            self.workers.append(self.launcher.start(lr, rank, env, rank_logs))
        self.launcher.schedule_spares({lr: self._slot_prefix(rank)
                                       for lr, rank in enumerate(self._ranks())})
        self._hot_due = time.monotonic() + self.launcher.spare_delay
        self._started = True
        self.clock.started()
        for tier in self.tiers:
            tier.attempt_started(attempt)
        self.state = "running"
        self._write_status(force=True)

    def _log_root(self) -> str:
        """torchrun's ``<log-dir>/<run-id>_<random>/`` with --log-dir, else ``<run-dir>/logs``."""
        if not hasattr(self, "_logs"):
            os.makedirs(self.cfg.log_dir or self.run_dir, mode=0o700, exist_ok=True)
            self._logs = (tempfile.mkdtemp(prefix=f"{self.info.run_id}_", dir=self.cfg.log_dir)
                          if self.cfg.log_dir else os.path.join(self.run_dir, "logs"))
        return self._logs

    def _stop_group(self, restart: bool) -> None:
        """A restart SIGKILLs once no snapshot copy is under way (snapshots are in agent memory;
        survivors sit in a collective where no handler runs); a final stop SIGTERMs first."""
        kept = set(self.kept)
        early, self._retired_early = self._retired_early, set()
        going = [w for w in self.workers if w.local_rank not in kept and w.pid not in early]
        if restart:
            self._await_copies(going)  # not the kept ones': they finish it as they unwind
            self.launcher.retire(going)
        else:
            stop_workers(going, self.cfg.shutdown_timeout)
        for w in self.workers:
            if w.local_rank not in kept:
                self.reaper.forget(w.pid)
            # every bootstrap opens its stacks file; keep only real dumps
            path = stacks_path(self.run_dir, self.epoch.attempt, w.global_rank)
            with contextlib.suppress(OSError):
                if os.path.getsize(path) == 0:
                    os.unlink(path)

    def _await_copies(self, workers: List[Worker]) -> None:
        """Live ``workers`` about to be killed that are in the middle of a snapshot (phase
        SAVING) may finish it first (up to 2x their last copy time, within
        ``--shutdown-timeout``): no step lost to the kill."""
        busy = {w.local_rank: (w, rec) for w in workers if w.status() is None
                for rec in [self.control.record(w.local_rank)] if rec["phase"] == P.Phase.SAVING}
        limit = 0.1 + 2 * max([rec["save_copy_s"] for _, rec in busy.values()], default=0.0)
        deadline = time.monotonic() + min(self.cfg.shutdown_timeout, limit)
        while busy and time.monotonic() < deadline:
            time.sleep(0.005)
            for lr, (w, before) in list(busy.items()):
                rec = self.control.record(lr)  # done: phase left SAVING, or a newer save began
                if (rec["phase"] != P.Phase.SAVING or rec["beats"] != before["beats"]
                        or w.status() is not None):
                    del busy[lr]

    def _progressed(self) -> bool:
        """Whether a worker of this attempt committed a snapshot after its restore."""
        start = int(self.restore.get("step", 0) or 0)
        return any(self.control.record(w.local_rank)["committed_step"] > start
                   for w in self.workers)

    def _error_file(self, w: Worker) -> str:
        return os.path.join(self._log_root(), f"attempt_{self.epoch.attempt}", str(w.local_rank),
                            "error.json")

    def _fail(self, w: Worker, **fields) -> None:
        rec = {"time": time.time(), "rank": w.global_rank, "local_rank": w.local_rank,
               "attempt": self.epoch.attempt, **fields}
        self.failures = (self.failures + [rec])[-20:]

    def _supervise(self):
        """Watch the group until it is done ("done") or the epoch moves (new Epoch)."""
        attempt, marked_done = self.epoch.attempt, False
        while True:
            wait_for_exit(self.workers, self.cfg.monitor_interval)
            self.launcher.tick()
            self._tend_hot_spares()
            for tier in self.tiers:
                tier.tick()  # the memory tier keeps the slots mapped for a fast verify
            codes = [self._status(w) for w in self.workers]
            failed = primary_first([(w, c) for w, c in zip(self.workers, codes)
                                    if c not in (None, 0)])
            fatal = self._fatal()
            if fatal is not None:  # before the exit it causes: a restart cannot fix it
                return fatal
            if failed:
                self._await_a_lost_machine([c for _, c in failed])  # raises NodeLost
                self._note_restored([self.control.record(w.local_rank) for w in self.workers])
                seen = []
                for w, c in failed:
                    how = ({"signal": signal.Signals(-c).name} if c < 0 else {"exit_code": c})
                    self.events.emit("worker_failed", rank=w.global_rank, attempt=attempt,
                                     **how)
                    self._fail(w, event="worker_failed", **how)
                    seen.append((w.global_rank, describe_how(how),
                                 error_message(self._error_file(w))))
                self.clock.failed(at=self._last_sign_of_life([w for w, _ in failed]))
                self.exits = [Exit(w.global_rank, w.local_rank, w.pid, c, self._error_file(w))
                              for w, c in failed]
                if self.loops.failed(signature(seen), self._progressed()):
                    self.events.emit("restart_loop", attempt=attempt, failures=self.loops.count,
                                     ranks=[r for r, _, _ in seen], how=seen[0][1],
                                     error=seen[0][2])
                    return self.coord.report_stop(attempt)
                return self.coord.report_failure(attempt)
            verdict = self._check_control(codes)
            if verdict is not None:
                return verdict
            if all(c == 0 for c in codes) and not marked_done:
                self.coord.mark_done(attempt)
                marked_done = True
            if marked_done and self.coord.all_done(attempt):
                return "done"
            if self.live is not None:
                self.live.check()  # raises NodeLost
            epoch = self.coord.poll()
            if epoch != self.epoch:
                self.clock.failed()  # another node's failure: counted from here
                return epoch  # another node failed: restart here too
            rollback = self._rollback_asked()
            if rollback is not None:  # ``ckptrun restore --rollback N``: not a failure
                self.coord.set_rollback(attempt + 1, rollback)
                return self.coord.request_restart(attempt)
            self._write_status()

    def _rollback_asked(self) -> Optional[int]:
        """The step ``ckptrun restore --rollback N`` asked for (its ``rollback.json``, taken
        away once read); None when none was asked.  A file there that is not one ckptrun
        wrote (a symlink, a FIFO, no step) is said in one line and removed, never followed."""
        path = os.path.join(self.run_dir, "rollback.json")
        if not os.path.lexists(path):
            return None
        try:
            asked = read_json(path)
            step = asked.get("step") if isinstance(asked, dict) else None
            if asked is not None and (type(step) is not int or step < 0):
                raise UntrustedFile(f"{path} names no step")
        except UntrustedFile as e:
            print(f"ckptrun: ignoring a rollback request: {e}", file=sys.stderr, flush=True)
            step = None
        with contextlib.suppress(OSError):
            os.unlink(path)
        return step

    def _await_a_lost_machine(self, codes: List[int]) -> None:
        """A worker of a job on several machines raised (or aborted): most often because a
        collective's connection to a machine that is gone closed, and the link to that
        machine's agent breaks within the same few tens of milliseconds.  Waiting that long
        makes it one restart, with the new membership, instead of a local restart first --
        which the loss, seen a moment later, throws away together with the warm spares it
        used (the next start is then cold: seconds).  A worker killed by a signal is its
        own failure: no wait."""
        if self.live is None or not any(c > 0 or c == -signal.SIGABRT for c in codes):
            return
        deadline = time.monotonic() + LOSS_GRACE_S
        while True:
            self.live.check()
            if time.monotonic() >= deadline:
                return
            time.sleep(0.02)

    def _tend_hot_spares(self) -> None:
        """``--hot-spares``: once a worker runs its resilient function (and the group is past
        its start-up), a spare for its rank runs the script to that point and waits."""
        launcher = self.launcher
        if not launcher.hot_wanted():
            return
        launcher.check_hot()
        if launcher.hot_note is not None:
            to_stderr(launcher.hot_note)
            self.events.emit("hot_spares_off", why=launcher.hot_note)
            launcher.hot_note = None
            return
        if time.monotonic() < self._hot_due:
            return
        nproc = self.cfg.nproc_per_node
        for w in self.workers:
            lr = w.local_rank
            if w.status() is not None or not self.control.get(lr, "resilient"):
                continue
            if lr in launcher.hot_pending():
                continue
            env = dict(self._envs[lr])
            logs = os.path.join(self._log_root(), "hot_spares", str(lr))
            env.update({P.ENV_HOT_SPARE: str(nproc + lr), "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": "1",  # a group made before the function fails fast
                        P.ENV_RESTORE: '{"step": 0}',
                        P.ENV_STACKS_FILE: os.path.join(self.run_dir, "stacks",
                                                        f"hot-spare-local{lr}.txt"),
                        "TORCHELASTIC_ERROR_FILE": os.path.join(logs, "error.json")})
            self.control.reset(nproc + lr)
            launcher.start_hot(lr, w.global_rank, env, nproc + lr, logs)

    def _hot_ready(self, record: int) -> bool:
        return hot_spare_ready(self.control, record)

    def _fatal(self) -> Optional[Epoch]:
        """A worker that hit a configuration error a restart cannot fix (``fatal``): the job
        stops with exit code 2."""
        for w in self.workers:
            fatal = self.control.get(w.local_rank, "fatal")
            if fatal:
                self.events.emit("worker_failed", rank=w.global_rank, exit_code=2, fatal=fatal)
                self._fail(w, event="fatal", fatal=fatal)
                return self.coord.report_fatal(self.epoch.attempt)
        return None

    def _status(self, w: Worker) -> Optional[int]:
        """``w.status()``, or exit code 1 for a worker whose script raised and is on its
        way out (its traceback printed; the interpreter's teardown may take seconds)."""
        code = w.status()
        if code is None and self.control.get(w.local_rank, "raised"):
            return 1
        return code

    def _check_control(self, codes) -> Optional[Epoch]:
        now, restored = time.monotonic(), []
        for w, code in zip(self.workers, codes):
            rec = self.control.record(w.local_rank)
            restored.append(rec)
            self._note_interval(w, rec)
            if code is not None:
                self.hang.gone(w.local_rank)
                continue
            self.hang.observe(w.local_rank, rec["beats"], rec["heartbeat"], rec["sampled"],
                              rec["advanced"], rec["phase"])
        remote_age = None
        if self.live is not None:
            if now - self.hang.local_progress(now) < 1.0:
                self.live.advancing()  # the other nodes' verdicts count our progress
            remote_age = self.live.remote_progress_age()
        by_pid = {w.local_rank: w.pid for w in self.workers}
        hang = self.hang.verdict(now, remote_age,
                                 lambda lr: lr in by_pid and process_stopped(by_pid[lr]))
        if hang is not None:  # the ranks that stopped, not the ones waiting on them
            by_local = {w.local_rank: w for w in self.workers}
            children = {}  # local rank -> the stopped process it started
            if hang.deadlock:
                children = {lr: c for lr in hang.ranks
                            for c in [stopped_descendant(by_local[lr].pid)] if c is not None}
                if children:
                    hang = Hang(hang.silent_s, sorted(children), deadlock=False)
            self._hung = list(hang.ranks)
            for lr in hang.ranks:
                w = by_local[lr]
                cause = {"why": "deadlock" if hang.deadlock else
                         "child_stopped" if children else "stopped"}
                if children:
                    cause.update(child_pid=children[lr][0], child=children[lr][1])
                self.events.emit("hang_detected", rank=w.global_rank,
                                 seconds_silent=hang.silent_s, attempt=self.epoch.attempt,
                                 **cause)
                # (status's recent failures say why too, from the same fields)
                self._fail(w, event="hang_detected", seconds_silent=hang.silent_s, **cause)
            self.clock.failed(at=now - hang.silent_s, now=now)
            self._dump_stacks()
            return self.coord.report_failure(self.epoch.attempt)
        self._note_restored(restored)
        recovered = self.clock.finish(restored)
        if recovered is not None:
            self.events.emit("recovered", attempt=self.epoch.attempt,
                             step=int(self.restore.get("step", 0) or 0),
                             tier=self.restore.get("tier"), **recovered)
        return None

    def _last_sign_of_life(self, workers: List[Worker]) -> Optional[float]:
        """When the first of ``workers`` was last seen alive (its progress sampler or its
        heartbeat, monotonic); None when none of them ever reported."""
        seen = [max(rec["sampled"], rec["heartbeat"]) for w in workers
                for rec in [self.control.record(w.local_rank)]]
        seen = [t for t in seen if t > 0]
        return min(seen) if seen else None

    def _note_restored(self, records) -> None:
        """``restored`` once every worker's ``restore()`` returned (also when one died soon
        after: its control record keeps what it restored)."""
        if not self.restored_emitted and records and \
                all(r["restored_step"] >= 0 for r in records):
            self.restored_emitted = True
            step = min(r["restored_step"] for r in records)
            if step > 0:  # restore() returning 0 means "nothing to restore"
                self.events.emit("restored", step=step, tier=self.restore.get("tier", "memory"),
                                 seconds=round(max(r["restore_s"] for r in records), 4))

    def _note_interval(self, w, rec: dict) -> None:
        """A worker snapshotting every N steps (``every=``/``--snapshot-every``): log each
        interval it picks (under "auto" it changes with the measured cost)."""
        every = rec["snapshot_every"]
        if every and self._intervals.get(w.global_rank) != every:
            self._intervals[w.global_rank] = every
            self.events.emit("snapshot_interval", rank=w.global_rank, every=every,
                             step=rec["step"], overhead=round(rec["snapshot_overhead"], 4))

    def _dump_stacks(self) -> None:
        """One ``stacks_dumped`` event per rank whose stacks were written; one line said for
        all of them (eight ranks made eight lines naming the same folder)."""
        dumped = self._stacks_of([w for w in self.workers if w.proc.poll() is None])
        for rank, path in dumped.items():
            self.events.emit("stacks_dumped", say=False, path=path, rank=rank)
        paths = list(dumped.values())
        if len(paths) == 1:
            self.events.say(f"stacks of the hung worker are in {paths[0]}")
        elif paths:
            where = os.path.join(os.path.dirname(paths[0]),
                                 f"attempt_{self.epoch.attempt}-rank*.txt")
            self.events.say(f"stacks of the hung workers (ranks {rank_ranges(dumped)}) "
                            f"are in {where}")

    def _stacks_of(self, workers: List[Worker], wait: float = 1.0) -> Dict[int, str]:
        """{global rank: file} of ``workers`` whose stacks were dumped, in the order they
        were (``<run-dir>/stacks/attempt_<k>-rank<r>.txt``, the file each worker's
        faulthandler writes to for this attempt)."""
        at = {stacks_path(self.run_dir, self.epoch.attempt, w.global_rank): w for w in workers}
        paths = dump_stacks([(w.pid, w.bootstrapped, p, p) for p, w in at.items()], wait=wait)
        return {at[p].global_rank: p for p in paths}

    def _write_status(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_status < 0.5:
            return
        self._last_status = now
        st = self.status()
        write_json_atomic(os.path.join(self.run_dir, "status.json"), st)
        if self.metrics is not None:
            self.metrics.status(st)

    def status(self) -> dict:
        """The ``status.json`` object (DESIGN §1 keys plus the agent's own)."""
        cfg, now = self.cfg, time.monotonic()
        info = getattr(self, "info", None)
        recs = [self.control.record(w.local_rank) for w in self.workers]
        workers = [w.row(r, info.group_rank if info else 0, now) for w, r in zip(self.workers, recs)]
        for row, r in zip(workers, recs):
            # interval mode (0: a snapshot at every step), or what every-step snapshots
            # were measured to cost the loop
            if r["snapshot_every"] or r["snapshot_overhead"]:
                row.update(snapshot_every=r["snapshot_every"] or 1,
                           snapshot_overhead=round(r["snapshot_overhead"], 4))
        slots = {str(w.global_rank): [p for k in range(cfg.num_slots) for p in
                                      [P.slot_path(self._slot_prefix(w.global_rank), k)]
                                      if os.path.exists(p)] for w in self.workers}
        checkpoint = {"memory_step": None, "peer_step": None, "persisted_step": None,
                      "persisted_url": None}
        for tier in self.tiers:
            checkpoint.update(tier.status())
        if self.state in ("succeeded", "failed"):  # the agent unlinks its slots on exit
            checkpoint["memory_step"] = None
            slots = {}
        return {
            "run_id": info.run_id if info else cfg.rdzv_id, "state": self.state,
            "restarts": self.epoch.restarts, "attempt": self.epoch.attempt,
            "nnodes": info.group_world_size if info else cfg.min_nodes,
            "nproc_per_node": cfg.nproc_per_node,
            "node": info.group_rank if info else (None if cfg.standby else 0),
            "standby": cfg.standby and info is None,  # waiting for a machine to replace
            **describe_standby(getattr(self, "standby_holder", None)),
            "linked_nodes": (self.live.links.linked() if getattr(self, "live", None)
                             and self.live.links else []),
            "agent_pid": os.getpid(), "updated": time.time(), "job_token": self.token,
            "persist_to": cfg.persist_to, "workers": workers, "checkpoint": checkpoint,
            "failures": self.failures, "slots": slots,
            "hang_timeout_s": self.hang.current_timeout(), "restore": self.restore,
            "spare_pids": self.launcher.spare_pids(),
            "hot_spares": self.launcher.hot_status(self._hot_ready),
            "metrics_url": self.metrics_server.url if self.metrics_server else None,
        }

    def _shutdown(self, code: int) -> None:
        try:
            stop_workers(self.workers, self.cfg.shutdown_timeout,
                         sig=self.stopped_by or signal.SIGTERM)
            for tier in self.tiers:  # e.g. the final persist of a job that succeeded or
                tier.finished(code, stopped=self.stopped_by is not None)  # was preempted
        finally:
            if getattr(self, "live", None) is not None:  # the goodbye on the agents' links
                with contextlib.suppress(Exception):
                    self.live.stop()
            self.launcher.close()
            self.state = "succeeded" if code == 0 else "failed"
            with contextlib.suppress(Exception):
                self._write_status(force=True)
            self.events.emit("finished", exit_code=code, **(
                {"signal": signal.Signals(self.stopped_by).name} if self.stopped_by else {}))
            if self.metrics_server is not None:
                self.metrics_server.close()
            if code == 1 and self.stopped_by is None and self.exits:
                with contextlib.suppress(Exception):  # as torchrun: the first failure's story
                    sys.stderr.write(failure_summary(self.cfg.script, self.exits) + "\n")
            self.memory.cleanup()
            self.control.close()
            unlink_shm(self.token)
            self.reaper.close()
            if hasattr(self, "rdzv"):
                if getattr(self, "info", None) is not None and self.info.group_world_size > 1:
                    release_standbys(self.rdzv)
                self.rdzv.shutdown()
            self.events.close()


def _signals(cfg: AgentConfig) -> List[int]:
    names = {n.strip() for n in (cfg.signals_to_handle or "").split(",")}
    return sorted({signal.SIGTERM, signal.SIGINT} | {
        getattr(signal, n) for n in names if n.startswith("SIG") and hasattr(signal, n)})


def run_agent(cfg: AgentConfig, user_umask: Optional[int] = None) -> int:
    """Run one node's agent until the job ends; returns the process exit code.
    ``user_umask``: the user's, when the caller already set the agent's (0o077)."""
    err = _config_error(cfg)
    if err:
        print(f"ckptrun: error: {err}", file=sys.stderr)
        return 2
    # What the agent writes -- run files, logs, a --persist-to directory -- is the user's
    # alone, whatever the umask: checkpoints hold the whole training state.
    own = user_umask is None
    if own:
        user_umask = os.umask(0o077)
    try:
        return Agent(cfg, user_umask).run()
    finally:
        if own:
            os.umask(user_umask)


def primary_first(failed: List[Tuple[Worker, int]]) -> List[Tuple[Worker, int]]:
    """Failures noticed in one poll, the likely root cause first (the restart's cause in
    events and metrics, the failure summary's first line).

    Why this order: when one rank dies its peers' collectives break, and they exit with an
    error (or SIGABRT from gloo's teardown) within milliseconds, often inside the same poll.
    A death by any other signal (SIGKILL, SIGSEGV, SIGBUS, ...) is never such a consequence,
    so it goes first; otherwise rank order.
    """
    return sorted(failed, key=lambda wc: not (wc[1] < 0 and wc[1] != -signal.SIGABRT))
