"""Peer-memory replication: authenticated TCP transfer of slot files between agents.

GEMINI's second tier.  Each agent runs a :class:`ReplicaServer` on the address it uses for the
rendezvous; peers push their newest committed snapshots to it (``put``) and a replacement
machine pulls a lost rank's copy back (``fetch``).  Copies live in agent-owned shared memory in
the same slot layout as local snapshots (``protocol.py``), so every reader works on both.

Wire format, after the handshake: a frame is a 4-byte big-endian length and a JSON object
(never pickle).  Bulk bytes follow a ``put``/``fetch`` frame as chunks, each an 8-byte length
then the bytes; length 0 ends the stream, ``ABORT`` abandons it (the sender saw its source slot
change under it).  A copy counts only once the whole stream arrived and its xxh3 checksum
matches the one the writer recorded at commit -- a transfer cut by a kill never becomes usable.

Handshake: mutual HMAC-SHA256 challenge with the per-job secret agreed through the rendezvous
store.  A peer without the secret is refused before it can send a byte of data.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import mmap
import os
import socket
import struct
import threading
import time
from typing import Callable, Dict, Optional, Tuple

from ckptrun import protocol as P

log = logging.getLogger("ckptrun.replication")

CHUNK = 4 << 20
ABORT = (1 << 64) - 1
MAX_FRAME = 1 << 20  # a JSON frame larger than this is a protocol violation
_U64 = struct.Struct(">Q")


class AuthError(ConnectionError):
    """The peer did not prove it knows the job's secret."""


# --------------------------------------------------------------------------- framing

def tune_socket(sock: socket.socket) -> None:
    """No Nagle delay for the small frames; large kernel buffers for the bulk stream."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, 8 << 20)
        except OSError:
            pass  # capped by net.core.[rw]mem_max: the kernel default still works


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    _recv_into(sock, memoryview(buf))
    return bytes(buf)


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    while len(view):
        got = sock.recv_into(view)
        if got == 0:
            raise ConnectionError("peer closed the connection")
        view = view[got:]


def send_frame(sock: socket.socket, obj: dict) -> None:
    data = json.dumps(obj).encode()
    sock.sendall(struct.pack(">I", len(data)) + data)


def recv_frame(sock: socket.socket) -> dict:
    (n,) = struct.unpack(">I", _recv_exact(sock, 4))
    if n > MAX_FRAME:
        raise ConnectionError(f"frame of {n} bytes exceeds the limit")
    obj = json.loads(_recv_exact(sock, n))
    if not isinstance(obj, dict):
        raise ConnectionError("malformed frame")
    return obj


# --------------------------------------------------------------------------- handshake

def _mac(secret: bytes, *parts: bytes) -> bytes:
    return hmac.new(secret, b"|".join(parts), hashlib.sha256).digest()


def server_handshake(sock: socket.socket, secret: bytes) -> str:
    """Challenge the connecting peer; returns its node name or raises :class:`AuthError`."""
    nonce = os.urandom(32)
    sock.sendall(nonce)
    hello = recv_frame(sock)
    node = str(hello.get("node", ""))
    their_nonce = bytes.fromhex(str(hello.get("nonce", "")))
    proof = bytes.fromhex(str(hello.get("proof", "")))
    if len(their_nonce) != 32 or not hmac.compare_digest(
        proof, _mac(secret, b"client", nonce, node.encode())
    ):
        raise AuthError(f"peer {node or '?'} failed authentication")
    send_frame(sock, {"proof": _mac(secret, b"server", their_nonce).hex()})
    return node


def client_handshake(sock: socket.socket, secret: bytes, node: str) -> None:
    """Answer the server's challenge and check that the server knows the secret too."""
    nonce = _recv_exact(sock, 32)
    mine = os.urandom(32)
    send_frame(sock, {"node": node, "nonce": mine.hex(),
                      "proof": _mac(secret, b"client", nonce, node.encode()).hex()})
    reply = recv_frame(sock)
    if not hmac.compare_digest(bytes.fromhex(str(reply.get("proof", ""))),
                               _mac(secret, b"server", mine)):
        raise AuthError("replica server failed authentication")


