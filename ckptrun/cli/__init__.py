"""The command line: ``ckptrun [run] ...``, ``ckptrun status``, ``ckptrun restore``.

* :mod:`~ckptrun.cli.commands` -- the click entry point and its subcommands;
* :mod:`~ckptrun.cli.args` -- torchrun-parity arguments and ckptrun's options -> ``AgentConfig``;
* :mod:`~ckptrun.cli.usage` -- the usage error (exit 2) and the value spellings both share;
* :mod:`~ckptrun.cli.preflight` -- machine checks before anything starts;
* :mod:`~ckptrun.cli.status` -- ``ckptrun status``;
* :mod:`~ckptrun.cli.restore` -- ``ckptrun restore``.

The command line is the top of the import graph: it may import the agent and the tiers;
nothing imports it.  ``ckptrun status`` must stay fast, so this package imports neither
torch nor the agent until ``run`` needs them.
"""

from ckptrun.cli.commands import main

__all__ = ["main"]
