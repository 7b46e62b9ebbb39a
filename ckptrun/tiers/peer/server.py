"""The replica server an agent runs, and the client operations other agents call on it.

``ReplicaServer`` accepts authenticated connections (see ``ckptrun.tiers.peer.wire``) and serves three
operations: ``put`` (store a peer's snapshot in this agent's :class:`PeerStore`), ``fetch``
(stream a held copy back, for a replacement machine) and ``list`` (which ranks and steps are
held).  One operation per connection keeps the server stateless.

Even an authenticated request is bounded before it is served: a ``put`` only for the ranks
this server keeps copies of, with sizes that fit the memory left in ``/dev/shm`` (a reserve
always stays free), every field type-checked.  A bad request closes its connection with one
log line; refusals are logged at most every few seconds (with how many were not), so a flood
of garbage connections is a handful of lines, not one each.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from ckptrun import protocol as P
from ckptrun.protocol.gate import Gate, accept_or_back_off, start_thread
from ckptrun.tiers.peer.channel import PeerClosed
from ckptrun.tiers.peer.copies import MapCache, PeerStore, done_with_map
from ckptrun.tiers.peer.wire import (
    AuthError,
    Channel,
    connect,
    lower_thread_priority,
    receive_slot,
    recv_frame,
    send_frame,
    send_stream,
    server_handshake,
    slot_regions,
    tune_socket,
)

log = logging.getLogger(__name__)

MAX_RANK = 1 << 20
MAX_META = 256 << 20  # a snapshot's JSON skeleton; far above any real one
SHM_RESERVE = 0.05  # of /dev/shm that a put never takes (at least SHM_RESERVE_MIN bytes)
SHM_RESERVE_MIN = 64 << 20


class BadRequest(ValueError):
    """A request this server will not serve, said in one line."""


def field_int(req: dict, name: str, lo: int, hi: int) -> int:
    """``req[name]`` when it is an integer in ``lo..hi``; else :class:`BadRequest`."""
    v = req.get(name)
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise BadRequest(f"field {name!r} is not an integer in {lo}..{hi}")
    return v


class ReplicaServer:
    """Listens on ``host`` (the address the node uses for the rendezvous) for peer agents."""

    def __init__(self, host: str, secret: bytes, store: PeerStore,
                 on_refused: Optional[Callable[[str], None]] = None,
                 on_received: Optional[Callable[[int, int, int, float], None]] = None,
                 local_copy: Optional[Callable[[int, int], Optional[str]]] = None,
                 put_nice: int = 0, accept_ranks: Optional[Sequence[int]] = None):
        self.store = store
        # the ranks a put may name (this node's sources'); None: any (tests of the wire)
        self._accept = None if accept_ranks is None else frozenset(int(r) for r in accept_ranks)
        self._put_nice = put_nice  # niceness of the threads receiving pushes (0: unchanged)
        self._local_copy = local_copy  # (rank, step) -> path of this node's own slot, if any
        self._secret = secret
        self._gate = Gate("replica connection", on_refused=on_refused)
        self._on_received = on_received
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, 0))
        self._sock.listen(16)
        self.address: Tuple[str, int] = self._sock.getsockname()[:2]
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._accept_loop, name="ckptrun-replica-server",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop listening; the store's cached mappings are unmapped (its files stay)."""
        self._stopped.set()
        self._gate.close()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        self._thread.join(timeout=5)
        self.store.close()

    def _accept_loop(self) -> None:
        while True:
            got = accept_or_back_off(self._sock, "the replica server", self._stopped)
            if got is None:
                return
            conn, peer = got
            self._gate.admit(conn, f"{peer[0]}:{peer[1]}")
            if not start_thread(self._serve, (conn, peer), "ckptrun-replica-conn", conn):
                self._gate.leave(conn)

    def _serve(self, conn: socket.socket, peer) -> None:
        conn.settimeout(30.0)
        tune_socket(conn)
        try:
            try:
                node, ch = server_handshake(conn, self._secret)
            finally:
                self._gate.leave(conn)  # proven, or out: either way out of the gate
        except (PeerClosed, ConnectionResetError, BrokenPipeError, TimeoutError) as e:
            # gone before it said who it is: a peer agent that died mid-connect (every
            # machine loss made one) is not an intruder, and one that only connects and
            # leaves learned nothing -- a refusal is for what a peer sent
            log.debug("replica connection from %s:%s ended in the handshake: %s",
                      peer[0], peer[1], e)
            conn.close()
            return
        except (AuthError, ConnectionError, ValueError, OSError) as e:
            self._gate.report(f"{peer[0]}:{peer[1]}", str(e))
            conn.close()
            return
        try:
            req = recv_frame(ch)
            op = req.get("op")
            if op == "put":
                lower_thread_priority(self._put_nice)  # this connection's thread only
                self._put(ch, node, req)
            elif op == "fetch":
                self._fetch(ch, req)
            elif op == "list":
                inv = self.store.inventory()
                send_frame(ch, {"ok": True, "inventory": {str(r): s for r, s in inv.items()}})
            else:
                send_frame(ch, {"ok": False, "error": f"unknown op {str(op)[:40]!r}"})
        except BadRequest as e:
            log.warning("refused a request of %s: %s", node, e)
            with contextlib.suppress(OSError):
                send_frame(ch, {"ok": False, "error": str(e)})
        except (ConnectionError, OSError, ValueError, KeyError, TypeError) as e:
            log.warning("replica connection from %s broke: %s", node, e)
        finally:
            ch.close()

    def _put(self, ch: Channel, node: str, req: dict) -> None:
        rank = field_int(req, "rank", 0, MAX_RANK)
        if self._accept is not None and rank not in self._accept:
            raise BadRequest(f"rank {rank} is not one this machine keeps copies of")
        field_int(req, "step", 1, 1 << 62)
        field_int(req, "checksum", 0, (1 << 64) - 1)
        if "world_size" in req:
            field_int(req, "world_size", 0, MAX_RANK)
        meta_len = field_int(req, "meta_len", 0, MAX_META)
        data_len = field_int(req, "data_len", 0, 1 << 50)
        path = self.store.incoming_path(rank)
        if path is None:  # a transfer of this rank is already in flight: the sender retries later
            send_frame(ch, {"ok": False, "error": "busy"})
            return
        try:
            self._check_room(path, rank, meta_len + data_len)
            send_frame(ch, {"ok": True})
            t0 = time.monotonic()
            ok = receive_slot(ch, path, req, self.store.maps)
        finally:
            self.store.done(rank)  # before the reply: the sender's next push is not "busy"
        send_frame(ch, {"ok": ok})
        if ok and self._on_received:
            self._on_received(rank, int(req["step"]), int(req["meta_len"]) + int(req["data_len"]),
                              time.monotonic() - t0)

    def _check_room(self, path: str, rank: int, size: int) -> None:
        """Refuse a put that would leave less than the reserve of /dev/shm free (the copy
        goes into ``path``, whose pages it reuses)."""
        st = os.statvfs(P.SHM_DIR)
        free, total = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
        reusable = self._file_size(path)
        reserve = max(int(total * SHM_RESERVE), SHM_RESERVE_MIN)
        if size + P.PAGE * 4 - reusable > free - reserve:
            raise BadRequest(f"no room for {size} bytes of rank {rank} in {P.SHM_DIR} "
                             f"({free} free, {reserve} kept in reserve)")

    @staticmethod
    def _file_size(path: str) -> int:
        try:
            return os.stat(path).st_size
        except OSError:
            return 0

    def _fetch(self, ch: Channel, req: dict) -> None:
        """Serve a held copy of ``rank`` (newest, or exactly ``step``): a peer copy, else this
        node's own slot of that rank (a rank that moved to another machine)."""
        rank = field_int(req, "rank", 0, MAX_RANK)
        step = None if req.get("step") is None else field_int(req, "step", 0, 1 << 62)
        copies = self.store.copies(rank)
        path = copies.get(int(step)) if step is not None else (
            copies[max(copies)] if copies else None)
        if path is None and step is not None and self._local_copy is not None:
            path = self._local_copy(rank, int(step))
        if path is None:
            send_frame(ch, {"ok": False, "error": "not held"})
            return
        _stream_slot_file(ch, path, rank)