def connect(addr: Tuple[str, int], secret: bytes, node: str, timeout: float = 10.0) -> socket.socket:
    sock = socket.create_connection(addr, timeout=timeout)
    tune_socket(sock)
    try:
        client_handshake(sock, secret, node)
    except BaseException:
        sock.close()
        raise
    return sock


# --------------------------------------------------------------------------- slot streams

def slot_regions(mm) -> Tuple[P.SlotHeader, list]:
    """Header and the (meta, data) memory regions of a committed slot, as memoryviews."""
    h = P.SlotHeader.unpack_from(mm)
    view = memoryview(mm)
    meta = view[P.SLOT_HEADER_SIZE : P.SLOT_HEADER_SIZE + h.meta_len]
    data = view[h.data_offset : h.data_offset + h.data_len]
    return h, [meta, data]


def send_stream(sock: socket.socket, regions: list, rate_bps: Optional[float] = None,
                still_valid: Callable[[], bool] = lambda: True) -> int:
    """Send regions as chunks, paced to ``rate_bps``; ABORT if the source changed meanwhile."""
    sent, t0 = 0, time.monotonic()
    for region in regions:
        for off in range(0, len(region), CHUNK):
            piece = region[off : off + CHUNK]
            sock.sendall(_U64.pack(len(piece)))
            sock.sendall(piece)
            sent += len(piece)
            if rate_bps:  # pacing: never run ahead of the bandwidth budget
                ahead = sent / rate_bps - (time.monotonic() - t0)
                if ahead > 0:
                    time.sleep(ahead)
    sock.sendall(_U64.pack(0 if still_valid() else ABORT))
    return sent


def recv_stream_into(sock: socket.socket, regions: list, checksum) -> bool:
    """Receive chunks into regions (exact sizes); False if the sender aborted."""
    targets = [r for r in regions if len(r)]
    ti, pos = 0, 0
    while True:
        (n,) = _U64.unpack(_recv_exact(sock, 8))
        if n == ABORT:
            return False
        if n == 0:
            if ti != len(targets):
                raise ConnectionError("stream ended early")
            return True
        while n:
            if ti >= len(targets):
                raise ConnectionError("stream longer than announced")
            dst = targets[ti][pos : pos + n]
            _recv_into(sock, dst)
            checksum.update(dst)
            n -= len(dst)
            pos += len(dst)
            if pos == len(targets[ti]):
                ti, pos = ti + 1, 0


def prepare_slot_file(path: str, meta_len: int, data_len: int) -> mmap.mmap:
    """(Re)create ``path`` as a slot file big enough for the announced sizes, state WRITING."""
    data_offset = P.data_offset_for(max(meta_len, P.PAGE))
    size = data_offset + data_len
    if os.path.exists(path) and os.path.getsize(path) >= size:
        mm = P.open_shm_file(path, populate=True)  # reuse: map every page now, not per fault
    else:
        if os.path.exists(path):
            os.unlink(path)
        mm = P.create_shm_file(path, size)
    h = P.SlotHeader.unpack_from(mm)
    h.state, h.step, h.seq = P.SlotState.WRITING, -1, h.seq + 1
    h.meta_len, h.data_len, h.data_offset, h.capacity = meta_len, data_len, data_offset, len(mm)
    h.pack_into(mm)
    return mm


def receive_slot(sock: socket.socket, path: str, info: dict) -> bool:
    """Receive one announced snapshot into slot file ``path``; commit only if it verifies."""
    meta_len, data_len = int(info["meta_len"]), int(info["data_len"])
    mm = prepare_slot_file(path, meta_len, data_len)
    h = P.SlotHeader.unpack_from(mm)
    view = memoryview(mm)
    regions = [view[P.SLOT_HEADER_SIZE : P.SLOT_HEADER_SIZE + meta_len],
               view[h.data_offset : h.data_offset + data_len]]
    try:
        digest = P.new_checksum()
        if not recv_stream_into(sock, regions, digest):
            return False
        if digest.intdigest() != int(info["checksum"]):
            return False
        h.checksum, h.commit_time = int(info["checksum"]), time.time()
        h.rank, h.world_size = int(info["rank"]), int(info.get("world_size", 0))
        h.state, h.step = P.SlotState.WRITING, -1
        h.pack_into(mm)
        P.set_slot_state(mm, P.SlotState.COMMITTED, int(info["step"]))  # the commit point
        return True
    finally:
        for r in regions:
            r.release()
        view.release()
        try:
            mm.close()
        except BufferError:
            pass  # a failed recv's traceback still holds a slice; unmapped when collected


