"""``python -m benchmarks [--quick] [--sizes 256M,1G] [--reps N] [--out FILE.json]``.

Runs every registered section in one process, prints rich tables, writes one JSON file
(default ``benchmarks/results/<host>-<date>.json``) and, with ``--update-doc``, rewrites
the generated part of ``docs/performance.md`` from it.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import shlex
import socket
import sys
import tempfile
import time
import traceback
from datetime import datetime
from typing import List, Optional

import torch

from benchmarks import SECTION_MODULES, SECTIONS, Context, parse_size
from benchmarks.report import print_rich

QUICK_SIZES = "256M"
FULL_SIZES = "256M,1G"


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help=f"sizes {QUICK_SIZES}, 3 reps (< 5 min)")
    ap.add_argument("--sizes", help=f"comma list, e.g. 8M,256M,1G (default {FULL_SIZES})")
    ap.add_argument("--reps", type=int, help="repetitions per measurement (default 5, quick 3)")
    ap.add_argument("--only", help="comma list of sections to run (default: all)")
    ap.add_argument("--out", help="JSON path (default benchmarks/results/<host>-<date>.json)")
    ap.add_argument("--tmpdir", default=tempfile.gettempdir(), help="local-disk scratch dir")
    ap.add_argument("--target", help="fsspec URL for the fsspec write limit (default file://<tmpdir>)")
    ap.add_argument("--iteration-s", type=float, default=1.0,
                    help="goodput input: training iteration time (assumed, not measured)")
    ap.add_argument("--failure-rate", type=float, default=0.015,
                    help="goodput input: machine failures per machine per day (GEMINI: 0.015)")
    ap.add_argument("--replicas", type=int, default=2, help="goodput input: GEMINI's m")
    ap.add_argument("--restart-s", type=float,
                    help="goodput input: restart overhead (default: measured cold torch import)")
    ap.add_argument("--persist-interval-s", type=float, default=600.0,
                    help="goodput input: ckptrun's durable fallback interval")
    ap.add_argument("--state", help="goodput input: state per machine, e.g. 40G "
                    "(default: the largest size measured)")
    ap.add_argument("--recovery-state", help="recovery job state per rank (default 64M quick, "
                    "256M full)")
    ap.add_argument("--replication-size", help="slot pushed by the replication section "
                    "(default 64M quick, 256M full)")
    ap.add_argument("--replication-rate", type=float, help="pacing rate, bytes/s (default 1e9)")
    ap.add_argument("--launch-reps", type=int, help="rounds of the sections that launch jobs "
                    "(recovery, overhead; default 1 quick, --reps full)")
    ap.add_argument("--fail-after-s", type=float, help="recovery: train at least this long "
                    "before the failure (default 2; ckptrun's warm spares must be up too)")
    ap.add_argument("--hang-observe-s", type=float, help="recovery: how long to watch torchrun "
                    "with a hung rank (default 3 quick, 30 full)")
    ap.add_argument("--machine-loss-cases", help="machine_loss: STATE_MiB@STEP_S[@BUDGET] list "
                    "(default 64@0.15 quick; 64@0.15,256@0.5,64@0,64@0@off full); a fourth field "
                    "standby or standby-pull: a --standby machine takes the place")
    ap.add_argument("--inplace-forms", help="inplace: comma list of plain, setup, compile, "
                    "compile-kept (default all)")
    ap.add_argument("--cuda-parts", help="cuda: comma list of copy, save, process, recovery "
                    "(default all)")
    ap.add_argument("--overhead-steps", type=int, help="overhead: steps per run (120 quick, 400)")
    ap.add_argument("--steady-sizes", help="steady_state: comma list of 64M,256M,1G (quick: 64M)")
    ap.add_argument("--steady-steps", type=int, help="steady_state: steps per run (12 quick, 24)")
    ap.add_argument("--steady-cold", action="store_true",
                    help="steady_state: do not warm the machine's memory before each run")
    ap.add_argument("--plots", metavar="DIR", nargs="?", const="docs",
                    help="write PNG plots (needs matplotlib) into DIR (default docs)")
    ap.add_argument("--update-doc", metavar="MD", nargs="?", const="docs/performance.md",
                    help="rewrite the generated part of docs/performance.md from this run")
    ap.add_argument("--no-print", action="store_true", help="do not print tables")
    ap.add_argument("--merge-into", metavar="JSON", help="replace the sections run now in this "
                    "earlier results file (the rest stays; its meta records the re-run) and "
                    "write it back, instead of a new file")
    return ap.parse_args(argv)


def merge_into(path: str, new: dict) -> dict:
    """``new``'s sections replace the same ones of the run in ``path``; its meta lists the
    re-run (command, date, sections), so every table says which run it came from."""
    with open(path) as f:
        old = json.load(f)
    names = list(new["sections"])
    old["sections"].update(new["sections"])
    meta = new["meta"]
    reruns = [r for r in old["meta"].get("reruns", [])  # those now replaced say nothing
              if not set(r["sections"]) <= set(names)]
    old["meta"]["reruns"] = reruns + [
        {"command": meta["command"], "date": meta["date"], "sections": names,
         "wall_s": meta["wall_s"]}]
    if meta.get("plots"):
        old["meta"]["plots"] = sorted(set(old["meta"].get("plots") or []) | set(meta["plots"]))
    return old


def _size(text: Optional[str]) -> Optional[int]:
    return parse_size(text) if text else None


def default_out() -> str:
    host = socket.gethostname().split(".")[0] or "host"
    return os.path.join("benchmarks", "results", f"{host}-{datetime.now():%Y%m%d-%H%M%S}.json")


def run(argv: Optional[List[str]] = None) -> dict:
    """Run the benchmarks; return the results dict (also written to ``--out``)."""
    args = parse_args(argv)
    sizes_text = args.sizes or (QUICK_SIZES if args.quick else FULL_SIZES)
    sizes = sorted(parse_size(s) for s in sizes_text.split(",") if s.strip())
    reps = args.reps or (3 if args.quick else 5)
    for mod in SECTION_MODULES:
        importlib.import_module(mod)
    only = [s.strip() for s in args.only.split(",")] if args.only else None
    os.makedirs(args.tmpdir, exist_ok=True)  # a scratch dir that does not exist yet is fine
    ctx = Context(sizes=sizes, reps=reps, quick=args.quick, tmpdir=args.tmpdir,
                  target=args.target or f"file://{os.path.abspath(args.tmpdir)}",
                  time_budget_s=150.0 if args.quick else 1200.0,
                  options={"iteration_s": args.iteration_s, "failure_rate": args.failure_rate,
                           "replicas": args.replicas, "restart_s": args.restart_s,
                           "persist_interval_s": args.persist_interval_s,
                           "state_bytes": parse_size(args.state) if args.state else None,
                           "recovery_state_bytes": _size(args.recovery_state),
                           "replication_bytes": _size(args.replication_size),
                           "replication_rate": args.replication_rate,
                           "launch_reps": args.launch_reps, "fail_after_s": args.fail_after_s,
                           "hang_observe_s": args.hang_observe_s,
                           "overhead_steps": args.overhead_steps,
                           "steady_sizes": args.steady_sizes, "steady_steps": args.steady_steps,
                           "steady_cold": args.steady_cold,
                           "machine_loss_cases": args.machine_loss_cases,
                           "inplace_forms": args.inplace_forms,
                           "cuda_parts": args.cuda_parts})
    started = time.monotonic()
    results: dict = {"meta": {
        "command": "python -m benchmarks " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])),
        "host": socket.gethostname(), "date": datetime.now().isoformat(timespec="seconds"),
        "torch": torch.__version__, "python": platform.python_version(),
        "platform": platform.platform(), "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "sizes": sizes, "reps": reps, "quick": args.quick, "target": ctx.target,
    }, "sections": {}}
    for name, sec in SECTIONS.items():
        if only and name not in only:
            continue
        t0 = time.monotonic()
        entry: dict = {"title": sec.title, "note": sec.note, "columns": [list(c) for c in sec.columns]}
        try:
            entry["rows"] = sec.fn(ctx)
        except Exception as exc:  # one broken section must not lose the others' numbers
            entry["rows"] = []
            entry["error"] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
        entry["seconds"] = time.monotonic() - t0
        ctx.results[name] = entry["rows"]
        results["sections"][name] = entry
    results["meta"]["wall_s"] = time.monotonic() - started
    if "goodput_inputs" in ctx.options:
        results["meta"]["goodput_inputs"] = ctx.options["goodput_inputs"]
    if args.plots:  # before the JSON is written, so that it lists them
        from benchmarks.plots import write_plots

        results["meta"]["plots"] = write_plots(results, args.plots)
    if args.merge_into:
        results = merge_into(args.merge_into, results)
    out = args.merge_into or args.out or default_out()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(results, f, indent=1)
    results["meta"]["out"] = out
    if not args.no_print:
        print_rich(results)
        print(f"results: {out}")
    if args.update_doc:
        from benchmarks.report import update_doc

        update_doc(results, args.update_doc)
        print(f"updated: {args.update_doc}")
    return results


def main(argv: Optional[List[str]] = None) -> int:
    results = run(argv)
    return 1 if any(s.get("error") for s in results["sections"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
