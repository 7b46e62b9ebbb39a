"""In-process recovery: how the agent takes a live worker into the next attempt.

A worker running a ``@ckptrun.resilient`` function shows it in its control record
(``resilient`` = attempt + 1).  When a rank elsewhere fails, the agent of each node keeps
such workers instead of killing them:

1. it sets ``recover`` = the next attempt in their records: the worker stops saving,
   breaks its process groups' collectives (``ckptrun.worker.collectives``) and unwinds the
   function, then sets ``unwound`` = that attempt (its last snapshot copy is finished);
2. once they have unwound (the others are killed and replaced by new processes), the agent
   decides the restore step as for a restart, writes this file -- for each kept local rank,
   the environment variables that change from one attempt to the next (MASTER_PORT,
   TORCHELASTIC_RESTART_COUNT, CKPTRUN_RESTORE, ...) -- and sets ``recover_go``;
3. the worker applies them to ``os.environ`` and calls the function again.

A hot spare (``--hot-spares``) is a process that ran the script up to its resilient function
and waits there, on a record of its own after the workers' (``CKPTRUN_HOT_SPARE``); to
replace a failed rank it gets the same message for that record, with the rest of a worker's
variables (its control record, its slots), and calls the function as a kept worker does.

The file lives in the run directory (private to the user, as every run file) and holds
only strings; a file that does not parse, or names another attempt, is refused and the
worker exits with the failure that unwound it -- the agent then replaces it like any dead
rank.
"""

from __future__ import annotations

import json
import os
from typing import Dict, Optional

RECOVER_DIR = "recover"
# the variables a kept worker takes from the message; nothing else of its environment moves
CHANGING = ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID",
            "TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_USE_AGENT_STORE", "CKPTRUN_RESTORE",
            "CKPTRUN_STACKS_FILE")
# ... and a hot spare taking a rank (``--hot-spares``) the rest of a worker's own variables
# too (its record, its slots); the rank itself it was started with, and must match
PROMOTING = CHANGING + ("CKPTRUN_LOCAL_RANK", "CKPTRUN_SLOT_PREFIX", "CKPTRUN_NUM_SLOTS",
                        "CKPTRUN_HOT_SPARE", "CKPTRUN_PERSIST_TO", "CKPTRUN_SNAPSHOT_EVERY")


def message_path(run_dir: str, attempt: int, local_rank: int) -> str:
    return os.path.join(run_dir, RECOVER_DIR, f"attempt_{attempt}-local{local_rank}.json")


def message(attempt: int, env: Dict[str, str], promote: bool = False) -> dict:
    """The message for one kept worker (``promote``: a hot spare): ``env`` narrowed to the
    variables that change."""
    keys = PROMOTING if promote else CHANGING
    return {"attempt": attempt, "env": {k: str(env.get(k, "")) for k in keys
                                        if k in env or promote}}


def read_message(path: str, attempt: int, promote: bool = False) -> Optional[Dict[str, str]]:
    """The environment updates of a message for ``attempt``; None when the file is missing,
    malformed, or for another attempt.  An empty value unsets the variable."""
    allowed = PROMOTING if promote else CHANGING
    try:
        with open(path) as f:
            msg = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(msg, dict) or msg.get("attempt") != attempt:
        return None
    env = msg.get("env")
    if not isinstance(env, dict) or not all(
            isinstance(k, str) and k in allowed and isinstance(v, str) for k, v in env.items()):
        return None
    return env