def copy_slot_file(src_path: str, dst_path: str) -> Optional[int]:
    """Copy a committed slot file, verifying the copy against the writer's checksum.

    Returns the step, or None if the source was not committed, changed during the copy, or
    does not match its checksum (a corrupted copy is never committed).
    """
    src = P.open_shm_file(src_path, populate=True, write=False)
    regions: list = []
    try:
        h, regions = slot_regions(src)
        if h.state != P.SlotState.COMMITTED:
            return None
        dst = prepare_slot_file(dst_path, h.meta_len, h.data_len)
        try:
            dh = P.SlotHeader.unpack_from(dst)
            digest = P.new_checksum()
            for region, off in zip(regions, (P.SLOT_HEADER_SIZE, dh.data_offset)):
                for pos in range(0, len(region), CHUNK):  # hash while the chunk is hot
                    piece = region[pos : pos + CHUNK]
                    dst[off + pos : off + pos + len(piece)] = piece
                    digest.update(dst[off + pos : off + pos + len(piece)])
            now = P.SlotHeader.unpack_from(src)
            if (now.state, now.step, now.seq) != (h.state, h.step, h.seq) \
                    or digest.intdigest() != h.checksum:
                return None
            dh.checksum, dh.commit_time, dh.rank, dh.world_size = (
                h.checksum, time.time(), h.rank, h.world_size)
            dh.pack_into(dst)
            P.set_slot_state(dst, P.SlotState.COMMITTED, h.step)
            return h.step
        finally:
            dst.close()
    finally:
        del regions
        try:
            src.close()
        except BufferError:
            pass


# --------------------------------------------------------------------------- peer copies

class PeerStore:
    """Agent-owned copies of other machines' ranks: two slot files per rank (newest + incoming)."""

    def __init__(self, job_token: str):
        self.job_token = job_token
        self._lock = threading.Lock()
        self._busy: set = set()

    def path(self, rank: int, k: int) -> str:
        return os.path.join(P.SHM_DIR, f"{P.SHM_PREFIX}{self.job_token}-peer-r{rank}-s{k}")

    def latest(self, rank: int) -> Optional[Tuple[int, str]]:
        """(step, path) of the newest committed copy of ``rank``, if any."""
        best = None
        for k in (0, 1):
            h = _read_header(self.path(rank, k))
            if h and h.state == P.SlotState.COMMITTED and (best is None or h.step > best[0]):
                best = (h.step, self.path(rank, k))
        return best

    def copies(self, rank: int) -> Dict[int, str]:
        """{step: path} of every committed copy of ``rank`` held here (at most two)."""
        out: Dict[int, str] = {}
        for k in (0, 1):
            h = _read_header(self.path(rank, k))
            if h and h.state == P.SlotState.COMMITTED:
                out[h.step] = self.path(rank, k)
        return out

    def inventory(self) -> Dict[int, list]:
        """{rank: [steps]} of every committed copy held here."""
        return {r: sorted(self.copies(r)) for r in self.holdings()}

    def holdings(self) -> Dict[int, int]:
        """{rank: newest committed step} of every rank this agent holds a copy of."""
        out: Dict[int, int] = {}
        prefix = f"{P.SHM_PREFIX}{self.job_token}-peer-r"
        for name in os.listdir(P.SHM_DIR):
            if name.startswith(prefix):
                rank = int(name[len(prefix):].split("-")[0])
                got = self.latest(rank)
                if got:
                    out[rank] = got[0]
        return out

    def incoming_path(self, rank: int) -> Optional[str]:
        """The slot to receive into: never the newest committed copy; None if one is in flight."""
        with self._lock:
            if rank in self._busy:
                return None
            self._busy.add(rank)
        got = self.latest(rank)
        return self.path(rank, 0 if got is None or got[1] == self.path(rank, 1) else 1)

    def done(self, rank: int) -> None:
        with self._lock:
            self._busy.discard(rank)


def _read_header(path: str) -> Optional[P.SlotHeader]:
    try:
        with open(path, "rb") as f:
            return P.SlotHeader.unpack_from(f.read(P.SLOT_HEADER_SIZE))
    except OSError:
        return None
