"""``torch.numa.binding``: the CPUs torch binds a GPU's worker to (torchrun's ``--numa-binding``).

Checked on torch 2.13.0 and 2.15.0; torch 2.7 has no ``torch.numa`` (:func:`modes` is empty
and ``--numa-binding`` is refused with one line naming the torch that has it).
"""

from __future__ import annotations

from typing import Set, Tuple


def modes() -> Tuple[str, ...]:
    """The affinity modes this torch knows (empty before torch 2.9, which has no binding)."""
    try:
        from torch.numa.binding import AffinityMode
    except ImportError:
        return ()
    return tuple(m.value for m in AffinityMode)


def cpus_for_gpu(mode: str, gpu_index: int) -> Set[int]:
    """torch's CPU set for GPU ``gpu_index`` under ``mode`` (validated: non-empty, allowed to
    this process); torch's own error where it cannot tell.  torchrun gets it from
    ``_get_validated_logical_cpus_to_bind_to`` and hands it to ``numactl``; there is no
    public function that returns the set."""
    from torch.numa.binding import (
        AffinityMode,
        NumaOptions,
        _get_validated_logical_cpus_to_bind_to,
    )
    options = NumaOptions(affinity_mode=AffinityMode(mode))
    return set(_get_validated_logical_cpus_to_bind_to(gpu_index=gpu_index,
                                                       numa_options=options))
