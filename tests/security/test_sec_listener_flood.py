"""A flood of connections that never prove the key, past each listener's cap: the replica
server, the agents' link port and the metrics endpoint hold no more than the cap in their
handshake, close the rest at once, end each slow handshake at its deadline however slowly
its bytes trickle in, say so in a line or two -- and serve a real peer meanwhile.

(Before: 2,000 connections sending a byte every 15 s held 2,012 agent threads for minutes,
and at a low file limit the replication thread died of EMFILE and ended the job.)"""

from __future__ import annotations

import encodings.idna  # noqa: F401  (imported now: at the file limit no module can be)
import glob
import logging
import os
import resource
import socket
import threading
import time
import urllib.request

import pytest
from test_replication import SECRET, make_slot, read_data

from ckptrun.protocol import gate
from ckptrun.tiers.peer.copies import PeerStore
from ckptrun.tiers.peer.server import ReplicaServer, push

CAP, DEADLINE_S, FLOOD = 16, 2.0, 60  # the flood is sized past the cap


@pytest.fixture(autouse=True)
def small_gates(monkeypatch):
    monkeypatch.setattr(gate, "MAX_PENDING", CAP)
    monkeypatch.setattr(gate, "HANDSHAKE_DEADLINE_S", DEADLINE_S)


class Flood:
    """``n`` connections to ``address``, each sending one byte every ``every`` s (a handshake
    that never ends, one read at a time inside any per-read timeout)."""

    def __init__(self, address, n: int, every: float = 0.5) -> None:
        self.socks, self.closed = [], 0
        for _ in range(n):
            s = socket.create_connection(address, timeout=5)
            self.socks.append(s)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._trickle, args=(every,), daemon=True)
        self._thread.start()

    def _trickle(self, every: float) -> None:
        while not self._stop.wait(every):
            for s in self.socks:
                try:
                    s.send(b"\x00")
                except OSError:
                    pass

    def count_closed(self) -> int:
        """How many of the flood's connections the server has closed (a read sees EOF or a
        reset at once)."""
        n = 0
        for s in self.socks:
            s.setblocking(False)
            try:
                while True:  # what the server sent first (its nonce), then EOF or nothing
                    if s.recv(65536) == b"":
                        n += 1
                        break
            except BlockingIOError:
                pass
            except OSError:
                n += 1
        return n

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        for s in self.socks:
            s.close()


def _threads() -> int:
    return threading.active_count()


def test_the_replica_server_bounds_a_flood_and_serves_a_peer_meanwhile(token, caplog):
    caplog.set_level(logging.WARNING)
    srv = ReplicaServer("127.0.0.1", SECRET, PeerStore(token + "-b"))
    before = _threads()
    flood = Flood(srv.address, FLOOD)
    try:
        time.sleep(0.5)
        assert srv._gate.pending <= CAP
        assert _threads() <= before + CAP + 2, _threads()  # a thread per admitted one only
        assert flood.count_closed() >= FLOOD - CAP  # the rest closed at the door
        # a real peer is served in the middle of the flood
        src = f"/dev/shm/ckptrun-{token}-r3-s0"
        data = os.urandom(1 << 20)
        make_slot(src, 5, data)
        t0 = time.monotonic()
        assert push(srv.address, SECRET, "node-a", 3, src)["step"] == 5
        assert time.monotonic() - t0 < 2.0
        assert read_data(srv.store.latest(3)[1]) == data
        # the slow handshakes end at their deadline, trickle as they may
        time.sleep(DEADLINE_S + 1.0)
        assert flood.count_closed() == FLOOD and srv._gate.pending == 0
        assert _threads() <= before + 2
    finally:
        flood.stop()
        srv.stop()
        for f in glob.glob(f"/dev/shm/ckptrun-{token}-*"):
            os.unlink(f)
    said = [r.getMessage() for r in caplog.records if "refused replica connection" in r.getMessage()]
    assert 1 <= len(said) <= 2, said  # one line, not one per connection


def test_the_agent_link_port_bounds_a_flood():
    from ckptrun.agent.links import Links

    class Store:  # what Links needs of the rendezvous store: somewhere to post its address
        def __init__(self) -> None:
            self.kv = {}

        def set(self, key, value) -> None:
            self.kv[key] = value

    before = _threads()
    links = Links(Store(), node=0, nnodes=2, host="127.0.0.1", secret=SECRET)
    flood = Flood(links.address, FLOOD)
    try:
        time.sleep(0.5)
        assert links._gate.pending <= CAP and _threads() <= before + CAP + 4
        time.sleep(DEADLINE_S + 1.0)
        assert flood.count_closed() == FLOOD and links._gate.pending == 0
    finally:
        flood.stop()
        links.close()


def test_the_metrics_endpoint_bounds_a_flood_and_answers_a_scrape():
    pytest.importorskip("prometheus_client")
    from ckptrun.agent.metrics import AgentMetrics, MetricsServer

    server = MetricsServer(AgentMetrics(), 0, "127.0.0.1")
    host, port = server.url.split("//")[1].split("/")[0].rsplit(":", 1)
    before = _threads()
    flood = Flood((host, int(port)), FLOOD)
    try:
        time.sleep(0.5)
        assert server._gate.pending <= CAP and _threads() <= before + CAP + 2
        time.sleep(DEADLINE_S + 1.0)  # the trickling ones are gone: a scrape is served
        with urllib.request.urlopen(server.url, timeout=5) as r:
            assert r.status == 200 and b"ckptrun" in r.read()
        assert flood.count_closed() == FLOOD
    finally:
        flood.stop()
        server.close()


def test_an_accept_loop_out_of_descriptors_waits_and_goes_on(token):
    """At the file limit accept() fails with EMFILE: the server says so and serves again
    once descriptors are free, instead of its thread ending (and the job with it)."""
    srv = ReplicaServer("127.0.0.1", SECRET, PeerStore(token + "-b"))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    hog = []
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (512, hard))
        with pytest.raises(OSError):
            while True:
                hog.append(os.open("/dev/null", os.O_RDONLY))
        os.close(hog.pop())  # one for the client: the server's accept() has none
        c = socket.create_connection(srv.address, timeout=5)
        time.sleep(0.5)
        assert srv._thread.is_alive()
        for fd in hog:
            os.close(fd)
        hog.clear()
        c.close()
        src = f"/dev/shm/ckptrun-{token}-r3-s0"
        make_slot(src, 9, b"x" * 4096)
        assert push(srv.address, SECRET, "node-a", 3, src)["step"] == 9
    finally:
        for fd in hog:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        srv.stop()
        for f in glob.glob(f"/dev/shm/ckptrun-{token}-*"):
            os.unlink(f)
