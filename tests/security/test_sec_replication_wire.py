"""What crosses the network between replica servers: a man in the middle on loopback sees
no byte of the state in the clear, and a byte he changes ends the transfer with no copy
committed (every record is sealed with AES-GCM under per-direction session keys)."""

from __future__ import annotations

import os
import socket
import threading

import pytest
from test_replication import make_slot, read_data

from ckptrun.tiers.peer.copies import PeerStore
from ckptrun.tiers.peer.server import ReplicaServer, fetch, push

KEY = os.urandom(32)
MARKER = b"PLAINTEXT-WEIGHTS-"


class Proxy:
    """Forwards one connection at a time to ``target``, recording (and optionally
    tampering with) what the client sends."""

    def __init__(self, target, flip_at=None):
        self.target, self.flip_at = target, flip_at
        self.sent = bytearray()
        self.received = bytearray()
        self._lsock = socket.create_server(("127.0.0.1", 0))
        self.address = self._lsock.getsockname()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                client, _ = self._lsock.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            threading.Thread(target=self._pipe, args=(client, server, self.sent, True),
                             daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, self.received, False),
                             daemon=True).start()

    def _pipe(self, src, dst, log, tamper):
        try:
            while True:
                data = bytearray(src.recv(1 << 16))
                if not data:
                    break
                start = len(log)
                log += data
                if tamper and self.flip_at is not None and start <= self.flip_at < len(log):
                    data[self.flip_at - start] ^= 0x01
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self):
        self._lsock.close()


@pytest.fixture
def server():
    token = f"secwire{os.getpid()}"
    srv = ReplicaServer("127.0.0.1", KEY, PeerStore(token + "-b"))
    yield srv, token
    srv.stop()
    for name in os.listdir("/dev/shm"):
        if name.startswith(f"ckptrun-{token}"):
            os.unlink(os.path.join("/dev/shm", name))


def test_no_byte_of_the_state_crosses_in_the_clear(server):
    srv, token = server
    src, dst = f"/dev/shm/ckptrun-{token}-r3-s0", f"/dev/shm/ckptrun-{token}-got"
    data = MARKER * 60_000  # ~1 MiB of recognisable "weights"
    make_slot(src, 5, data)
    proxy = Proxy(srv.address)
    try:
        assert push(proxy.address, KEY, "node-a", 3, src)["step"] == 5
        assert fetch(proxy.address, KEY, "node-c", 3, dst) == 5
    finally:
        proxy.close()
    assert read_data(dst) == data  # it did arrive, both ways
    assert len(proxy.sent) > len(data) and len(proxy.received) > len(data)
    assert MARKER not in bytes(proxy.sent) and MARKER not in bytes(proxy.received)
    assert b'"rank"' not in bytes(proxy.sent)  # the frames are sealed too, not just the data


def test_a_byte_changed_in_transit_commits_nothing(server):
    srv, token = server
    src = f"/dev/shm/ckptrun-{token}-r3-s0"
    make_slot(src, 5, os.urandom(1 << 20))
    proxy = Proxy(srv.address, flip_at=300_000)  # inside the data stream, after the handshake
    try:
        res = push(proxy.address, KEY, "node-a", 3, src)
    except (ConnectionError, OSError):  # the server dropped the connection at the bad record
        res = None
    finally:
        proxy.close()
    assert res is None
    assert srv.store.latest(3) is None
    assert push(srv.address, KEY, "node-a", 3, src)["step"] == 5  # the direct path still works
