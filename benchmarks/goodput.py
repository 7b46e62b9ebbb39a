"""Goodput projection (``ckptrun.sim``) fed with the limits measured in this run.

Measured here: snapshot copy bandwidth (shm copy), replication bandwidth (loopback TCP,
i.e. the best a NIC could do on this machine), storage bandwidth (disk write+fsync), the save
stall (``ckptrun save()`` blocking time when measured, else the whole shm copy) and the
restart floor (cold ``import torch``).  Not measurable on one machine and therefore
inputs: iteration time (``--iteration-s``), machine failure rate (``--failure-rate``,
default the GEMINI paper's 1.5%/day), replicas (``--replicas``), persist interval.

The projection is shown twice: with the measured storage bandwidth available to *every
machine* (a store that scales with the cluster -- flatters the storage-only baseline) and
*shared by all machines* (one store of that bandwidth, like the paper's FSx).  The state
per machine is the largest size measured unless ``--state`` says otherwise.
"""

from __future__ import annotations

from dataclasses import replace
from typing import List

from benchmarks import Context, Row, section
from benchmarks.limits import limit
from ckptrun.sim import (
    ClusterInputs,
    RestartCosts,
    goodput,
    goodput_by_mode,
    paper_reference_inputs,
    storage_break_even,
)

SIZES = (16, 64, 256, 1000, 4096, 10_000)

COLUMNS = [("machines", "machines", "int"), ("failures_per_day", "failures/day", "float"),
           ("p_memory", "P(served from memory)", "pct"),
           ("ckptrun_wasted_s", "ckptrun wasted/failure", "s"),
           ("storage_wasted_s", "storage-only wasted/failure", "s"),
           ("ckptrun_ratio", "ckptrun effective", "pct"),
           ("storage_ratio", "storage-only effective", "pct"),
           ("gain", "ckptrun / storage-only", "ratio")]


def inputs_from_measurements(ctx: Context) -> ClusterInputs:
    """Build the model's inputs from this run's rows plus the user-supplied options."""
    lim = ctx.rows("limits")
    size = ctx.sizes[-1]
    shm = limit(lim, "shm copy (pre-faulted)", size)
    tcp = limit(lim, "loopback TCP", size)
    # Durable means flushed: fsspec's file:// write stops at the page cache.
    store = limit(lim, "disk write+fsync", size)
    cold = limit(lim, "cold torch import", 0)
    stall_s = float(shm["median_s"])
    for row in ctx.rows("stall"):
        if row.get("method") == "ckptrun save()" and "median_s" in row and row.get("bytes") == size:
            stall_s = float(row["median_s"])
    opts = ctx.options
    return ClusterInputs(
        machines=16,
        iteration_s=float(opts.get("iteration_s", 1.0)),
        state_bytes=float(opts.get("state_bytes") or shm["bytes"]),
        snapshot_bytes_per_s=float(shm["gb_per_s"]) * 1e9,
        network_bytes_per_s=float(tcp["gb_per_s"]) * 1e9,
        storage_bytes_per_s=float(store["gb_per_s"]) * 1e9,
        storage_shared=False,
        failure_rate_per_day=float(opts.get("failure_rate", 0.015)),
        replicas=int(opts.get("replicas", 2)),
        restart_s=float(opts.get("restart_s") or cold["median_s"]),
        snapshot_stall_s=stall_s,
        storage_stall_s=stall_s,  # storage-only gets the same async copy: the best case for it
        persist_interval_s=float(opts.get("persist_interval_s", 600.0)),
    )


def _gain(ours: float, theirs: float):
    """Ratio of effective times; None (JSON null) when the baseline makes no progress."""
    return ours / theirs if theirs > 0 else None


def _rows(inp: ClusterInputs, label: str) -> List[Row]:
    rows: List[Row] = []
    for n in SIZES:
        res = goodput(inp.with_machines(n))
        c, s = res.ckptrun, res.storage_only
        rows.append({
            "inputs": label, "machines": n, "failures_per_day": c.failures_per_day,
            "p_memory": c.memory_recovery_probability,
            "ckptrun_wasted_s": c.wasted_per_failure_s, "storage_wasted_s": s.wasted_per_failure_s,
            "ckptrun_ratio": c.effective_ratio, "storage_ratio": s.effective_ratio,
            "gain": _gain(c.effective_ratio, s.effective_ratio),
        })
    return rows


