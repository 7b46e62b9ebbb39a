"""The CUDA paths, measured on a GPU (the section returns no rows on a machine without one).

* ``copy`` -- device -> host into a slot as ckptrun allocates it (``SlotSet``: a
  shared-memory file registered with ``cudaHostRegister``) with ``non_blocking`` copies on
  a side stream, next to the same copy into an unregistered (pageable) slot and into
  ``torch``'s own pinned memory (the ceiling); host -> device from a registered slot (a
  restore); and what registering a slot costs (paid once per slot, at its allocation);
* ``save`` -- a GPU training step (an MLP + AdamW whose state is the size, in a plain
  ``python`` process) with ``Checkpointer.save()`` every step vs without: the per-step cost
  and what ``save()`` blocks the loop (the copy off the GPU; the checksum of the host copy
  runs behind the next step);
* ``process`` -- what a restarted GPU process pays again and an in-place survivor keeps: a
  fresh interpreter's ``import torch``, its CUDA context, an NCCL communicator (a group of
  one: NCCL refuses two ranks on one GPU), and aborting it and forming a new one in the
  same process (what ``ckptrun.worker.collectives`` does to a survivor's NCCL group);
* ``recovery`` -- ``examples/train.py --device cuda`` (2 ranks sharing the GPU, gloo
  reducing CUDA tensors, a ballast of GPU state), SIGKILL of rank 1: the ``recovered``
  event's downtime for a restart and for ``--in-place``.
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from typing import List

import torch

from benchmarks import Context, Row, human_bytes, section
from benchmarks.jobrun import ROOT

COLUMNS = [("kind", "kind", "str"), ("case", "case", "str"), ("bytes", "size", "bytes"),
           ("median_s", "median", "ms"), ("min_s", "min", "ms"), ("max_s", "max", "ms"),
           ("gb_per_s", "GB/s", "gbps"), ("ratio", "ratio", "ratio"),
           ("reps", "reps", "int"), ("note", "note", "str")]

MiB = 1 << 20


def _stats(samples: List[float]) -> Row:
    return {"median_s": statistics.median(samples), "min_s": min(samples),
            "max_s": max(samples), "reps": len(samples)}


def _timed_cuda(fn, reps: int) -> Row:
    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        samples.append(time.perf_counter() - t0)
    return _stats(samples)


def _copy_rows(nbytes: int, reps: int) -> List[Row]:
    from ckptrun.worker import pinning
    from ckptrun.worker.slotset import SlotSet

    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    rows: List[Row] = []

    def d2h(dst: torch.Tensor):
        def run():
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
            stream.synchronize()
        return run

    pinned = SlotSet(None, 2, 1)  # in-process slots: anonymous maps, pinned as the shm ones
    t0 = time.perf_counter()
    mm = pinned.ensure(0, nbytes + 4096, 0, nbytes)
    alloc_s = time.perf_counter() - t0
    slot = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes)
    registered = pinned._pinned[0] is not None
    plain = mmap.mmap(-1, nbytes + 4096, flags=mmap.MAP_PRIVATE | getattr(mmap, "MAP_POPULATE", 0))
    pageable = torch.frombuffer(plain, dtype=torch.uint8, count=nbytes)
    best = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    cases = [("D2H into torch pinned memory (ceiling)", best),
             ("D2H into a ckptrun slot (registered)", slot),
             ("D2H into a pageable slot", pageable)]
    for name, dst in cases:
        st = _timed_cuda(d2h(dst), reps)
        rows.append({"kind": "copy", "case": name, "bytes": nbytes, **st,
                     "gb_per_s": nbytes / st["median_s"] / 1e9})
    ceiling = rows[0]["median_s"]
    for r in rows:
        r["ratio"] = r["median_s"] / ceiling
    rows[1]["note"] = "registered" if registered else "NOT registered: pinning failed"
    back = torch.empty_like(src)
    st = _timed_cuda(lambda: back.copy_(slot, non_blocking=True), reps)
    rows.append({"kind": "copy", "case": "H2D from a ckptrun slot (restore)", "bytes": nbytes,
                 **st, "gb_per_s": nbytes / st["median_s"] / 1e9})
    # what registering costs, apart from the allocation (a second, unregistered map)
    probe = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | getattr(mmap, "MAP_POPULATE", 0))
    view = torch.frombuffer(probe, dtype=torch.uint8)
    t0 = time.perf_counter()
    ok = pinning.register(view, torch.cuda.current_device())
    reg_s = time.perf_counter() - t0
    if ok:
        pinning.unregister(view, torch.cuda.current_device())
    rows.append({"kind": "copy", "case": "cudaHostRegister of a slot (once per slot)",
                 "bytes": nbytes, **_stats([reg_s]), "gb_per_s": nbytes / reg_s / 1e9,
                 "note": f"the slot's whole allocation took {alloc_s * 1e3:.0f} ms"
                 + ("" if ok else "; FAILED")})
    view = slot = pageable = best = None  # the maps close once no view holds them
    pinned.close()
    return rows


SAVE_CASES = {"no checkpointing": None, "save() every step": 1, "save(), every=\"auto\"": "auto"}
LONG_STEP_FLOP = 2.2e12  # the "long" step's forward + backward: ~40 ms in fp32 on an H200


def _save_rows(nbytes: int, steps: int, device: str = "cuda") -> List[Row]:
    """Per-step time of a GPU training step with and without snapshots, for a short step
    (batch 512) and a long one (~40 ms), and what a snapshot's phases took."""
    from benchmarks.steady_state import hidden_for

    width = hidden_for(nbytes)
    long_batch = max(512, int(LONG_STEP_FLOP / (24 * width * width)))
    rows: List[Row] = []
    for batch in (512, long_batch):
        per: dict = {}
        first = len(rows)
        for case, every in SAVE_CASES.items():
            n = steps * 12 if every == "auto" else steps
            row = _save_case(width, batch, every, n, device)
            per[case] = row["median_s"]
            rows.append({"kind": "save", "case": f"batch {batch}: {case}", **row})
        for r in rows[first:]:
            r["ratio"] = r["median_s"] / per["no checkpointing"]
    return rows


