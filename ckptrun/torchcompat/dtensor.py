"""DTensor: where this rank's shard sits in the global tensor.

Checked on torch 2.7.0, 2.13.0 and 2.15.0.
"""

from __future__ import annotations

from typing import Any, List


def local_offset(x: Any) -> List[int]:
    """The global offset of DTensor ``x``'s local shard, per dimension.

    torch computes it for DCP through the ``__create_chunk_list__`` protocol that DTensor
    implements (its first chunk is the local shard); the function that protocol calls,
    ``torch.distributed.tensor._utils.compute_local_shape_and_global_offset``, is private
    too, and reproducing DTensor's uneven-sharding rules here would be a second copy of them.
    """
    return [int(o) for o in x.__create_chunk_list__()[0].offsets]
