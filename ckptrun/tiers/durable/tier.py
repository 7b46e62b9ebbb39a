"""The durable tier as the agent sees it: background persistence and restore from storage.

One of the agent's tiers (:class:`~ckptrun.tiers.interface.Tier`).  It

* runs a :class:`~ckptrun.tiers.durable.persister.Persister` that copies the newest step every local rank
  committed to ``--persist-to`` every ``--persist-every`` steps or seconds, and the final step
  of a successful job;
* materialises a durable step into the local ranks' slot files when no memory copy exists:
  the job's own newest durable step (a restart of the whole job with the same ``--run-dir``,
  or every memory copy failed its checksum), or ``--resume-from`` at the first start.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Dict, List, Optional, Tuple

from ckptrun.protocol import Phase
from ckptrun.tiers.durable import storage
from ckptrun.tiers.durable.persister import Persister
from ckptrun.tiers.durable.rounds import PersistRounds
from ckptrun.tiers.interface import Tier, TierContext
from ckptrun.tiers.memory.node import SlotChanged

log = logging.getLogger(__name__)

CATCH_AHEAD = 2  # steps before a --persist-every multiple at which its slots are watched
CATCH_WAIT_S = 5.0  # the longest a read waits for that step (the persister's thread)
WARM_EARLY_S = 60.0  # a persist period shorter than this imports DCP at the start


class DurableTier(Tier):
    """Persistence and storage restore for one agent (single-node jobs persist everything;
    on several nodes each agent still restores its own ranks from storage)."""

    name = "storage"

    def __init__(self, ctx: TierContext) -> None:
        cfg = ctx.cfg
        self.url = cfg.persist_to
        self.resume_from = cfg.resume_from
        self.memory = ctx.memory
        self.ranks: List[int] = ctx.ranks
        self.world_size = ctx.world_size
        self.restored_from_storage: Optional[int] = None
        self.emit = ctx.emit
        self._where: Dict[int, Tuple[str, Optional[int]]] = {}  # offered step -> (url, step)
        # reads pin the slot they copy, so the worker writes its next snapshots elsewhere
        self.memory.attach_control(ctx.control, self.ranks)
        # A durable step needs every rank.  One machine writes it alone; on several, node 0
        # leads persist rounds in the store and every node writes its own ranks' part.
        self.persister: Optional[Persister] = None
        self.rounds: Optional[PersistRounds] = None
        reader, write = self._read, None
        self.every_steps = cfg.persist_every_steps
        self._closing = threading.Event()  # the job ends: a read waiting for a step gives up
        if ctx.nnodes > 1:
            self.rounds = PersistRounds(ctx.store, ctx.node, ctx.nnodes, self.ranks,
                                        self.memory, ctx.emit, self.url,
                                        every_steps=self.every_steps)
            reader, write = self.rounds.read, self.rounds.write
        # DCP is imported off the main thread, not during the rendezvous (it slows torch's
        # rendezvous events, each of which walks every loaded module).  A persist due within
        # the first steps (--persist-every N, or a short period) needs it at once: a first
        # persist importing it under load took seconds, and the multiples of N it was to
        # catch went by.  Otherwise it waits for the job's first snapshot (:meth:`tick`):
        # not while the workers import torch (on a small machine its ~2 s of CPU came out of
        # every job's start-up), and not at all for a job that never saves.
        self._warm_started = False
        if self.every_steps or (cfg.persist_every_seconds or 0) < WARM_EARLY_S:
            self._start_warm_up()
        self.control = ctx.control
        self._early: Optional[threading.Thread] = None  # the final persist, begun early
        if ctx.node == 0:
            self.persister = Persister(
                self.url, reader=reader, write=write, world_size=self.world_size,
                every_steps=cfg.persist_every_steps,
                every_seconds=None if cfg.persist_every_steps else cfg.persist_every_seconds,
                keep=cfg.keep, emit=ctx.emit, start_step=self._newest_durable() or 0)

    # -- the tier interface ----------------------------------------------------------------
    def offers(self, ranks: List[int], attempt: int, max_step: Optional[int]) -> List[int]:
        """The durable steps (at most ``max_step``): ``--resume-from`` at the first start,
        else the job's own ``--persist-to`` (the same command run again resumes there)."""
        self._join_early()  # a restart after all: the slots are the restore's now
        self._where = dict(self._candidates(attempt, max_step))
        return sorted(self._where)

    def materialise(self, ranks: List[int], attempt: int, step: int) -> Optional[str]:
        """Read ``step`` of every rank in ``ranks`` from storage into its slots."""
        url, at = self._where.get(step, (self.url, step))
        t0 = time.monotonic()
        try:
            # another world size than the saved one reshards sharded (DTensor) state
            snaps: Dict[int, tuple] = {
                r: storage.read_rank(url, at, r, world_size=self.world_size) for r in ranks}
        except (storage.StorageError, OSError) as e:
            # a corrupt, partial or crafted durable copy is skipped, never loaded: the
            # decision tries an older step, and says why this one was refused
            log.warning("durable step %s at %s unusable: %s", step, url, e)
            self.rejected = f"step {step} at {url}: {e}"
            self.emit("restore_rejected", tier=self.name, step=step, url=url, error=str(e))
            return None
        for r, (meta, tensors) in snaps.items():
            self.memory.write(r, meta, tensors, step)
        log.info("materialised step %s from %s in %.3fs", step, url, time.monotonic() - t0)
        self.restored_from_storage = step
        return "storage"

    def attempt_started(self, attempt: int) -> None:
        self._join_early()  # a job that failed in its teardown: the early persist is over
        if self.persister is not None:
            self.persister.start()
        elif self.rounds is not None:
            self.rounds.start_follower()

    def tick(self) -> None:
        self._warm_up_once_saving()
        if self.persister is not None:
            self.persister.notify(0)
            self._begin_final_early()

    def _begin_final_early(self) -> None:
        """On one machine, once every local script has ended successfully with its last
        snapshot committed, write that step now, while the workers tear down (process
        groups, data loaders, CUDA contexts: up to seconds); :meth:`finished` then finds it
        durable.  A job that fails after all keeps a step it had committed, as a background
        persist would have; several machines persist their last step in a round instead."""
        if self._early is not None or self.rounds is not None:
            return
        recs = [self.control.record(lr) for lr in range(len(self.ranks))]
        if not all(r["phase"] == Phase.DONE and r["ended_ok"] == 1 for r in recs):
            return
        step = recs[0]["committed_step"]
        if step <= 0 or any(r["committed_step"] != step or r["step"] != step for r in recs):
            return  # a save still copying, or none: the exit path persists as before
        self._early = threading.Thread(target=self.persister.persist_now,
                                       args=(step, self._hold),
                                       name="ckptrun-final-persist", daemon=True)
        self._early.start()

    def _join_early(self) -> None:
        if self._early is not None:
            self._early.join()
            self._early = None

    def _warm_up_once_saving(self) -> None:
        """Start importing what a persist needs when the first snapshot is committed (the
        control block says so: no slot file is opened), so that the first persist does not
        pay for it."""
        if not self._warm_started and any(
                self.control.get(lr, "committed_step") > 0 for lr in range(len(self.ranks))):
            self._start_warm_up()

    def _start_warm_up(self) -> None:
        self._warm_started = True
        threading.Thread(target=storage.warm_up, name="ckptrun-dcp-import", daemon=True).start()

    def finished(self, exit_code: int, stopped: bool = False) -> None:
        """Persist the newest step of a job that succeeded, or that was stopped by a signal
        (a preemption: the same command run again resumes from it); every node takes part."""
        self._closing.set()
        keep = exit_code == 0 or stopped
        if self.persister is None:  # a follower: answer the leader's final round
            if self.rounds is not None:
                (self.rounds.finish_follower if keep else self.rounds.stop)()
            return
        step = self.memory.common_step(self.ranks) if keep else None
        if self.rounds is not None:
            self.rounds.job_done(step)  # a round waiting for a step gives up first
        try:
            self._join_early()
            if step:
                self._final(step)
        finally:
            if self.rounds is not None:
                self.rounds.close_leader()
            self.persister.stop()

    def close(self) -> None:
        """Membership changed (a machine lost): stop persisting without a final step; what
        is in storage and in memory stays.  The agent re-creates the tier afterwards."""
        self._closing.set()
        self._join_early()
        if self.rounds is not None:
            self.rounds.stop()
        if self.persister is not None:
            self.persister.stop()

    def status(self) -> dict:
        if self.persister is None:
            return {"persisted_step": self._newest_durable(), "persisted_url": self.url}
        st = self.persister.status()
        return {"persisted_step": st["persisted_step"] if st["persisted_step"] is not None
                else self._newest_durable(),
                "persisted_url": st["persisted_url"] or self.url,
                "persist_error": st["last_error"]}

    # -- internals -----------------------------------------------------------------------
    def _final(self, step: int) -> None:
        """The job's last persist.  On one machine its workers are stopped by now, so the
        slots are written straight from memory, not copied out first (the copy's fresh pages
        cost ~0.3 s per 512 MiB here); a slot that fails its checksum, or is rewritten all
        the same, falls back to the copying reader, which says why in ``persist_failed``."""
        assert self.persister is not None
        if self.rounds is None and self.persister.final(step, attempts=1, holder=self._hold):
            return
        self.persister.final(step, exact=self.rounds is None)

    def _hold(self, step: int):
        """The persister's holder on one machine: the slots themselves, verified, pinned."""
        return self.memory.holding(self.ranks, step)

    def _read(self, min_step: int):
        """The persister's reader on one machine (several: ``PersistRounds.read``)."""
        if not self.every_steps or min_step % self.every_steps:  # also the final step
            return self.memory.read_common(min_step, self.ranks)
        return self._read_multiple(min_step)

    def _read_multiple(self, target: int):
        """``target`` (a multiple of ``--persist-every N``) as soon as every local rank has
        committed it, or a later multiple if the workers moved past it first; None while it
        is more than a couple of steps away.  A step stays in the slots only for the next
        two saves, so near it the slots are watched closely (every 2 ms)."""
        n, deadline = self.every_steps, time.monotonic() + CATCH_WAIT_S
        while True:
            held = [self.memory.steps(r) for r in self.ranks]
            common = set.intersection(*(set(h) for h in held)) if held else set()
            ready = sorted(s for s in common if s >= target and s % n == 0)
            if ready:
                step = target if target in ready else ready[-1]
                try:
                    return step, {r: self.memory.read(r, step) for r in self.ranks}
                except (KeyError, SlotChanged):
                    continue  # rewritten under the read: look again
            newest = max(common) if common else None
            if newest is None or newest < target - CATCH_AHEAD:
                return None  # not due yet: the persister asks again
            if any(h and min(h) > target for h in held):  # gone on some rank: the next one
                target = (newest // n + 1) * n
            if self._closing.is_set() or time.monotonic() > deadline:
                return None
            time.sleep(0.002)

    def _newest_durable(self) -> Optional[int]:
        try:
            return storage.newest_step(self.url)
        except (storage.StorageError, OSError):
            return None

    def _candidates(self, attempt: int, max_step: Optional[int]):
        """(step, (url, step in url)) pairs; step in url None: ``url`` is a step directory."""
        if attempt == 0 and self.resume_from:
            try:
                url, step = storage.resolve(self.resume_from)
            except storage.StorageError as e:
                log.warning("--resume-from %s: %s", self.resume_from, e)
                self.rejected = str(e)
                self.emit("restore_rejected", tier=self.name, step=None, url=self.resume_from,
                          error=str(e))
            else:
                if max_step is None or step <= max_step:
                    yield step, (url, None)
                return
        try:
            steps = [s["step"] for s in storage.list_steps(self.url)]
        except (storage.StorageError, OSError) as e:
            log.warning("cannot list durable steps at %s: %s", self.url, e)
            return
        for step in steps:
            if max_step is None or step <= max_step:
                yield step, (self.url, step)
