"""Peer-memory replication: authenticated transfer, verification, refusal, interrupted copies."""

from __future__ import annotations

import glob
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import uuid

import pytest

from ckptrun import protocol as P
from ckptrun.tiers.peer.copies import MapCache, PeerStore
from ckptrun.tiers.peer.server import ReplicaServer, fetch, holdings, push
from ckptrun.tiers.peer.wire import AuthError

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


def test_a_peer_that_dies_in_the_handshake_is_not_called_an_intruder(server):
    """A machine lost while it connects leaves the server a closed or reset connection
    (every machine-loss test made one): no ``replication_refused`` -- that is for a peer
    that sent something without the job's key (the test above)."""
    for reset in (False, True):
        with socket.create_connection(server.address, timeout=10) as s:
            assert len(s.recv(32)) == 32  # the challenge
            if reset:  # RST instead of FIN, as a killed process's socket may end
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with socket.create_connection(server.address, timeout=10):
        pass  # before even reading the challenge
    time.sleep(0.3)
    assert server.refused == []


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
        "import sys; from ckptrun.tiers.peer.server import push; "
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


def test_push_while_the_same_rank_is_in_flight_is_refused_not_raised(token, server):
    """A second push of a rank whose transfer is still running gets None ("busy") -- no
    BufferError or other exception -- and the rank is free again once the first is done."""
    src = f"/dev/shm/ckptrun-{token}-r3-s0"
    make_slot(src, 5, b"q" * (8 << 20))
    maps = MapCache()
    first: list = []
    t = threading.Thread(target=lambda: first.append(
        push(server.address, SECRET, "node-a", 3, src, rate_bps=16e6, maps=maps)))  # ~0.5 s
    t.start()
    deadline = time.monotonic() + 10
    while not glob.glob(server.store.path(3, 0)) and time.monotonic() < deadline:
        time.sleep(0.01)
    other = f"/dev/shm/ckptrun-{token}-r3-s1"
    make_slot(other, 6, b"w" * 4096)
    assert push(server.address, SECRET, "node-b", 3, other, maps=maps) is None  # busy
    t.join()
    assert first and first[0]["step"] == 5
    for _ in range(3):  # back to back with cached mappings on both ends
        res = push(server.address, SECRET, "node-b", 3, other, maps=maps)
        assert res is not None and res["step"] == 6
    assert server.store.latest(3)[0] == 6
    maps.close()


def test_map_cache_never_reuses_a_replaced_file(token):
    path = f"/dev/shm/ckptrun-{token}-cache"
    make_slot(path, 1, b"a" * 8192)
    maps = MapCache()
    mm = maps.open(path)
    maps.give(path, mm, False)
    assert maps.open(path) is mm  # same file: the mapping is reused
    maps.give(path, mm, False)
    make_slot(path, 2, b"b" * 8192)  # unlinked and created again: another file
    mm2 = maps.open(path)
    assert mm2 is not mm and mm.closed
    assert P.SlotHeader.unpack_from(mm2).step == 2
    maps.give(path, mm2, False)
    assert maps.take(path, 1 << 30, False) is None  # too small for the request: dropped
    maps.close()


def test_rewritten_source_with_cached_mappings_sends_the_new_bytes(token, server):
    """The sender's kept mapping shows the file as it is now, not as it was."""
    src = f"/dev/shm/ckptrun-{token}-r3-s0"
    maps = MapCache()
    make_slot(src, 1, b"1" * 100000)
    assert push(server.address, SECRET, "a", 3, src, maps=maps)["step"] == 1
    mm = P.open_shm_file(src)  # rewrite in place (same file), as a worker reuses a slot
    h = P.SlotHeader.unpack_from(mm)
    data = b"2" * 100000
    mm[h.data_offset:h.data_offset + len(data)] = data
    meta = bytes(mm[P.SLOT_HEADER_SIZE:P.SLOT_HEADER_SIZE + h.meta_len])
    digest = P.new_checksum()
    digest.update(meta)
    digest.update(data)
    h.step, h.seq, h.checksum = 2, h.seq + 1, digest.intdigest()
    h.pack_into(mm)
    mm.close()
    assert push(server.address, SECRET, "a", 3, src, maps=maps)["step"] == 2
    assert read_data(server.store.latest(3)[1]) == data
    maps.close()


def _fake_agent(node: int, store, events: list, rate_bps=None, nnodes: int = 2):
    """What ``ReplicaTier`` gets from an agent: ``nnodes`` machines x 1 rank, a shared store."""
    from ckptrun.config import AgentConfig
    from ckptrun.tiers.interface import TierContext
    from ckptrun.tiers.memory.node import NodeMemory

    token = "tier" + uuid.uuid4().hex[:8]
    cfg = AgentConfig(script="train.py", replicas=2, nproc_per_node=1, local_addr="127.0.0.1",
                      rdzv_endpoint=f"127.0.0.1:{store.port}", replication_rate=rate_bps,
                      replication_budget=None)
    return TierContext(
        cfg=cfg, node=node, nnodes=nnodes, store=store, memory=NodeMemory(token, num_slots=3),
        control=P.ControlBlock(P.control_path(token), 1, create=True), token=token,
        emit=lambda event, **f: events.append(dict(f, event=event)), address="127.0.0.1")


