"""The one contract shared by the agent (``ckptrun`` process) and the worker-side API.

Nothing in here imports agent, worker or tier internals (nor torch); both sides import this
package and the snapshot format only.  Its parts:

* :mod:`~ckptrun.protocol.env` -- the environment variables the agent hands to every worker;
* :mod:`~ckptrun.protocol.control` -- the node's *control block* (heartbeats, steps, phases,
  commit pointers, the agent's pin);
* :mod:`~ckptrun.protocol.slot_file` -- the *slot file* layout (binary header, JSON area,
  raw tensor bytes) and its life cycle;
* :mod:`~ckptrun.protocol.shm` -- shared-memory files: names, creation, mapping;
* :mod:`~ckptrun.protocol.untrusted` -- reading a file someone else may have planted;
* :mod:`~ckptrun.protocol.gate` -- the bound in front of every listener (connections that
  have not proven the key, a deadline for the whole handshake, accept() out of descriptors).

Their names are re-exported here, so ``from ckptrun import protocol as P; P.SlotHeader`` is
the way the rest of the code reads them.
"""

from ckptrun.protocol.control import (
    CONTROL_HEADER_SIZE,
    CONTROL_MAGIC,
    RECORD_SIZE,
    ControlBlock,
    Fatal,
    Phase,
)
from ckptrun.protocol.env import (
    DEFAULT_NUM_SLOTS,
    ENV_CONTROL,
    ENV_EVERY,
    ENV_HOT_SPARE,
    ENV_LOCAL_RANK,
    ENV_MAX_STATE_BYTES,
    ENV_NUM_SLOTS,
    ENV_PERSIST_TO,
    ENV_RESTORE,
    ENV_RUN_DIR,
    ENV_SLOT_PREFIX,
    ENV_STACKS_FILE,
)
from ckptrun.protocol.shm import (
    SHM_DIR,
    SHM_PREFIX,
    ShmMaps,
    control_path,
    create_shm_file,
    fill_zeros,
    open_private,
    open_shm_file,
    rank_slot_prefix,
    slot_path,
)
from ckptrun.protocol.slot_file import (
    PAGE,
    SLOT_HEADER_SIZE,
    SLOT_MAGIC,
    SLOT_VERSION,
    SlotHeader,
    SlotState,
    data_offset_for,
    new_checksum,
    set_slot_state,
)

__all__ = [
    "CONTROL_HEADER_SIZE", "CONTROL_MAGIC", "RECORD_SIZE", "ControlBlock", "Fatal", "Phase",
    "DEFAULT_NUM_SLOTS", "ENV_CONTROL", "ENV_EVERY", "ENV_HOT_SPARE", "ENV_LOCAL_RANK", "ENV_MAX_STATE_BYTES", "ENV_NUM_SLOTS",
    "ENV_PERSIST_TO", "ENV_RESTORE", "ENV_RUN_DIR", "ENV_SLOT_PREFIX", "ENV_STACKS_FILE",
    "SHM_DIR", "SHM_PREFIX", "ShmMaps", "control_path", "create_shm_file", "fill_zeros", "open_private", "open_shm_file",
    "rank_slot_prefix", "slot_path",
    "PAGE", "SLOT_HEADER_SIZE", "SLOT_MAGIC", "SLOT_VERSION", "SlotHeader", "SlotState",
    "data_offset_for", "new_checksum", "set_slot_state",
]