@section("goodput", "Goodput projection (GEMINI wasted-time model, measured inputs)", COLUMNS,
         note="effective training time ratio = useful time / wall time; see docs/performance.md")
def projection(ctx: Context) -> List[Row]:
    inp = inputs_from_measurements(ctx)
    ctx.options["goodput_inputs"] = {k: getattr(inp, k) for k in inp.__dataclass_fields__}
    rows = _rows(inp, "measured, storage bandwidth per machine")
    rows += _rows(replace(inp, storage_shared=True), "measured, storage bandwidth shared")
    ref = goodput(paper_reference_inputs())
    rows.append({"inputs": "GEMINI paper reference (sim.paper_reference_inputs)",
                 "machines": ref.machines, "failures_per_day": ref.ckptrun.failures_per_day,
                 "p_memory": ref.ckptrun.memory_recovery_probability,
                 "ckptrun_wasted_s": ref.ckptrun.wasted_per_failure_s,
                 "storage_wasted_s": ref.storage_only.wasted_per_failure_s,
                 "ckptrun_ratio": ref.ckptrun.effective_ratio,
                 "storage_ratio": ref.storage_only.effective_ratio,
                 "gain": _gain(ref.ckptrun.effective_ratio, ref.storage_only.effective_ratio)})
    return rows


MODE_COLUMNS = [("inputs", "inputs", "str"), ("mode", "recovery", "str"),
                ("process_failure_s", "downtime: a process dies", "s"),
                ("machine_loss_s", "downtime: a machine is lost", "s"),
                ("downtime_s", "mean (half of each)", "s"),
                ("effective_ratio", "effective at 1,000 machines", "pct")]


def restart_costs(ctx: Context) -> RestartCosts:
    """The model's defaults, with this run's measured parts where there are any (a cold
    ``import torch``; a dead rank's detection from the recovery section)."""
    costs = RestartCosts()
    cold = [r for r in ctx.rows("limits") if r.get("case") == "cold torch import"
            and "median_s" in r]
    if cold:
        costs = replace(costs, process_s=float(cold[0]["median_s"]))
    detect = [float(r["detect_s"]) for r in ctx.rows("inplace") if r.get("detect_s")]
    if detect:
        costs = replace(costs, detect_s=min(detect))
    return costs


@section("goodput_modes", "Goodput with restart costs: restart vs in-process vs standby",
         MODE_COLUMNS,
         note="ckptrun.sim.recovery_downtime: a recovery costs what its slowest restarted "
              "process pays; defaults: RestartCosts (public orders of magnitude, measured "
              "where this machine can); effective ratio with the GEMINI reference cluster")
def modes(ctx: Context) -> List[Row]:
    costs = restart_costs(ctx)
    ctx.options["restart_costs"] = {k: getattr(costs, k) for k in costs.__dataclass_fields__}
    rows: List[Row] = []
    for label, inp in (("GEMINI reference, 1,000 machines", paper_reference_inputs()),):
        for mode, got in goodput_by_mode(inp, costs).items():
            rows.append({"inputs": label, "mode": mode, **got})
    return rows


BREAK_COLUMNS = [("machines", "machines", "int"),
                 ("ckptrun_ratio", "ckptrun effective", "pct"),
                 ("break_even_gb_per_s", "storage GB/s per machine to match it", "float"),
                 ("state_gb", "state per machine (GB)", "float"),
                 ("checkpoint_s", "storage checkpoint at that bandwidth", "s")]


@section("storage_break_even", "When does checkpointing to scalable storage match memory?",
         BREAK_COLUMNS,
         note="storage whose bandwidth grows with the cluster (S3, Lustre): the bandwidth per "
              "machine at which checkpointing only to it, as often as it allows, reaches "
              "ckptrun's effective ratio (GEMINI reference inputs, ckptrun.sim.storage_break_even)")
def break_even(ctx: Context) -> List[Row]:
    rows: List[Row] = []
    base = paper_reference_inputs()
    for n in SIZES:
        inp = base.with_machines(n)
        bw = storage_break_even(inp)
        rows.append({"machines": n, "ckptrun_ratio": goodput(inp).ckptrun.effective_ratio,
                     "break_even_gb_per_s": bw / 1e9 if bw else None,
                     "state_gb": inp.state_bytes / 1e9,
                     "checkpoint_s": inp.state_bytes / bw if bw else None})
    return rows
