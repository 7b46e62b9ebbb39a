"""``ckptrun check --faults N [--kinds LIST] [--seed S]``: a fault soak.

One failure-free reference run, then one run with N faults at random steps (the schedule of
``ckptrun.protocol.check``): a rank SIGKILLed, SIGSTOPped (a hang), an exception raised in
the script's main thread, the agent SIGKILLed or SIGTERMed (preemption) -- after those two
the command is run again, as a user or a scheduler would -- and one byte of a rank's newest
memory copy flipped before it dies.  Every snapshot committed in the soak, replayed steps
included, must be bitwise equal to the reference's snapshot of the same rank and step, and
every rank must reach the last step: then nothing was lost.

The soak's runs get a short fixed hang timeout, a restart budget for N faults and a persist
every few steps unless the command line gives its own; it says so.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from collections import Counter
from typing import Dict, List, Optional, Tuple

from ckptrun.agent.events import read_events
from ckptrun.cli.check_runs import (
    Run,
    broken,
    differing_units,
    entry_of,
    launcher_args,
    read_records,
    run_job,
    say,
    second_reference,
    static_units,
    when,
)
from ckptrun.cli.usage import UsageError
from ckptrun.config import AgentConfig
from ckptrun.protocol.check import KINDS, RERUN_KINDS, Fault, injected

SOAK_HANG_TIMEOUT_S = 10
SOAK_PERSIST_EVERY = 5
FIRST_FAULT_STEP = 1  # a fault may come right after the first save


def parse_kinds(text: Optional[str]) -> List[str]:
    """``kill,stop`` -> ``["kill", "stop"]``; None = every kind."""
    if text is None:
        return list(KINDS)
    kinds = [k.strip() for k in text.split(",") if k.strip()]
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        raise UsageError(f"--kinds takes a comma-separated list of {','.join(KINDS)}, "
                         f"got {text!r}")
    return list(dict.fromkeys(kinds))


def schedule(n: int, kinds: List[str], steps: int, world: int, seed: int) -> List[Fault]:
    """``n`` faults at distinct random steps in the first four fifths of the run (at least
    ``n`` steps), every kind as often as the others (within one), each on a random rank.

    Why not up to the last step: a fault is due only after the restart of the one before
    has replayed past it, so faults drift later; the last fifth is room for that drift, or
    a fault near the end slips past it and is never injected."""
    rng = random.Random(seed)
    last = max(FIRST_FAULT_STEP + n, (steps * 4) // 5)
    at = sorted(rng.sample(range(FIRST_FAULT_STEP, min(last, steps)), n))
    order = [kinds[i % len(kinds)] for i in range(n)]
    rng.shuffle(order)
    return [Fault(i, s, rng.randrange(world), k) for i, (s, k) in enumerate(zip(at, order))]


def soak_main(cfg: AgentConfig, ns: argparse.Namespace, argv: List[str]) -> int:
    """The soak; returns the exit code (0 nothing lost, 1 a difference or a run failed)."""
    n = ns.faults if ns.faults is not None else 20
    kinds = parse_kinds(ns.kinds)
    if n < 1:
        raise UsageError(f"--faults must be >= 1, got {n}")
    if ns.fail_at is not None or ns.check_rank is not None:
        raise UsageError("--fail-at/--rank name a single failure; a soak (--faults) picks "
                         "its own steps and ranks (give --seed to repeat one)")
    if ns.steps is not None and n > ns.steps - FIRST_FAULT_STEP:
        raise UsageError(f"--faults {n} needs at least {n + FIRST_FAULT_STEP} steps (one "
                         f"fault per step, none at the last); --steps is {ns.steps}")
    seed = ns.seed if ns.seed is not None else random.SystemRandom().randrange(1 << 31)
    base = ns.run_dir or tempfile.mkdtemp(prefix="ckptrun-soak-")
    launcher = launcher_args(argv, ns)
    soak_launcher = launcher + _soak_defaults(argv, n, kinds)
    world = cfg.nproc_per_node
    say(f"soaking {cfg.script} on {world} process(es) with {n} faults ({','.join(kinds)}), "
        f"seed {seed}; runs under {base}")

    ref = run_job("reference", base, launcher, ns, ns.steps, None)
    if ref.code != 0 or not ref.prints:
        return broken(ref, ns.as_json)
    steps = ns.steps or ref.last_step()
    if n > steps - FIRST_FAULT_STEP:
        raise UsageError(f"--faults {n} needs at least {n + FIRST_FAULT_STEP} steps (one "
                         f"fault per step, none at the last); the script ends at step {steps}")
    faults = schedule(n, kinds, steps, world, seed)
    soak, launches = _soak_runs(base, soak_launcher, ns, steps, faults)
    records = read_records(f"{soak.directory}/check")
    done = injected(f"{soak.directory}/faults")
    result = _verify(ref, records, faults, done, steps, world)
    result.update(_counts(faults, done, records, soak, launches), seed=seed, steps=steps,
                  runs=base)
    if soak.code != 0:
        result["exact"] = False
        result["hint"] = (f"the soak run failed with exit code {soak.code} after "
                          f"{len(done)} of {n} faults; see {soak.directory}/console.log")
        say(f"its last output:\n{soak.console_tail()}")
    elif not result["exact"] and result["first_divergent_step"] is not None:
        nd_step, nd_entries, again = second_reference(ref, base, launcher, ns, steps)
        result["deterministic"] = nd_step is None and again.code == 0
        if not result["deterministic"]:
            result["hint"] = (f"the job is not deterministic: two runs without a failure "
                              f"already differ at step {nd_step} ({', '.join(nd_entries)}); "
                              "make it deterministic first, then soak again")
    _report(result, ns.as_json)
    return 0 if result["exact"] else 1


def _soak_defaults(argv: List[str], n: int, kinds: List[str]) -> List[str]:
    """Options the soak needs unless the command line has its own: a hang is caught in
    seconds, N faults fit the restart budget, an agent lost resumes from a recent step."""
    given = {tok.split("=", 1)[0].replace("_", "-") for tok in argv if tok.startswith("--")}
    out: List[str] = []
    if "stop" in kinds and "--hang-timeout" not in given:
        out += ["--hang-timeout", str(SOAK_HANG_TIMEOUT_S)]
    if "--max-restarts" not in given:
        out += ["--max-restarts", str(n + 2)]
    if "agent" in kinds and "--persist-every" not in given:
        out += ["--persist-every", str(SOAK_PERSIST_EVERY)]
    if out:
        say(f"the soak run adds {' '.join(out)} (give them to change)")
    return out


def _soak_runs(base: str, launcher: List[str], ns: argparse.Namespace, steps: int,
               faults: List[Fault]) -> Tuple[Run, int]:
    """Run the soak, running the command again after each agent or SIGTERM fault; returns
    the last run and the number of launches."""
    faults_dir = f"{base}/soak/faults"
    reported: set = set()

    def progress() -> None:
        for index, step in sorted(injected(faults_dir).items()):
            if index not in reported:
                reported.add(index)
                f = faults[index]
                say(f"fault {index + 1}/{len(faults)}: {f.kind} on rank {f.rank} after "
                    f"save({step})")

    launch = 0
    while True:
        what = (f"{len(faults)} faults" if launch == 0
                else f"the command again, launch {launch + 1}")
        run = run_job("soak", base, launcher, ns, steps, faults, what=what, launch=launch,
                      watch=progress)
        progress()
        done = injected(faults_dir)
        ends = sum(1 for i in done if faults[i].kind in RERUN_KINDS)
        # each agent or SIGTERM fault ends one launch; a run that ends for another reason
        # (or ends at step K anyway) is not run again
        if run.code == 0 or launch >= ends or launch > len(faults):
            return run, launch + 1
        launch += 1


def _verify(ref: Run, records: List[dict], faults: List[Fault], done: Dict[int, int],
            steps: int, world: int) -> dict:
    """Every soak record against the reference's record of the same rank and step."""
    # units that never change in the reference cannot matter (an RNG the script never draws
    # from); whatever they feed shows up in what does change
    static = static_units(ref.prints)
    result = {"exact": True, "first_divergent_step": None, "divergent_entries": [],
              "deterministic": True, "hint": ""}
    for rec in sorted(records, key=lambda r: (*when(r), r["step"], r["rank"])):
        want = ref.prints.get((rec["rank"], rec["step"]))
        if want is None:
            continue  # past the reference's end
        diff = sorted({entry_of(u) for u in
                       differing_units(want, rec, static.get(rec["rank"], set()))})
        if diff:
            result.update(exact=False, first_divergent_step=rec["step"], divergent_entries=diff,
                          divergent_rank=rec["rank"])
            result["hint"] = (f"rank {rec['rank']} step {rec['step']} (launch "
                              f"{rec.get('launch', 0) + 1}, attempt {rec.get('attempt', 0)}) "
                              f"differs from the reference in {', '.join(diff)}"
                              f"{_after(rec, faults, done)}")
            return result
    reached = {r: max((x["step"] for x in records if x["rank"] == r), default=0)
               for r in range(world)}
    short = {r: s for r, s in reached.items() if s < steps}
    if short:
        result.update(exact=False, hint="ranks did not reach the last step: " + ", ".join(
            f"rank {r} stopped at {s}" for r, s in sorted(short.items())))
    return result


