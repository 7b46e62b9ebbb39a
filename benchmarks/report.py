"""Render a results JSON as rich tables (terminal) or Markdown (docs/performance.md).

Every number in the rendered output comes from the JSON; nothing is typed by hand.
``python -m benchmarks.report RESULTS.json [--markdown OUT.md]``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Dict, List, Optional, Sequence

from benchmarks import Column, human_bytes


def fmt(value: object, kind: str) -> str:
    """One cell, formatted by column kind."""
    if value is None or value == "":
        return "—" if kind != "str" else ""
    if kind == "str":
        return str(value)
    if kind == "bytes":
        return human_bytes(float(value)) if float(value) > 0 else "—"  # type: ignore[arg-type]
    v = float(value)  # type: ignore[arg-type]
    if kind == "ms":
        return f"{v * 1e3:.1f} ms" if v < 10 else f"{v:.1f} s"
    if kind == "s":
        if v >= 3600:
            return f"{v / 3600:.1f} h"
        return f"{v:.1f} s" if v >= 1 else f"{v * 1e3:.0f} ms"
    if kind == "gbps":
        return f"{v:.2f}"
    if kind == "ratio":
        return f"{v:.3f}" if v < 10 else f"{v:.1f}"
    if kind == "pct":
        return f"{v * 100:.2f}%"
    if kind == "int":
        return f"{int(v):,}"
    if kind == "float":
        return f"{v:.3g}"
    return str(value)


def table_cells(rows: List[Dict], columns: Sequence[Column]) -> List[List[str]]:
    return [[fmt(r.get(key), kind) for key, _, kind in columns] for r in rows]


def _groups(rows: List[Dict]) -> Dict[str, List[Dict]]:
    """Split rows on an ``inputs`` key (the goodput table has measured + reference)."""
    out: Dict[str, List[Dict]] = {}
    for r in rows:
        out.setdefault(str(r.get("inputs", "")), []).append(r)
    return out


def print_rich(results: Dict, names: Optional[List[str]] = None) -> None:
    """Print every section of ``results`` as a rich table."""
    from rich.console import Console
    from rich.table import Table

    console = Console() if sys.stdout.isatty() else Console(width=160)
    for name, sec in results["sections"].items():
        if names and name not in names:
            continue
        for label, rows in _groups(sec["rows"]).items():
            title = sec["title"] + (f" — {label}" if label else "")
            table = Table(title=title, caption=sec.get("note") or None)
            for _, header, kind in sec["columns"]:
                table.add_column(header, justify="left" if kind == "str" else "right")
            for cells in table_cells(rows, sec["columns"]):
                table.add_row(*cells)
            console.print(table)
        if sec.get("error"):
            console.print(f"[red]{name}: {sec['error']}[/red]")


def markdown_table(rows: List[Dict], columns: Sequence[Column]) -> str:
    head = "| " + " | ".join(h for _, h, _ in columns) + " |"
    sep = "|" + "|".join("---" if k == "str" else "---:" for _, _, k in columns) + "|"
    body = ["| " + " | ".join(cells) + " |" for cells in table_cells(rows, columns)]
    return "\n".join([head, sep, *body])


def markdown_sections(results: Dict) -> str:
    """All sections of a run as Markdown tables with a one-line provenance header."""
    meta = results["meta"]
    parts = [f"Run: `{meta['command']}` on `{meta['host']}` at {meta['date']} "
             f"(torch {meta['torch']}, Python {meta['python']}, {meta['cpus']} CPUs, "
             f"{meta['reps']} repetitions, {meta['wall_s']:.0f} s in all)."]
    for rerun in meta.get("reruns", []):
        parts.append(f"Sections {', '.join(rerun['sections'])} were re-run later: "
                     f"`{rerun['command']}` at {rerun['date']} ({rerun['wall_s']:.0f} s); "
                     "their tables below are from that run.")
    for _name, sec in results["sections"].items():
        for label, rows in _groups(sec["rows"]).items():
            title = sec["title"] + (f" — {label}" if label else "")
            parts.append(f"#### {title}\n\n{markdown_table(rows, sec['columns'])}")
            if sec.get("note"):
                parts.append(f"_{sec['note']}_")
        if sec.get("error"):
            parts.append(f"**{sec['title']} failed:** `{sec['error']}`")
    inputs = results["meta"].get("goodput_inputs")
    if inputs:
        listed = ", ".join(f"`{k}`={_short(v)}" for k, v in inputs.items() if v is not None)
        parts.append(f"Goodput inputs (measured above, or options): {listed}.")
    return "\n\n".join(parts)


BEGIN = "<!-- BEGIN GENERATED: python -m benchmarks --update-doc; do not edit by hand -->"
END = "<!-- END GENERATED -->"


def key_findings(results: Dict) -> List[str]:
    """Sentences with the headline ratios, computed from the rows (for the doc)."""
    out: List[str] = []
    lim = results["sections"].get("limits", {}).get("rows", [])
    by = {(r.get("case"), r.get("bytes")): r for r in lim if "median_s" in r}
    for size in results["meta"]["sizes"]:
        base = by.get(("memcpy", size))
        if not base:
            continue
        parts = [f"memcpy {float(base['gb_per_s']):.2f} GB/s"]
        for case in ("shm copy (pre-faulted)", "shm first touch", "loopback TCP",
                     "disk write+fsync", "fsspec write"):
            r = by.get((case, size))
            if r:
                parts.append(f"{case} {float(r['gb_per_s']):.2f} GB/s "
                             f"({float(r['vs_memcpy']):.3f}x memcpy)")
        shm, touch = by.get(("shm copy (pre-faulted)", size)), by.get(("shm first touch", size))
        line = f"At {human_bytes(size)}: " + "; ".join(parts) + "."
        if shm and touch:
            line += (f" First touch is {float(touch['median_s']) / float(shm['median_s']):.1f}x "
                     "slower than copying into pre-faulted shm.")
        out.append(line)
    for r in results["sections"].get("stall", {}).get("rows", []):
        if "vs_copy" in r and r.get("method") != "plain copy_":
            out.append(f"{r['method']} at {human_bytes(float(r['bytes']))} blocks "
                       f"{float(r['median_s']) * 1e3:.1f} ms = {float(r['vs_copy']):.2f}x a plain copy_.")
    out += recovery_findings(results)
    for r in results["sections"].get("goodput", {}).get("rows", []):
        if str(r.get("inputs", "")).startswith("measured") and r.get("machines") == 1000:
            out.append(f"Projected at 1,000 machines ({r['inputs']}): ckptrun "
                       f"{float(r['ckptrun_ratio']) * 100:.1f}% vs storage-only "
                       f"{float(r['storage_ratio']) * 100:.1f}% effective training time.")
        elif str(r.get("inputs", "")).startswith("GEMINI paper"):
            out.append(f"GEMINI paper reference (1,000 instances, 1.5%/day): model gives "
                       f"{float(r['ckptrun_ratio']) * 100:.1f}% effective training time (paper: about 91%).")
    return out


def recovery_findings(results: Dict) -> List[str]:
    """Headline sentences of the recovery, replication and overhead sections."""
    out: List[str] = []
    rec = [r for name in ("recovery", "machine_loss")
           for r in results["sections"].get(name, {}).get("rows", [])]
    base = next((r for r in rec if r.get("case") == "ckptrun" and "median_s" in r), None)
    for r in rec:
        if "median_s" not in r:
            if r.get("note"):
                out.append(f"{r['case']}, {r['failure']}: {r['note']}.")
            continue
        line = (f"{r['case']}, {r['failure']}: first step {float(r['median_s']):.2f} s after the "
                f"failure (min {float(r['min_s']):.2f}, max {float(r['max_s']):.2f}, "
                f"{r['reps']} runs), {float(r['steps_lost']):g} steps lost (median)")
        if r.get("beyond_timeout_s") is not None:
            line += (f"; restarted {float(r['beyond_timeout_s']):.2f} s after the "
                     f"{float(r['restart_s']) - float(r['beyond_timeout_s']):g} s timeout")
        if r is not base and r.get("vs_ckptrun") and base:
            line += f"; time lost {float(r['vs_ckptrun']):.1f}x ckptrun's"
        if r.get("met"):
            line += f"; DESIGN target {r['target']}: {r['met']}"
        out.append(line + ".")
    waits = [float(x["trained_s"]) for r in rec if r.get("case", "").startswith("ckptrun")
             for x in r.get("samples", []) if x.get("spares_warm") and "trained_s" in x]
    if waits:
        out.append(f"ckptrun's warm spares were ready {min(waits):.0f}–{max(waits):.0f} s after "
                   "training began (niced, importing torch while training saturates the CPU); "
                   "the failures above came after that.")
    rep = {r.get("case"): r for r in results["sections"].get("replication", {}).get("rows", [])}
    if "push" in rep and "raw loopback TCP" in rep:
        p, t = rep["push"], rep["raw loopback TCP"]
        out.append(f"Replication push of {human_bytes(float(p['bytes']))}: "
                   f"{float(p['gb_per_s']):.2f} GB/s = {float(p['vs_tcp']):.2f}x raw loopback TCP "
                   f"({float(t['gb_per_s']):.2f} GB/s) in the same run (goal 0.70: {p.get('met')}).")
    for r in results["sections"].get("overhead", {}).get("rows", []):
        if r.get("slowdown") is not None:
            out.append(f"Overhead, {r['case']}: {float(r['steps_per_s']):.1f} steps/s, "
                       f"{float(r['slowdown']) * 100:.1f}% slower than without checkpointing "
                       f"(goal ≤ 10%: {r.get('met')}).")
    return out


def update_doc(results: Dict, path: str, extra: Sequence[Dict] = ()) -> None:
    """Replace the text between the BEGIN/END markers of ``path`` with this run's tables
    (and those of ``extra`` runs, each with its own provenance line, after them)."""
    with open(path) as f:
        text = f.read()
    if BEGIN not in text or END not in text:
        raise ValueError(f"{path} has no generated-section markers")
    lines = key_findings(results)
    for more in extra:
        lines += recovery_findings(more)
    findings = "\n".join(f"- {line}" for line in lines)
    body = f"{BEGIN}\n\n### Headline ratios\n\n{findings}\n\n### Tables\n\n{markdown_sections(results)}"
    for more in extra:
        body += f"\n\n### Tables of a separate run\n\n{markdown_sections(more)}"
    plots = results["meta"].get("plots") or []
    if plots:
        here = os.path.dirname(os.path.abspath(path))
        links = "\n\n".join(f"![{os.path.basename(p)}]({os.path.relpath(os.path.abspath(p), here)})"
                             for p in plots)
        body += f"\n\n### Plots\n\n{links}"
    body += f"\n\n{END}"
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    with open(path, "w") as f:
        f.write(head + body + tail)


def _short(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.report")
    ap.add_argument("results")
    ap.add_argument("more", nargs="*", help="further results JSON rendered after the first")
    ap.add_argument("--markdown", help="write the Markdown tables here instead of printing")
    ap.add_argument("--update-doc", help="rewrite the generated part of this Markdown file")
    args = ap.parse_args(argv)
    with open(args.results) as f:
        results = json.load(f)
    extra = []
    for path in args.more:
        with open(path) as f:
            extra.append(json.load(f))
    if args.update_doc:
        update_doc(results, args.update_doc, extra)
    elif args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown_sections(results) + "\n")
    else:
        print_rich(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