def _save_case(width: int, batch: int, every, steps: int, device: str) -> Row:
    import ckptrun

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(4)]).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(batch, width, device=device)
    ckpt = None if every is None else \
        ckptrun.Checkpointer({"model": model, "optim": opt}, every=every)
    times, blocks = [], []
    for step in range(steps):
        sync()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        model(x).square().mean().backward()
        opt.step()
        if ckpt is not None:
            b0 = time.perf_counter()
            ckpt.save(step + 1)
            blocks.append(time.perf_counter() - b0)
        sync()
        times.append(time.perf_counter() - t0)
    note = ""
    if ckpt is not None:
        ckpt.wait()
        slots = ckpt._slots._pinned
        note = (f"copy {ckpt.last_copy_s * 1e3:.0f} ms of which checksum "
                f"{ckpt.last_hash_s * 1e3:.0f} ms; save() blocks "
                f"{statistics.median(blocks[4:]) * 1e3:.1f} ms, the first "
                f"{blocks[0] * 1e3:.0f} ms; {sum(v is not None for v in slots)}/{len(slots)} "
                "slots registered")
        if every == "auto":
            note += f"; settled on every {ckpt.every} steps"
        ckpt.close()
    state = sum(p.numel() * 12 for p in model.parameters())
    del model, opt, ckpt
    if device == "cuda":
        torch.cuda.empty_cache()
    warm = times[len(times) // 3:] if every == "auto" else times[4:]  # slots, AdamW's moments
    return {"bytes": state, **_stats(warm), "note": note}


def _python(script: str, *args: str, timeout: float = 180) -> dict:
    proc = subprocess.run([sys.executable, script, *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else
                f"exit {proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


PROBE = os.path.join(ROOT, "tests", "scripts", "nccl_reform_probe.py")


def _process_rows(reps: int) -> List[Row]:
    got = [_python(PROBE, tempfile.mktemp(prefix="ckptrun-nccl-")) for _ in range(reps)]
    ok = [g for g in got if "error" not in g]
    if not ok:
        return [{"kind": "process", "case": "probe failed", "note": got[0]["error"]}]
    cases = [("import torch (fresh interpreter)", "import_s"),
             ("CUDA context + first kernel", "context_s"),
             ("NCCL group of one: first formed", "form_s_0"),
             ("NCCL: abort (break_all + destroy)", "abort_s_0"),
             ("NCCL: formed again in the same process", "form_s_1")]
    return [{"kind": "process", "case": name, **_stats([g[key] for g in ok])}
            for name, key in cases]


def _recovery_rows(ballast_mib: int, device: str = "cuda") -> List[Row]:
    train = os.path.join(ROOT, "examples", "train.py")
    rows: List[Row] = []
    for case, extra in (("restart", []), ("in place (@ckptrun.resilient)", ["--in-place"])):
        work = tempfile.mkdtemp(prefix="ckptrun-cuda-")
        try:
            cmd = [sys.executable, "-m", "ckptrun.cli", "--standalone", "--nproc-per-node", "2",
                   "--run-dir", work, train, "--device", device, "--width", "1024",
                   "--ballast-mib", str(ballast_mib), "--steps", "60", "--step-time", "0.05",
                   "--crash-at", "30", *extra]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
            with open(os.path.join(work, "events.jsonl")) as f:
                evts = [json.loads(line) for line in f if line.strip()]
        finally:
            shutil.rmtree(work, ignore_errors=True)
        rec = [e for e in evts if e["event"] == "recovered"]
        restored = [e for e in evts if e["event"] == "restored"]
        if proc.returncode != 0 or not rec:
            rows.append({"kind": "recovery", "case": case,
                         "note": f"exit {proc.returncode}: {proc.stderr.strip()[-300:]}"})
            continue
        phases = rec[0].get("phases") or {}
        note = ", ".join(f"{k} {v:.2f} s" for k, v in phases.items()
                         if isinstance(v, (int, float)))
        if restored:
            note += f"; restored from {restored[0].get('tier')}"
        rows.append({"kind": "recovery", "case": case, "bytes": ballast_mib * MiB,
                     **_stats([float(rec[0]["downtime_s"])]), "note": note})
    return rows


@section("cuda", "The CUDA paths (measured where a GPU is lent; none on the build machine)",
         COLUMNS)
def cuda(ctx: Context) -> List[Row]:
    if not torch.cuda.is_available():
        return []
    parts = [(f"copy {human_bytes(n)}", lambda n=n: _copy_rows(n, ctx.reps)) for n in ctx.sizes]
    parts += [(f"save {human_bytes(n)}", lambda n=n: _save_rows(n, steps=24)) for n in ctx.sizes]
    parts += [("process", lambda: _process_rows(ctx.reps)), ("recovery", lambda: _recovery_rows(256))]
    wanted = str(ctx.options.get("cuda_parts") or "copy,save,process,recovery").split(",")
    parts = [(name, part) for name, part in parts if name.split()[0] in wanted]
    rows: List[Row] = []
    for name, part in parts:  # one part's failure is a row; the others are still measured
        try:
            rows += part()
        except Exception as exc:  # noqa: BLE001
            first = str(exc).splitlines()[0] if str(exc) else ""
            where = " < ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}"
                               for f in reversed(traceback.extract_tb(exc.__traceback__)[-4:]))
            rows.append({"kind": "failed", "case": name,
                         "note": f"{type(exc).__name__}: {first} (at {where})"})
    for r in rows:
        r.setdefault("note", "")
    if rows:
        name = torch.cuda.get_device_name(0)
        rows[0]["note"] = "; ".join(x for x in (rows[0]["note"], name) if x)
    return rows
