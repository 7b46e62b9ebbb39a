"""``ckptrun check [TORCHRUN OPTIONS] [--steps K] [--fail-at S] [--rank R] [--json] SCRIPT ...``:
proves that a script resumes exactly, or names what is missing.

It runs the job (through ``ckptrun`` itself, on this machine) twice to step K: once without a
failure, once with rank R SIGKILLed right after its ``save(S)``, which the agent restores
from memory as it would any crash.  Every committed snapshot of both runs is fingerprinted
(``ckptrun.worker.check_probe``: an xxh3 per state entry and per tensor, read from the slot),
and every step after the restore is compared entry by entry.  When they differ, a second run
without a failure tells a job that resumes wrongly from one that is not deterministic at all.

Exit codes: 0 exact, 1 not exact (or a run failed), 2 usage error.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from ckptrun.cli.usage import UsageError
from ckptrun.protocol.check import ENV_CHECK_KILL, ENV_CHECK_LOG, ENV_CHECK_STEPS

# check's own options (and --run-dir: each run gets its own) -> whether they take a value;
# left out of the command line of the runs
OWN = {"--steps": True, "--fail-at": True, "--fail_at": True, "--rank": True, "--json": False,
       "--faults": True, "--kinds": True, "--run-dir": True, "--run_dir": True}
Fingerprints = Dict[Tuple[int, int], dict]  # (rank, step) -> {"entries": ..., "tensors": ...}


def add_options(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("ckptrun check options")
    g.add_argument("--steps", type=int, default=None, metavar="K",
                   help="compare up to step K (default: the script's own end)")
    g.add_argument("--fail-at", dest="fail_at", type=int, default=None, metavar="S",
                   help="SIGKILL a rank right after its save(S) (default: K/2)")
    g.add_argument("--rank", dest="check_rank", type=int, default=None, metavar="R",
                   help="the rank to kill (default 1; 0 with one process)")
    g.add_argument("--json", dest="as_json", action="store_true", help="one JSON object")
    g.add_argument("--faults", default=None, metavar="N", help="(not available yet)")
    g.add_argument("--kinds", default=None, metavar="LIST", help="(not available yet)")


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


def check_main(argv: List[str]) -> int:
    """The ``check`` subcommand; returns the exit code."""
    from ckptrun.cli.args import parse_with

    cfg, ns = parse_with(argv, add_options)
    if ns.faults is not None or ns.kinds is not None:
        raise UsageError("ckptrun check --faults/--kinds (the fault soak) is not available "
                         "in this version; run a single failure with --fail-at S")
    if cfg.min_nodes != 1 or cfg.max_nodes != 1:
        raise UsageError("ckptrun check runs the job on this machine only (--nnodes 1)")
    world = cfg.nproc_per_node
    rank = ns.check_rank if ns.check_rank is not None else (1 if world > 1 else 0)
    if not 0 <= rank < world:
        raise UsageError(f"--rank {rank} is outside 0..{world - 1}")
    for flag, value in (("--steps", ns.steps), ("--fail-at", ns.fail_at)):
        if value is not None and value < 1:
            raise UsageError(f"{flag} must be >= 1, got {value}")
    if ns.steps is not None and ns.fail_at is not None and ns.fail_at >= ns.steps:
        raise UsageError(f"--fail-at {ns.fail_at} must be before --steps {ns.steps}")
    base = ns.run_dir or tempfile.mkdtemp(prefix="ckptrun-check-")
    launcher = _launcher_args(argv, ns)
    say(f"checking {cfg.script} on {world} process(es); runs under {base}")

    steps = ns.steps
    ref = _run("reference", base, launcher, ns, steps, None)
    if ref.code != 0 or not ref.prints:
        return _broken(ref, ns.as_json)
    steps = steps or ref.last_step()
    fail_at = ns.fail_at or max(1, steps // 2)
    if fail_at >= steps:
        raise UsageError(f"the script ends at step {steps}: nothing to compare after "
                         f"--fail-at {fail_at}")
    failed = _run("failure", base, launcher, ns, steps, f"{fail_at}:{rank}",
                  what=f"rank {rank} SIGKILLed after save({fail_at})")
    if failed.code != 0:
        return _broken(failed, ns.as_json)
    restored = failed.restored if failed.restored is not None else 0
    step, entries, paths = _first_difference(ref.prints, failed.prints, restored, steps)
    result = {"exact": step is None, "first_divergent_step": step, "divergent_entries": entries,
              "deterministic": True, "restored_step": restored, "fail_at": fail_at,
              "steps": steps, "rank": rank, "hint": "", "runs": base}
    if step is None:
        result["hint"] = (f"exact: steps {restored + 1}..{steps} bitwise equal after a "
                          f"restore at {restored}")
    else:
        again = _run("reference-2", base, launcher, ns, steps, None,
                     what="a second run without a failure")
        nd_step, nd_entries, _ = _first_difference(ref.prints, again.prints, 0, steps)
        result["deterministic"] = nd_step is None and again.code == 0
        result["hint"] = _hint(result, restored, nd_step, nd_entries, paths,
                               failed.warnings + ref.warnings)
    _report(result, paths, ns.as_json)
    return 0 if result["exact"] else 1


def say(text: str) -> None:
    """A progress line, on stderr (stdout keeps the result, e.g. the JSON object)."""
    print(f"ckptrun check: {text}", file=sys.stderr, flush=True)


def _launcher_args(argv: List[str], ns: argparse.Namespace) -> List[str]:
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


def _run(name: str, base: str, launcher: List[str], ns: argparse.Namespace,
         steps: Optional[int], kill: Optional[str],
         what: str = "no failure") -> Run:
    run = Run(name, os.path.join(base, name))
    logs = os.path.join(run.directory, "check")
    os.makedirs(logs, mode=0o700, exist_ok=True)
    env = dict(os.environ, **{ENV_CHECK_LOG: logs})
    env.pop(ENV_CHECK_KILL, None)
    env.pop(ENV_CHECK_STEPS, None)
    if steps:
        env[ENV_CHECK_STEPS] = str(steps)
    if kill:
        env[ENV_CHECK_KILL] = kill
    cmd = [sys.executable, "-m", "ckptrun.cli", *launcher, "--run-dir",
           os.path.join(run.directory, "run"), "--persist-to",
           os.path.join(run.directory, "run", "checkpoints"),
           ns.training_script, *ns.training_script_args]
    say(f"{name} run ({what}) ...")
    t0 = time.monotonic()
    with open(os.path.join(run.directory, "console.log"), "w") as console:
        run.code = subprocess.run(cmd, env=env, stdout=console, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL).returncode
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


def _read_prints(directory: str) -> Fingerprints:
    """{(rank, step): record}, the latest attempt's record winning (a restarted worker saves
    the steps after the restore again: that timeline is the one compared)."""
    out: Fingerprints = {}
    for name in sorted(os.listdir(directory)) if os.path.isdir(directory) else []:
        with open(os.path.join(directory, name), errors="replace") as f:
            for line in f:
                try:
                    rec = json.loads(line)
                    key = (int(rec["rank"]), int(rec["step"]))
                except (ValueError, KeyError, TypeError):
                    continue  # a line cut by the kill
                if key not in out or rec.get("attempt", 0) >= out[key].get("attempt", 0):
                    out[key] = rec
    return out


def _restored_step(run_dir: str) -> Optional[int]:
    from ckptrun.agent.events import read_events

    for e in read_events(run_dir):
        if e.get("event") == "restored":
            return int(e["step"])
    return None


def _units(rec: dict) -> Dict[str, str]:
    """What is compared in a record: every entry's skeleton and every tensor, by name."""
    return {**{f"{n}#": h for n, h in rec["entries"].items()}, **rec["tensors"]}


