"""Peer-memory replication: authenticated, encrypted TCP transfer of slot files between agents.

GEMINI's second tier.  Each agent runs a :class:`ReplicaServer` on the address it uses for the
rendezvous; peers push their newest committed snapshots to it (``put``) and a replacement
machine pulls a lost rank's copy back (``fetch``).  Copies live in agent-owned shared memory in
the same slot layout as local snapshots (``ckptrun.protocol.slot_file``), so every reader works on both.

Handshake: mutual HMAC-SHA256 challenge with fresh nonces under the job key (derived from
the user's secret, :mod:`ckptrun.protocol.job_secret`); a peer without it is refused before
it can send a byte of data.  Its only frames are plain 4-byte-length JSON objects of at most
:data:`MAX_HELLO` bytes.

After it, everything travels in sealed records (:class:`~ckptrun.tiers.peer.channel.Channel`,
AES-GCM with per-direction session keys): JSON frames (never pickle), and the bulk bytes that
follow a ``put``/``fetch`` frame as chunks of at most 4 MiB, ended by an END record or an
ABORT one (the sender saw its source slot change under it).  A copy counts only once the
whole stream arrived and its xxh3 checksum matches the one the writer recorded at commit --
a transfer cut by a kill never becomes usable.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import queue
import socket
import struct
import threading
import time
from typing import Callable, Optional, Tuple

from ckptrun import protocol as P
from ckptrun.tiers.peer.channel import (
    ABORT,
    DATA,
    END,
    FRAME,
    MAX_CHUNK,
    Channel,
    recv_into,
    session_keys,
)
from ckptrun.tiers.peer.copies import MapCache, done_with_map, prepare_slot_file

log = logging.getLogger(__name__)

PACED_CHUNK = MAX_CHUNK  # a paced stream sleeps between chunks of this size
MAX_FRAME = 1 << 20  # a JSON frame larger than this is a protocol violation
MAX_HELLO = 4096  # before the peer proved it has the key, only this much is read


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
    recv_into(sock, memoryview(buf))
    return bytes(buf)


def send_frame(ch: Channel, obj: dict) -> None:
    """One JSON object as a sealed frame."""
    ch.send(FRAME, json.dumps(obj).encode())


def recv_frame(ch: Channel, limit: int = MAX_FRAME) -> dict:
    """One sealed JSON object frame; anything else (another kind of record, too long, not
    JSON, nested too deep, not an object) is a :class:`ConnectionError` -- the connection
    is dropped, nothing raised past it."""
    kind, data = ch.recv(limit)
    if kind != FRAME:
        raise ConnectionError(f"a {kind!r} record where a frame was expected")
    return _parse(data)


def _send_plain(sock: socket.socket, obj: dict) -> None:
    """A handshake frame: before the session keys exist."""
    data = json.dumps(obj).encode()
    sock.sendall(struct.pack(">I", len(data)) + data)


def _recv_plain(sock: socket.socket, limit: int = MAX_HELLO) -> dict:
    (n,) = struct.unpack(">I", _recv_exact(sock, 4))
    if n > limit:
        raise ConnectionError(f"frame of {n} bytes exceeds the limit of {limit}")
    return _parse(_recv_exact(sock, n))


def _parse(data: bytes) -> dict:
    try:
        obj = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise ConnectionError(f"malformed frame ({type(e).__name__})") from None
    if not isinstance(obj, dict):
        raise ConnectionError("malformed frame")
    return obj


def lower_thread_priority(nice: int) -> None:
    """Renice the calling thread only (Linux: a thread is a task with its own nice)."""
    if nice <= 0:
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, max(os.getpriority(os.PRIO_PROCESS, tid), nice))
    except (AttributeError, OSError):
        pass  # not Linux, or not permitted: replication still works, at normal priority


# --------------------------------------------------------------------------- handshake

def _mac(secret: bytes, *parts: bytes) -> bytes:
    return hmac.new(secret, b"|".join(parts), hashlib.sha256).digest()


def server_handshake(sock: socket.socket, secret: bytes) -> Tuple[str, Channel]:
    """Challenge the connecting peer: its node name and the sealed channel to it, or
    :class:`AuthError`."""
    nonce = os.urandom(32)
    sock.sendall(nonce)
    hello = _recv_plain(sock)
    node = str(hello.get("node", ""))[:64]
    try:
        their_nonce = bytes.fromhex(str(hello.get("nonce", "")))
        proof = bytes.fromhex(str(hello.get("proof", "")))
    except ValueError:
        raise AuthError(f"peer {node or '?'} sent a malformed hello") from None
    if len(their_nonce) != 32 or not hmac.compare_digest(
        proof, _mac(secret, b"client", nonce, node.encode())
    ):
        raise AuthError(f"peer {node or '?'} failed authentication")
    _send_plain(sock, {"proof": _mac(secret, b"server", their_nonce).hex()})
    return node, Channel(sock, *session_keys(secret, nonce, their_nonce, is_server=True))


def client_handshake(sock: socket.socket, secret: bytes, node: str) -> Channel:
    """Answer the server's challenge, check that the server knows the key too; the sealed
    channel to it."""
    nonce = _recv_exact(sock, 32)
    mine = os.urandom(32)
    _send_plain(sock, {"node": node, "nonce": mine.hex(),
                       "proof": _mac(secret, b"client", nonce, node.encode()).hex()})
    reply = _recv_plain(sock)
    try:
        proof = bytes.fromhex(str(reply.get("proof", "")))
    except ValueError:
        proof = b""
    if not hmac.compare_digest(proof, _mac(secret, b"server", mine)):
        raise AuthError("replica server failed authentication")
    return Channel(sock, *session_keys(secret, nonce, mine, is_server=False))


def parse_address(text: str) -> Tuple[str, int]:
    """``"host:port"`` as an agent publishes its listening address in the store."""
    host, _, port = text.rpartition(":")
    return host, int(port)


def connect(addr: Tuple[str, int], secret: bytes, node: str, timeout: float = 10.0) -> Channel:
    """An authenticated, sealed channel to the replica server at ``addr``."""
    sock = socket.create_connection(addr, timeout=timeout)
    tune_socket(sock)
    try:
        return client_handshake(sock, secret, node)
    except BaseException:
        sock.close()
        raise


# --------------------------------------------------------------------------- slot streams

def slot_regions(mm) -> Tuple[P.SlotHeader, list]:
    """Header and the (meta, data) memory regions of a committed slot, as memoryviews."""
    h = P.SlotHeader.unpack_from(mm)
    view = memoryview(mm)
    meta = view[P.SLOT_HEADER_SIZE : P.SLOT_HEADER_SIZE + h.meta_len]
    data = view[h.data_offset : h.data_offset + h.data_len]
    return h, [meta, data]


def _pace(sent: int, t0: float, rate_bps: Optional[float]) -> None:
    """Sleep until ``sent`` bytes are within the budget of ``rate_bps`` since ``t0``."""
    if rate_bps:
        ahead = sent / rate_bps - (time.monotonic() - t0)
        if ahead > 0:
            time.sleep(ahead)


def send_stream(ch: Channel, regions: list, rate_bps: Optional[float] = None,
                still_valid: Callable[[], bool] = lambda: True) -> int:
    """Send in-memory regions as sealed chunks, paced to ``rate_bps``; ABORT if the source
    changed meanwhile."""
    sent, t0 = 0, time.monotonic()
    for region in regions:
        for off in range(0, len(region), PACED_CHUNK):
            piece = region[off : off + PACED_CHUNK]
            ch.send(DATA, piece)
            sent += len(piece)
            _pace(sent, t0, rate_bps)
    ch.send(END if still_valid() else ABORT)
    return sent


class _PipelinedChecksum:
    """Hash received pieces on a second thread while the next piece is being received.

    xxhash releases the GIL on large buffers, so receiving (``recv_into``, a kernel copy)
    and hashing run on two cores at once instead of one after the other.  Pieces are
    hashed in the order they are fed; every view handed over is released after hashing.
    """

    def __init__(self, digest) -> None:
        self.digest = digest
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name="ckptrun-recv-hash", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            view = self._q.get()
            if view is None:
                return
            try:
                if self._error is None:
                    self.digest.update(view)
            except BaseException as e:  # reported by finish()
                self._error = e
            finally:
                view.release()

    def feed(self, view: memoryview) -> None:
        self._q.put(view)

    def finish(self) -> int:
        """Wait for every piece fed so far; the digest."""
        self.close()
        if self._error is not None:
            raise self._error
        return self.digest.intdigest()

    def close(self) -> None:
        if self._thread.is_alive():
            self._q.put(None)
            self._thread.join()


def recv_stream_into(ch: Channel, regions: list, checksum) -> bool:
    """Receive sealed chunks into regions (exact sizes; a chunk never spans two regions, as
    :func:`send_stream` cuts them), feeding each decrypted chunk to ``checksum`` (an object
    with ``update``, or a :class:`_PipelinedChecksum`) right after it arrived; False if the
    sender aborted."""
    feed = checksum.feed if isinstance(checksum, _PipelinedChecksum) else checksum.update
    targets = [r for r in regions if len(r)]
    ti, pos = 0, 0
    while True:
        left = len(targets[ti]) - pos if ti < len(targets) else 0
        kind, n = ch.recv_header(max(left, 0))
        if kind == ABORT:
            ch.recv_body(memoryview(bytearray()))
            return False
        if kind == END:
            ch.recv_body(memoryview(bytearray()))
            if ti != len(targets):
                raise ConnectionError("stream ended early")
            return True
        if kind != DATA or ti >= len(targets) or not n:
            raise ConnectionError("stream longer than announced or out of order")
        dst = targets[ti][pos : pos + n]
        ch.recv_body(dst)
        feed(dst)  # may be released by the hashing thread from here on
        del dst
        pos += n
        if pos == len(targets[ti]):
            ti, pos = ti + 1, 0


def receive_slot(ch: Channel, path: str, info: dict,
                 maps: Optional[MapCache] = None) -> bool:
    """Receive one announced snapshot into slot file ``path``; commit only if it verifies.

    The checksum is computed while receiving (on a second thread, piece by piece right
    after each piece arrived), so there is no second pass over the bytes."""
    meta_len, data_len = int(info["meta_len"]), int(info["data_len"])
    mm = prepare_slot_file(path, meta_len, data_len, maps)
    h = P.SlotHeader.unpack_from(mm)
    view = memoryview(mm)
    regions = [view[P.SLOT_HEADER_SIZE : P.SLOT_HEADER_SIZE + meta_len],
               view[h.data_offset : h.data_offset + data_len]]
    digest = _PipelinedChecksum(P.new_checksum())
    try:
        if not recv_stream_into(ch, regions, digest):
            return False
        if digest.finish() != int(info["checksum"]):
            return False
        h.checksum, h.commit_time = int(info["checksum"]), time.time()
        h.rank, h.world_size = int(info["rank"]), int(info.get("world_size", 0))
        h.state, h.step = P.SlotState.WRITING, -1
        h.pack_into(mm)
        P.set_slot_state(mm, P.SlotState.COMMITTED, int(info["step"]))  # the commit point
        return True
    finally:
        digest.close()  # every fed view released before the mapping is closed or kept
        for r in regions:
            r.release()
        view.release()
        done_with_map(path, mm, maps, True)


__all__ = ["AuthError", "Channel", "connect", "lower_thread_priority", "receive_slot", "recv_frame",
           "send_frame", "send_stream", "server_handshake", "slot_regions", "tune_socket"]
