"""ckptrun's benchmark harness: every comparison side by side, in one run, as ratios.

A *section* is a function ``fn(ctx) -> list[dict]`` registered with :func:`section`;
each dict is one table row.  Timing rows come from :func:`timed` and carry
``median_s``/``min_s``/``max_s`` over ``ctx.reps`` repetitions; :func:`interleave` runs
the cases of one comparison round-robin so that passing load hits them all alike.  Sections run in
registration order and can read the rows of earlier ones through ``ctx.results`` (the
goodput projection uses the measured limits this way).

To add a section (memory tier, recovery, overhead...), write a module that decorates its
functions with :func:`section` and append the module name to :data:`SECTION_MODULES`.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

# Imported in this order by ``python -m benchmarks``; later sections may use earlier rows.
SECTION_MODULES = ["benchmarks.limits", "benchmarks.stall", "benchmarks.replication",
                   "benchmarks.recovery", "benchmarks.machine_loss", "benchmarks.quoted",
                   "benchmarks.overhead", "benchmarks.steady_state",
                   "benchmarks.replication_overhead", "benchmarks.ddp_exact", "benchmarks.inplace",
                   "benchmarks.cuda", "benchmarks.goodput"]

Row = Dict[str, object]
Column = Tuple[str, str, str]  # (row key, header, format: "s", "ms", "gbps", "ratio", "pct", "int", "str", "bytes")


@dataclass
class Context:
    """What a section gets: the sizes to try, repetitions, scratch places, earlier rows."""

    sizes: List[int]
    reps: int
    quick: bool
    tmpdir: str  # on the local disk (disk and fsspec limits write here)
    target: str  # fsspec URL the "fsspec write" limit writes under
    time_budget_s: float  # a section should stop adding sizes once this is spent
    options: Dict[str, object] = field(default_factory=dict)
    results: Dict[str, List[Row]] = field(default_factory=dict)

    def rows(self, name: str) -> List[Row]:
        return self.results.get(name, [])


@dataclass
class Section:
    name: str
    title: str
    fn: Callable[[Context], List[Row]]
    columns: Sequence[Column]
    note: str = ""


SECTIONS: Dict[str, Section] = {}


def section(name: str, title: str, columns: Sequence[Column], note: str = ""):
    """Register ``fn(ctx) -> rows`` as a benchmark section named ``name``."""

    def wrap(fn: Callable[[Context], List[Row]]):
        SECTIONS[name] = Section(name, title, fn, list(columns), note)
        return fn

    return wrap


def timed(fn: Callable[[], object], reps: int, setup: Optional[Callable[[], object]] = None,
          teardown: Optional[Callable[[], object]] = None, warmup: int = 0) -> Row:
    """Median/min/max wall time of ``fn`` over ``reps`` runs (``setup`` is not timed)."""
    samples: List[float] = []
    for i in range(warmup + reps):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        if teardown is not None:
            teardown()
        if i >= warmup:
            samples.append(dt)
    return {"median_s": statistics.median(samples), "min_s": min(samples),
            "max_s": max(samples), "reps": len(samples)}


def interleave(benches: Sequence[Callable[[int], Row]], reps: int) -> List[Row]:
    """Run every bench once per round, ``reps`` rounds, and merge the samples.

    Round-robin instead of one case after the other: on a shared machine, load that comes
    and goes then hits all cases alike, so the ratios between them stay meaningful.  Each
    bench is called as ``bench(1)`` and must return a row from :func:`timed`.
    """
    per_case: List[List[Row]] = [[] for _ in benches]
    for _ in range(reps):
        for i, bench in enumerate(benches):
            per_case[i].append(bench(1))
    merged: List[Row] = []
    for rows in per_case:
        row = dict(rows[0])
        if "median_s" in row:
            samples = [float(r["median_s"]) for r in rows]
            row.update(median_s=statistics.median(samples), min_s=min(samples),
                       max_s=max(samples), reps=len(samples))
            totals = [float(r["total_median_s"]) for r in rows if "total_median_s" in r]
            if totals:
                row["total_median_s"] = statistics.median(totals)
            if "gb_per_s" in row and row.get("bytes"):
                nbytes = float(row["bytes"])  # type: ignore[arg-type]
                row["gb_per_s"] = nbytes / float(row["median_s"]) / 1e9
                if "gb_per_s_max" in row:
                    row["gb_per_s_max"] = nbytes / float(row["min_s"]) / 1e9
                    row["gb_per_s_min"] = nbytes / float(row["max_s"]) / 1e9
        merged.append(row)
    return merged


def bandwidth_row(case: str, nbytes: int, stats: Row, **extra) -> Row:
    """A timing row plus GB/s at the median and at the best and worst repetitions."""
    row: Row = {"case": case, "bytes": nbytes, **stats}
    row["gb_per_s"] = nbytes / float(stats["median_s"]) / 1e9
    row["gb_per_s_max"] = nbytes / float(stats["min_s"]) / 1e9
    row["gb_per_s_min"] = nbytes / float(stats["max_s"]) / 1e9
    row.update(extra)
    return row


def parse_size(text: str) -> int:
    """``256M``, ``1G``, ``8M``, ``4096`` -> bytes (binary units)."""
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    if text and text[-1] in mult:
        return int(float(text[:-1]) * mult[text[-1]])
    return int(text)


def human_bytes(n: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            value = n / size
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.2f} {unit}"
    return f"{int(n)} B"
