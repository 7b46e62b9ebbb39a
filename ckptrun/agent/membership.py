"""Machine membership: liveness of the other agents, stable group ranks across a
re-rendezvous, and the tiers built anew for each membership.

* :class:`Liveness` -- every agent bumps ``ckptrun/alive/<node>`` in the rendezvous store from
  a daemon thread (every ``interval_s``, independent of the agent's main loop, so a long
  restore does not look like a death).  A node whose counter has not moved for
  ``CKPTRUN_NODE_TIMEOUT`` seconds (default 5) is *lost*: its agent and its memory are gone.
  Sooner where it can be: an agent whose direct link (:mod:`ckptrun.agent.links`) breaks
  without a goodbye is lost at once; the timeout remains for machines that go silent.
* :func:`assign_ranks` -- after a new round of torch's rendezvous, survivors keep their group
  rank (their memory holds those ranks' snapshots) and newcomers take the missing ones;
  torch's own rank order in a round is not stable.  The job-wide epoch travels with the
  survivors because torch gives every round a fresh store prefix.
* :func:`join_round` / :func:`replace_nodes` -- a round of torch's rendezvous for this agent,
  and the job's tiers (:func:`ckptrun.tiers.stack.build_tiers`) for the membership it forms.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import socket
import sys
import threading
import time
from datetime import timedelta
from typing import Dict, List, Optional, Tuple

from ckptrun.agent.links import Links, start_links
from ckptrun.agent.rendezvous import KEY_PREFIX, RUN, Epoch, JobCoordinator
from ckptrun.agent.standby import offer_places
from ckptrun.config import AgentConfig
from ckptrun.store.kvstore import as_text, own_client, wait_keys
from ckptrun.tiers.interface import TierContext
from ckptrun.tiers.stack import build_tiers

log = logging.getLogger(__name__)

NODE_TIMEOUT_ENV = "CKPTRUN_NODE_TIMEOUT"
DEFAULT_NODE_TIMEOUT_S = 5.0
ALIVE = KEY_PREFIX + "alive/"
PROGRESS = KEY_PREFIX + "progress/"  # bumped while some local rank's main thread advances
MEMBER = KEY_PREFIX + "member/"


class NodeLost(Exception):
    """Other machines of the job stopped showing signs of life.  ``how``: ``"link"`` (their
    agent's connection broke) or ``"heartbeat"`` (silent for the timeout)."""

    def __init__(self, nodes: List[int], silent_s: float, how: str = "heartbeat"):
        super().__init__(f"node(s) {nodes} silent for {silent_s:.1f}s ({how})")
        self.nodes, self.silent_s, self.how = nodes, silent_s, how


def node_timeout_s() -> float:
    """Seconds of silence after which a machine counts as lost (``CKPTRUN_NODE_TIMEOUT``)."""
    try:
        return max(1.0, float(os.environ.get(NODE_TIMEOUT_ENV, "") or DEFAULT_NODE_TIMEOUT_S))
    except ValueError:
        return DEFAULT_NODE_TIMEOUT_S


class Liveness:
    """Publishes this agent's liveness and watches the other agents' (see module docstring)."""

    def __init__(self, store, node: int, nnodes: int, timeout_s: Optional[float] = None,
                 interval_s: float = 0.5, links: Optional[Links] = None):
        self.store, self.node, self.nnodes = store, node, nnodes
        self.links = links  # a broken link is a loss at once (ckptrun.agent.links)
        self.timeout_s = node_timeout_s() if timeout_s is None else timeout_s
        self.interval_s = interval_s
        now = time.monotonic()
        self._seen: Dict[int, Tuple[int, float]] = {g: (-1, now) for g in range(nnodes)
                                                    if g != node}
        # the other nodes' progress counters: (value, when it last changed); a node's hang
        # verdict needs to know whether some rank elsewhere is still advancing
        self._progress: Dict[int, Tuple[int, float]] = dict(self._seen)
        self._advancing = False
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="ckptrun-liveness", daemon=True)

    def start(self) -> Liveness:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop beating and say goodbye on the links (this agent leaves on purpose)."""
        self._stop.set()
        if self.links is not None:
            self.links.close()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _loop(self) -> None:
        while not self._stop.is_set():
            # A failing store op moves nothing: if the store host itself is gone, every
            # other node goes silent and the agent gives up at the re-rendezvous.
            with contextlib.suppress(Exception):
                self.store.add(f"{ALIVE}{self.node}", 1)
                if self._advancing:
                    self._advancing = False
                    self.store.add(f"{PROGRESS}{self.node}", 1)
                for g in list(self._seen):
                    value = self.store.add(f"{ALIVE}{g}", 0)
                    moved = self.store.add(f"{PROGRESS}{g}", 0)
                    with self._lock:
                        if value != self._seen[g][0]:
                            self._seen[g] = (value, time.monotonic())
                        if moved != self._progress[g][0]:
                            self._progress[g] = (moved, time.monotonic())
            self._stop.wait(self.interval_s)

    def advancing(self) -> None:
        """Some local rank advanced: tell the other nodes at the next beat."""
        self._advancing = True

    def remote_progress_age(self) -> float:
        """Seconds since any other node last reported a rank advancing (since start if
        none did yet)."""
        now = time.monotonic()
        with self._lock:
            return min((now - t for _, t in self._progress.values()), default=float("inf"))

    def lost(self) -> Tuple[List[int], float]:
        """(nodes lost -- their link broke, or silent for longer than the timeout --, the
        longest time since one was last known alive, in seconds)."""
        now = time.monotonic()
        with self._lock:
            silent = {g: now - t for g, (_, t) in self._seen.items()}
        broken = self.links.broken() if self.links is not None else {}
        silent.update({g: now - t for g, t in broken.items() if g in silent})
        gone = sorted(g for g, s in silent.items() if s > self.timeout_s or g in broken)
        return gone, max((silent[g] for g in gone), default=0.0)

    def check(self) -> None:
        """Raise :class:`NodeLost` when some node is lost (used inside bounded waits too)."""
        gone, silent = self.lost()
        if gone:
            broken = self.links.broken() if self.links is not None else {}
            raise NodeLost(gone, silent, "link" if set(gone) <= set(broken) else "heartbeat")


FORMED = KEY_PREFIX + "formed"
TAKEOVER_FORM_S = 5.0  # how long the members of a standby takeover wait for each other


class NotFormed(Exception):
    """A standby takeover's membership did not form: some member never came (a machine
    lost moments after the loss the offer named).  Everyone re-forms in torch's round."""


