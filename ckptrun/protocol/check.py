"""What ``ckptrun check`` tells a worker, and what the worker writes back.

The check command runs the job with these environment variables; the Checkpointer reads
them (``ckptrun.worker.check_probe``) and appends one JSON line per committed snapshot to
``<CKPTRUN_CHECK_LOG>/rank<R>.jsonl``: ``{"step", "rank", "attempt", "entries": {name:
hex}, "tensors": {path: hex}}`` -- the xxh3 of every state entry's skeleton (its plain
values and structure) and of every tensor of the snapshot, as the slot holds it.
"""

ENV_CHECK_LOG = "CKPTRUN_CHECK_LOG"  # directory of the per-rank check logs
ENV_CHECK_KILL = "CKPTRUN_CHECK_KILL"  # "S:R": rank R SIGKILLs itself after save(S), attempt 0
ENV_CHECK_STEPS = "CKPTRUN_CHECK_STEPS"  # K: every rank exits (code 0) after save(K)


def log_path(directory: str, rank: int) -> str:
    return f"{directory}/rank{rank}.jsonl"
