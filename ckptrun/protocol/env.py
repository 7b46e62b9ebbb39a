"""The environment variables the agent hands to every worker, and shared constants.

The worker side reads these; the agent sets them (``ckptrun.agent.supervisor``).
"""

ENV_CONTROL = "CKPTRUN_CONTROL"  # path of the node's control block file
ENV_LOCAL_RANK = "CKPTRUN_LOCAL_RANK"  # this worker's record there (LOCAL_RANK may be
# 0 for every worker under --virtual-local-rank)
ENV_SLOT_PREFIX = "CKPTRUN_SLOT_PREFIX"  # path prefix of this rank's slot files (+ "<k>")
ENV_NUM_SLOTS = "CKPTRUN_NUM_SLOTS"  # slots per rank
ENV_RESTORE = "CKPTRUN_RESTORE"  # JSON {"step": N, "tier": "memory|peer|storage"}; step 0 = none
# (+ "verified": true when the agent has just checked the slot's checksum itself)
ENV_RUN_DIR = "CKPTRUN_RUN_DIR"
ENV_STACKS_FILE = "CKPTRUN_STACKS_FILE"  # faulthandler target for SIGUSR1 stack dumps
ENV_PERSIST_TO = "CKPTRUN_PERSIST_TO"  # also read by Checkpointer outside ckptrun
ENV_MAX_STATE_BYTES = "CKPTRUN_MAX_STATE_BYTES"  # shm budget for one rank's slots (0 = no limit)

DEFAULT_NUM_SLOTS = 3
ENV_EVERY = "CKPTRUN_SNAPSHOT_EVERY"  # --snapshot-every: the worker snapshots every N-th save
ENV_HOT_SPARE = "CKPTRUN_HOT_SPARE"  # a hot spare's own control record (--hot-spares): it runs
# the script up to its @ckptrun.resilient function and waits there to take a rank