def assign_ranks(store, torch_rank: int, world: int, old_rank: Optional[int],
                 epoch: Optional[Epoch], timeout_s: float = 300.0, agreed: bool = False
                 ) -> Tuple[int, Optional[Epoch]]:
    """This node's group rank in the new round, and the job's epoch (None: a fresh job).

    Survivors keep ``old_rank`` (if it still fits the world), newcomers take the free ranks
    in torch's round order; the epoch is the most advanced one any survivor carries.

    ``agreed`` (a standby takeover's membership, which no round of torch's vouched for): a
    member missing after ``timeout_s`` raises :class:`NotFormed` -- for every member alike,
    as one ``compare_set`` decides; otherwise one member could form the group with a key
    that arrived just after another gave up, and wait for it forever.
    """
    store.set(f"{MEMBER}{torch_rank}", json.dumps(
        {"old": old_rank, "epoch": epoch.encode() if epoch else None}))
    keys = [f"{MEMBER}{t}" for t in range(world)]
    if agreed:
        try:
            wait_keys(store, keys, timeout_s)
            verdict = "formed"
        except TimeoutError:
            verdict = "failed"
        if as_text(store.compare_set(FORMED, "", verdict)) != "formed":
            raise NotFormed(f"not every member of the takeover came within {timeout_s:.0f} s")
    else:
        store.wait(keys, timedelta(seconds=timeout_s))
    recs = [json.loads(v) for v in store.multi_get(keys)]

    def keeps(rec) -> bool:
        return rec["old"] is not None and 0 <= rec["old"] < world

    free = sorted(set(range(world)) - {r["old"] for r in recs if keeps(r)})
    newcomers = [t for t, r in enumerate(recs) if not keeps(r)]
    rank = old_rank if keeps(recs[torch_rank]) else free[newcomers.index(torch_rank)]
    epochs = [Epoch.decode(r["epoch"]) for r in recs if r["epoch"]]
    return rank, max(epochs, key=lambda e: (e.attempt, e.restarts)) if epochs else None


# ------------------------------------------------------------------ the agent's side


