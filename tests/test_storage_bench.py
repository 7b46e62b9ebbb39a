"""Persistence throughput vs a raw fsspec write of the same bytes to the same target.

Not a timed test (2 shared cores make timings noisy): skipped unless ``CKPTRUN_BENCH=1``::

    CKPTRUN_BENCH=1 CKPTRUN_BENCH_MIB=256 python -m pytest -s tests/test_storage_bench.py

Prints MB/s for ``storage.write_step`` (DCP files + .metadata + ckptrun.json, fsync on local
disk) and for the raw write (the same tensor bytes through ``fsspec.open``; with and without
fsync for local disk), on local disk and on S3 (moto on 127.0.0.1).
"""

from __future__ import annotations

import os
import time

import fsspec
import pytest
import torch
from s3util import s3_bucket, s3_endpoint  # noqa: F401  (pytest fixtures)

from ckptrun.tiers.durable import storage

THREADS = int(os.environ.get("CKPTRUN_BENCH_THREADS", "1"))  # storage.write_step(threads=)
pytestmark = pytest.mark.skipif(os.environ.get("CKPTRUN_BENCH") != "1",
                                reason="benchmark: set CKPTRUN_BENCH=1")


def bench_snapshots(total_mib: int, world: int = 2, per_rank_tensors: int = 8):
    numel = total_mib * 2**20 // 4 // world // per_rank_tensors
    snaps = {}
    for r in range(world):
        ts = [torch.rand(numel) for _ in range(per_rank_tensors)]
        meta = {"format": 1, "step": 1, "rank": r, "world_size": world, "tree": None,
                "tensors": [{"path": f"p{i}", "dtype": "float32", "shape": [numel],
                             "offset": 0, "nbytes": numel * 4} for i in range(per_rank_tensors)]}
        snaps[r] = (meta, ts)
    return snaps


def raw_write(url: str, snaps, fsync: bool) -> float:
    fs, root = fsspec.core.url_to_fs(url)
    fs.makedirs(root, exist_ok=True)
    t0 = time.perf_counter()
    for r, (_, ts) in snaps.items():
        with fs.open(f"{root}/rank{r}.bin", "wb") as f:
            for t in ts:
                f.write(memoryview(t.numpy()).cast("B"))
            if fsync:
                f.flush()
                os.fsync(f.fileno())
    return time.perf_counter() - t0


def report(name, nbytes, raw_s, ours_s):
    mb = nbytes / 1e6
    print(f"\n{name}: {mb:.0f} MB  raw {mb / raw_s:8.1f} MB/s  ckptrun {mb / ours_s:8.1f} MB/s"
          f"  ratio {raw_s / ours_s:.2f}")


def _alternate(raw, ours, n=3):
    """Best of ``n`` for each, interleaved so page-cache writeback hits both alike."""
    raw_s, ours_s = [], []
    for i in range(n):
        raw_s.append(raw(i))
        ours_s.append(ours(i))
    return min(raw_s), min(ours_s)


def test_bench_local(tmp_path):
    import shutil

    mib = int(os.environ.get("CKPTRUN_BENCH_MIB", "256"))
    snaps = bench_snapshots(mib)
    nbytes = sum(t.nbytes for _, ts in snaps.values() for t in ts)

    def clean(fn, name):
        def run(i):
            s = fn(f"file://{tmp_path}/{name}{i}")
            shutil.rmtree(tmp_path / f"{name}{i}")
            return s
        return run

    ours = clean(lambda u: storage.write_step(u, 1, snaps, 2, threads=THREADS)["seconds"], "ck")
    for sync in (True, False):
        raw, mine = _alternate(clean(lambda u, sync=sync: raw_write(u, snaps, sync), "raw"), ours)
        report(f"local disk, raw {'with' if sync else 'without'} fsync", nbytes, raw, mine)


def test_bench_s3(s3_bucket):  # noqa: F811
    mib = int(os.environ.get("CKPTRUN_BENCH_MIB", "256")) // 4  # moto keeps it all in RAM
    snaps = bench_snapshots(mib)
    nbytes = sum(t.nbytes for _, ts in snaps.values() for t in ts)
    raw, ours = _alternate(lambda i: raw_write(f"{s3_bucket}/raw{i}", snaps, False),
                           lambda i: storage.write_step(f"{s3_bucket}/ck{i}", 1, snaps, 2, threads=THREADS)["seconds"])
    report("s3 (moto)", nbytes, raw, ours)
