"""DDP / plain PyTorch: a ``DistributedDataParallel`` wrapper snapshots as its inner module.

``Checkpointer({"model": ddp_model})`` and ``Checkpointer({"model": ddp_model.module})``
store the same keys (no ``module.`` prefix), so a snapshot taken with one restores into the
other, or into a model without DDP at all.  ``torch.compile``'s wrapper (``_orig_mod``) is
unwrapped the same way.

Replicated state (every data-parallel rank holds identical model and optimizer state) is
stored once in the durable copy: :func:`ckptrun.storage.write_parts` compares the ranks it
writes byte for byte and keeps one copy of each identical tensor (per-rank RNG and data
state differ, so they stay per rank); both DCP keys point at the same bytes.  Memory slots
stay per rank: a rank's restore must never depend on another rank's process.
"""

from __future__ import annotations

from typing import Any, Dict

import torch


def unwrap(module: Any) -> Any:
    """The module whose ``state_dict`` is the model's: DDP and ``torch.compile`` unwrapped."""
    for _ in range(8):  # DDP(compile(model)) and the like
        if isinstance(module, torch.nn.parallel.DistributedDataParallel):
            module = module.module
        elif isinstance(module, torch.nn.Module) and hasattr(module, "_orig_mod") \
                and type(module).__name__ == "OptimizedModule":
            module = module._orig_mod
        else:
            return module
    return module


def adapt(state: Dict[str, Any], cache: Dict[Any, Any]) -> Dict[str, Any]:
    """``state`` with DDP/compiled wrappers replaced by their inner modules (top level)."""
    out = None
    for k, v in state.items():
        if isinstance(v, torch.nn.Module):
            inner = unwrap(v)
            if inner is not v:
                out = dict(state) if out is None else out
                out[k] = inner
    return state if out is None else out
