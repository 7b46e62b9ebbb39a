"""PNG plots of a results JSON (optional: needs matplotlib, the ``plots`` extra).

``python -m benchmarks.plots RESULTS.json [DIR]`` or ``python -m benchmarks --plots``:

* ``stall_vs_size.png`` -- blocking time of one save vs state size, per method (median,
  min-max bars), from the ``stall`` section;
* ``goodput_vs_cluster.png`` -- effective training time vs number of machines, ckptrun vs
  storage-only, from the ``goodput`` section (both storage assumptions);
* ``recovery.png`` -- time lost per failure, per case, from the ``recovery`` section;
* ``storage_break_even.png`` -- effective training time of storage-only checkpoints vs the
  storage bandwidth each machine gets (a store that grows with the cluster: S3, Lustre),
  one line per cluster size, with ckptrun's ratio at that size and the break-even points of
  the ``storage_break_even`` section.

Every measured point comes from the JSON; the storage-only curves are ``ckptrun.sim``'s
model evaluated on the same GEMINI reference inputs as that section.  A section that is
missing just skips its plot.
"""

from __future__ import annotations

import json
import math
import os
import sys
from typing import Dict, List, Optional


def _plt():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _plain_ticks():
    from matplotlib.ticker import FuncFormatter

    return FuncFormatter(lambda v, _pos: f"{v:g}")


def _save(plt, fig, ax, path: str) -> str:
    """Legend, layout, write the PNG, free the figure."""
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_stall(results: Dict, path: str) -> Optional[str]:
    rows = [r for r in results["sections"].get("stall", {}).get("rows", []) if "median_s" in r]
    if not rows:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for method in dict.fromkeys(r["method"] for r in rows):
        pts = sorted((r for r in rows if r["method"] == method), key=lambda r: r["bytes"])
        x = [r["bytes"] / 2**20 for r in pts]
        y = [r["median_s"] * 1e3 for r in pts]
        err = [[m - r["min_s"] * 1e3 for m, r in zip(y, pts)],
               [r["max_s"] * 1e3 - m for m, r in zip(y, pts)]]
        ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=method)
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(_plain_ticks())
    ax.set_yscale("log")
    ax.set_xlabel("state size (MiB)")
    ax.set_ylabel("time one save blocks training (ms)")
    ax.set_title("Checkpoint stall vs state size (median, min–max)")
    ax.grid(True, which="both", alpha=0.3)
    return _save(plt, fig, ax, path)


def plot_goodput(results: Dict, path: str) -> Optional[str]:
    rows = [r for r in results["sections"].get("goodput", {}).get("rows", [])
            if str(r.get("inputs", "")).startswith("measured")]
    if not rows:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label in dict.fromkeys(r["inputs"] for r in rows):
        pts = sorted((r for r in rows if r["inputs"] == label), key=lambda r: r["machines"])
        x = [r["machines"] for r in pts]
        short = label.replace("measured, ", "")
        ax.plot(x, [r["ckptrun_ratio"] * 100 for r in pts], marker="o", label=f"ckptrun ({short})")
        ax.plot(x, [r["storage_ratio"] * 100 for r in pts], marker="s", linestyle="--",
                label=f"storage-only ({short})")
    ax.set_xscale("log")
    ax.set_ylim(0, 101)
    ax.set_xlabel("machines")
    ax.set_ylabel("effective training time (%)")
    ax.set_title("Projected effective training time vs cluster size (GEMINI model)")
    ax.grid(True, which="both", alpha=0.3)
    return _save(plt, fig, ax, path)


def plot_recovery(results: Dict, path: str) -> Optional[str]:
    rows = [r for r in results["sections"].get("recovery", {}).get("rows", []) if "median_s" in r]
    if not rows:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    labels = [f"{r['case']}\n{r['failure']}" for r in rows]
    restart = [r["median_s"] for r in rows]
    redo = [max(0.0, r.get("lost_s", r["median_s"]) - r["median_s"]) for r in rows]
    ax.barh(labels, restart, label="failure → first step after restore")
    ax.barh(labels, redo, left=restart, label="lost steps redone")
    ax.errorbar(restart, labels, xerr=[[m - r["min_s"] for m, r in zip(restart, rows)],
                                       [r["max_s"] - m for m, r in zip(restart, rows)]],
                fmt="none", ecolor="black", capsize=3)
    ax.invert_yaxis()
    ax.set_xlabel("seconds (median; bars: min–max)")
    ax.set_title("Time lost per failure")
    ax.tick_params(axis="y", labelsize=8)
    return _save(plt, fig, ax, path)


def plot_break_even(results: Dict, path: str) -> Optional[str]:
    rows = [r for r in results["sections"].get("storage_break_even", {}).get("rows", [])
            if r.get("break_even_gb_per_s")]
    if not rows:
        return None
    from dataclasses import replace

    from ckptrun.sim import paper_reference_inputs, storage_only

    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    base = paper_reference_inputs()
    bandwidths = [0.05 * 1.15 ** i for i in range(int(math.log(400) / math.log(1.15)) + 1)]
    for row, color in zip(sorted(rows, key=lambda r: r["machines"]), _colors(plt, len(rows))):
        n = int(row["machines"])
        inp = replace(base.with_machines(n), storage_shared=False)
        curve = [storage_only(replace(inp, storage_bytes_per_s=bw * 1e9)).effective_ratio
                 for bw in bandwidths]
        ax.plot(bandwidths, [c * 100 for c in curve], color=color,
                label=f"{n:,} machines: storage only")
        ax.axhline(row["ckptrun_ratio"] * 100, color=color, linestyle=":", linewidth=1)
        ax.plot([row["break_even_gb_per_s"]], [row["ckptrun_ratio"] * 100], "o", color=color)
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(_plain_ticks())
    ax.set_ylim(0, 101)
    ax.set_xlabel("storage bandwidth per machine (GB/s)")
    ax.set_ylabel("effective training time (%)")
    ax.set_title("Storage-only checkpoints vs ckptrun (dotted) by cluster size;\n"
                 "dots: the bandwidth at which they match (GEMINI reference inputs)",
                 fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    return _save(plt, fig, ax, path)


def _colors(plt, n: int) -> List:
    cmap = plt.get_cmap("viridis")
    return [cmap(i / max(1, n - 1) * 0.9) for i in range(n)]


def write_plots(results: Dict, out_dir: str) -> List[str]:
    """Write every plot the results allow into ``out_dir``; [] without matplotlib."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("plots skipped: matplotlib is not installed (pip install matplotlib)",
              file=sys.stderr)
        return []
    os.makedirs(out_dir, exist_ok=True)
    made = [plot_stall(results, os.path.join(out_dir, "stall_vs_size.png")),
            plot_goodput(results, os.path.join(out_dir, "goodput_vs_cluster.png")),
            plot_recovery(results, os.path.join(out_dir, "recovery.png")),
            plot_break_even(results, os.path.join(out_dir, "storage_break_even.png"))]
    return [p for p in made if p]


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print("usage: python -m benchmarks.plots RESULTS.json [DIR]", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        results = json.load(f)
    for path in write_plots(results, argv[1] if len(argv) > 1 else "docs"):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
