"""The durable tier as seen by the agent: background persistence and restore from storage.

An agent extension (see ``agent.EXTENSION_MODULES``; ``persister.agent_extension`` returns
one of these).  It

* runs a :class:`~ckptrun.persister.Persister` that copies the newest step every local rank
  committed to ``--persist-to`` every ``--persist-every`` steps or seconds, and the final step
  of a successful job;
* materialises a durable step into the local ranks' slot files when no memory copy exists:
  the job's own newest durable step (a restart of the whole job with the same ``--run-dir``,
  or every memory copy failed its checksum), or ``--resume-from`` at the first start.
"""

from __future__ import annotations

import logging
import time
from typing import Dict, List, Optional, Tuple

from ckptrun import storage
from ckptrun.persist_rounds import PersistRounds
from ckptrun.persister import Persister

log = logging.getLogger("ckptrun.durable")


class DurableTier:
    """Persistence and storage restore for one agent (single-node jobs persist everything;
    on several nodes each agent still restores its own ranks from storage)."""

    def __init__(self, agent) -> None:
        cfg = agent.cfg
        self.agent = agent
        self.url = cfg.persist_to
        self.resume_from = cfg.resume_from
        self.memory = agent.memory
        info = agent.info
        self.ranks: List[int] = [info.group_rank * cfg.nproc_per_node + lr
                                 for lr in range(cfg.nproc_per_node)]
        self.world_size = info.group_world_size * cfg.nproc_per_node
        self.restored_from_storage: Optional[int] = None
        # A durable step needs every rank.  One machine writes it alone; on several, node 0
        # leads persist rounds in the store and every node writes its own ranks' part.
        self.persister: Optional[Persister] = None
        self.rounds: Optional[PersistRounds] = None
        if self.memory is None:
            return
        # reads pin the slot they copy, so the worker writes its next snapshots elsewhere
        self.memory.attach_control(agent.control, self.ranks)
        reader, write = self._read, None
        if info.group_world_size > 1:
            self.rounds = PersistRounds(info.store, info.group_rank, info.group_world_size,
                                        self.ranks, self.memory, agent.events.emit, self.url)
            reader, write = self.rounds.read, self.rounds.write
        if info.group_rank == 0:
            self.persister = Persister(
                self.url, reader=reader, write=write, world_size=self.world_size,
                every_steps=cfg.persist_every_steps,
                every_seconds=None if cfg.persist_every_steps else cfg.persist_every_seconds,
                keep=cfg.keep, emit=agent.events.emit,
                start_step=self._newest_durable() or 0)

    # -- agent hooks ---------------------------------------------------------------------
    def restore_step(self, ranks: List[int], attempt: int,
                     max_step: Optional[int]) -> Optional[Tuple[int, str]]:
        """Materialise the newest usable durable step (<= max_step) into the slots."""
        if self.memory is None:
            return None
        for url, step in self._candidates(attempt, max_step):
            t0 = time.monotonic()
            try:
                # another world size than the saved one reshards sharded (DTensor) state
                snaps: Dict[int, tuple] = {
                    r: storage.read_rank(url, step, r, world_size=self.world_size)
                    for r in ranks}
            except (storage.StorageError, OSError, KeyError, ValueError) as e:
                # a corrupt or partial durable copy is skipped, never loaded
                log.warning("durable step %s at %s unusable: %s", step, url, e)
                continue
            real = step if step is not None else int(next(iter(snaps.values()))[0]["step"])
            for r, (meta, tensors) in snaps.items():
                self.memory.write(r, meta, tensors, real)
            log.info("materialised step %s from %s in %.3fs", real, url, time.monotonic() - t0)
            self.restored_from_storage = real
            return real, "storage"
        return None

    def attempt_started(self, attempt: int) -> None:
        if self.persister is not None:
            self.persister.start()
        elif self.rounds is not None:
            self.rounds.start_follower()

    def tick(self) -> None:
        if self.persister is not None:
            self.persister.notify(0)

    def finished(self, exit_code: int) -> None:
        """Persist the final step of a successful job (every node takes part)."""
        if self.persister is None:  # a follower: answer the leader's final round
            if self.rounds is not None:
                (self.rounds.finish_follower if exit_code == 0 else self.rounds.stop)()
            return
        step = self.memory.common_step(self.ranks) if exit_code == 0 else None
        if self.rounds is not None:
            self.rounds.job_done(step)  # a round waiting for a step gives up first
        try:
            if step:
                self.persister.final(step)
        finally:
            if self.rounds is not None:
                self.rounds.close_leader()
            self.persister.stop()

    def close(self) -> None:
        """Membership changed (a machine lost): stop persisting without a final step; what
        is in storage and in memory stays.  The agent re-creates the tier afterwards."""
        if self.rounds is not None:
            self.rounds.stop()
        if self.persister is not None:
            self.persister.stop()

    def checkpoint_status(self) -> dict:
        if self.persister is None:
            return {"persisted_step": self._newest_durable(), "persisted_url": self.url}
        st = self.persister.status()
        return {"persisted_step": st["persisted_step"] if st["persisted_step"] is not None
                else self._newest_durable(),
                "persisted_url": st["persisted_url"] or self.url,
                "persist_error": st["last_error"]}

    # -- internals -----------------------------------------------------------------------
    def _read(self, min_step: int):
        return self.memory.read_common(min_step, self.ranks)

    def _newest_durable(self) -> Optional[int]:
        try:
            return storage.newest_step(self.url)
        except (storage.StorageError, OSError):
            return None

    def _candidates(self, attempt: int, max_step: Optional[int]):
        """(url, step) pairs to try, newest first; step None = ``url`` is a step directory."""
        if attempt == 0 and self.resume_from:
            try:
                url, step = storage.resolve(self.resume_from)
            except storage.StorageError as e:
                log.warning("--resume-from %s: %s", self.resume_from, e)
            else:
                if max_step is None or step <= max_step:
                    yield url, None
                return
        try:
            steps = sorted((s["step"] for s in storage.list_steps(self.url)), reverse=True)
        except (storage.StorageError, OSError) as e:
            log.warning("cannot list durable steps at %s: %s", self.url, e)
            return
        for step in steps:
            if max_step is None or step <= max_step:
                yield self.url, step


def agent_extension(agent) -> Optional[DurableTier]:
    """The factory ``agent.load_extensions`` calls."""
    if not agent.cfg.persist_to and not agent.cfg.resume_from:
        return None
    return DurableTier(agent)