def _after(rec: dict, faults: List[Fault], done: Dict[int, int]) -> str:
    """", after fault i (kind, rank, step)": the last fault injected before ``rec``."""
    k = int(rec.get("faults_before", 0) or 0)
    if not 0 < k <= len(faults) or k - 1 not in done:
        return " (before any fault)"
    f = faults[k - 1]
    return f", after fault {k} ({f.kind} on rank {f.rank} at step {done[k - 1]})"


def _counts(faults: List[Fault], done: Dict[int, int], records: List[dict], soak: Run,
            launches: int) -> dict:
    """What the soak did: faults by kind, restores by tier, steps replayed."""
    by_kind = Counter(faults[i].kind for i in done)
    restores = Counter(str(e.get("tier", "?")) for e in read_events(f"{soak.directory}/run")
                       if e.get("event") == "restored")
    per_rank = Counter(r["rank"] for r in records)
    distinct = Counter(r for r, _ in {(x["rank"], x["step"]) for x in records})
    replayed = max((per_rank[r] - distinct[r] for r in per_rank), default=0)
    return {"requested": len(faults), "injected": len(done),
            "faults": {k: by_kind.get(k, 0) for k in dict.fromkeys(f.kind for f in faults)},
            "restores": dict(restores), "steps_replayed": replayed, "launches": launches,
            "seconds": round(soak.seconds, 1)}


def _report(result: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(result))
        return
    kinds = ", ".join(f"{k} {v}" for k, v in result["faults"].items())
    tiers = ", ".join(f"{k} {v}" for k, v in sorted(result["restores"].items())) or "none"
    print(f"soak: {result['injected']} of {result['requested']} faults injected ({kinds}); "
          f"{result['launches']} launch(es); restores: {tiers}; "
          f"{result['steps_replayed']} step(s) replayed")
    if result["exact"]:
        print(f"exact: every snapshot of every rank, replays included, bitwise equal to the "
              f"reference through step {result['steps']}: nothing lost")
    else:
        print(f"not exact: {result['hint']}")
        if result["divergent_entries"]:
            print(f"  differs: {', '.join(result['divergent_entries'])}")
        print(f"deterministic: {'yes' if result['deterministic'] else 'no'}")
