"""Peer-memory replication: authenticated transfer, verification, refusal, interrupted copies."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest

from ckptrun import protocol as P
from ckptrun.replication import AuthError, PeerStore
from ckptrun.replicator import ReplicaServer, fetch, holdings, push

SECRET = b"s" * 32


def make_slot(path: str, step: int, data: bytes, rank: int = 3) -> None:
    """Write a committed slot file the way a worker would (header, JSON meta, data)."""
    meta = json.dumps({"format": 1, "step": step, "rank": rank}).encode()
    if os.path.exists(path):
        os.unlink(path)
    off = P.data_offset_for(P.PAGE)
    mm = P.create_shm_file(path, off + len(data))
    mm[P.SLOT_HEADER_SIZE : P.SLOT_HEADER_SIZE + len(meta)] = meta
    mm[off : off + len(data)] = data
    digest = P.new_checksum()
    digest.update(meta)
    digest.update(data)
    P.SlotHeader(P.SlotState.COMMITTED, step, 1, len(meta), len(data), off, digest.intdigest(),
                 time.time(), len(mm), rank, 4).pack_into(mm)
    mm.close()


def read_data(path: str) -> bytes:
    mm = P.open_shm_file(path, write=False)
    h = P.SlotHeader.unpack_from(mm)
    out = bytes(mm[h.data_offset : h.data_offset + h.data_len])
    mm.close()
    return out


@pytest.fixture
def token():
    tok = "test" + uuid.uuid4().hex[:8]
    yield tok
    for f in glob.glob(f"/dev/shm/ckptrun-{tok}*"):
        os.unlink(f)


@pytest.fixture
def server(token):
    refused = []
    received = []
    srv = ReplicaServer("127.0.0.1", SECRET, PeerStore(token + "-b"), on_refused=refused.append,
                        on_received=lambda *a: received.append(a))
    srv.refused, srv.received = refused, received
    yield srv
    srv.stop()
    for f in glob.glob(f"/dev/shm/ckptrun-{token}-b*"):
        os.unlink(f)


def test_push_verifies_and_fetch_returns_identical_bytes(token, server):
    src = f"/dev/shm/ckptrun-{token}-r3-s0"
    data = os.urandom(9 << 20)  # spans several chunks
    make_slot(src, 7, data)
    res = push(server.address, SECRET, "node-a", 3, src)
    assert res and res["step"] == 7 and res["bytes"] > len(data)
    step, path = server.store.latest(3)
    assert step == 7 and read_data(path) == data
    assert holdings(server.address, SECRET, "node-c") == {3: 7}
    assert server.received and server.received[0][:2] == (3, 7)

    dst = f"/dev/shm/ckptrun-{token}-r3-s1"
    assert fetch(server.address, SECRET, "node-c", 3, dst) == 7
    assert read_data(dst) == data
    h = P.SlotHeader.unpack_from(open(dst, "rb").read(P.SLOT_HEADER_SIZE))
    assert h.state == P.SlotState.COMMITTED and h.step == 7 and h.rank == 3
    assert fetch(server.address, SECRET, "node-c", 3, dst, step=6) is None


def test_newer_push_keeps_previous_copy_until_replaced(token, server):
    src = f"/dev/shm/ckptrun-{token}-r3-s0"
    for step in (1, 2, 3):
        make_slot(src, step, bytes([step]) * 4096)
        assert push(server.address, SECRET, "node-a", 3, src)["step"] == step
    step, path = server.store.latest(3)
    assert step == 3 and read_data(path) == bytes([3]) * 4096
    steps = sorted(P.SlotHeader.unpack_from(open(server.store.path(3, k), "rb").read(4096)).step
                   for k in (0, 1))
    assert steps == [2, 3]


def test_wrong_secret_is_refused(token, server):
    src = f"/dev/shm/ckptrun-{token}-r3-s0"
    make_slot(src, 5, b"x" * 1000)
    with pytest.raises((AuthError, ConnectionError)):
        push(server.address, b"wrong" * 8, "intruder", 3, src)
    time.sleep(0.2)
    assert server.refused
    assert server.store.latest(3) is None


def test_corrupted_source_never_becomes_a_copy(token, server):
    src = f"/dev/shm/ckptrun-{token}-r3-s0"
    make_slot(src, 5, b"y" * 100000)
    mm = P.open_shm_file(src)
    off = P.SlotHeader.unpack_from(mm).data_offset
    mm[off + 10] ^= 0x01  # flipped after the checksum was recorded
    mm.close()
    assert push(server.address, SECRET, "node-a", 3, src) is None
    assert server.store.latest(3) is None


def test_source_rewritten_during_send_is_aborted(token, server):
    src = f"/dev/shm/ckptrun-{token}-r3-s0"
    make_slot(src, 5, b"z" * (8 << 20))

    def rewrite():  # the worker starts a new write into this slot mid-transfer
        time.sleep(0.3)
        mm = P.open_shm_file(src)
        P.set_slot_state(mm, P.SlotState.WRITING, 6, seq=99)
        mm.close()

    t = threading.Thread(target=rewrite)
    t.start()
    res = push(server.address, SECRET, "node-a", 3, src, rate_bps=8e6)  # ~1 s transfer
    t.join()
    assert res is None
    assert server.store.latest(3) is None


def test_sender_killed_mid_transfer_leaves_no_usable_copy(token, server):
    src = f"/dev/shm/ckptrun-{token}-r3-s0"
    make_slot(src, 5, b"k" * (16 << 20))
    code = (
        "import sys; from ckptrun.replicator import push; "
        f"push(('127.0.0.1', {server.address[1]}), {SECRET!r}, 'a', 3, {src!r}, rate_bps=4e6)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code])
    deadline = time.monotonic() + 30
    while not glob.glob(server.store.path(3, 0)) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    time.sleep(0.5)
    assert server.store.latest(3) is None
    # the half-written incoming slot was released: a complete push now succeeds
    make_slot(src, 6, b"k" * 1000)
    assert push(server.address, SECRET, "node-a", 3, src)["step"] == 6


def test_back_to_back_pushes_of_one_rank_all_land(token, server):
    """The receiver frees a rank before it replies, so the sender's next push is never
    refused as busy (and an early return never leaks a mapped view)."""
    src = f"/dev/shm/ckptrun-{token}-r3-s0"
    for step in range(1, 41):
        make_slot(src, step, bytes([step]) * (1 << 20))
        res = push(server.address, SECRET, "node-a", 3, src)
        assert res is not None and res["step"] == step
    assert server.store.latest(3)[0] == 40
