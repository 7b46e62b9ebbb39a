"""Checkpoint stall: how long one save blocks the training loop, per method, same state.

The state is a dict of float32 tensors (8 of them) adding up to the size; every method
saves the same objects.  ``blocking`` is the time until the call returns (what training
waits for); for asynchronous methods ``total`` is the time until the copy is complete.

* ``plain copy_`` -- tensor-by-tensor copy into pre-touched buffers (the floor);
* ``ckptrun save()`` -- ``ckptrun.Checkpointer.save`` of a model + optimizer holding the
  same tensors, overlapped (default) and with ``overlap=False``; in-process mode (no
  agent, so no shared-memory slots and no replication);
* ``torch.save+fsync`` -- one file on the local disk, flushed;
* ``DCP save`` / ``DCP async_save`` -- ``torch.distributed.checkpoint`` to the local disk,
  single process.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import warnings
from typing import Dict, List

import torch

from benchmarks import Context, Row, interleave, section, timed

COLUMNS = [("method", "method", "str"), ("bytes", "size", "bytes"),
           ("median_s", "blocking median", "ms"), ("min_s", "min", "ms"), ("max_s", "max", "ms"),
           ("total_median_s", "total median", "ms"), ("vs_copy", "blocking / plain copy", "ratio"),
           ("gb_per_s", "GB/s (blocking)", "gbps"), ("note", "note", "str")]

PIECES = 8


class Params(torch.nn.Module):
    """``PIECES`` float32 parameters adding up to the size: a model with no compute."""

    def __init__(self, nbytes: int) -> None:
        super().__init__()
        per = max(1, nbytes // PIECES // 4)
        gen = torch.Generator().manual_seed(0)
        self.w = torch.nn.ParameterList(
            torch.nn.Parameter(torch.rand(per, generator=gen)) for _ in range(PIECES))


def make_state(nbytes: int) -> Dict[str, torch.Tensor]:
    """The tensors every method saves (a model's ``state_dict``), ``nbytes`` in total."""
    return dict(Params(nbytes).state_dict())


def state_bytes(state: Dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def _row(method: str, nbytes: int, stats: Row, **extra) -> Row:
    row: Row = {"method": method, "bytes": nbytes, **stats}
    row["gb_per_s"] = nbytes / float(stats["median_s"]) / 1e9
    row.update(extra)
    return row


def bench_plain_copy(state: Dict[str, torch.Tensor], reps: int) -> Row:
    dst = {k: torch.empty_like(v).fill_(0) for k, v in state.items()}

    def copy() -> None:
        for k, v in state.items():
            dst[k].copy_(v)

    return _row("plain copy_", state_bytes(state), timed(copy, reps, warmup=1))


def bench_ckptrun(nbytes: int, reps: int, overlap: bool) -> Row:
    """``Checkpointer.save`` of a model + SGD optimizer (no optimizer state: same bytes).

    With ``overlap`` the parameters are copied by a background thread (they only change in
    ``optimizer.step()``, which waits), so ``save()`` blocks for the small synchronous part;
    ``total`` is until :meth:`wait` returns.
    """
    method = "ckptrun save()" + ("" if overlap else " overlap=False")
    try:
        from ckptrun.protocol import DEFAULT_NUM_SLOTS
        from ckptrun.worker.checkpointer import Checkpointer
    except ImportError:
        return {"method": method, "bytes": nbytes,
                "note": "skipped: ckptrun.Checkpointer not in this checkout yet"}
    model = Params(nbytes)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    ckpt = Checkpointer({"model": model, "optim": opt}, overlap=overlap, capture_rng=False)
    step = [0]
    totals: List[float] = []
    started = [0.0]

    def save() -> None:
        step[0] += 1
        started[0] = time.perf_counter()
        ckpt.save(step[0])

    def finish() -> None:
        ckpt.wait()
        totals.append(time.perf_counter() - started[0])

    try:
        # Warm-up touches every slot once, as a long training run would have.
        stats = timed(save, reps, teardown=finish, warmup=DEFAULT_NUM_SLOTS)
    finally:
        ckpt.close()
    mode = "agent" if os.environ.get("CKPTRUN_CONTROL") else "in-process (no agent)"
    total = sorted(totals[DEFAULT_NUM_SLOTS:])
    return _row(method, state_bytes(dict(model.state_dict())), stats, note=mode,
                total_median_s=total[len(total) // 2])


def bench_torch_save(state: Dict[str, torch.Tensor], reps: int, tmpdir: str) -> Row:
    path = os.path.join(tmpdir, f"ckptrun-bench-{os.getpid()}.pt")

    def save() -> None:
        with open(path, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())

    try:
        stats = timed(save, reps, teardown=lambda: os.unlink(path))
    finally:
        if os.path.exists(path):
            os.unlink(path)
    return _row("torch.save+fsync", state_bytes(state), stats, note="local disk")


def _dcp_bench(state: Dict[str, torch.Tensor], reps: int, tmpdir: str, use_async: bool) -> Row:
    import torch.distributed.checkpoint as dcp

    root = tempfile.mkdtemp(prefix="ckptrun-bench-dcp-", dir=tmpdir)
    totals: List[float] = []
    counter = [0]
    pending: Dict[str, object] = {}

    def target() -> str:
        return os.path.join(root, f"step-{counter[0]}")

    def setup() -> None:
        counter[0] += 1

    def save() -> None:
        start = time.perf_counter()
        if use_async:
            pending["future"] = dcp.async_save(state, checkpoint_id=target())
            pending["start"] = start
        else:
            dcp.save(state, checkpoint_id=target())

    def teardown() -> None:
        if use_async:
            pending["future"].result()  # type: ignore[union-attr]
            totals.append(time.perf_counter() - float(pending["start"]))  # type: ignore[arg-type]
        shutil.rmtree(target(), ignore_errors=True)

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
            stats = timed(save, reps, setup=setup, teardown=teardown)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    extra: Row = {"note": "single process, local disk"}
    if totals:
        extra["total_median_s"] = sorted(totals)[len(totals) // 2]
    return _row("DCP async_save" if use_async else "DCP save", state_bytes(state), stats, **extra)


@section("stall", "Checkpoint stall: time one save blocks training", COLUMNS,
         note="same state for every method; ratio = blocking time / plain copy_ time")
def stall(ctx: Context) -> List[Row]:
    rows: List[Row] = []
    # One size is enough to compare methods; the largest one requested is the target's.
    sizes = [ctx.sizes[-1]] if ctx.quick else ctx.sizes
    for size in sizes:
        state = make_state(size)
        size_rows = interleave([
            lambda r, st=state: bench_plain_copy(st, r),
            lambda r, n=size: bench_ckptrun(n, r, overlap=True),
            lambda r, n=size: bench_ckptrun(n, r, overlap=False),
            lambda r, st=state: bench_torch_save(st, r, ctx.tmpdir),
            lambda r, st=state: _dcp_bench(st, r, ctx.tmpdir, use_async=False),
            lambda r, st=state: _dcp_bench(st, r, ctx.tmpdir, use_async=True),
        ], ctx.reps)
        base = float(size_rows[0]["median_s"])
        for row in size_rows:
            if "median_s" in row:
                row["vs_copy"] = float(row["median_s"]) / base
        rows.extend(size_rows)
        del state
    return rows
