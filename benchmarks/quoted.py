"""Context, not measurement: the peers' recovery numbers quoted from DESIGN §5.

These were measured by others on the same kind of machine (2 CPU cores, gloo) and are
copied here verbatim so the recovery table can be read next to them.  Nothing in this
section was measured by this harness; every row says so.
"""

from __future__ import annotations

from typing import List

from benchmarks import Context, Row, section

COLUMNS = [("system", "system", "str"), ("failure", "failure", "str"),
           ("quoted", "quoted result", "str"), ("source", "source", "str")]

SOURCE = "quoted from DESIGN §5 — not measured here"

# (system, failure, result) as DESIGN states them (§5; the GEMINI breakdown: its preamble).
QUOTES = [
    ("DLRover flash checkpoint", "worker crash", "restored from shm in 2.9–3.5 s"),
    ("DLRover flash checkpoint", "agent/node loss", "falls back to disk, 5 steps lost"),
    ("NVIDIA ft_launcher", "SIGKILL", "first step of new cycle 3.0 s"),
    ("NVIDIA ft_launcher", "hung rank (SIGSTOP), 5 s timeout", "8–9 s"),
    ("lm-resiliency (GEMINI reimpl.)", "any crash", "through disk: 6–8 s to first step"),
    ("lm-resiliency (GEMINI reimpl.)", "kill during replication",
     "waits a hard-coded 10 s, loses 3 steps"),
    ("torchrun", "hang", "no hang detection"),
    ("GEMINI paper", "recovery breakdown",
     "load from memory < 3 s; torch.save 162 s; restart warm-up > 4 min"),
]


@section("quoted", "Peers' recovery numbers (quoted, not measured)", COLUMNS,
         note="context for the recovery table; copied from DESIGN §5, not measured by this run")
def quoted(ctx: Context) -> List[Row]:
    return [{"system": s, "failure": f, "quoted": q,
             "source": SOURCE if s != "GEMINI paper" else "quoted from DESIGN (paper, SOSP 2023)"
             " — not measured here"} for s, f, q in QUOTES]