def _entry_of(unit: str) -> str:
    """The state entry a unit belongs to: ``model/0.weight`` -> ``model``, ``values/batch/0``
    -> ``values.batch``, ``rng#`` -> ``rng``."""
    if unit.endswith("#"):
        return unit[:-1]
    parts = unit.split("/")
    if parts[0] in ("values", "__ckptrun_values__") and len(parts) > 1:
        return f"values.{parts[1]}"
    return parts[0]


def static_units(prints: Fingerprints) -> Dict[int, set]:
    """{rank: units whose digest is the same at every step of a run}: state that never
    changes cannot make two runs diverge (an RNG the script never draws from, unseeded, is
    different in every run and harmless); whatever it feeds shows up in what does change."""
    seen: Dict[int, Dict[str, set]] = {}
    for (rank, _), rec in prints.items():
        for unit, h in _units(rec).items():
            seen.setdefault(rank, {}).setdefault(unit, set()).add(h)
    return {rank: {u for u, hs in units.items() if len(hs) == 1} for rank, units in seen.items()}


def _first_difference(want: Fingerprints, got: Fingerprints, after: int, steps: int
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
            skip = a_static.get(r, set()) & b_static.get(r, set())
            ua, ub = _units(a), _units(b)
            for unit in sorted(set(ua) | set(ub)):
                if unit in skip or ua.get(unit) == ub.get(unit):
                    continue
                name = _entry_of(unit)
                if name not in entries:
                    entries.append(name)
                if not unit.endswith("#") and unit not in paths.setdefault(name, []):
                    paths[name].append(unit)
        if entries:
            return step, entries, paths
    return None, [], {}


def _hint(result: dict, restored: int, nd_step: Optional[int], nd_entries: List[str],
          paths: Dict[str, List[str]], warnings: List[str]) -> str:
    if nd_step is not None:
        return (f"the job is not deterministic: two runs without a failure already differ at "
                f"step {nd_step} ({', '.join(nd_entries)}); make it deterministic first "
                "(seeds on every rank, torch.use_deterministic_algorithms(True), data that "
                "does not depend on time or on worker timing), then check again")
    step, entries = result["first_divergent_step"], result["divergent_entries"]
    parts = []
    if warnings:
        parts.append("; ".join(sorted(set(warnings))))
    if step == restored + 1:
        parts.append(
            f"step {step}, the first after the restore at {restored}, already differs "
            f"({', '.join(entries)}): the step read state that the snapshot did not hold -- "
            "a batch fetched before save() (give it as ckpt.save(step, batch=(X, Y)) and "
            "read it back with ckpt.get('batch')), a number the loop rebinds (give it as "
            "ckpt.save(step, name=value)), or a data iterator's position (register a "
            "stateful loader or sampler)")
    else:
        parts.append(
            f"steps {restored + 1}..{step - 1} after the restore matched, step {step} does "
            f"not ({', '.join(entries)}): state that matters only later was not restored -- a "
            "counter or schedule the loop keeps outside the Checkpointer, a data iterator's "
            "position, or a number the loop rebinds (give it at save time)")
    return "; ".join(parts)


def _report(result: dict, paths: Dict[str, List[str]], as_json: bool) -> None:
    if as_json:
        print(json.dumps(result))
        return
    if result["exact"]:
        print(result["hint"])
        return
    print(f"not exact: step {result['first_divergent_step']} differs after a restore at "
          f"{result['restored_step']} (rank {result['rank']} killed after "
          f"save({result['fail_at']}))")
    for name in result["divergent_entries"]:
        where = paths.get(name, [])
        more = f": {', '.join(where[:3])}{' ...' if len(where) > 3 else ''}" if where else ""
        print(f"  differs: {name}{more}")
    print(f"deterministic: {'yes' if result['deterministic'] else 'no'}")
    print(f"hint: {result['hint']}")


def _broken(run: Run, as_json: bool) -> int:
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