def _stream_slot_file(ch: Channel, path: str, rank: int,
                      rate_bps: Optional[float] = None, op: Optional[str] = None,
                      maps: Optional[MapCache] = None) -> Optional[Tuple[int, int]]:
    """Announce and stream the committed slot at ``path``; returns (step, bytes sent) or None.

    With ``maps`` the file's mapping is kept for the next send (mapping and populating a
    large file costs more than a third of sending it over loopback).  ``sendall`` from the
    mapping beat ``sendfile`` here: loopback TCP gains nothing from zero-copy pages."""
    # populate: one mapping call instead of a page fault per 4 KiB inside the socket copy
    mm = maps.open(path) if maps is not None else P.open_shm_file(path, populate=True,
                                                                   write=False)
    regions: list = []
    try:
        h, regions = slot_regions(mm)
        if h.state != P.SlotState.COMMITTED or h.data_offset + h.data_len > len(mm):
            send_frame(ch, {"ok": False, "error": "not committed"})
            return None
        announce = {"ok": True, "rank": rank, "step": h.step, "meta_len": h.meta_len,
                    "data_len": h.data_len, "checksum": h.checksum, "world_size": h.world_size}
        if op:
            announce["op"] = op
        send_frame(ch, announce)
        if op and not recv_frame(ch).get("ok"):
            return None

        def unchanged() -> bool:
            now = P.SlotHeader.unpack_from(mm)
            return (now.state, now.step, now.seq) == (h.state, h.step, h.seq)

        return h.step, send_stream(ch, regions, rate_bps, unchanged)
    finally:
        for r in regions:  # early returns too: exported views would keep mm from closing
            r.release()
        done_with_map(path, mm, maps, False)


