"""Running a job under ``ckptrun check`` and reading what it fingerprinted.

Shared by the single-failure check (``ckptrun.cli.check``) and the fault soak
(``ckptrun.cli.soak``): each run goes through ``ckptrun`` itself, on this machine, with the
check probe's environment (``ckptrun.protocol.check``); its per-rank logs are read back as
records, one per committed snapshot, and compared unit by unit (an entry's skeleton, or one
tensor).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

from ckptrun.protocol.check import (
    ENV_CHECK_FAULTS,
    ENV_CHECK_LAUNCH,
    ENV_CHECK_LOG,
    ENV_CHECK_STEPS,
    OLD_VALUES_ENTRY,
    VALUES_ENTRY,
    Fault,
    write_schedule,
)

# check's own options (and --run-dir: each run gets its own) -> whether they take a value;
# left out of the command line of the runs
OWN = {"--steps": True, "--fail-at": True, "--fail_at": True, "--rank": True, "--json": False,
       "--faults": True, "--kinds": True, "--seed": True, "--run-dir": True, "--run_dir": True}
Fingerprints = Dict[Tuple[int, int], dict]  # (rank, step) -> {"entries": ..., "tensors": ...}


@dataclass
class Run:
    name: str
    directory: str
    code: int = 0
    seconds: float = 0.0
    prints: Fingerprints = field(default_factory=dict)
    restored: Optional[int] = None
    warnings: List[str] = field(default_factory=list)

    def last_step(self) -> int:
        return max((s for _, s in self.prints), default=0)

    def console_tail(self, lines: int = 25) -> str:
        try:
            with open(os.path.join(self.directory, "console.log"), errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""


def say(text: str) -> None:
    """A progress line, on stderr (stdout keeps the result, e.g. the JSON object)."""
    print(f"ckptrun check: {text}", file=sys.stderr, flush=True)


def launcher_args(argv: List[str], ns: argparse.Namespace) -> List[str]:
    """``argv`` without check's own options and ``--run-dir`` (each run gets its own), split
    off before the script and its arguments."""
    tail = [ns.training_script, *ns.training_script_args]
    head = argv[:len(argv) - len(tail)] if argv[len(argv) - len(tail):] == tail else argv
    out, skip = [], False
    for tok in head:
        if skip:
            skip = False
            continue
        name = tok.split("=", 1)[0]
        if name in OWN:
            skip = OWN[name] and "=" not in tok
            continue
        out.append(tok)
    return out


def second_reference(ref: Run, base: str, launcher: List[str], ns: argparse.Namespace,
                     steps: int) -> Tuple[Optional[int], List[str], Run]:
    """Run the job once more without a failure: (first step where it differs from ``ref``,
    the entries that differ there, the run) -- a job that resumes wrongly or one that is not
    deterministic at all."""
    again = run_job("reference-2", base, launcher, ns, steps, None,
                 what="a second run without a failure")
    nd_step, nd_entries, _ = first_difference(ref.prints, again.prints, 0, steps)
    return nd_step, nd_entries, again


def run_job(name: str, base: str, launcher: List[str], ns: argparse.Namespace,
         steps: Optional[int], faults: Optional[List[Fault]],
         what: str = "no failure", launch: int = 0,
         watch: Optional[Callable[[], None]] = None) -> Run:
    """Run the job through ``ckptrun`` to step ``steps`` with ``faults`` scheduled.  The
    same ``name`` with a higher ``launch`` runs the command again on the same run dir (the
    faults already injected stay injected)."""
    run = Run(name, os.path.join(base, name))
    logs = os.path.join(run.directory, "check")
    os.makedirs(logs, mode=0o700, exist_ok=True)
    env = {k: v for k, v in os.environ.items()
           if k not in (ENV_CHECK_FAULTS, ENV_CHECK_STEPS, ENV_CHECK_LAUNCH)}
    env[ENV_CHECK_LOG] = logs
    env[ENV_CHECK_LAUNCH] = str(launch)
    if steps:
        env[ENV_CHECK_STEPS] = str(steps)
    if not faults:  # a run without a failure never restarts: warm spares would only cost
        env.setdefault("CKPTRUN_WARM_SPARES", "0")
    if faults:
        env[ENV_CHECK_FAULTS] = os.path.join(run.directory, "faults")
        if launch == 0:
            write_schedule(env[ENV_CHECK_FAULTS], faults)
    cmd = [sys.executable, "-m", "ckptrun.cli", *launcher, "--run-dir",
           os.path.join(run.directory, "run"), "--persist-to",
           os.path.join(run.directory, "run", "checkpoints"),
           ns.training_script, *ns.training_script_args]
    say(f"{name} run ({what}) ...")
    t0 = time.monotonic()
    with open(os.path.join(run.directory, "console.log"), "a" if launch else "w") as console:
        proc = subprocess.Popen(cmd, env=env, stdout=console, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
        while True:
            try:
                run.code = proc.wait(timeout=1.0)
                break
            except subprocess.TimeoutExpired:
                if watch is not None:
                    watch()
    run.seconds = time.monotonic() - t0
    run.prints = _read_prints(logs)
    run.restored = _restored_step(os.path.join(run.directory, "run"))
    run.warnings = [line.split("warning: ", 1)[1].strip()
                    for line in run.console_tail(10_000).splitlines()
                    if "ckptrun: warning: state entry" in line]
    restored = "" if run.restored is None else f", restored step {run.restored}"
    say(f"{name} run: exit {run.code} in {run.seconds:.1f} s, {run.last_step()} steps"
        f"{restored}")
    return run


def read_records(directory: str) -> List[dict]:
    """Every fingerprint record of a run's check logs, in file order per rank."""
    out: List[dict] = []
    for name in sorted(os.listdir(directory)) if os.path.isdir(directory) else []:
        with open(os.path.join(directory, name), errors="replace") as f:
            for line in f:
                try:
                    rec = json.loads(line)
                    rec["rank"], rec["step"] = int(rec["rank"]), int(rec["step"])
                except (ValueError, KeyError, TypeError):
                    continue  # a line cut by the kill
                out.append(rec)
    return out