def _write_lockstep(agents, steps, pause_s: float = 0.01) -> None:
    """Both machines commit ``steps`` in lockstep (data parallel: a step apart at most)."""
    import torch

    from ckptrun import snapshot as S

    lockstep = threading.Barrier(len(agents))

    def train(node: int) -> None:
        mem, w = agents[node].memory, torch.zeros(1 << 20)
        for step in steps:
            lockstep.wait()
            w += 1
            tree, items = S.flatten({"w": w, "step": step})
            mem.write(node, S.make_meta(step, node, 2, tree, items, [0] * len(items)),
                      [t for _, t in items], step=step)
            time.sleep(pause_s)

    writers = [threading.Thread(target=train, args=(n,)) for n in range(len(agents))]
    for t in writers:
        t.start()
    for t in writers:
        t.join()


def _close_tiers(tiers, agents) -> None:
    for tier, agent in zip(tiers, agents):
        tier.close()
        agent.control.close()
        agent.memory.cleanup()
        for f in glob.glob(f"/dev/shm/ckptrun-{agent.token}*"):
            os.unlink(f)


def _wait_for(pred, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not pred():
        time.sleep(0.05)
    return bool(pred())


def test_a_node_behind_gets_its_round_after_the_others_are_done():
    """A node whose round failed asks for another one; the others join it although they
    have nothing new (before, it waited forever for them once training stopped)."""
    from torch.distributed import TCPStore

    from ckptrun.tiers.peer.tier import ReplicaTier

    master = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    agents = [_fake_agent(n, TCPStore("127.0.0.1", master.port, is_master=False), [])
              for n in (0, 1)]
    tiers = [ReplicaTier(a) for a in agents]
    real = tiers[1]._replicate
    tiers[1]._replicate = lambda step: None  # every round of node 1 fails for now
    try:
        for tier in tiers:
            tier.attempt_started(0)
        _write_lockstep(agents, range(1, 11))
        assert _wait_for(lambda: tiers[0].replicated_step == 10, 20)
        assert tiers[1].replicated_step is None
        tiers[1]._replicate = real
        assert _wait_for(lambda: tiers[1].replicated_step == 10, 20), tiers[1].replicated_step
        assert tiers[0].copies.latest(1)[0] == 10
    finally:
        _close_tiers(tiers, agents)


def test_rounds_always_take_the_newest_step_never_a_queue():
    """Steps come faster than a (paced) round can copy them: each round replicates the
    newest step there is when it starts -- the ones committed meanwhile are skipped, not
    queued -- and once training stops, the last step is what both machines hold."""
    from torch.distributed import TCPStore

    from ckptrun.tiers.peer.tier import ReplicaTier

    master = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    events: list = []
    agents = [_fake_agent(n, TCPStore("127.0.0.1", master.port, is_master=False), events,
                          rate_bps=40e6) for n in (0, 1)]  # 4 MiB a push: ~0.1 s
    tiers = [ReplicaTier(a) for a in agents]
    received = {0: [], 1: []}
    for tier in tiers:
        tier.server._on_received = lambda rank, step, nbytes, s: received[rank].append(step)
    last = 60

    try:
        for tier in tiers:
            tier.attempt_started(0)
        _write_lockstep(agents, range(1, last + 1))
        _wait_for(lambda: all(t.replicated_step == last for t in tiers), 20)
        assert [t.replicated_step for t in tiers] == [last, last]
        for steps in received.values():
            assert steps == sorted(set(steps)), steps  # strictly newer every round
            assert steps[-1] == last
            assert len(steps) < last // 2, steps  # rounds skipped the stale steps
            assert any(b - a > 1 for a, b in zip(steps, steps[1:])), steps
        assert tiers[1].copies.latest(0)[0] == last and tiers[0].copies.latest(1)[0] == last
    finally:
        _close_tiers(tiers, agents)


def test_copies_of_other_ranks_go_once_two_rounds_replaced_every_copy():
    """A standby that took a place keeps its copies of every rank of the job (a second
    machine may be lost before the new membership replicated anything); once this
    membership's rounds have filled both copy files of every rank, they are dropped."""
    from torch.distributed import TCPStore

    from ckptrun.tiers.peer.tier import ReplicaTier

    master = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    agents = [_fake_agent(n, TCPStore("127.0.0.1", master.port, is_master=False), [])
              for n in (0, 1)]
    tiers = [ReplicaTier(a) for a in agents]
    foreign = [tiers[0].copies.path(r, 0) for r in (5, 6)]  # what the standby was pushed
    for r, path in zip((5, 6), foreign):
        make_slot(path, 3, b"s" * 4096, rank=r)
    try:
        assert sorted(tiers[0].copies.holdings()) == [5, 6]
        _write_lockstep(agents, range(1, 3), pause_s=0)
        tiers[0]._replicate(2)
        assert tiers[0].rounds == 1 and all(os.path.exists(p) for p in foreign)
        _write_lockstep(agents, range(3, 5), pause_s=0)
        tiers[0]._replicate(4)
        assert tiers[0].rounds == 2 and not any(os.path.exists(p) for p in foreign)
        assert sorted(tiers[0].copies.holdings()) == [0]
        assert tiers[1].copies.latest(0)[0] == 4
    finally:
        _close_tiers(tiers, agents)


def test_a_restore_asks_every_machine_when_the_holders_cannot_cover_its_ranks(token):
    """3 machines, 2 copies: node 1's copies live on nodes 1 and 2.  Both were lost; the
    only copy of rank 1 left is on node 0 (a standby that took node 2's place earlier kept
    every rank's copies).  The newcomer at node 1 finds it there and fetches it."""
    from torch.distributed import TCPStore

    from ckptrun.tiers.peer.tier import ReplicaTier

    master = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    agents = [_fake_agent(n, TCPStore("127.0.0.1", master.port, is_master=False), [],
                          nnodes=3) for n in (0, 1, 2)]
    tiers = [ReplicaTier(a) for a in agents]
    try:
        assert tiers[1].holders == [2]
        data = os.urandom(1 << 16)
        make_slot(tiers[0].copies.path(1, 0), 9, data, rank=1)
        assert tiers[1].offers([1], 1, None) == [9]
        assert tiers[1].materialise([1], 1, 9) == "peer"
        assert read_data(agents[1].memory.slot_paths(1)[0]) == data
    finally:
        _close_tiers(tiers, agents)


def test_a_round_whose_step_is_gone_does_not_stop_later_rounds():
    """Regression: a round for a step the worker had already overwritten returned early
    with the rank still marked busy, and every later round of that agent failed."""
    from torch.distributed import TCPStore

    from ckptrun.tiers.peer.tier import ReplicaTier

    master = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    agents = [_fake_agent(n, TCPStore("127.0.0.1", master.port, is_master=False), [])
              for n in (0, 1)]
    tiers = [ReplicaTier(a) for a in agents]  # rounds not started: _replicate called here
    try:
        _write_lockstep(agents, range(1, 6), pause_s=0)  # 3 slots: steps 3, 4, 5 are held
        tiers[0]._replicate(1)  # gone
        assert tiers[0].replicated_step is None
        tiers[0]._replicate(5)
        assert tiers[0].replicated_step == 5 and tiers[1].copies.latest(0)[0] == 5
    finally:
        _close_tiers(tiers, agents)


def test_the_step_all_restore_ranks_share_is_never_overwritten(token):
    """This node's own copy of round 7 landed, the peer's push of its rank for round 7 did
    not: 5 is the only step held for both ranks.  The next copy of the own rank must replace
    7, not 5 (which the old rule, "never the newest", would have overwritten -- leaving no
    step one restore could take for both ranks)."""
    store = PeerStore(token, pin_ranks=[0, 1])
    make_slot(store.path(0, 0), 5, b"a" * 4096, rank=0)
    make_slot(store.path(0, 1), 7, b"b" * 4096, rank=0)
    make_slot(store.path(1, 0), 5, b"c" * 4096, rank=1)
    assert store.pinned_step() == 5
    assert store.incoming_path(0) == store.path(0, 1)
    store.done(0)
    make_slot(store.path(1, 1), 7, b"d" * 4096, rank=1)  # the push of round 7 arrives
    assert store.pinned_step() == 7
    assert store.incoming_path(0) == store.path(0, 0)  # now 5 may go
    store.done(0)
    assert PeerStore(token).incoming_path(0) == store.path(0, 0)  # no pins: not the newest


def test_a_copy_file_still_being_created_is_no_copy_and_breaks_nothing(token):
    """A receive creates its file before sizing it: a header read meanwhile finds fewer
    bytes than a header.  That file holds no copy -- and the serving thread that looked at
    it goes on (a ``struct.error`` there once killed a standby's server mid-job)."""
    store = PeerStore(token, pin_ranks=[0])
    make_slot(store.path(0, 0), 5, b"a" * 4096, rank=0)
    open(store.path(0, 1), "wb").close()  # created, not yet sized
    assert store.copies(0) == {5: store.path(0, 0)}
    assert store.latest(0) == (5, store.path(0, 0)) and store.pinned_step() == 5
    assert store.incoming_path(0) == store.path(0, 1)
    store.done(0)
