"""Direct links between the agents of a membership: a machine's loss seen the moment its
agent's connections break, not after seconds of silence.

Every agent listens on the address it reaches the rendezvous from and connects to each agent
with a lower group rank, so each pair of agents shares one TCP connection.  Connections are
authenticated and sealed like replication's (:mod:`ckptrun.tiers.peer.wire`) with a key from
the job secret; a link is only counted once the handshake proved the other end knows it, so
someone who can reach the port can neither add a link nor, by closing one, fake a loss.

An agent that leaves on purpose (the job is over, it stops on a signal, the membership is
re-formed) says a goodbye on its links first.  A link that ends without it means that agent's
process is gone -- SIGKILLed, crashed, its machine rebooted: the kernel closes its sockets at
once.  A machine that vanishes without closing anything (power cut, network partition) leaves
its links open and silent: :class:`ckptrun.agent.membership.Liveness`'s heartbeat timeout
still catches that, and only that.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from typing import Dict, List, Optional

from ckptrun.protocol.gate import Gate, accept_or_back_off, start_thread
from ckptrun.store.kvstore import agreed_secret, as_text, wait_keys
from ckptrun.tiers.peer.channel import Channel, ChannelError
from ckptrun.tiers.peer.wire import AuthError, connect, parse_address, server_handshake

log = logging.getLogger(__name__)

KEY = "ckptrun/link/"
BYE = b"B"  # a record kind (one byte): this agent leaves on purpose
HANDSHAKE_TIMEOUT_S = 5.0
CONNECT_TIMEOUT_S = 60.0  # how long the other agents get to publish their link address


class Links:
    """This agent's links to the other agents of one membership (module docstring)."""

    def __init__(self, store, node: int, nnodes: int, host: str, secret: bytes) -> None:
        self.node, self.nnodes, self.secret = node, nnodes, secret
        self._links: Dict[int, Channel] = {}
        self._broken: Dict[int, float] = {}  # node -> when its link ended without a bye
        self._closing = threading.Event()
        self._lock = threading.Lock()
        self._gate = Gate("agent link")
        self._listener = socket.create_server((host, 0))
        self.address = self._listener.getsockname()[:2]
        store.set(f"{KEY}{node}", "{}:{}".format(*self.address))
        threading.Thread(target=self._accept, name="ckptrun-links-accept", daemon=True).start()
        lower = list(range(node))
        if lower:
            threading.Thread(target=self._connect, args=(store, lower),
                             name="ckptrun-links-connect", daemon=True).start()

    # -- what the agent asks ------------------------------------------------------------------
    def broken(self) -> Dict[int, float]:
        """{node: monotonic time its link ended without a goodbye}."""
        with self._lock:
            return dict(self._broken)

    def linked(self) -> List[int]:
        """The nodes a link is up with (for status and tests)."""
        with self._lock:
            return sorted(self._links)

    def close(self) -> None:
        """Say goodbye on every link and stop listening: this agent leaves on purpose."""
        self._closing.set()
        self._gate.close()
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            links, self._links = list(self._links.values()), {}
        for ch in links:
            with contextlib.suppress(OSError, ValueError):
                ch.send(BYE)
            with contextlib.suppress(OSError):
                ch.sock.shutdown(socket.SHUT_RDWR)
            ch.close()

    # -- the threads ----------------------------------------------------------------------------
    def _accept(self) -> None:
        while True:
            got = accept_or_back_off(self._listener, "the agent links", self._closing)
            if got is None:
                return  # closed
            sock, peer = got
            self._gate.admit(sock, peer[0])
            if not start_thread(self._greet, (sock, peer), "ckptrun-links-greet", sock):
                self._gate.leave(sock)

    def _greet(self, sock: socket.socket, peer) -> None:
        """A connecting agent: counted only once it proved it holds the job key, and only as
        the higher-ranked node it says it is (each pair has one link)."""
        try:
            sock.settimeout(HANDSHAKE_TIMEOUT_S)
            name, ch = server_handshake(sock, self.secret)
            other = int(name) if name.isdigit() else -1
            if not self.node < other < self.nnodes:
                raise AuthError(f"a link from node {name!r}, which cannot link here")
        except (AuthError, OSError, ValueError) as e:
            self._gate.leave(sock)
            self._gate.report(peer[0], str(e))  # one line per few seconds, not one each
            sock.close()
            return
        self._gate.proven(sock)
        self._watch(other, ch)

    def _connect(self, store, nodes: List[int]) -> None:
        for other in nodes:
            try:
                wait_keys(store, [f"{KEY}{other}"], CONNECT_TIMEOUT_S, stop=self._closing)
                if self._closing.is_set():
                    return
                ch = connect(parse_address(as_text(store.get(f"{KEY}{other}"))), self.secret,
                             str(self.node),
                             timeout=HANDSHAKE_TIMEOUT_S)
            except Exception as e:  # noqa: BLE001 -- the heartbeat still covers that node
                log.info("no link to node %d: %s", other, e)
                continue
            threading.Thread(target=self._watch, args=(other, ch), daemon=True,
                             name=f"ckptrun-link-{other}").start()

    def _watch(self, other: int, ch: Channel) -> None:
        """Block on the link until it ends: with a goodbye, or broken."""
        ch.settimeout(None)
        with self._lock:
            if self._closing.is_set():
                ch.close()
                return
            self._links[other] = ch
        said_bye = False
        try:
            while True:
                kind, _ = ch.recv(64)
                if kind == BYE:
                    said_bye = True
                    break
        except (ChannelError, OSError, ValueError):
            pass
        with self._lock:
            if self._links.get(other) is ch:
                del self._links[other]
            if not said_bye and not self._closing.is_set():
                self._broken.setdefault(other, time.monotonic())
        ch.close()


def links_secret(cfg, store) -> bytes:
    """The links' key: from the job secret (never in the store), or for an ``--insecure``
    job one agreed in the store, as replication does there."""
    from ckptrun.protocol.job_secret import job_key

    if cfg.secret is not None:
        return job_key(cfg.secret, f"{cfg.rdzv_id}|links")
    return agreed_secret(store, f"{KEY}secret")


def start_links(cfg, store, node: int, nnodes: int, host: Optional[str]) -> Optional[Links]:
    """Links for this membership, or None when they cannot be set up (the heartbeat
    timeout then covers every machine, as it always covers silent ones)."""
    try:
        return Links(store, node, nnodes, host or "127.0.0.1", links_secret(cfg, store))
    except (OSError, ValueError, RuntimeError) as e:
        log.warning("agent links not set up: %s", e)
        return None
