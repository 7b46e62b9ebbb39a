"""Replication: ``ckptrun.tiers.peer.server.push`` of one slot vs a raw loopback TCP stream.

A committed slot file (header, small JSON meta, ``--replication-size`` bytes of data) is
pushed to a ``ReplicaServer`` on 127.0.0.1 in another process, the way an agent sends its
node's snapshot to a peer's agent: authenticated handshake, every record sealed (AES-GCM),
the receiver decrypts, verifies the xxh3 checksum and commits.  Side by side, round-robin in
the same run:

* ``raw loopback TCP`` -- the same number of bytes, one ``sendall`` to one ``recv_into``
  loop (``benchmarks.limits``): the ceiling on this machine;
* ``push`` -- unpaced;
* ``push paced`` -- with ``rate_bps`` set (default 1 GB/s), to check that pacing holds
  the rate it is given (the agent paces so training traffic is not slowed).

Timings are wall clock from ``push()`` call to the receiver's verified commit.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import time
import uuid
from typing import List, Tuple

import torch

from benchmarks import Context, Row, bandwidth_row, interleave, section, timed
from benchmarks.limits import _tcp_once
from ckptrun import protocol as P
from ckptrun.tiers.peer.copies import MapCache
from ckptrun.tiers.peer.server import push

SECRET = os.urandom(32)
GOAL = 0.70  # DESIGN §6: replication >= 70% of loopback TCP throughput

COLUMNS = [("case", "case", "str"), ("bytes", "size", "bytes"), ("median_s", "median", "ms"),
           ("min_s", "min", "ms"), ("max_s", "max", "ms"), ("gb_per_s", "GB/s (median)", "gbps"),
           ("gb_per_s_min", "GB/s worst", "gbps"), ("gb_per_s_max", "GB/s best", "gbps"),
           ("vs_tcp", "vs raw TCP", "ratio"), ("vs_rate", "vs requested rate", "ratio"),
           ("met", "≥ 0.70 of TCP", "str"), ("note", "note", "str")]


def make_slot(path: str, nbytes: int, step: int = 1, rank: int = 0) -> None:
    """A committed slot file as a worker leaves it: header, JSON meta, data, checksum."""
    meta = json.dumps({"format": 1, "step": step, "rank": rank}).encode()
    # Random bytes (xxh3 and TCP do not care, but no zero-page shortcuts anywhere); plain
    # ``bytes`` so that no buffer export of the mapping outlives ``close()``.
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(0)).numpy().tobytes()
    digest = P.new_checksum()
    digest.update(meta)
    digest.update(data)
    off = P.data_offset_for(P.PAGE)
    mm = P.create_shm_file(path, off + nbytes)
    try:
        mm[P.SLOT_HEADER_SIZE:P.SLOT_HEADER_SIZE + len(meta)] = meta
        mm[off:off + nbytes] = data
        P.SlotHeader(P.SlotState.COMMITTED, step, 1, len(meta), nbytes, off, digest.intdigest(),
                     time.time(), len(mm), rank, 2).pack_into(mm)
    finally:
        mm.close()


_SERVER = """
import sys
from ckptrun.tiers.peer.copies import PeerStore
from ckptrun.tiers.peer.server import ReplicaServer
key = bytes.fromhex(sys.stdin.readline().strip())
srv = ReplicaServer("127.0.0.1", key, PeerStore(sys.argv[1]))
print(srv.address[1], flush=True)
sys.stdin.read()  # until the benchmark closes the pipe
srv.stop()
"""


def start_server(token: str) -> Tuple[subprocess.Popen, Tuple[str, int]]:
    """A replica server in its own process, as a peer agent is (the key goes over stdin,
    never argv)."""
    proc = subprocess.Popen([sys.executable, "-c", _SERVER, token], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(SECRET.hex() + "\n")
    proc.stdin.flush()
    port = int(proc.stdout.readline())
    return proc, ("127.0.0.1", port)


def size_for(ctx: Context) -> int:
    opt = ctx.options.get("replication_bytes")
    return int(opt) if opt else (64 << 20 if ctx.quick else 256 << 20)  # type: ignore[arg-type]


@section("replication", "Replication: push of one slot vs raw loopback TCP", COLUMNS,
         note="same bytes, same run, round-robin; push = authenticated, chunked, verified "
              "and committed by the receiver; goal (DESIGN §6) ≥ 0.70 of raw TCP")
def replication(ctx: Context) -> List[Row]:
    nbytes = size_for(ctx)
    rate = float(ctx.options.get("replication_rate") or 1e9)
    token = f"bench{uuid.uuid4().hex[:8]}"
    src = os.path.join(P.SHM_DIR, f"{P.SHM_PREFIX}{token}-src")
    server = maps = None
    try:
        make_slot(src, nbytes)
        server, address = start_server(token)
        payload = torch.empty(nbytes, dtype=torch.uint8).fill_(7)
        view = memoryview(payload.numpy()).cast("B")

        maps = MapCache()  # the agent keeps its copies' mappings from round to round

        def do_push(rate_bps=None) -> None:
            # Back-to-back pushes of one rank, as the agent's rounds make them.
            if push(address, SECRET, "bench", 0, src, rate_bps=rate_bps,
                    maps=maps) is None:
                raise RuntimeError("push returned None (receiver busy, or the copy failed)")

        rows = interleave([
            lambda r: bandwidth_row("raw loopback TCP", nbytes,
                                    timed(lambda: _tcp_once(view, 60.0), r, warmup=1)),
            lambda r: bandwidth_row("push", nbytes, timed(do_push, r, warmup=4)),
            lambda r: bandwidth_row(f"push paced ({rate / 1e9:g} GB/s)", nbytes,
                                    timed(lambda: do_push(rate), r)),
        ], max(ctx.reps, 5))  # cheap: a few seconds even at 256 MiB
        base = float(rows[0]["gb_per_s"])
        for row in rows:
            row["vs_tcp"] = float(row["gb_per_s"]) / base
        rows[1]["met"] = "yes" if float(rows[1]["vs_tcp"]) >= GOAL else "no"
        rows[1]["note"] = "includes handshake, checksum verify and commit on the receiver"
        rows[2]["vs_rate"] = float(rows[2]["gb_per_s"]) * 1e9 / rate
        rows[2]["rate_bps"] = rate
        rows[2]["note"] = "vs requested rate: 1.0 = pacing holds the rate exactly"
        return rows
    finally:
        if server is not None:
            server.stdin.close()  # type: ignore[union-attr]
            server.wait(timeout=30)
        if maps is not None:
            maps.close()
        for path in glob.glob(os.path.join(P.SHM_DIR, f"{P.SHM_PREFIX}{token}*")):
            os.unlink(path)