def _read_prints(directory: str) -> Fingerprints:
    """{(rank, step): record}, the latest attempt's record winning (a restarted worker saves
    the steps after the restore again: that timeline is the one compared)."""
    out: Fingerprints = {}
    for rec in read_records(directory):
        key = (rec["rank"], rec["step"])
        if key not in out or when(rec) >= when(out[key]):
            out[key] = rec
    return out


def when(rec: dict) -> Tuple[int, int]:
    """(launch, attempt) of a record: its place in a run's timeline."""
    return int(rec.get("launch", 0)), int(rec.get("attempt", 0))


def _restored_step(run_dir: str) -> Optional[int]:
    from ckptrun.agent.events import read_events

    restored = [e for e in read_events(run_dir) if e.get("event") == "restored"]
    return int(restored[-1]["step"]) if restored else None  # the newest launch's last


def units(rec: dict) -> Dict[str, str]:
    """What is compared in a record: every entry's skeleton and every tensor, by name."""
    return {**{f"{n}#": h for n, h in rec["entries"].items()}, **rec["tensors"]}


def entry_of(unit: str) -> str:
    """The state entry a unit belongs to: ``model/0.weight`` -> ``model``, ``values/batch/0``
    -> ``values.batch``, ``rng#`` -> ``rng``."""
    if unit.endswith("#"):
        return unit[:-1]
    parts = unit.split("/")
    if parts[0] in (VALUES_ENTRY, OLD_VALUES_ENTRY) and len(parts) > 1:
        return f"{VALUES_ENTRY}.{parts[1]}"
    return parts[0]


def static_units(prints: Fingerprints) -> Dict[int, set]:
    """{rank: units whose digest is the same at every step of a run}: state that never
    changes cannot make two runs diverge (an RNG the script never draws from, unseeded, is
    different in every run and harmless); whatever it feeds shows up in what does change."""
    seen: Dict[int, Dict[str, set]] = {}
    for (rank, _), rec in prints.items():
        for unit, h in units(rec).items():
            seen.setdefault(rank, {}).setdefault(unit, set()).add(h)
    return {rank: {u for u, hs in units.items() if len(hs) == 1} for rank, units in seen.items()}


def differing_units(a: dict, b: dict, skip: set) -> List[str]:
    """The units (see :func:`units`) whose digests differ between records ``a`` and ``b``,
    sorted, ``skip`` left out."""
    ua, ub = units(a), units(b)
    return [u for u in sorted(set(ua) | set(ub)) if u not in skip and ua.get(u) != ub.get(u)]


def first_difference(want: Fingerprints, got: Fingerprints, after: int, steps: int
                      ) -> Tuple[Optional[int], List[str], Dict[str, List[str]]]:
    """(first step > ``after`` whose fingerprints differ, the entries that differ there,
    {entry: tensor paths that differ}); (None, [], {}) when every step matches.  Units that
    never change in either run are left out (:func:`static_units`)."""
    a_static, b_static = static_units(want), static_units(got)
    ranks = sorted({r for r, _ in want})
    for step in range(after + 1, steps + 1):
        entries: List[str] = []
        paths: Dict[str, List[str]] = {}
        for r in ranks:
            a, b = want.get((r, step)), got.get((r, step))
            if a is None:
                continue
            if b is None:
                entries.append(f"(rank {r} never saved step {step})")
                continue
            for unit in differing_units(a, b, a_static.get(r, set()) & b_static.get(r, set())):
                name = entry_of(unit)
                if name not in entries:
                    entries.append(name)
                if not unit.endswith("#") and unit not in paths.setdefault(name, []):
                    paths[name].append(unit)
        if entries:
            return step, entries, paths
    return None, [], {}


def broken(run: Run, as_json: bool) -> int:
    say(f"the {run.name} run did not complete (exit {run.code}, {run.last_step()} steps "
        f"fingerprinted); its last output:\n{run.console_tail()}")
    if not run.prints:
        say("no snapshot was fingerprinted: does the script use ckptrun.Checkpointer "
            "(or an adapter) and call save()?")
    if as_json:
        print(json.dumps({"exact": False, "first_divergent_step": None,
                          "divergent_entries": [], "deterministic": False,
                          "hint": f"the {run.name} run failed with exit code {run.code}",
                          "runs": os.path.dirname(run.directory)}))
    return 1