def join_round(agent, old_rank: Optional[int] = None, epoch: Optional[Epoch] = None,
               joined=None, takeover: bool = False) -> bool:
    """A round of torch's rendezvous (``joined``: a membership formed already -- one a
    standby's round completed, or, with ``takeover``, the one a standby took places in,
    :mod:`.standby`), then our own stable group ranks (survivors keep theirs) and the job's
    epoch carried over; the tiers are (re-)created for it.  A takeover whose members do not
    all come falls back to torch's round.  False: no round could be completed (e.g. fewer
    than MIN machines before the join timeout)."""
    from torch.distributed.elastic.rendezvous import RendezvousError

    try:
        info = joined if joined is not None else agent.rdzv.join()
        if info.group_world_size > 1:
            try:
                rank, epoch = assign_ranks(
                    info.store, info.group_rank, info.group_world_size, old_rank, epoch,
                    **({"timeout_s": TAKEOVER_FORM_S, "agreed": True} if takeover else {}))
            except NotFormed as e:
                print(f"ckptrun: {e}; re-forming through the rendezvous", file=sys.stderr)
                return join_round(agent, old_rank, epoch)
            info = dataclasses.replace(info, group_rank=rank)
    except (RendezvousError, RuntimeError) as e:  # torch's store errors are RuntimeErrors
        print(f"ckptrun: rendezvous failed: {type(e).__name__}: {e}", file=sys.stderr)
        return False
    agent.info = info
    agent.coord = JobCoordinator(info.store, info.group_rank, info.group_world_size,
                                 agent.cfg.max_restarts)
    if epoch is not None:  # survivors carry the epoch: a new round has a fresh store prefix
        info.store.compare_set(KEY_PREFIX + "epoch", "", epoch.encode())
    agent.epoch = agent.coord.init()
    agent.live = None
    agent._own_addr = (_own_address(agent.cfg, info.master_addr)
                       if info.group_world_size > 1 else None)
    if info.group_world_size > 1:
        links = start_links(agent.cfg, info.store, info.group_rank, info.group_world_size,
                            agent._own_addr)
        # its own client: a heartbeat queued behind other threads' waits reads as a death
        agent.live = Liveness(own_client(info.store), info.group_rank,
                              info.group_world_size, links=links).start()
        agent.coord.check = agent.live.check
    agent.tiers = build_tiers(TierContext(
        cfg=agent.cfg, node=info.group_rank, nnodes=info.group_world_size, store=info.store,
        memory=agent.memory, control=agent.control, token=agent.token, emit=agent.events.emit,
        address=agent._own_addr, master_addr=info.master_addr,
        job_store=getattr(agent.rdzv, "store", None)))
    return True


def replace_nodes(agent, lost: NodeLost) -> bool:
    """Machines are gone: count one restart job-wide, then meet the survivors and the
    replacements in a new rendezvous round.  The workers the agent kept (``agent.kept``,
    in-process recovery) go on only where this machine's ranks stay what they were.  False
    when the job cannot go on."""
    attempt = agent.epoch.attempt
    # how far this node's workers got: steps lost = this minus the step restored next
    steps = [agent.control.record(w.local_rank)["step"] for w in agent.workers]
    for node in lost.nodes:  # the status file's recent failures get the event itself
        rec = agent.events.emit("node_lost", node=node, attempt=attempt,
                                seconds_silent=round(lost.silent_s, 3), detected_by=lost.how,
                                step=min(steps) if steps and min(steps) >= 0 else None)
        agent.failures = (agent.failures + [rec])[-20:]
    agent.state = "restarting"
    agent._write_status(force=True)
    with contextlib.suppress(Exception):  # the store host may be among the lost
        # workers of this attempt ran: a failure (counted once job-wide); else the
        # failure that started this attempt was counted already: a new attempt only
        agent.epoch = (agent.coord.report_failure(attempt) if agent._started
                       else agent.coord.request_restart(attempt))
    # standbys take the lost places at once, or the survivors meet in torch's next round
    taken = offer_places(agent, lost.nodes) if agent.epoch.state == RUN else None
    agent.live.stop()
    for tier in agent.tiers:
        tier.close()
    if agent.epoch.state != RUN:
        agent.drop_kept()
        return True  # the loop ends the job (budget spent)
    before = (agent.info.group_rank, agent.info.group_world_size)
    if not join_round(agent, agent.info.group_rank, agent.epoch, joined=taken,
                      takeover=taken is not None):
        return False
    if (agent.info.group_rank, agent.info.group_world_size) != before:
        agent.drop_kept()  # its workers' ranks changed: they start again as new processes
    agent.settle_kept()
    took = taken is not None and agent.info.membership == taken.membership  # not re-formed
    kept = sorted(w.global_rank for w in agent.kept.values())
    agent.events.emit("restart", attempt=agent.epoch.attempt, restarts=agent.epoch.restarts,
                      nnodes=agent.info.group_world_size, node=agent.info.group_rank,
                      **({"standby_took": sorted(lost.nodes)} if took else {}),
                      **({"in_place": kept} if kept else {}))
    return True


def local_address(cfg: AgentConfig, master_addr: str) -> str:
    """The address this node uses to reach the rendezvous endpoint (where peers reach it):
    ``--local-addr`` if given, else the interface that routes to the endpoint -- so a job
    rendezvousing on 127.0.0.1 listens on loopback only."""
    if cfg.local_addr:
        return socket.gethostbyname(cfg.local_addr)
    host, _, port = (cfg.rdzv_endpoint or "").rpartition(":")
    target = (host or master_addr).strip("[]")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # connect() sends nothing
        s.connect((socket.gethostbyname(target), int(port or 0) or 1))
        return s.getsockname()[0]


def _own_address(cfg: AgentConfig, master_addr: str) -> Optional[str]:
    """The address this machine reaches the rendezvous from (node 0 serves workers' stores
    there, the replica server listens there); None if it cannot be found."""
    try:
        return local_address(cfg, master_addr)
    except (OSError, ValueError):
        return None
