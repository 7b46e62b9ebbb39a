"""The denominators: what this machine can do at best, measured the same way ckptrun works.

* ``memcpy`` -- ``torch`` ``copy_`` between two already-touched buffers: the ceiling of a
  snapshot copy;
* ``shm copy`` -- ``copy_`` into a pre-faulted shared-memory file
  (``ckptrun.protocol.create_shm_file``), what a snapshot into a slot costs;
* ``shm first touch`` -- the same into a fresh, not pre-faulted file: why slots are
  allocated and faulted once;
* ``loopback TCP`` -- one sender thread to one receiver on 127.0.0.1: the ceiling of
  replication on one machine (a memory-to-memory copy through the kernel, not a NIC);
* ``disk write+fsync`` -- raw ``os.write`` of the bytes plus ``fsync`` on the local disk;
* ``fsspec write`` -- ``fsspec.open(target, "wb")`` of the same bytes (what the durable
  tier goes through; for ``file://`` fsspec does not fsync);
* ``cold torch import`` -- a fresh interpreter importing torch: the floor of a cold
  worker restart (ckptrun's warm spares avoid it).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from typing import List

import torch

from benchmarks import Context, Row, bandwidth_row, interleave, section, timed
from ckptrun.protocol import SHM_DIR, SHM_PREFIX, create_shm_file

COLUMNS = [("case", "case", "str"), ("bytes", "size", "bytes"), ("median_s", "median", "ms"),
           ("min_s", "min", "ms"), ("max_s", "max", "ms"), ("gb_per_s", "GB/s (median)", "gbps"),
           ("gb_per_s_min", "GB/s worst", "gbps"), ("gb_per_s_max", "GB/s best", "gbps"),
           ("vs_memcpy", "vs memcpy", "ratio")]


def _source(nbytes: int) -> torch.Tensor:
    src = torch.empty(nbytes, dtype=torch.uint8)
    src.fill_(7)  # touch every page so the source side never faults
    return src


def _shm_path() -> str:
    return os.path.join(SHM_DIR, f"{SHM_PREFIX}bench-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def bench_memcpy(src: torch.Tensor, reps: int) -> Row:
    dst = torch.empty_like(src)
    dst.fill_(0)
    stats = timed(lambda: dst.copy_(src), reps, warmup=1)
    return bandwidth_row("memcpy", src.numel(), stats)


def bench_shm_copy(src: torch.Tensor, reps: int) -> Row:
    path = _shm_path()
    mm = create_shm_file(path, src.numel(), prefault=True)
    # The tensor view must be gone before the mapping can close (exported buffer).
    view = [torch.frombuffer(mm, dtype=torch.uint8)]
    try:
        stats = timed(lambda: view[0].copy_(src), reps, warmup=1)
    finally:
        view.clear()
        mm.close()
        os.unlink(path)
    return bandwidth_row("shm copy (pre-faulted)", src.numel(), stats)


def bench_shm_first_touch(src: torch.Tensor, reps: int) -> Row:
    state: dict = {}

    def setup() -> None:
        state["path"] = _shm_path()
        state["mm"] = create_shm_file(state["path"], src.numel(), prefault=False)
        state["dst"] = torch.frombuffer(state["mm"], dtype=torch.uint8)

    def teardown() -> None:
        del state["dst"]
        state["mm"].close()
        os.unlink(state["path"])

    stats = timed(lambda: state["dst"].copy_(src), reps, setup=setup, teardown=teardown)
    return bandwidth_row("shm first touch", src.numel(), stats)


def _tcp_once(payload: memoryview, timeout_s: float) -> None:
    """Send ``payload`` over loopback TCP from a thread; return when all bytes arrived."""
    nbytes = len(payload)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(timeout_s)
    port = listener.getsockname()[1]
    errors: List[BaseException] = []

    def send() -> None:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
                s.sendall(payload)
        except BaseException as exc:  # reported by the caller
            errors.append(exc)

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    conn, _ = listener.accept()
    conn.settimeout(timeout_s)
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    buf = bytearray(min(nbytes, 8 << 20))
    view = memoryview(buf)
    got = 0
    deadline = time.monotonic() + timeout_s
    try:
        while got < nbytes:
            if time.monotonic() > deadline:
                raise TimeoutError("loopback TCP benchmark ran past its time limit")
            n = conn.recv_into(view, min(len(buf), nbytes - got))
            if n == 0:
                raise ConnectionError(f"sender closed after {got} of {nbytes} bytes")
            got += n
    finally:
        conn.close()
        listener.close()
        sender.join(timeout_s)
    if errors:
        raise errors[0]


def bench_loopback_tcp(src: torch.Tensor, reps: int) -> Row:
    payload = memoryview(src.numpy()).cast("B")
    timeout_s = 60.0
    stats = timed(lambda: _tcp_once(payload, timeout_s), reps, warmup=1)
    return bandwidth_row("loopback TCP", src.numel(), stats)


def bench_disk_fsync(src: torch.Tensor, reps: int, tmpdir: str) -> Row:
    payload = memoryview(src.numpy()).cast("B")
    path = os.path.join(tmpdir, f"ckptrun-bench-{os.getpid()}.bin")

    def write() -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            done = 0
            while done < len(payload):
                done += os.write(fd, payload[done:done + (64 << 20)])
            os.fsync(fd)
        finally:
            os.close(fd)

    try:
        stats = timed(write, reps, teardown=lambda: os.unlink(path))
    finally:
        if os.path.exists(path):
            os.unlink(path)
    return bandwidth_row("disk write+fsync", src.numel(), stats, note=tmpdir)


def bench_fsspec(src: torch.Tensor, reps: int, target: str) -> Row:
    import fsspec

    payload = memoryview(src.numpy()).cast("B")
    url = target.rstrip("/") + f"/ckptrun-bench-{os.getpid()}.bin"
    fs, path = fsspec.core.url_to_fs(url)

    def write() -> None:
        with fsspec.open(url, "wb") as f:
            f.write(payload)

    try:
        stats = timed(write, reps, teardown=lambda: fs.rm(path))
    finally:
        if fs.exists(path):
            fs.rm(path)
    return bandwidth_row("fsspec write", src.numel(), stats, note=target)


def bench_cold_import(reps: int) -> Row:
    cmd = [sys.executable, "-c", "import torch"]
    stats = timed(lambda: subprocess.run(cmd, check=True, timeout=120), reps)
    return {"case": "cold torch import", "bytes": 0, **stats}


@section("limits", "Limits of this machine (the denominators)", COLUMNS,
         note="ratios are bandwidth / memcpy bandwidth of the same size")
def limits(ctx: Context) -> List[Row]:
    rows: List[Row] = []
    started = time.monotonic()
    for size in ctx.sizes:
        if rows and time.monotonic() - started > ctx.time_budget_s:
            rows.append({"case": "skipped (time budget)", "bytes": size})
            continue
        src = _source(size)
        size_rows = interleave([
            lambda r, src=src: bench_memcpy(src, r),
            lambda r, src=src: bench_shm_copy(src, r),
            lambda r, src=src: bench_shm_first_touch(src, r),
            lambda r, src=src: bench_loopback_tcp(src, r),
            lambda r, src=src: bench_disk_fsync(src, r, ctx.tmpdir),
            lambda r, src=src: bench_fsspec(src, r, ctx.target),
        ], ctx.reps)
        base = float(size_rows[0]["gb_per_s"])
        for row in size_rows:
            row["vs_memcpy"] = float(row["gb_per_s"]) / base
        rows.extend(size_rows)
        del src
    rows.append(bench_cold_import(max(1, min(ctx.reps, 3))))
    return rows


def limit(rows: List[Row], case: str, size: int) -> Row:
    """The row of ``case`` at ``size`` (or the largest size measured)."""
    matches = [r for r in rows if r.get("case") == case and "median_s" in r]
    exact = [r for r in matches if r.get("bytes") == size]
    if exact:
        return exact[0]
    if not matches:
        raise KeyError(case)
    return max(matches, key=lambda r: int(r["bytes"]))
