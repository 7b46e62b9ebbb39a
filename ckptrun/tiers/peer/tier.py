"""Peer-memory replication as seen by the agent (GEMINI's second tier).

One of the agent's tiers (:class:`~ckptrun.tiers.interface.Tier`), present when the job has
several machines and ``--replicas M`` > 1.  Each agent:

* runs a :class:`~ckptrun.tiers.peer.server.ReplicaServer` on the address it uses to reach the
  rendezvous, publishing its address in the rendezvous store; connections authenticate with
  the job key derived from the user's secret (:mod:`ckptrun.protocol.job_secret`), which
  never goes through the store;
* replicates in **rounds** that every agent runs in step: in round r all agents agree on
  ``S_r`` = the oldest of their newest committed steps (data-parallel nodes are at most a step
  apart, so every node still holds it), copy their ranks' ``S_r`` out of the worker slots
  into agent-owned copies (verified against the writer's checksum) and push those copies to
  the M-1 peers of GEMINI's placement.  Every agent so holds, for its own ranks and for its
  sources' ranks, the two newest round steps -- the same steps everywhere, which is what
  lets a replacement machine and the survivors restore one common step;
* on restore offers the steps it can produce for all its ranks from its own slots, its own
  copies, or -- for a machine that lost its memory -- the copies its holders keep, and
  materialises exactly the agreed step into the worker slots.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Dict, List, Optional, Tuple

from ckptrun import protocol as P
from ckptrun.protocol.job_secret import job_key
from ckptrun.store.kvstore import agreed_secret, as_text, own_client, wait_keys
from ckptrun.tiers.interface import Tier, TierContext
from ckptrun.tiers.peer import placement
from ckptrun.tiers.peer.beat_windows import BeatWindows
from ckptrun.tiers.peer.copies import PeerStore, copy_slot_file
from ckptrun.tiers.peer.pacing import Pacer
from ckptrun.tiers.peer.server import ReplicaServer, fetch, inventory, push
from ckptrun.tiers.peer.standby_copies import StandbyTargets
from ckptrun.tiers.peer.wire import lower_thread_priority, parse_address

log = logging.getLogger(__name__)

KEY = "ckptrun/replica/"
ROUND_TIMEOUT_S = 10.0
EVENT_EVERY_S = 2.0  # `replicated` events per peer at most this often (rounds can be ms apart)
COLD_ROUNDS = 2  # rounds that fill the two new copy files of a rank: not measured
NICE_ENV = "CKPTRUN_REPLICATION_NICE"


def replication_nice() -> int:
    """CPU niceness of the replication threads (``CKPTRUN_REPLICATION_NICE``, default 0).

    With a positive value, rounds (the local copy, the checksums, the sends) and the
    receiving side of pushes yield the CPU to training on a machine whose cores are busy.
    The default is normal priority: on a loaded 2-core machine niceness 10 made a 64 MiB
    round take 3x longer (1.6 s instead of 0.45 s) and cost 5 steps at a machine loss,
    with no slowdown of training that could be told apart from the noise (docs/
    performance.md).  Restores (fetches of lost ranks) always run at normal priority."""
    try:
        return max(0, int(os.environ.get(NICE_ENV, "") or 0))
    except ValueError:
        return 0


class ReplicaTier(Tier):
    """One agent's replication and peer restore (see the module docstring)."""

    name = "peer"

    def __init__(self, ctx: TierContext) -> None:
        self.ctx = ctx
        cfg = ctx.cfg
        self.node, self.n = ctx.node, ctx.nnodes
        self.m = placement.effective_replicas(self.n, cfg.replicas)
        self.store = ctx.store
        self._rounds_store = own_client(ctx.store)  # the rounds' thread waits on its own
        self.memory = ctx.memory
        self.ranks = ctx.ranks
        sources = [n for n in range(self.n)
                   if n != self.node and self.node in placement.peers_of(n, self.n, self.m)]
        # rounds pin the slots they copy, as the durable tier's reads do
        self.memory.attach_control(ctx.control, self.ranks)
        # a restore needs this node's ranks and its sources' ranks at one step
        self.copies = PeerStore(ctx.token, self.ranks + [
            n * cfg.nproc_per_node + lr for n in sources for lr in range(cfg.nproc_per_node)])
        # the job key: from the user's secret, which never goes through the store; only an
        # --insecure job agrees one there (anyone who reads the store then has it)
        self.secret = job_key(cfg.secret, cfg.rdzv_id) if cfg.secret is not None \
            else agreed_secret(self.store, f"{KEY}secret")
        self.nice = replication_nice()
        self.pacer = Pacer(cfg.replication_budget)
        self.windows = BeatWindows(self.pacer, ctx.control, cfg.nproc_per_node)
        self.server = ReplicaServer(ctx.address or "127.0.0.1", self.secret, self.copies,
                                    on_refused=self._refused, local_copy=self._own_slot,
                                    put_nice=self.nice, accept_ranks=self.copies.pin_ranks)
        self.store.set(f"{KEY}addr/{self.node}", "{}:{}".format(*self.server.address))
        self.peers = placement.peers_of(self.node, self.n, self.m)
        self.holders = [h for h in placement.holders_of(self.node, self.n, self.m)
                        if h != self.node]
        # --standby machines get every round's copies too (none for an --insecure job)
        self.standbys = (StandbyTargets(ctx.job_store, self.secret, self.node)
                         if cfg.secret is not None and ctx.job_store is not None else None)
        self.rate = cfg.replication_rate  # bytes/s per push; None = unpaced
        self.replicated_step: Optional[int] = None
        self.rate_mb_s: Optional[float] = None  # throughput of the last complete round
        # per peer: the newest step of ours it holds (a push this attempt that arrived and
        # verified), the push's throughput and when it arrived
        self.peer_copies: Dict[int, dict] = {}
        self.round_s: Optional[float] = None  # duration of the last complete round
        self.lag_steps: Optional[int] = None  # newest local step - replicated, at its end
        self.rounds = 0  # complete rounds (this agent's copies landed on every peer)
        self.replicated_bytes = 0  # bytes of those rounds pushed to peers
        self._last_event: Dict[int, float] = {}
        self._stop = threading.Event()
        self._busy = threading.Lock()  # a round and a restore never touch slots together
        self._attempt = -1
        self._thread: Optional[threading.Thread] = None
        self._restore_sources: Dict[int, Dict[int, List[Tuple[str, object]]]] = {}

    # -- the tier interface ----------------------------------------------------------------
    def attempt_started(self, attempt: int) -> None:
        self._attempt = attempt
        self.replicated_step = None  # the restored step may be older than the last round
        self.peer_copies = {}
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="ckptrun-replication",
                                            daemon=True)
            self._thread.start()

    def finished(self, exit_code: int, stopped: bool = False) -> None:
        self.close()

    def close(self) -> None:
        """Stop the rounds and the server (membership changed or job over); the copies in
        shared memory stay for the next membership's tier (same agent token)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=ROUND_TIMEOUT_S)
            self._thread = None
        self.server.stop()  # unmaps the copies' cached mappings too

    def status(self) -> dict:
        """``peer_step``: the newest step every holder has; ``peers``: each holder's own."""
        copies = dict(self.peer_copies)  # the rounds' thread replaces entries meanwhile
        slow = self.pacer.slowdown_while_active()
        peers = [{"node": h, "holds_step": None, "mb_s": None, "updated": None,
                  **copies.get(h, {})} for h in self.holders]
        return {"peer_step": self.replicated_step, "replica_peers": self.peers,
                "replica_holders": self.holders, "replication_mb_s": self.rate_mb_s,
                "peers": peers,
                "replication_round_s": self.round_s, "replication_lag_steps": self.lag_steps,
                "replication_rounds": self.rounds, "replicated_bytes": self.replicated_bytes,
                "replication_duty": round(self.pacer.duty(), 4),
                "replication_slowdown": None if slow is None else round(slow, 4),
                "replication_rate_mb_s": self.rate / 1e6 if self.rate else None,
                "standby_copies": self.standbys.status() if self.standbys else None}

    def offers(self, ranks: List[int], attempt: int, max_step: Optional[int]) -> List[int]:
        """The steps (at most ``max_step``) every rank here can get from this node's slots,
        its copies or its holders' copies (asked over the network)."""
        self._attempt = attempt
        with self._busy:
            self._restore_sources = sources = self._sources(ranks)
        common = set.intersection(*(set(s) for s in sources.values())) if sources else set()
        log.info("restore ranks %s: steps all of them can get %s (at most %s)", ranks,
                 sorted(common), max_step)
        return sorted(s for s in common if max_step is None or s <= max_step)

    def materialise(self, ranks: List[int], attempt: int, step: int) -> Optional[str]:
        self._attempt = attempt
        with self._busy:
            sources = self._restore_sources
            if any(step not in sources.get(r, {}) for r in ranks):
                return None
            return self._materialise(ranks, step, sources)

    # -- replication rounds --------------------------------------------------------------
    def _loop(self) -> None:
        lower_thread_priority(self.nice)
        rnd, attempt = 0, self._attempt
        while not self._stop.is_set():
            if self._attempt != attempt:  # a restart: rounds start over with the new attempt
                rnd, attempt = 0, self._attempt
            newest = self._newest_local()
            want = newest is not None and (self.replicated_step is None
                                           or newest > self.replicated_step)
            if newest is None or (not want and not self._wanted(f"{attempt}/{rnd}")):
                self._stop.wait(0.02)
                continue
            try:
                step = self._agree(f"{attempt}/{rnd}", newest, want)
            except Exception as e:  # a peer is gone or the store is: the agent will notice
                log.debug("replication round %s/%s: %s", attempt, rnd, e)
                self._stop.wait(0.5)
                continue
            if step is None:  # stopped while waiting
                continue
            rnd += 1
            if not (self.replicated_step is None or step > self.replicated_step):
                # a peer has not committed our newest step yet (it commits a moment
                # later, or its workers start later after a restore): asking again at
                # once made hundreds of empty rounds a second (store traffic and CPU of
                # both agents, also while the workers restart)
                log.debug("round %s/%s: nothing new (step %s, newest here %s)", attempt, rnd,
                          step, newest)
                self._stop.wait(0.02)
                continue
            cold, t0 = self.rounds < COLD_ROUNDS, time.monotonic()
            self.windows.round_starts()
            with self._busy:
                self._replicate(step)
            # the first rounds write into new copy files (every page touched for the
            # first time, while the workers still warm up): seconds long and nothing
            # like the rest -- not measured, and no pause after them.  The window opens
            # after the agreement: its wait is the peers' own pause, and counting it
            # would make the pauses feed each other
            took = time.monotonic() - t0
            window = self.windows.round_ended(measure=not cold, stop=self._stop)
            pause = self.pacer.pause(took if window is None else window)
            log.debug("round %d: %.3f s, window %s, pause %.3f s (duty %.2f)", rnd, took,
                      window and round(window, 3), pause, self.pacer.duty())
            self._stop.wait(0.0 if cold else pause)

    def _newest_local(self) -> Optional[int]:
        """Newest step every local rank has committed (headers only: cheap)."""
        return self.memory.newest_committed(self.ranks)

    def _wanted(self, rnd: str) -> bool:
        """Whether another node asked for round ``rnd`` (it has a step to copy that we
        already copied, e.g. its last round failed): we join it even with nothing new."""
        try:
            return bool(self._rounds_store.check([f"{KEY}round/{rnd}/want"]))
        except Exception:
            return False

    def _agree(self, rnd: str, newest: int, want: bool = True) -> Optional[int]:
        """Every node posts its newest step for round ``rnd``; the round's step is the min.
        A node with a step newer than its last replicated one asks for the round; the
        others join it even when they have nothing new themselves.
        None if the tier is stopped while waiting (a node that finished posts no more)."""
        prefix, store = f"{KEY}round/{rnd}/", self._rounds_store
        if want:
            store.set(prefix + "want", "1")
        store.set(prefix + str(self.node), str(newest))
        keys = [prefix + str(g) for g in range(self.n)]
        # looks at most 10 ms apart: every ms the round starts late is lag (a check costs
        # ~20 us); and a machine lost mid-round never posts, while close() (the agent's
        # recovery) waits for this thread to notice the stop
        if not wait_keys(store, keys, ROUND_TIMEOUT_S, stop=self._stop, slice_s=0.01):
            return None
        return min(int(v) for v in store.multi_get(keys))

    def _replicate(self, step: int) -> None:
        t0 = time.monotonic()
        own: Dict[int, str] = {}
        for r in self.ranks:
            # pinned while copied: with fast steps the worker reused the slot mid-copy in
            # about one round of four, and the round was lost on this machine only
            with self.memory.hold(r, step) as src:
                dst = None if src is None else self.copies.incoming_path(r)  # busy until done
                if dst is None:  # src None: the worker moved on past that step
                    return
                try:
                    got = copy_slot_file(src, dst, self.copies.maps)
                finally:
                    self.copies.done(r)
            if got != step:
                return  # rewritten meanwhile or corrupt: this round has no copy of ours
            own[r] = dst
        t_copied, sent = time.monotonic(), {}  # type: Dict[int, int]
        for peer in self.peers:
            addr, t_peer = self._addr(peer, self._rounds_store), time.monotonic()
            for r, path in own.items():
                try:
                    res = push(addr, self.secret, f"node{self.node}", r, path, self.rate,
                               maps=self.copies.maps)
                except (OSError, ConnectionError) as e:
                    log.debug("push of rank %d to node %d failed: %s", r, peer, e)
                    res = None
                if res is None:
                    return
                sent[peer] = sent.get(peer, 0) + res["bytes"]
            took = time.monotonic() - t_peer
            self.peer_copies[peer] = {
                "holds_step": step, "updated": time.time(),
                "mb_s": round(sent.get(peer, 0) / took / 1e6, 1) if took > 0 else None}
        if self.standbys is not None:
            self.replicated_bytes += self.standbys.push_round(own, step, self.rate,
                                                              self.copies.maps)
        self.replicated_step = step
        now = time.monotonic()
        self.rounds += 1
        if self.rounds == COLD_ROUNDS:
            # both copy files of every rank now hold this membership's rounds: a standby's
            # copies of the whole job, an earlier membership's sources are of no restore
            dropped = self.copies.drop_others()
            if dropped:
                log.info("dropped the copies of ranks %s (not this membership's)", dropped)
        self.replicated_bytes += sum(sent.values())
        self.round_s = round(now - t0, 4)
        newest = self._newest_local()
        self.lag_steps = None if newest is None else max(0, newest - step)
        if sent and now > t0:
            self.rate_mb_s = round(sum(sent.values()) / (now - t0) / 1e6, 1)
        log.debug("round of step %d: local copy %.3f s, pushes %.3f s (%s MB/s), lag %s",
                  step, t_copied - t0, now - t_copied, self.rate_mb_s, self.lag_steps)
        for peer, nbytes in sent.items():
            if now - self._last_event.get(peer, 0.0) >= EVENT_EVERY_S:
                self._last_event[peer] = now
                self.ctx.emit("replicated", step=step, peer=peer, bytes=nbytes,
                                       seconds=round(now - t0, 4), rounds=self.rounds,
                                       lag_steps=self.lag_steps)

    # -- restore -------------------------------------------------------------------------
    def _sources(self, ranks: List[int]) -> Dict[int, Dict[int, List[Tuple[str, object]]]]:
        """{rank: {step: [(kind, where), ...]}} in order of preference: this node's worker
        slots, its own copies, then the copies its holders keep."""
        remote = self._inventories(self.holders)
        out = self._collect(ranks, remote)
        if out and not set.intersection(*(set(s) for s in out.values())):
            # the holders cannot give every rank one step: a machine that joined as a
            # standby may still hold the copies it was pushed of every rank of the job
            others = [n for n in range(self.n) if n != self.node and n not in remote]
            if others:
                remote.update(self._inventories(others))
                out = self._collect(ranks, remote)
        return out

    def _inventories(self, nodes: List[int]) -> Dict[int, Dict[int, List[int]]]:
        """{node: {rank: [steps]}} of the copies each reachable node of ``nodes`` keeps."""
        remote: Dict[int, Dict[int, List[int]]] = {}
        for h in nodes:
            try:
                remote[h] = inventory(self._addr(h), self.secret, f"node{self.node}")
            except (OSError, ConnectionError, KeyError, ValueError) as e:
                log.info("node %d's copies cannot be listed: %s", h, e)
        return remote

    def _collect(self, ranks: List[int], remote: Dict[int, Dict[int, List[int]]]
                 ) -> Dict[int, Dict[int, List[Tuple[str, object]]]]:
        out: Dict[int, Dict[int, List[Tuple[str, object]]]] = {r: {} for r in ranks}
        for r in ranks:
            for s in self.memory.steps(r):
                out[r].setdefault(s, []).append(("slot", None))
            for s, path in self.copies.copies(r).items():
                out[r].setdefault(s, []).append(("copy", path))
            for h, inv in remote.items():
                for s in inv.get(r, []):
                    out[r].setdefault(s, []).append(("peer", h))
        return out

    def _materialise(self, ranks: List[int], step: int, sources) -> Optional[str]:
        """Put ``step`` of every rank into its worker slots, trying each source in turn (a
        copy that fails verification is skipped); 'peer' if any came over the network,
        'memory' if all was on this machine, None if some rank could not be had."""
        tier = "memory"
        for r in ranks:
            for kind, where in sources[r][step]:
                if kind == "slot":
                    if self.memory.verify(r, step):
                        break
                    continue
                dst = P.slot_path(self.memory.slot_prefix(r), self._free_slot(r, step))
                if kind == "copy":
                    got = copy_slot_file(where, dst)
                else:
                    try:
                        got = fetch(self._addr(where), self.secret, f"node{self.node}", r,
                                    dst, step)
                    except (OSError, ConnectionError, KeyError, ValueError) as e:
                        got = f"{type(e).__name__}: {e}"  # the holder went away: next source
                if got == step:
                    tier = "peer" if kind == "peer" else tier
                    break
                log.info("rank %d step %d: the %s copy (%s) gave %s", r, step, kind, where, got)
            else:
                return None
        return tier

    def _free_slot(self, rank: int, step: int) -> int:
        """A slot of ``rank`` to write ``step`` into (workers are stopped): a free one, else
        the one already named for ``step`` (it failed verification), else the oldest."""
        held = {k: s for s, k in self.memory.steps(rank).items()}
        free = [k for k in range(self.memory.num_slots) if k not in held]
        if free:
            return free[0]
        same = [k for k, s in held.items() if s == step]
        return same[0] if same else min(held, key=held.get)

    def _own_slot(self, rank: int, step: int) -> Optional[str]:
        k = self.memory.steps(rank).get(step)
        return None if k is None else P.slot_path(self.memory.slot_prefix(rank), k)

    # -- store ---------------------------------------------------------------------------
    def _addr(self, node: int, store=None) -> Tuple[str, int]:
        return parse_address(as_text((self.store if store is None else store).get(
            f"{KEY}addr/{node}")))

    def _refused(self, peer: str) -> None:
        self.ctx.emit("replication_refused", peer=peer)
