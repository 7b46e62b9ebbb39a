"""Copies for standby machines: a ``--standby`` agent holds every machine's newest round
step before any machine is lost, so the one that takes a lost machine's place restores its
ranks from its own memory instead of pulling them over the network.

* :class:`StandbyHolder` -- the standby's side: a :class:`ReplicaServer` that accepts copies
  of any rank of the job into a :class:`PeerStore` named after the standby's agent token.
  The files stay when it stops: once the standby is a member, its replica tier (same token)
  finds the lost ranks' copies among its own (``restored`` with ``tier: memory``).  The
  copies of the other ranks stay too, until the new membership's rounds have replaced every
  copy in the job (``PeerStore.drop_others``): a second machine lost before then -- even one
  lost at the same moment, seen a little later -- is restored from them.
* :class:`StandbyTargets` -- a member's side: after a round's pushes to its placement peers,
  the same copies go to every standby, best-effort (a standby that just left is no failure
  of the round; the round's pacing counts the extra time, so training still pays at most the
  ``--replication-budget``).

The standbys' addresses are in the rendezvous handler's own store (``ckptrun/standby/
server/<n>``): a standby is in no membership, so the membership's keys do not reach it.
Connections authenticate with the job key as every replication connection does, so a job
without a secret (``--insecure``), whose replication key is agreed in a membership's store,
has no standby copies: its standby pulls the lost ranks' copies at the restore.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Dict, List, Optional, Tuple

from ckptrun.protocol.job_secret import job_key
from ckptrun.store.kvstore import as_text
from ckptrun.tiers.peer.copies import PeerStore
from ckptrun.tiers.peer.server import ReplicaServer, push
from ckptrun.tiers.peer.wire import parse_address

log = logging.getLogger(__name__)

COUNT = "ckptrun/standby/servers"
SERVER = "ckptrun/standby/server/"
REFRESH_S = 1.0  # how often a member looks for standbys that came or went


class StandbyHolder:
    """A waiting standby's copies of every rank of the job (module docstring)."""

    def __init__(self, cfg, job_store, token: str, host: str) -> None:
        self.world = cfg.max_nodes * cfg.nproc_per_node
        self.copies = PeerStore(token, pin_ranks=range(self.world))
        self.server = ReplicaServer(host, job_key(cfg.secret, cfg.rdzv_id), self.copies,
                                    accept_ranks=range(self.world))
        self.store = job_store
        self.slot = job_store.add(COUNT, 1)
        job_store.set(f"{SERVER}{self.slot}", "{}:{}".format(*self.server.address))

    def held_step(self) -> Optional[int]:
        """The newest step held for every rank of the job (for status and tests)."""
        return self.copies.pinned_step()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.store.set(f"{SERVER}{self.slot}", "")
        self.server.stop()


class StandbyTargets:
    """Where a member pushes its round copies besides its placement peers."""

    def __init__(self, job_store, secret: bytes, node: int) -> None:
        self.store, self.secret, self.node = job_store, secret, node
        self._addrs: List[Tuple[str, int]] = []
        self._seen = 0.0
        self.held: Dict[str, int] = {}  # standby address -> newest step of ours it holds

    def addresses(self) -> List[Tuple[str, int]]:
        now = time.monotonic()
        if self.store is not None and now - self._seen >= REFRESH_S:
            self._seen = now
            try:
                n = self.store.add(COUNT, 0)
                keys = [f"{SERVER}{i}" for i in range(1, n + 1)]
                vals = self.store.multi_get(keys) if n and self.store.check(keys) else []
                addrs = []
                for v in vals:  # a standby that left blanks its entry
                    with contextlib.suppress(ValueError):
                        host, port = parse_address(as_text(v))
                        if host:
                            addrs.append((host, port))
                self._addrs = addrs
            except Exception as e:  # noqa: BLE001 -- no standbys this round
                log.debug("standby addresses: %s", e)
        return self._addrs

    def push_round(self, own: Dict[int, str], step: int, rate, maps) -> int:
        """Push this round's copies (``{rank: path}``) to every standby; bytes sent."""
        sent = 0
        for addr in self.addresses():
            ok = True
            for r, path in own.items():
                try:
                    res = push(addr, self.secret, f"node{self.node}", r, path, rate, maps=maps)
                except (OSError, ConnectionError) as e:
                    log.debug("push of rank %d to standby %s failed: %s", r, addr, e)
                    res = None
                if res is None:
                    ok = False
                    break
                sent += res["bytes"]
            if ok:
                self.held["{}:{}".format(*addr)] = step
        return sent

    def status(self) -> Optional[dict]:
        return dict(self.held) if self.held else None


def describe(holder: Optional[StandbyHolder]) -> dict:
    """The standby's part of ``status.json``."""
    if holder is None:
        return {}
    return {"standby_holds_step": holder.held_step(),
            "standby_copies": {str(r): steps for r, steps in holder.copies.inventory().items()}}

