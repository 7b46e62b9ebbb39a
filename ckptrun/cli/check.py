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
import tempfile
from typing import Dict, List, Optional

from ckptrun.cli.check_runs import (
    broken,
    first_difference,
    launcher_args,
    run_job,
    say,
    second_reference,
)
from ckptrun.cli.soak import soak_main
from ckptrun.cli.usage import UsageError
from ckptrun.protocol.check import Fault


def add_options(parser: argparse.ArgumentParser) -> None:
    parser.prog = "ckptrun check"
    parser.description = ("Run the training script twice through ckptrun -- without a failure "
                          "and with a rank SIGKILLed after a save() -- and compare every "
                          "snapshot after the restore bitwise (docs/exact.md).")
    g = parser.add_argument_group("ckptrun check options")
    g.add_argument("--steps", type=int, default=None, metavar="K",
                   help="compare up to step K (default: the script's own end)")
    g.add_argument("--fail-at", dest="fail_at", type=int, default=None, metavar="S",
                   help="SIGKILL a rank right after its save(S) (default: K/2)")
    g.add_argument("--rank", dest="check_rank", type=int, default=None, metavar="R",
                   help="the rank to kill (default 1; 0 with one process)")
    g.add_argument("--json", dest="as_json", action="store_true", help="one JSON object")
    g.add_argument("--faults", type=int, default=None, metavar="N",
                   help="a fault soak: N faults at random steps of one run")
    g.add_argument("--kinds", default=None, metavar="LIST",
                   help="the soak's fault kinds, comma-separated (default: all of "
                        "kill,stop,raise,agent,term,corrupt)")
    g.add_argument("--seed", type=int, default=None, metavar="N",
                   help="the soak's schedule seed (default: random, printed)")


def check_main(argv: List[str]) -> int:
    """The ``check`` subcommand; returns the exit code."""
    from ckptrun.cli.args import parse_with

    cfg, ns = parse_with(argv, add_options)
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
    if ns.faults is not None or ns.kinds is not None or ns.seed is not None:
        return soak_main(cfg, ns, argv)
    base = ns.run_dir or tempfile.mkdtemp(prefix="ckptrun-check-")
    launcher = launcher_args(argv, ns)
    say(f"checking {cfg.script} on {world} process(es); runs under {base}")

    steps = ns.steps
    ref = run_job("reference", base, launcher, ns, steps, None)
    if ref.code != 0 or not ref.prints:
        return broken(ref, ns.as_json)
    steps = steps or ref.last_step()
    fail_at = ns.fail_at or max(1, steps // 2)
    if fail_at >= steps:
        raise UsageError(f"the script ends at step {steps}: nothing to compare after "
                         f"--fail-at {fail_at}")
    failed = run_job("failure", base, launcher, ns, steps, [Fault(0, fail_at, rank, "kill")],
                  what=f"rank {rank} SIGKILLed after save({fail_at})")
    if failed.code != 0:
        return broken(failed, ns.as_json)
    restored = failed.restored if failed.restored is not None else 0
    step, entries, paths = first_difference(ref.prints, failed.prints, restored, steps)
    result = {"exact": step is None, "first_divergent_step": step, "divergent_entries": entries,
              "deterministic": True, "restored_step": restored, "fail_at": fail_at,
              "steps": steps, "rank": rank, "hint": "", "runs": base}
    if step is None:
        result["hint"] = (f"exact: steps {restored + 1}..{steps} bitwise equal after a "
                          f"restore at {restored}")
    else:
        nd_step, nd_entries, again = second_reference(ref, base, launcher, ns, steps)
        result["deterministic"] = nd_step is None and again.code == 0
        result["hint"] = _hint(result, restored, nd_step, nd_entries, paths,
                               failed.warnings + ref.warnings)
    _report(result, paths, ns.as_json)
    return 0 if result["exact"] else 1


# what a dataset with random transforms needs (docs/exact.md, section 4)
_WORKER_RNG = ("keep torch.get_rng_state() in the dataset's state_dict() under torchdata's "
               "StatefulDataLoader, or draw from a generator seeded by epoch and index")


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
            "ckpt.save(step, name=value)), a data iterator's position (register a "
            "stateful loader or sampler), or random transforms in data-loader workers (a "
            "restore reseeds the workers' RNG: " + _WORKER_RNG + ")")
    else:
        parts.append(
            f"steps {restored + 1}..{step - 1} after the restore matched, step {step} does "
            f"not ({', '.join(entries)}): state that matters only later was not restored -- a "
            "counter or schedule the loop keeps outside the Checkpointer, a data iterator's "
            "position, a number the loop rebinds (give it at save time), or random transforms "
            "in data-loader workers (" + _WORKER_RNG + ")")
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