def push(addr: Tuple[str, int], secret: bytes, node: str, rank: int, src_path: str,
         rate_bps: Optional[float] = None, maps: Optional[MapCache] = None) -> Optional[dict]:
    """Send the committed snapshot in ``src_path`` (rank ``rank``) to the agent at ``addr``.

    Returns ``{"step", "bytes", "seconds"}`` once the receiver verified and committed it, or
    None when there was nothing committed to send, the receiver was busy with another
    transfer of this rank, or the copy failed verification.  Connection problems raise
    ``OSError``/``ConnectionError``.  ``maps``: keep the source's mapping for the next push.
    """
    t0 = time.monotonic()
    with connect(addr, secret, node) as ch:
        ch.settimeout(60.0)
        got = _stream_slot_file(ch, src_path, rank, rate_bps, op="put", maps=maps)
        if got is None or not recv_frame(ch).get("ok"):
            return None
    return {"step": got[0], "bytes": got[1], "seconds": time.monotonic() - t0}


def fetch(addr: Tuple[str, int], secret: bytes, node: str, rank: int, dst_path: str,
          step: Optional[int] = None) -> Optional[int]:
    """Pull the copy of ``rank`` held at ``addr`` into slot file ``dst_path``; returns its step."""
    with connect(addr, secret, node) as ch:
        ch.settimeout(60.0)
        send_frame(ch, {"op": "fetch", "rank": rank, "step": step})
        info = recv_frame(ch)
        if not info.get("ok"):
            return None
        return int(info["step"]) if receive_slot(ch, dst_path, info) else None


def holdings(addr: Tuple[str, int], secret: bytes, node: str) -> Dict[int, int]:
    """{rank: newest step} of the copies the agent at ``addr`` holds."""
    return {r: max(steps) for r, steps in inventory(addr, secret, node).items()}


def inventory(addr: Tuple[str, int], secret: bytes, node: str) -> Dict[int, List[int]]:
    """{rank: [steps]} of every committed copy the agent at ``addr`` holds."""
    with connect(addr, secret, node) as ch:
        send_frame(ch, {"op": "list"})
        reply = recv_frame(ch)
    return {int(r): [int(s) for s in steps] for r, steps in reply.get("inventory", {}).items()}
