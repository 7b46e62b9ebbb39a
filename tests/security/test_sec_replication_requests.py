"""Attacks on the replica server, from the network: requests of a peer that knows the key
but asks for what no peer should (another rank, a negative one, all of /dev/shm), frames that
are not frames (a 100k-deep JSON hello, garbage), and a flood of them.  Each is refused and
the server goes on serving the real peers."""

from __future__ import annotations

import json
import logging
import os
import socket
import struct
import threading

import pytest

from ckptrun import protocol as P
from ckptrun.tiers.peer.copies import PeerStore
from ckptrun.tiers.peer.server import ReplicaServer, holdings
from ckptrun.tiers.peer.wire import connect, recv_frame, send_frame

KEY = os.urandom(32)


@pytest.fixture
def server():
    token = f"secrep{os.getpid()}"
    refused = []
    srv = ReplicaServer("127.0.0.1", KEY, PeerStore(token), on_refused=refused.append,
                        accept_ranks=[2, 3])
    srv.refused = refused
    yield srv
    srv.stop()
    for name in os.listdir(P.SHM_DIR):
        if name.startswith(f"{P.SHM_PREFIX}{token}"):
            os.unlink(os.path.join(P.SHM_DIR, name))


def ask(srv, req: dict) -> dict:
    with connect(srv.address, KEY, "peer") as sock:
        send_frame(sock, req)
        return recv_frame(sock)


def put(rank, data_len=4096, **kw) -> dict:
    return {"op": "put", "rank": rank, "step": 5, "meta_len": 100, "data_len": data_len,
            "checksum": 1, "world_size": 4, **kw}


def shm_files(srv) -> list:
    return [n for n in os.listdir(P.SHM_DIR) if n.startswith(f"{P.SHM_PREFIX}{srv.store.job_token}")]


@pytest.mark.parametrize("req,why", [
    (put(7), "not one this machine keeps"),
    (put(-1), "'rank'"),
    (put("3"), "'rank'"),
    (put([3]), "'rank'"),
    (put(3, data_len=1 << 49), "no room"),
    (put(3, step={"a": 1}), "'step'"),
    ({"op": "fetch", "rank": -5}, "'rank'"),
    ({"op": "fetch", "rank": 2, "step": "x"}, "'step'"),
    ({"op": "rm -rf"}, "unknown op"),
])
def test_a_request_out_of_bounds_is_refused(server, req, why):
    reply = ask(server, req)
    assert reply["ok"] is False and why in reply["error"], reply
    assert shm_files(server) == []  # nothing was allocated for it
    assert holdings(server.address, KEY, "peer") == {}  # and the server still serves


def test_a_put_that_would_fill_dev_shm_is_refused(server):
    st = os.statvfs(P.SHM_DIR)
    free = st.f_bavail * st.f_frsize
    reply = ask(server, put(3, data_len=free - (1 << 20)))  # fits, but eats the reserve
    assert reply["ok"] is False and "no room" in reply["error"], reply
    assert shm_files(server) == []


def _raw(srv, payload: bytes) -> bytes:
    with socket.create_connection(srv.address, timeout=10) as s:
        s.recv(32)  # the server's challenge
        s.sendall(payload)
        try:
            return s.recv(100)
        except OSError:
            return b""


def test_a_deep_json_hello_and_garbage_close_the_connection_quietly(server, caplog):
    errors = []
    old = threading.excepthook
    threading.excepthook = lambda args: errors.append(args.exc_value)
    try:
        deep = b"[" * 100_000 + b"]" * 100_000
        assert _raw(server, struct.pack(">I", len(deep)) + deep) == b""  # over the hello limit
        small = b"[" * 2000 + b"]" * 2000
        assert _raw(server, struct.pack(">I", len(small)) + small) == b""
        hello = json.dumps({"node": "x" * 10, "nonce": "zz", "proof": "qq"}).encode()
        assert _raw(server, struct.pack(">I", len(hello)) + hello) == b""
        with caplog.at_level(logging.WARNING, logger="ckptrun.tiers.peer.server"):
            for _ in range(200):  # a flood of garbage connections
                _raw(server, os.urandom(64))
    finally:
        threading.excepthook = old
    assert errors == [], errors  # no thread died with a traceback
    lines = [r for r in caplog.records if "refused replica connection" in r.getMessage()]
    assert len(lines) <= 2, [r.getMessage() for r in lines]
    assert 1 <= len(server.refused) <= 3
    assert holdings(server.address, KEY, "peer") == {}
