"""The ``ckptrun`` command: ``ckptrun [run] ...``, ``ckptrun status``, ``ckptrun restore``.

``ckptrun [TORCHRUN OPTIONS] [CKPTRUN OPTIONS] SCRIPT [ARGS...]`` without a subcommand means
``run``. Click dispatches the subcommands; the run options are parsed by torch's argparse
parser (``ckptrun.cli.args``), so click must pass them through untouched: the ``run`` command
takes its arguments unprocessed and has no help option of its own (``--help`` goes to
argparse, which lists torchrun's and ckptrun's options).

Exit codes: 0 success, 1 job failed, 2 usage error. Heavy imports (torch, the agent) happen
only in ``run`` so that ``ckptrun status`` stays fast.
"""

from __future__ import annotations

import gc
import logging
import os
import sys
from typing import List, Optional

import click

from ckptrun import __version__

SUBCOMMANDS = ("run", "status", "restore", "check")
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def usage_error(message: str) -> int:
    """Print ``ckptrun: error: <message>`` (one line) to stderr and return exit code 2."""
    click.echo(f"ckptrun: error: {message}", err=True)
    return EXIT_USAGE


def run_main(argv: List[str]) -> int:
    """Parse a run command line and hand it to the agent; returns the process exit code."""
    # from the first check on (it creates --run-dir and --persist-to), what ckptrun writes is
    # the user's alone; the workers get the user's umask back (agent.supervisor.run_agent)
    user_umask = os.umask(0o077)
    try:
        return _run(argv, user_umask)
    finally:
        os.umask(user_umask)


def _run(argv: List[str], user_umask: int) -> int:
    from ckptrun.cli.args import UsageError, parse

    try:
        cfg = parse(argv)
    except UsageError as exc:
        return usage_error(str(exc))
    level = os.environ.get("CKPTRUN_LOG_LEVEL", "").upper()
    if level:  # the agent's own log (restore decisions, replication) on stderr, for debugging
        logging.basicConfig(level=getattr(logging, level, logging.INFO),
                            format="ckptrun %(asctime)s %(name)s: %(message)s")
        logging.getLogger("torch").setLevel(logging.WARNING)
    from ckptrun.agent.supervisor import run_agent  # torch: only for ``run``

    return int(run_agent(cfg, user_umask))


class _Group(click.Group):
    """Loads ``status`` and ``restore`` only when used (the restore side may import torch)."""

    def list_commands(self, ctx: click.Context) -> List[str]:
        return list(SUBCOMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> Optional[click.Command]:
        if name == "run":
            return run_command
        if name == "status":
            from ckptrun.cli.status import status_command

            return status_command
        if name == "restore":
            return _restore_command()
        if name == "check":
            return check_command
        return None


def _restore_command() -> click.Command:
    from ckptrun.cli.restore import restore_command

    return restore_command


@click.group(
    cls=_Group,
    context_settings={"help_option_names": ["-h", "--help"]},
    help="A drop-in torchrun with per-iteration in-memory checkpoints and fast recovery.\n\n"
    "ckptrun [TORCHRUN OPTIONS] [CKPTRUN OPTIONS] SCRIPT [ARGS...]  (= ckptrun run ...)",
)
@click.version_option(__version__, "--version", prog_name="ckptrun", message="%(prog)s %(version)s")
def cli() -> None:
    """The click group; :func:`main` routes command lines without a subcommand to ``run``."""


def _passthrough(name: str):
    """A subcommand whose arguments go, unprocessed, to torch's argparse parser (which has
    the torchrun options and their ``--help``)."""
    def wrap(fn):
        fn = click.pass_context(fn)
        fn = click.argument("argv", nargs=-1, type=click.UNPROCESSED)(fn)
        return click.command(name, add_help_option=False, context_settings={
            "ignore_unknown_options": True, "allow_extra_args": True,
            "allow_interspersed_args": False, "help_option_names": []})(fn)
    return wrap


@_passthrough("run")
def run_command(ctx: click.Context, argv: List[str]) -> None:
    """Launch and supervise SCRIPT like torchrun (see ckptrun --help for the options)."""
    ctx.exit(run_main(list(argv)))


@_passthrough("check")
def check_command(ctx: click.Context, argv: List[str]) -> None:
    """Prove that SCRIPT resumes exactly: a run without and one with a failure, compared."""
    from ckptrun.cli.args import UsageError
    from ckptrun.cli.check import check_main

    try:
        ctx.exit(check_main(list(argv)))
    except UsageError as exc:
        ctx.exit(usage_error(str(exc)))


def main(argv: Optional[List[str]] = None) -> None:
    """Console-script entry point (``ckptrun = ckptrun.cli:main``); exits the process."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0] not in SUBCOMMANDS and argv[0] != "--version"):
        argv = ["run", *argv]  # no subcommand: everything, --help included, belongs to run
    if argv[0] in ("run", "check", "restore") and not {"-h", "--help"} & set(argv):
        from ckptrun.torchcompat import floor_problem

        problem = floor_problem()
        if problem is not None:  # before anything starts, in one line
            sys.exit(usage_error(problem))
    try:
        cli.main(args=argv, prog_name="ckptrun", standalone_mode=True)
    except KeyboardInterrupt:
        sys.exit(130)
    finally:
        # Interpreter shutdown runs a full garbage collection over everything torch created
        # at import: ~0.6-0.8 s of a 2-core machine after the job is over, on every launch.
        # Nothing needs collecting any more (the workers, slots and files are gone), so the
        # collector is told to leave every object alone.
        gc.freeze()


if __name__ == "__main__":
    main()
