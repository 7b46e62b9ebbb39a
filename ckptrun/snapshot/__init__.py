"""The snapshot format: training state as raw tensor bytes plus a JSON skeleton, no pickle.

Used by both sides -- the worker writes snapshots into its slots, the agent and its tiers read,
verify, copy and persist them -- so nothing here imports the agent, the worker side, a tier
or the command line.  Its parts:

* :mod:`~ckptrun.snapshot.tree` -- state tree <-> (skeleton, tensors);
* :mod:`~ckptrun.snapshot.loading` -- loading restored state back into the live objects, in
  the types their ``state_dict()`` gave (DTensors, devices);
* :mod:`~ckptrun.snapshot.slots` -- writing a snapshot into a slot file with its checksum,
  reading and verifying one;
* :mod:`~ckptrun.snapshot.copyplan` -- how a slot write moves the tensors (batched small
  ones, chunked large ones);
* :mod:`~ckptrun.snapshot.rng` -- the global RNG states as snapshot state;
* :mod:`~ckptrun.snapshot.shards` -- DTensor (FSDP2) shards: DCP entries and resharding.

The names the rest of the code uses are re-exported here (``from ckptrun import snapshot``).
"""

from ckptrun.snapshot.loading import LoadFailed, load_into
from ckptrun.snapshot.rng import DeferredRNG, capture_rng, restore_rng
from ckptrun.snapshot.slots import (
    dtype_from_name,
    dtype_name,
    meta_bytes,
    meta_checksum,
    read_slot,
    slot_checksum,
    slot_size,
    verify_slot,
    write_slot,
)
from ckptrun.snapshot.tree import (
    FORMAT,
    Flattened,
    Unsnapshottable,
    dtensor_class,
    find_optimizers,
    flatten,
    flatten_state,
    is_dtensor,
    make_meta,
    meta_json,
    tensor_entries,
    unflatten,
)

__all__ = [
    "DeferredRNG", "capture_rng", "restore_rng",
    "dtype_from_name", "dtype_name", "meta_bytes", "meta_checksum", "read_slot",
    "slot_checksum", "slot_size", "verify_slot", "write_slot",
    "FORMAT", "Flattened", "dtensor_class", "find_optimizers", "flatten", "flatten_state",
    "is_dtensor", "load_into", "make_meta", "meta_json", "tensor_entries", "unflatten",
    "LoadFailed", "Unsnapshottable",
]
