"""``torch.distributed.checkpoint`` (DCP): its storage writers and its per-item storage record.

The durable tier (:mod:`ckptrun.tiers.durable.storage`) writes steps with DCP's own storage
writers, through their public ``StorageWriter`` interface, and builds DCP's ``.metadata``
itself.  Checked on torch 2.7.0, 2.13.0 and 2.15.0.
"""

from __future__ import annotations

import warnings
from typing import Any

_quieted = False


def quiet_typed_storage_warning() -> None:
    """Hide the ``TypedStorage is deprecated`` warning that DCP's own writer of torch 2.7
    raises (``_SerialCpuLoader`` calls ``tensor.storage()`` for every tensor it writes; 2.13
    and 2.15 call ``untyped_storage()``): a job that persists would print it where the same
    script under torchrun prints nothing.  Only that message, only when attributed to DCP's
    ``filesystem`` module: the script's own uses of typed storages still warn."""
    global _quieted
    if not _quieted:
        warnings.filterwarnings("ignore", message="TypedStorage is deprecated",
                                category=UserWarning,
                                module=r"torch\.distributed\.checkpoint\.filesystem")
        _quieted = True



def storage_info(relative_path: str, offset: int, length: int) -> Any:
    """DCP's per-item storage record: ``.metadata`` must hold ``_StorageInfo`` objects for
    ``FileSystemReader`` to find a tensor, and torch has no public constructor for one
    (``torch.distributed.checkpoint.filesystem._StorageInfo``, 2.7 .. 2.15)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    return _StorageInfo(relative_path, offset, length)


def fsspec_writer_class() -> Any:
    """DCP's ``FsspecWriter``: public as ``torch.distributed.checkpoint.FsspecWriter`` or in
    ``.fsspec_filesystem`` on newer torch (2.15); before that only in the private
    ``._fsspec_filesystem`` (2.7 .. 2.14), which newer torch deprecates with a warning --
    so the public homes are tried first."""
    import torch.distributed.checkpoint as dcp

    cls = getattr(dcp, "FsspecWriter", None)
    if cls is not None:
        return cls
    try:
        from torch.distributed.checkpoint.fsspec_filesystem import FsspecWriter
    except ImportError:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
    return FsspecWriter


def node_plan(writer: Any, local_plan: Any, node: int) -> Any:
    """``local_plan`` (from ``writer.prepare_local_plan``, the writer set up as coordinator)
    with this node's file prefix, so that nodes writing one step into one directory never
    collide and need no collective: the writer's own global planning, asked as if empty plans
    of nodes ``0..node-1`` came first, names the files of the plan at index ``node``
    ``__<node>_<k>.distcp``.  Public interface only; newer torch's ``rank=`` and
    ``use_collectives=`` keywords of ``set_up_storage_writer`` are not on 2.7."""
    from torch.distributed.checkpoint.planner import SavePlan

    plans = writer.prepare_global_plan([SavePlan([]) for _ in range(int(node))] + [local_plan])
    return plans[int(node)]
